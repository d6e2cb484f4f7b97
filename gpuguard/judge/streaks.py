"""Checks in a row, advanced once per check (pure): the node's and each GPU's with no fault, and with no
degraded signal. The one place gpuguard counts "N checks in a row"; the quarantines compare the counts with
--recover-after (model.Streaks)."""

from __future__ import annotations

from gpuguard.core.model import Streaks, Verdict


def advance(previous: Streaks, verdict: Verdict) -> Streaks:
    """The streaks after one more check judged `verdict`. A GPU NVML no longer lists (no UUID in the verdict)
    is dropped; a GPU seen for the first time starts from its first check."""
    gpus = previous.gpus or {}
    return Streaks(
        healthy=previous.healthy + 1 if verdict.healthy else 0,
        gpus={g.uuid: gpus.get(g.uuid, 0) + 1 if g.healthy else 0 for g in verdict.gpus if g.uuid},
        clean=0 if verdict.degraded else previous.clean + 1,
        gpus_clean={
            g.uuid: 0 if g.degraded else previous.gpus_clean.get(g.uuid, 0) + 1
            for g in verdict.gpus
            if g.uuid
        },
    )
