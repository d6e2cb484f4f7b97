"""The clock signals' windows fitted to --interval. Pure.

`clock-hw-slowdown`, `clock-hw-thermal` and `clock-power-brake` count the checks within window_s in which the
event was read: more than `threshold` of them trip the signal. A window that cannot hold threshold + 1 checks
at the agent's --interval never trips, however long the storm: the default 5 checks within 300 s is dead at
--interval 60 (5 checks in 300 s at most). So the agent judges such a signal over (threshold + 1) * interval
instead, and says so once (`signals.window_widened`); a window that holds enough checks is left as it is.
"""

from __future__ import annotations

import math

from gpuguard.core.signaltable import IGNORE, SignalTable

# The signals counted once per check (gpuguard.judge.signals's CLOCK_BITS).
PER_CHECK = ("clock-hw-slowdown", "clock-hw-thermal", "clock-power-brake")


def fitted(table: SignalTable, interval: float) -> tuple[SignalTable, dict[str, float]]:
    """The table with each judged per-check signal's window widened to hold threshold + 1 checks at
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
