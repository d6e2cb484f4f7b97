"""Escalation's pure decision (gpuguard/quarantine/repeat/escalation.py)."""

from __future__ import annotations

from collections.abc import Mapping

from gpuguard.core.config import PolicySettings
from gpuguard.core.model import REPEAT_OFFENDER, GpuReading, Snapshot, XidEvent
from gpuguard.judge.policy import evaluate
from gpuguard.quarantine.repeat.escalation import (
    ALL,
    Limits,
    escalate,
    gpu_faults,
    held,
    held_faults,
    observe,
    release,
    repeat_offenders,
)
from gpuguard.store.history import Episode, GpuHistory

DAY = 86400.0
NOW = 100 * DAY


def test_three_faults_within_the_window_escalate() -> None:
    episodes = {"GPU-a": [NOW - 2 * DAY, NOW - DAY, NOW - 60]}
    assert repeat_offenders(episodes, Limits(), NOW) == {"GPU-a": 3}


def test_two_faults_do_not_escalate() -> None:
    assert repeat_offenders({"GPU-a": [NOW - DAY, NOW]}, Limits(), NOW) == {}


def test_a_gpu_that_faults_once_per_week_is_never_escalated() -> None:
    weekly = [NOW - k * 7 * DAY - 1 for k in range(10)]
    assert repeat_offenders({"GPU-a": weekly}, Limits(), NOW) == {}


def test_limit_zero_turns_escalation_off() -> None:
    episodes = {"GPU-a": [NOW - 3, NOW - 2, NOW - 1, NOW]}
    assert repeat_offenders(episodes, Limits(limit=0), NOW) == {}


def test_only_the_offending_gpu_is_named() -> None:
    episodes = {"GPU-a": [NOW - 3, NOW - 2, NOW - 1], "GPU-b": [NOW - 1]}
    assert repeat_offenders(episodes, Limits(), NOW) == {"GPU-a": 3}


# -- episodes, escalation and release over the history (observe, escalate, release, held_faults) ----------


def step(
    history: Mapping[str, GpuHistory],
    faults: Mapping[str, tuple[str, ...]],
    *,
    boot: str,
    now: float,
    streak: int = 0,
) -> dict[str, GpuHistory]:
    return observe(
        history,
        faults,
        streaks={"GPU-a": streak, "GPU-b": streak},
        recover_after=3,
        boot_id=boot,
        reset_cleared=frozenset(),
        now=now,
    )


def test_a_fault_opens_one_episode_however_long_it_lasts_and_a_reboot_ends_it() -> None:
    h = step({}, {"GPU-a": ("xid-79",)}, boot="a", now=1.0)
    h = step(h, {"GPU-a": ("xid-79",)}, boot="a", now=2.0)
    h = step(h, {"GPU-a": ("ecc", "xid-79")}, boot="a", now=3.0)
    assert h["GPU-a"].episodes == (Episode(reasons=("ecc", "xid-79"), first_seen=1.0, boot_id="a"),)
    h = step(h, {}, boot="b", now=4.0, streak=2)  # not yet --recover-after healthy checks
    assert h["GPU-a"].open is not None
    h = step(h, {}, boot="b", now=5.0, streak=3)
    assert h["GPU-a"].episodes[-1].ended == "reboot" and h["GPU-a"].open is None


def test_a_fault_in_a_new_boot_is_a_new_episode_even_before_the_old_one_ended() -> None:
    h = step({}, {"GPU-a": ("xid-79",)}, boot="a", now=1.0)
    h = step(h, {"GPU-a": ("xid-79",)}, boot="b", now=2.0)
    assert [(e.boot_id, e.ended) for e in h["GPU-a"].episodes] == [("a", "reboot"), ("b", None)]


def test_an_ecc_counter_that_goes_back_ends_as_a_counter_reset_and_a_driver_reset_as_a_reset() -> None:
    h = step({}, {"GPU-a": ("ecc",)}, boot="a", now=1.0)
    h = step(h, {}, boot="a", now=2.0, streak=3)
    assert h["GPU-a"].episodes[-1].ended == "counter-reset"
    h = step(h, {"GPU-a": ("xid-48",)}, boot="a", now=3.0)
    h = observe(
        h, {}, streaks={"GPU-a": 3}, recover_after=3, boot_id="a", reset_cleared=frozenset({"GPU-a"}), now=4.0
    )
    assert h["GPU-a"].episodes[-1].ended == "reset"


