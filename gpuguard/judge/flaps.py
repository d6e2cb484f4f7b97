"""Flapping, pure: a condition (the node's faults, a degraded signal on the node or on one GPU) that came back
within --flap-window of its last episode. While it flaps, what it put on the node is held until it has stayed
away a whole window, so an alternating GPU costs one write per window, not one per flip. Times are the agent's
monotonic clock in seconds, never counts of checks."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from gpuguard.core.model import Streaks, Verdict


@dataclass(frozen=True)
class Flap:
    """One condition's recent episodes: when each began (within the window), when it was last seen, and
    whether it is present now."""

    episodes: tuple[float, ...] = ()
    last_seen: float = -math.inf
    present: bool = False


def observe(previous: Flap, present: bool, now: float, window: float) -> Flap:
    """The condition read at `now`: a new episode when it comes back; older than `window`, forgotten."""
    episodes = previous.episodes
    if present and not previous.present:
        episodes = (*episodes, now)
    if episodes and now - episodes[0] > window:
        episodes = tuple(t for t in episodes if now - t <= window)
    return Flap(episodes=episodes, last_seen=now if present else previous.last_seen, present=present)


def flapping(flap: Flap, now: float, window: float) -> bool:
    """Two episodes or more within the window, the last seen less than a window ago."""
    return len(flap.episodes) >= 2 and now - flap.last_seen < window


@dataclass(frozen=True)
class Flaps:
    """The flaps the agent follows: the node's faults, its degraded signals (any, the node's or a GPU's), and
    each GPU's degraded signals by UUID."""

    faults: Flap = field(default_factory=Flap)
    degraded: Flap = field(default_factory=Flap)
    gpus_degraded: Mapping[str, Flap] = field(default_factory=dict)


def observe_verdict(previous: Flaps, verdict: Verdict, now: float, window: float) -> Flaps:
    """Every flap the agent follows, after a check at `now` judged `verdict`. A GPU NVML no longer lists is
    dropped."""
    return Flaps(
        faults=observe(previous.faults, not verdict.healthy, now, window),
        degraded=observe(previous.degraded, bool(verdict.degraded), now, window),
        gpus_degraded={
            g.uuid: observe(previous.gpus_degraded.get(g.uuid, Flap()), bool(g.degraded), now, window)
            for g in verdict.gpus
            if g.uuid
        },
    )


def held(streaks: Streaks, flaps: Flaps, now: float, window: float) -> Streaks:
    """The streaks with a flapping degraded signal's clean streak held at 0: its marks stay until it has
    stayed away a whole window (the node's, and each GPU's own)."""
    gpus = {u: f for u, f in flaps.gpus_degraded.items() if flapping(f, now, window)}
    if not gpus and not flapping(flaps.degraded, now, window):
        return streaks
    return replace(
        streaks,
        clean=0 if flapping(flaps.degraded, now, window) else streaks.clean,
        gpus_clean={u: 0 if u in gpus else n for u, n in streaks.gpus_clean.items()},
    )
