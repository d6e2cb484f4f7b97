"""What the agent hands the reconciler, for tests that drive a reconciler without an agent: one
model.Judgement per call, each call a check one --interval after the last, the runs advanced as the agent
advances them (gpuguard.judge.streaks), the healthy streaks as the test says (`healthy`; `gpus` None: the
node's streak for every GPU)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from weakref import WeakKeyDictionary

from gpuguard.core.model import Judgement, Verdict
from gpuguard.judge.streaks import Runs, advance, streaks
from gpuguard.quarantine.reconciler import NodeReconciler

# Per reconciler: the runs so far and how many checks were handed over.
_checks: WeakKeyDictionary[NodeReconciler, tuple[Runs, int]] = WeakKeyDictionary()


def hand_over(
    r: NodeReconciler,
    verdict: Verdict,
    healthy: int,
    *,
    flapping: bool = False,
    gpus: Mapping[str, int] | None = None,
) -> None:
    """One check's judgement handed to `r`: the degraded signals' clean streaks counted per call."""
    runs, n = _checks.get(r, (Runs(), 0))
    runs = advance(runs, verdict, float(n))
    _checks[r] = (runs, n + 1)
    counted = streaks(runs, float(n), 1.0)
    r.submit(Judgement(verdict, replace(counted, healthy=healthy, gpus=gpus), flapping))
