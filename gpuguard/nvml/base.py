"""The backend protocol. Deals in domain dataclasses and UUIDs, never in NVML handles."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gpuguard.core.model import Snapshot

Wakeup = Callable[[], None]
"""Called by a backend from any thread when something arrived that must not wait for the next poll
(an Xid): the agent runs a check at once."""


class Backend(Protocol):
    def open(self, wakeup: Wakeup) -> None:
        """Start the backend. An NVML init failure is not raised: it is a reading (Snapshot.init_error)."""

    def snapshot(self) -> Snapshot:
        """Read every GPU, plus the Xids delivered since the previous call (each Xid exactly once)."""

    def wait(self, until: float, wake: threading.Event) -> None:
        """Return at `until` (the agent's clock) or once `wake` is set, with `wake` cleared as the reading
        the next snapshot() returns begins (a wake-up after that wakes the next wait). A backend that reads on
        a thread of its own reads there meanwhile, so snapshot() then hands over what it read."""

    def close(self) -> None:
        """Stop background threads and release NVML. Idempotent."""


def wait_for(until: float, wake: threading.Event, clock: Callable[[], float] = time.monotonic) -> None:
    """Backend.wait for a backend that reads in snapshot() itself: one wait per poll (an idle agent must cost
    next to nothing); `wake` (an Xid, stop()) ends it at once."""
    while not wake.is_set():
        left = until - clock()
        if left <= 0:
            break
        wake.wait(left)
    wake.clear()


@dataclass(frozen=True)
class GpuAfterReset:
    """One GPU as the repair executor reads it after a reset (docs/design.md, "Repair": the proof)."""

    uuid: str
    recovery_action: int | None  # None: the driver does not report it
    remap_pending: bool | None  # None: no row remapping on this GPU
    retired_pending: bool | None  # None: no page retirement on this GPU
