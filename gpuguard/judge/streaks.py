"""Checks in a row, measured in time (pure): the node's and each GPU's runs with no fault and with no degraded
signal. The one place gpuguard counts "N checks in a row".

A run is kept as the moment it began on the agent's monotonic clock (`Runs`), and its length is told in
checks at --interval: a run that began at t0 is `1 + (now - t0) // interval` checks long, what polling at
--interval alone would have counted. An event (an Xid wakes a check at once) may bring a check earlier, so a
run may end sooner, but it never makes a run longer: no verdict depends on how often the agent looked."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuguard.core.model import Streaks, Verdict

# A check a few microseconds short of a whole interval after the run began (the clock's float arithmetic)
# counts as that interval's check.
_SLACK = 1e-6


@dataclass(frozen=True)
class Runs:
    """When each current run began (the agent's monotonic clock); None: not in such a run now."""

    healthy: float | None = None
    gpus: Mapping[str, float | None] = field(default_factory=dict)
    clean: float | None = None
    gpus_clean: Mapping[str, float | None] = field(default_factory=dict)


def _since(ok: bool, began: float | None, now: float) -> float | None:
    if not ok:
        return None
    return now if began is None else began


def advance(previous: Runs, verdict: Verdict, now: float) -> Runs:
    """The runs after a check at `now` judged `verdict`. A GPU NVML no longer lists (no UUID in the verdict)
    is dropped; a GPU seen for the first time starts its runs at this check."""
    return Runs(
        healthy=_since(verdict.healthy, previous.healthy, now),
        gpus={g.uuid: _since(g.healthy, previous.gpus.get(g.uuid), now) for g in verdict.gpus if g.uuid},
        clean=_since(not verdict.degraded, previous.clean, now),
        gpus_clean={
            g.uuid: _since(not g.degraded, previous.gpus_clean.get(g.uuid), now)
            for g in verdict.gpus
            if g.uuid
        },
    )


def checks(began: float | None, now: float, interval: float) -> int:
    """A run's length in checks at `interval`: 0 when not in the run."""
    if began is None:
        return 0
    if interval <= 0:
        return 1
    return 1 + int((now - began) / interval + _SLACK)


def streaks(runs: Runs, now: float, interval: float) -> Streaks:
    """The runs told in checks at --interval, as the quarantines compare them with --recover-after."""
    return Streaks(
        healthy=checks(runs.healthy, now, interval),
        gpus={u: checks(t, now, interval) for u, t in runs.gpus.items()},
        clean=checks(runs.clean, now, interval),
        gpus_clean={u: checks(t, now, interval) for u, t in runs.gpus_clean.items()},
    )
