"""The executor's next step for a request, pure: the ladder reset -> node reboot -> needs-repair, with the
memory of what was done to that GPU before (the record on the node). Table-driven in tests/test_repair.py;
the state machine is drawn in docs/design.md, "Repair"."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from gpuguard.quarantine.repair.values import (
    FAILED,
    NEEDS_REPAIR,
    PROVEN,
    REBOOT,
    UNDER_WAY,
    Record,
    Request,
)

Action = Literal["none", "veto", "reset", "reboot", "needs-repair", "wait"]


@dataclass(frozen=True)
class Step:
    """What to do, and why (a stable word, in the log line and the Event)."""

    action: Action
    why: str


def decide(
    request: Request | None,
    record: Record,
    *,
    boot: str,
    now: datetime,
    window_s: float,
    vetoed: bool,
) -> Step:
    """The next step for `request` on a node in `boot`. `window_s`: a fault that comes back within it of the
    GPU's last proven reset, or of its reboot request, climbs a rung instead of trying the same again."""
    if request is None:
        return Step("none", "no-request")
    if vetoed:
        return Step("veto", "vetoed")
    entry = record.get(request.uuid)
    if entry is None:
        return Step("reset", "first")
    within = now - entry.at <= timedelta(seconds=window_s)
    same_boot = entry.boot == boot
    if entry.phase in UNDER_WAY:
        # Found under way: the executor stopped mid-repair. The reset may have half happened: next rung.
        return Step("reboot", "interrupted") if same_boot else Step("reset", "rebooted")
    if entry.phase == FAILED:
        return Step("reboot", "reset-failed") if same_boot else Step("reset", "rebooted")
    if entry.phase == REBOOT:
        if same_boot:
            return Step("wait", "reboot-pending")
        return Step("needs-repair", "returned-after-reboot") if within else Step("reset", "window-passed")
    if entry.phase == NEEDS_REPAIR:
        if same_boot or within:
            return Step("wait", "needs-repair")
        return Step("reset", "window-passed")
    if entry.phase == PROVEN:
        last = entry.resets[-1] if entry.resets else entry.at
        if request.asked <= last:
            return Step("wait", "proven")  # the request that was done, until the agent removes it
        if now - last <= timedelta(seconds=window_s):
            return Step("reboot", "returned-after-reset")
        return Step("reset", "window-passed")
    return Step("reset", "veto-lifted")  # VETOED
