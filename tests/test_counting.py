"""What counts toward a GPU's repeat limit (gpuguard/quarantine/repeat/counting.py, used by escalation.py):
only the GPU's own faults; a node's cause (the fabric that Fabric Manager sets up, NVML itself) is recorded,
not counted."""

from __future__ import annotations

from collections.abc import Mapping

from gpuguard.core.model import NVML_INIT, NVML_UNRESPONSIVE
from gpuguard.core.signaltable import SIGNALS
from gpuguard.quarantine.repeat.counting import NOT_COUNTED, counted, counts
from gpuguard.quarantine.repeat.escalation import Limits, escalate, held, observe
from gpuguard.store.history import GpuHistory

NO_MORE: Mapping[str, tuple[str, ...]] = {}

DAY = 86400.0
NOW = 100 * DAY
EIGHT = tuple(f"GPU-{i}" for i in range(8))


def boots(
    faults_per_boot: Mapping[str, tuple[str, ...]], n: int = 3
) -> tuple[dict[str, GpuHistory], dict[str, int]]:
    """The same faults in `n` boots a day apart, escalated after each: the history and the last new holds."""
    h: dict[str, GpuHistory] = {}
    new: dict[str, int] = {}
    for k in range(n):
        t = NOW + k * DAY
        h = observe(
            h,
            faults_per_boot,
            streaks={},
            recover_after=3,
            boot_id=f"boot-{k}",
            reset_cleared=frozenset(),
            now=t,
        )
        h, new = escalate(h, Limits(), t + Limits().at_once_s)  # an episode counts once it is not new
    return h, new


def test_fabric_incomplete_on_all_eight_gpus_over_three_boots_holds_none_but_is_recorded() -> None:
    h, new = boots({u: ("fabric-incomplete",) for u in EIGHT})
    assert new == {} and held(h) == {}
    assert all(len(h[u].episodes) == 3 for u in EIGHT)  # still the evidence
    assert all(h[u].escalated is None for u in EIGHT)


def test_xid_79_over_three_boots_still_holds_the_gpu() -> None:
    h, new = boots({"GPU-0": ("xid-79",)})
    assert new == {"GPU-0": 3} and held(h) == {"GPU-0": 3}


def test_a_mixed_episode_of_fabric_and_xid_79_counts() -> None:
    faults = {u: ("fabric-incomplete",) for u in EIGHT}
    h, new = boots({**faults, "GPU-3": ("fabric-incomplete", "xid-79")})
    assert new == {"GPU-3": 3} and held(h) == {"GPU-3": 3}


def test_an_episode_that_gains_a_gpu_fault_later_in_the_same_boot_counts() -> None:
    h: dict[str, GpuHistory] = {}
    for k in range(3):
        for reasons, dt in ((("fabric-status",), 0.0), (("xid-79",), 60.0)):
            h = observe(
                h,
                {"GPU-0": reasons},
                streaks={},
                recover_after=3,
                boot_id=f"boot-{k}",
                reset_cleared=frozenset(),
                now=NOW + k * DAY + dt,
            )
            h, _ = escalate(h, Limits(), NOW + k * DAY + dt + Limits().at_once_s)
    assert held(h) == {"GPU-0": 3}


def test_the_fabric_signals_and_the_node_causes_do_not_count_and_the_gpus_own_faults_do() -> None:
    for reason in ("fabric-incomplete", "fabric-status", "fabric-degraded", NVML_INIT, NVML_UNRESPONSIVE):
        assert not counts(reason), reason
    for reason in (
        "xid-79",
        "xid-48",
        "xid-74",
        "ecc",
        "row-remap",
        "gpu-lost",
        "gpu-missing",
        "nvlink-down",
    ):
        assert counts(reason), reason
    assert not counts("recovery-recover-imex-domain") and counts("recovery-gpu-reset")
    assert not counted(("fabric-incomplete", "fabric-status")) and counted(("fabric-incomplete", "ecc"))


def test_every_non_counting_reason_says_why() -> None:
    for s in SIGNALS:
        assert s.repeat or len(s.repeat_why) > 20, s.name
    assert all(len(why) > 20 for why in NOT_COUNTED.values())


def test_an_episode_cut_to_three_reasons_keeps_the_one_that_counts() -> None:
    reasons = ("fabric-degraded", "fabric-incomplete", "recovery-recover-imex-domain", "xid-79")
    h, new = boots({"GPU-0": reasons})
    assert h["GPU-0"].episodes[0].reasons == ("fabric-degraded", "fabric-incomplete", "xid-79")
    assert new == {"GPU-0": 3}


def outages(
    timings: Mapping[str, float], n: int = 3, *, also: Mapping[str, tuple[str, ...]] = NO_MORE
) -> dict[str, GpuHistory]:
    """`n` outages a day apart in one boot, each GPU reading gpu-unreadable from its offset (seconds) on,
    then healthy for --recover-after checks; escalated after each."""
    h: dict[str, GpuHistory] = {}
    for k in range(n):
        t0 = NOW + k * DAY
        showing: dict[str, tuple[str, ...]] = {}
        for offset in sorted(set(timings.values())):
            showing |= {u: ("gpu-unreadable", *also.get(u, ())) for u, dt in timings.items() if dt <= offset}
            h = observe(
                h,
                showing,
                streaks={},
                recover_after=3,
                boot_id="b",
                reset_cleared=frozenset(),
                now=t0 + offset,
                gpus=list(timings),
            )
        end = t0 + 600
        h = observe(
            h,
            {},
            streaks=dict.fromkeys(timings, 3),
            recover_after=3,
            boot_id="b",
            reset_cleared=frozenset(),
            now=end,
            gpus=list(timings),
        )
        h, _ = escalate(h, Limits(), end)
    return h


def test_three_outages_in_which_every_gpu_answers_unknown_hold_no_gpu_and_are_recorded_as_the_nodes() -> None:
    h = outages(dict.fromkeys(EIGHT, 0.0))
    assert held(h) == {}
    assert all([e.shared for e in h[u].episodes] == [("gpu-unreadable",)] * 3 for u in EIGHT)


def test_every_gpu_within_the_at_once_seconds_is_at_once_and_a_gpus_own_reason_still_counts() -> None:
    staggered = {u: 5.0 * i for i, u in enumerate(EIGHT)}  # the last GPU 35 s after the first: not at once
    assert held(outages({u: min(t, 25.0) for u, t in staggered.items()})) == {}
    assert held(outages(staggered)) == dict.fromkeys(EIGHT, 3)
    mixed = outages(dict.fromkeys(EIGHT, 0.0), also={"GPU-3": ("xid-79",)})
    assert held(mixed) == {"GPU-3": 3}


def test_a_node_of_one_gpu_has_no_node_wide_evidence_its_faults_count() -> None:
    assert held(outages({"GPU-0": 0.0})) == {"GPU-0": 3}