def test_the_third_episode_within_the_window_holds_the_gpu_and_the_window_never_releases_it() -> None:
    h: dict[str, GpuHistory] = {}
    for boot, t in (("a", NOW), ("b", NOW + DAY), ("c", NOW + 2 * DAY)):
        h = step(h, {"GPU-a": ("xid-79",)}, boot=boot, now=t)
        h, new = escalate(h, Limits(), t)
        assert new == {}  # not yet: every GPU may still show it at once (the node's, then)
        h, new = escalate(h, Limits(), t + Limits().at_once_s)
    assert new == {"GPU-a": 3}
    assert held(h) == {"GPU-a": 3}
    later = NOW + 60 * DAY
    h, new = escalate(h, Limits(), later)
    assert new == {} and held(h) == {"GPU-a": 3}  # still held: only a release ends it


def test_a_release_lifts_the_hold_records_who_and_starts_the_count_afresh() -> None:
    h: dict[str, GpuHistory] = {}
    for boot, t in (("a", NOW), ("b", NOW + 1), ("c", NOW + 2)):
        h = step(h, {"GPU-a": ("xid-79",)}, boot=boot, now=t)
    h, _ = escalate(h, Limits(), NOW + 2 + Limits().at_once_s)
    h, released = release(h, "GPU-b", by="bob", at=NOW + 3)
    assert released == [] and held(h) == {"GPU-a": 3}  # another GPU named: nothing released
    h, released = release(h, ALL, by="alice", at=NOW + 3)
    assert released == ["GPU-a"] and held(h) == {}
    assert h["GPU-a"].releases[-1].by == "alice"
    assert h["GPU-a"].episodes[-1].ended == "operator"
    h = step(h, {"GPU-a": ("xid-79",)}, boot="c", now=NOW + 4)  # the same fault, same boot: no new episode
    h, new = escalate(h, Limits(), NOW + 4)
    assert new == {} and h["GPU-a"].open is None
    h = step(h, {"GPU-a": ("xid-79",)}, boot="d", now=NOW + 5)  # one new episode since the release
    h, new = escalate(h, Limits(), NOW + 5)
    assert new == {}


def test_a_gpu_faulting_once_a_week_through_the_history_is_never_held() -> None:
    h: dict[str, GpuHistory] = {}
    for week in range(12):
        t = NOW + week * 7 * DAY + 1
        h = step(h, {"GPU-a": ("xid-79",)}, boot=f"boot-{week}", now=t)
        h = step(h, {}, boot=f"boot-{week + 1}", now=t + 60, streak=3)
        h, new = escalate(h, Limits(), t + 60)
        assert new == {}
    assert len(h["GPU-a"].episodes) == 12 and held(h) == {}


def test_the_held_gpu_carries_a_repeat_offender_fault_that_the_history_never_counts() -> None:
    healthy = evaluate(
        Snapshot(gpus=(GpuReading(index=0, uuid="GPU-a"), GpuReading(index=1, uuid="GPU-b"))),
        previous=None,
        settings=PolicySettings(),
    )
    h = {"GPU-a": GpuHistory(episodes=(Episode(("xid-79",), NOW, "a"),) * 3, escalated=NOW)}
    v = held_faults(healthy, h, Limits())
    (fault,) = v.faults
    assert fault.reason == REPEAT_OFFENDER and fault.uuid == "GPU-a" and fault.gpu_index == 0
    assert "3 fault episodes" in fault.detail and "gpuguard release" in fault.detail
    assert not v.healthy and gpu_faults(v) == {}
    gone = held_faults(healthy, {"GPU-z": h["GPU-a"]}, Limits())  # not seen in this boot: the node's
    assert [f.uuid for f in gone.node_faults] == ["GPU-z"]


def test_gpu_faults_names_each_gpus_reasons() -> None:
    v = evaluate(
        Snapshot(
            gpus=(GpuReading(index=0, uuid="GPU-a", ecc_uncorrected=1),), xids=(XidEvent(0, "GPU-a", 79),)
        ),
        previous=None,
        settings=PolicySettings(),
    )
    assert gpu_faults(v) == {"GPU-a": ("ecc", "xid-79")}
