"""The budget both quarantines count against (--max-quarantined): `Budget` as read (the fully quarantined GPU
nodes and the limit), the time of the order's second check, and what makes a claim's place in the quarantine
order valid (`since_time`, `api_time`), which a node's claim (`node.budget`) and a DeviceTaintRule's
(`gpu.order`) share. Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from gpuguard.quarantine.record import ANN_SINCE

# Seconds after a full quarantine when the quarantine order is checked a second time: by then the writes of
# every agent that faulted in the same burst have landed (the first check runs right after our own write).
VERIFY_SETTLE = 10.0
# How far ahead of this node's clock another node's gpuguard.io/since may lie before it counts as a lie: node
# clocks drift apart by seconds (NTP), not by minutes.
SINCE_SKEW = timedelta(minutes=5)
# The one form gpuguard writes (view.rfc3339): one form, so that comparing the strings compares the times.
_SINCE = re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})Z")


@dataclass(frozen=True)
class Budget:
    """The cluster-wide quarantine budget as read from the API server (this node not counted).
    `gpu_nodes`: counted for a percentage, None for a count (`--max-quarantined 5` needs no total)."""

    quarantined: int
    limit: int
    gpu_nodes: int | None = None

    @property
    def has_room(self) -> bool:
        return self.quarantined < self.limit


def since_time(since: object, *, now: datetime) -> datetime | str:
    """A gpuguard.io/since claim as a time, or why it is not one: gpuguard's own form (RFC 3339 UTC, whole
    seconds), a valid time, not ahead of `now` by more than SINCE_SKEW. Pure; shared by the nodes' claims
    and the DeviceTaintRules' (`gpu.order`)."""
    if not isinstance(since, str) or not _SINCE.fullmatch(since):
        return f"{ANN_SINCE} is not an RFC 3339 UTC time: {since!r:.80}"
    when = _utc_seconds(since)
    if when is None:
        return f"{ANN_SINCE} is not a valid time: {since!r}"
    if when > now + SINCE_SKEW:
        return f"{ANN_SINCE} {since} lies in the future"
    return when


def api_time(value: object) -> datetime | None:
    """The API server's own timestamps (creationTimestamp): RFC 3339, second precision, UTC."""
    return _utc_seconds(value) if isinstance(value, str) else None


def _utc_seconds(value: str) -> datetime | None:
    """YYYY-MM-DDTHH:MM:SSZ as an aware UTC time; None if it is not one (a malformed or impossible date).
    Not datetime.strptime: its first call in a process builds the locale's regular expressions (milliseconds),
    and the first call here is in a fault's path, before its taint."""
    m = _SINCE.fullmatch(value)
    if m is None:
        return None
    try:
        year, month, day, hour, minute, second = (int(g) for g in m.groups())
        return datetime(year, month, day, hour, minute, second, tzinfo=UTC)
    except ValueError:
        return None
