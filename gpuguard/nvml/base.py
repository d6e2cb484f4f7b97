"""The backend protocol. Deals in domain dataclasses and UUIDs, never in NVML handles."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from gpuguard.model import Snapshot

Wakeup = Callable[[], None]
"""Called by a backend from any thread when something arrived that must not wait for the next poll
(an Xid): the agent runs a check at once."""


class Backend(Protocol):
    def open(self, wakeup: Wakeup) -> None:
        """Start the backend. An NVML init failure is not raised: it is a reading (Snapshot.init_error)."""

    def snapshot(self) -> Snapshot:
        """Read every GPU, plus the Xids delivered since the previous call (each Xid exactly once)."""

    def close(self) -> None:
        """Stop background threads and release NVML. Idempotent."""
