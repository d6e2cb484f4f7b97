"""The clock signals counted as polling at --interval would count them, and their windows fitted to it. Pure.

`clock-hw-slowdown`, `clock-hw-thermal` and `clock-power-brake` count the sightings of their event within
window_s: more than `threshold` of them trip the signal. A sighting is a slot one --interval wide that
begins at a check reading the event (`sighted`): every check within it adds to that sighting, not one of its
own, so the checks that Xids wake early and often count as the one poll would have.

A window that cannot hold threshold + 1 sightings at the agent's --interval never trips, however long the
storm: the default 5 within 300 s is dead at --interval 60 (5 in 300 s at most). So the agent judges such a
signal over (threshold + 1) * interval instead, and says so once (`signals.window_widened`); a window that
holds enough is left as it is.
"""

from __future__ import annotations

import math

from gpuguard.core.signaltable import IGNORE, SignalTable

# The signals counted once per sighting (gpuguard.judge.signals's CLOCK_BITS).
PER_CHECK = ("clock-hw-slowdown", "clock-hw-thermal", "clock-power-brake")
# A check a few microseconds short of a whole interval after a sighting began (the clock's float arithmetic)
# is the next poll's, as judge.streaks counts it.
_SLACK = 1e-6

Samples = tuple[tuple[float, int], ...]


def sighted(samples: Samples, now: float, mask: int, interval: float) -> Samples:
    """The sightings (when each began, the events read within it) after a check at `now` read `mask`: within
    the last sighting's --interval, its mask gains this one; later, a new sighting begins."""
    if samples and now - samples[-1][0] + _SLACK < interval:
        began, seen = samples[-1]
        return (*samples[:-1], (began, seen | mask))
    return (*samples, (now, mask))


def fitted(table: SignalTable, interval: float) -> tuple[SignalTable, dict[str, float]]:
    """The table with each judged per-sighting signal's window widened to hold threshold + 1 sightings at
    `interval`, and the windows widened (name -> the new window_s)."""
    widened: dict[str, float] = {}
    for name in PER_CHECK:
        s = table[name]
        need = (math.floor(s.threshold) + 1) * interval
        if s.level == IGNORE or s.window_s >= need:
            continue
        widened[name] = need
        table = table.changed(name, {"window_s": need}, where="--interval")
    return table, widened
