"""What the agent knows beside each verdict (pure): the runs (judge.streaks), the flaps (judge.flaps) and the
Judgement they make with the verdict, the one value handed to the writer's thread.

A steady node's checks judge the very same verdict object again and again (the agent remembers its last
evaluation). Then nothing here can change but the runs' lengths, and once every run is at --recover-after a
longer one changes no decision: the tally is kept as it was, and the writer's thread is handed the same
Judgement object, so an idle check rebuilds no per-GPU map (docs/performance.md, the idle agent)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuguard.core.model import Judgement, Streaks, Verdict
from gpuguard.judge.flaps import Flap, Flaps, flapping, held, observe_verdict
from gpuguard.judge.streaks import Runs, advance, streaks


@dataclass(frozen=True)
class Tally:
    """`verdict`: the verdict the runs and flaps last saw; `judgement`: the last one handed over;
    `settled`: it cannot change while the verdict stays the same object (no flap in the window, every run
    at least --recover-after checks long)."""

    runs: Runs = field(default_factory=Runs)
    flaps: Flaps = field(default_factory=Flaps)
    verdict: Verdict | None = None
    judgement: Judgement | None = None
    settled: bool = False


def _at_rest(flap: Flap) -> bool:
    return not flap.present and not flap.episodes


def _quiet(flaps: Flaps) -> bool:
    """No condition present and no episode in the window: observing the same verdict again changes nothing
    (judge.flaps.observe is then a fixed point)."""
    gpus = flaps.gpus_degraded.values()
    return _at_rest(flaps.faults) and _at_rest(flaps.degraded) and all(_at_rest(f) for f in gpus)


def _saturated(counted: Streaks, most: int) -> bool:
    return (
        counted.gpus is not None
        and min(counted.healthy, counted.clean) >= most
        and all(n >= most for n in counted.gpus.values())
        and all(n >= most for n in counted.gpus_clean.values())
    )


def tally(
    previous: Tally,
    verdict: Verdict,
    *,
    judged_at: float,
    now: float,
    interval: float,
    flap_window: float,
    recover_after: int | None,
) -> Tally:
    """The tally after a check judged `verdict` at `judged_at` (the runs' time) and ended at `now` (the
    flaps'). `recover_after` None: never settled (every check hands over a new Judgement)."""
    if verdict is previous.verdict and previous.settled:
        return previous
    same = verdict is previous.verdict
    # The same verdict object again: its runs have begun already (advance is then a fixed point).
    runs = previous.runs if same else advance(previous.runs, verdict, judged_at)
    flaps = previous.flaps
    if not (same and _quiet(flaps)):
        flaps = observe_verdict(flaps, verdict, now, flap_window)
    counted = held(streaks(runs, judged_at, interval), flaps, now, flap_window)
    judgement = Judgement(verdict, counted, flapping(flaps.faults, now, flap_window))
    settled = recover_after is not None and _quiet(flaps) and _saturated(counted, recover_after)
    return Tally(runs=runs, flaps=flaps, verdict=verdict, judgement=judgement, settled=settled)
