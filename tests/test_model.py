"""gpuguard.core.model: what a reading and a verdict mean when a backend leaves a field out, and the names a
fault goes by (its key in the node's record, its message)."""

from __future__ import annotations

import pytest

from gpuguard.core.model import (
    Fault,
    GpuReading,
    GpuVerdict,
    SignalMemory,
    Streaks,
    Verdict,
    recovery_reason,
    xid_reason,
)


def test_a_reading_left_to_its_defaults_is_a_healthy_watched_gpu_with_nothing_known_about_it() -> None:
    r = GpuReading(index=0, uuid="GPU-0")
    assert (r.name, r.pci_bus_id, r.xid_watch_note) == ("", "", "")
    assert (r.ecc_uncorrected, r.ecc_supported, r.remap_failure, r.remap_pending) == (0, True, None, None)
    assert (r.lost, r.transient_errors, r.unreadable, r.recovery_action, r.xid_watched) == (
        False,
        (),
        False,
        None,
        True,
    )


def test_a_verdict_left_to_its_defaults_is_a_present_healthy_watched_gpu() -> None:
    g = GpuVerdict(index=0, uuid="GPU-0")
    assert (g.name, g.present, g.faults, g.xid_watched, g.xid_watch_note, g.recovery_action) == (
        "",
        True,
        (),
        True,
        "",
        None,
    )
    assert g.healthy and Verdict().healthy and Verdict().faults == ()


@pytest.mark.parametrize(
    ("fault", "key"),
    [
        (Fault("nvml-init", "d"), "nvml-init/node"),
        (Fault("gpu-lost", "d", gpu_index=1), "gpu-lost/node"),
        (Fault("xid-79", "d", uuid="GPU-1", gpu_index=1), "xid-79/GPU-1"),
        (Fault("ecc", "d", uuid=""), "ecc/node"),
    ],
)
def test_a_faults_key_is_its_reason_and_its_gpu_or_the_node(fault: Fault, key: str) -> None:
    assert fault.key == key
    assert fault.message == f"{fault.reason}: d"


def test_the_node_faults_come_before_the_gpus_in_a_verdicts_faults() -> None:
    node = Fault("nvml-init", "n")
    gpu = Fault("ecc", "g", uuid="GPU-0", gpu_index=0)
    v = Verdict(gpus=(GpuVerdict(0, "GPU-0", faults=(gpu,)),), node_faults=(node,))
    assert v.faults == (node, gpu) and not v.healthy and not v.gpus[0].healthy


def test_reasons_of_xids_and_recovery_actions() -> None:
    assert xid_reason(79) == "xid-79"
    assert [recovery_reason(a) for a in (0, 1, 7, 42)] == [
        "recovery-none",
        "recovery-gpu-reset",
        "recovery-system-reboot",
        "recovery-42",
    ]


def test_the_verdict_a_first_check_starts_from_knows_no_gpu_and_counts_no_streak() -> None:
    """`evaluate(previous=None)` judges against `Verdict()`: any count here would be a check already made."""
    v = Verdict()
    assert (v.known, v.expected_gpus, v.sticky) == ((), None, ())
    assert (v.reset_clearable, v.reset_pending, v.reset_cleared) == (frozenset(), (), frozenset())
    assert (v.unreadable_since, v.unidentified_since, v.node_error_since) == ((), (), None)


def test_a_verdict_is_pending_while_a_gpu_an_index_or_a_node_wide_query_has_been_failing() -> None:
    """Time alone can change the judgement of a failure that lasts (judge.unanswered): each of the three
    kinds is enough by itself."""
    assert not Verdict().pending
    assert Verdict(unreadable_since=(("GPU-a", 1.0),)).pending
    assert Verdict(unidentified_since=((0, 1.0),)).pending
    assert Verdict(node_error_since=0.0).pending
    assert Verdict(node_error_since=5.0).pending


def test_a_counter_is_pending_from_its_second_sample_a_grace_or_clock_samples_at_once() -> None:
    assert not SignalMemory().pending
    assert not SignalMemory(counters=(("GPU-a/ecc", ((1.0, 3),)),)).pending
    assert SignalMemory(counters=(("GPU-a/ecc", ((1.0, 3), (2.0, 4))),)).pending
    assert SignalMemory(fabric_incomplete_since=(("GPU-a", 1.0),)).pending
    assert SignalMemory(clock_samples=(("GPU-a", ((1.0, 8),)),)).pending
    assert Verdict(signal_memory=SignalMemory(fabric_runs=(("GPU-a", (1.0, 0.0, None)),))).pending


def test_streaks_capped_tells_apart_only_lengths_up_to_the_most() -> None:
    """The handoff compares capped streaks: past --recover-after a longer run is the same decision."""
    s = Streaks(healthy=9, gpus={"GPU-b": 2, "GPU-a": 7}, clean=1, gpus_clean={"GPU-a": 5})
    assert s.capped(3) == (3, (("GPU-a", 3), ("GPU-b", 2)), 1, (("GPU-a", 3),))
    assert s.capped(3) == Streaks(
        healthy=4, gpus={"GPU-a": 3, "GPU-b": 2}, clean=1, gpus_clean={"GPU-a": 9}
    ).capped(3)
    assert Streaks(healthy=2).capped(3) == (2, (), 0, ())
