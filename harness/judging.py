"""What the agent hands the reconciler, for tests that drive a reconciler without an agent: one
model.Judgement per call, the streaks advanced as the agent advances them (gpuguard.judge.streaks), the
healthy streaks as the test says (`healthy`; `gpus` None: the node's streak for every GPU)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from weakref import WeakKeyDictionary

from gpuguard.core.model import Judgement, Streaks, Verdict
from gpuguard.judge.streaks import advance
from gpuguard.quarantine.reconciler import NodeReconciler

_counted: WeakKeyDictionary[NodeReconciler, Streaks] = WeakKeyDictionary()


def hand_over(
    r: NodeReconciler,
    verdict: Verdict,
    healthy: int,
    *,
    flapping: bool = False,
    gpus: Mapping[str, int] | None = None,
) -> None:
    """One check's judgement handed to `r`: the degraded signals' clean streaks counted per call."""
    counted = _counted[r] = advance(_counted.get(r, Streaks()), verdict)
    r.submit(Judgement(verdict, replace(counted, healthy=healthy, gpus=gpus), flapping))
