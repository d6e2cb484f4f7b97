"""Checks in a row, counted in one place (gpuguard.judge.streaks) on the agent's thread and measured in time:
a run's length is what polling at --interval would have counted, however often events brought a check; the
writer thread takes the streaks the judgement carries and counts nothing itself."""

from __future__ import annotations

import pytest

from gpuguard.core.config import NodeSettings, QuarantineLimit
from gpuguard.core.model import Fault, GpuVerdict, Judgement, Streaks, Verdict
from gpuguard.judge.streaks import Runs, advance, checks, streaks
from gpuguard.quarantine.node.degraded import LABEL_DEGRADED
from gpuguard.quarantine.node.view import NodeView
from gpuguard.quarantine.reconciler import NodeReconciler
from harness.fakes import FakeNodeWriter

NVLINK = Fault("nvlink-down", "link 3 inactive", uuid="GPU-0", gpu_index=0)
ECC = Fault("ecc", "2 uncorrected", uuid="GPU-1", gpu_index=1)


def gpus(*, sick: Fault | None = None, degraded: Fault | None = None) -> Verdict:
    return Verdict(
        gpus=tuple(
            GpuVerdict(
                index=i,
                uuid=f"GPU-{i}",
                faults=(sick,) if sick is not None and sick.gpu_index == i else (),
                degraded=(degraded,) if degraded is not None and degraded.gpu_index == i else (),
            )
            for i in range(2)
        )
    )


def run(*verdicts: Verdict, interval: float = 3.0) -> Streaks:
    """The verdicts judged one --interval apart, as polling alone judges them."""
    runs = Runs()
    for i, v in enumerate(verdicts):
        runs = advance(runs, v, i * interval)
    return streaks(runs, (len(verdicts) - 1) * interval, interval)


CLEAN, SICK, DEGRADED = gpus(), gpus(sick=ECC), gpus(degraded=NVLINK)


@pytest.mark.parametrize(
    ("verdicts", "want"),
    [
        ((CLEAN,), Streaks(1, {"GPU-0": 1, "GPU-1": 1}, 1, {"GPU-0": 1, "GPU-1": 1})),
        ((CLEAN, CLEAN, CLEAN), Streaks(3, {"GPU-0": 3, "GPU-1": 3}, 3, {"GPU-0": 3, "GPU-1": 3})),
        ((CLEAN, SICK), Streaks(0, {"GPU-0": 2, "GPU-1": 0}, 2, {"GPU-0": 2, "GPU-1": 2})),
        ((SICK, CLEAN, CLEAN), Streaks(2, {"GPU-0": 3, "GPU-1": 2}, 3, {"GPU-0": 3, "GPU-1": 3})),
        ((CLEAN, DEGRADED), Streaks(2, {"GPU-0": 2, "GPU-1": 2}, 0, {"GPU-0": 0, "GPU-1": 2})),
        ((DEGRADED, CLEAN), Streaks(2, {"GPU-0": 2, "GPU-1": 2}, 1, {"GPU-0": 1, "GPU-1": 2})),
        ((CLEAN, Verdict()), Streaks(2, {}, 2, {})),
    ],
    ids=[
        "one clean check starts every streak at one",
        "three clean checks are three in a row",
        "a fault ends the node's and that GPU's healthy streak, not its neighbour's",
        "after a fault the node counts again from the first healthy check",
        "a degraded signal ends the clean streaks, not the healthy ones",
        "after a degraded signal the clean streak counts again",
        "a GPU NVML no longer lists is dropped",
    ],
)
def test_the_streaks_polled_at_the_interval_count_the_checks(
    verdicts: tuple[Verdict, ...], want: Streaks
) -> None:
    assert run(*verdicts) == want


def test_checks_brought_early_by_events_never_make_a_run_longer() -> None:
    """A sick check, then 50 healthy checks within 0.5 s (an Xid storm of ignored Xids wakes a check each
    time): still one check's worth of run at --interval 3, as polling would have seen; then time counts."""
    runs = advance(Runs(), SICK, 0.0)
    for i in range(50):
        runs = advance(runs, CLEAN, 3.0 + i * 0.01)
    assert streaks(runs, 3.49, 3.0).healthy == 1
    runs = advance(runs, CLEAN, 9.0)
    assert streaks(runs, 9.0, 3.0).healthy == 3


@pytest.mark.parametrize(
    ("began", "now", "want"),
    [(None, 5.0, 0), (1.0, 1.0, 1), (1.0, 3.9, 1), (1.0, 4.0, 2), (0.1, 0.1 + 3 * 0.1, 4), (1.0, 100.0, 34)],
    ids=["no run", "the run's first check", "short of an interval", "one interval on", "float sums", "long"],
)
def test_a_run_is_told_in_checks_at_the_interval(began: float | None, now: float, want: int) -> None:
    assert checks(began, now, 3.0 if began != 0.1 else 0.1) == want


def test_the_writer_thread_counts_no_streak_and_lifts_the_degraded_marks_when_the_judgement_says() -> None:
    settings = NodeSettings(name="gpu-1", retry_max_wait=0.01, max_quarantined=QuarantineLimit.parse("1"))
    writer = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b"))
    r = NodeReconciler(writer, settings)
    r.submit(Judgement(DEGRADED, Streaks(healthy=5, clean=0)))
    r.reconcile_now()
    assert writer.node.labels.get(LABEL_DEGRADED) == "true"
    for _ in range(5):  # clean verdicts whose judgement still carries no clean streak: the marks stay
        r.submit(Judgement(CLEAN, Streaks(healthy=5, clean=0)))
        r.reconcile_now()
    assert writer.node.labels.get(LABEL_DEGRADED) == "true"
    r.submit(Judgement(CLEAN, Streaks(healthy=5, clean=settings.recover_after)))
    r.reconcile_now()
    assert LABEL_DEGRADED not in writer.node.labels


def test_a_run_at_an_interval_of_0_is_one_check() -> None:
    assert checks(0.0, 5.0, 0.0) == 1 and checks(None, 5.0, 0.0) == 0
