"""Reads that fail (every query on a GPU, a GPU NVML cannot identify, a node-wide query) are faults once the
failure has lasted `unreadable_after` checks at --interval, measured on the check's clock (`taken_at`): checks
that Xids wake early and often never make a failure last longer."""

from __future__ import annotations

from dataclasses import replace

from gpuguard.core.config import PolicySettings
from gpuguard.core.model import GpuReading, Snapshot, Verdict, XidEvent
from gpuguard.judge.policy import evaluate
from gpuguard.judge.unanswered import how_long

DEFAULT = PolicySettings()  # --interval 3, unreadable after 3 checks
OK = (GpuReading(index=0, uuid="GPU-0"), GpuReading(index=1, uuid="GPU-1"))
TIMEOUT = replace(OK[1], unreadable=True, ecc_uncorrected=None, transient_errors=("ecc:TIMEOUT",))
XID_13 = (XidEvent(0, "GPU-0", 13),)  # ignored (an application's fault), yet it wakes a check at once
BOTH = Snapshot(gpus=OK)


def judged(*checks: tuple[float, Snapshot], settings: PolicySettings = DEFAULT) -> list[Verdict]:
    out: list[Verdict] = []
    for at, s in checks:
        out.append(evaluate(replace(s, taken_at=at), previous=out[-1] if out else None, settings=settings))
    return out


def reasons(v: Verdict) -> list[str]:
    return [f.reason for f in v.faults]


def blip(bad: Snapshot, good: Snapshot = BOTH) -> list[Verdict]:
    """A 0.4 s failure while ignored Xid 13s on GPU 0 make the agent check ten times a second."""
    good = replace(good, xids=XID_13)
    return judged((0.0, good), *((0.1 * i, replace(bad, xids=XID_13)) for i in range(1, 5)), (0.5, good))


def test_a_sub_interval_timeout_blip_during_event_checks_is_not_gpu_unreadable() -> None:
    assert [reasons(v) for v in blip(Snapshot(gpus=(OK[0], TIMEOUT)))] == [[]] * 6


def test_a_sub_interval_unidentified_blip_during_event_checks_is_not_gpu_unreadable() -> None:
    # Never identified yet (a GPU listed before and not now would be gpu-missing).
    unidentified = Snapshot(gpus=OK[:1], unidentified=((1, "uuid:TIMEOUT"),))
    assert [reasons(v) for v in blip(unidentified, good=Snapshot(gpus=OK[:1]))] == [[]] * 6


def test_a_sub_interval_device_count_blip_during_event_checks_is_not_nvml_init() -> None:
    assert [reasons(v) for v in blip(Snapshot(gpus=OK, node_error="nvmlDeviceGetCount:TIMEOUT"))] == [[]] * 6


def test_an_unreadable_gpu_is_a_fault_at_the_third_check_at_interval_and_says_how_long() -> None:
    bad = Snapshot(gpus=(OK[0], TIMEOUT))
    v = judged((0.0, bad), (3.0, bad), (6.0, bad), (9.0, Snapshot(gpus=OK)))
    assert [reasons(x) for x in v] == [[], [], ["gpu-unreadable"], []]
    assert v[2].faults[0].detail == (
        "every NVML query failed for 6.0 s, 3 checks at --interval 3 (ecc:TIMEOUT) (GPU 1, GPU-1)"
    )


def test_an_unreadable_gpu_checked_seldom_is_a_fault_after_the_same_time() -> None:
    """Two checks 6 s apart span what three polls at --interval 3 would have seen failing."""
    bad = Snapshot(gpus=(OK[0], TIMEOUT))
    assert [reasons(x) for x in judged((0.0, bad), (6.0, bad))] == [[], ["gpu-unreadable"]]


def test_an_unidentified_gpu_and_a_failing_count_say_how_long() -> None:
    unidentified = Snapshot(gpus=OK[:1], unidentified=((1, "uuid:UNKNOWN"),))
    v = judged((0.0, unidentified), (3.0, unidentified), (6.0, unidentified))
    assert [f.detail for f in v[2].node_faults] == [
        "NVML counts GPU 1 but cannot identify it for 6.0 s, 3 checks at --interval 3 (uuid:UNKNOWN)"
    ]
    failing = Snapshot(gpus=OK, node_error="nvmlDeviceGetCount:UNKNOWN")
    v = judged((0.0, failing), (3.0, failing), (6.0, failing))
    assert [f.detail for f in v[2].node_faults] == [
        "nvmlDeviceGetCount failed for 6.0 s, 3 checks at --interval 3 (UNKNOWN)"
    ]


def test_a_failure_that_answers_in_between_starts_over() -> None:
    bad = Snapshot(gpus=(OK[0], TIMEOUT))
    v = judged((0.0, bad), (3.0, bad), (3.5, Snapshot(gpus=OK)), (6.0, bad), (9.0, bad))
    assert [reasons(x) for x in v] == [[], [], [], [], []]


def test_a_failures_length_is_told_in_seconds_and_checks() -> None:
    assert how_long(10.0, 16.0, 3.0) == "for 6.0 s, 3 checks at --interval 3"
    assert how_long(10.0, 12.0, 3.0) == "for 2.0 s, 1 check at --interval 3"
    assert how_long(10.0, 10.0, 3.0) == "in this check"
