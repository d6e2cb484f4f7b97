"""Escalation, pure: from a GPU's fault history and the limits, which GPUs are repeat offenders.

A repeat offender is a GPU with at least `limit` fault episodes (one episode per quarantine, however often a
flapping counter blinked within it) whose first-seen times fall within `window` seconds of `now`. Such a GPU
is held for repair instead of going back to work. `limit` 0 turns escalation off. Defaults (3 in 7 days):
GPUd asks for inspection after more than 3 reboots for the same Xid; NVSentinel escalates after 5 fatal Xids
in 24 h or 5 remediations in 7 days. A GPU that faults once per week never reaches 3 within 7 days.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

DEFAULT_LIMIT = 3
DEFAULT_WINDOW_S = 604800.0


@dataclass(frozen=True)
class Limits:
    """`limit` episodes within `window_s` seconds make a repeat offender; `limit` 0: escalation off."""

    limit: int = DEFAULT_LIMIT
    window_s: float = DEFAULT_WINDOW_S


def repeat_offenders(episodes: Mapping[str, Iterable[float]], limits: Limits, now: float) -> dict[str, int]:
    """The repeat offenders: GPU UUID -> its episodes within the window, for those at or over the limit.

    `episodes` maps each GPU UUID to the first-seen times of its fault episodes (seconds)."""
    if limits.limit <= 0:
        return {}
    start = now - limits.window_s
    found: dict[str, int] = {}
    for uuid, times in episodes.items():
        count = sum(1 for t in times if start <= t <= now)
        if count >= limits.limit:
            found[uuid] = count
    return found
