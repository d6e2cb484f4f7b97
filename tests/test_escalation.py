"""Escalation's pure decision (gpuguard/quarantine/repeat/escalation.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime

import pytest

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
    lag,
    observe,
    release,
    repeat_offenders,
)
from gpuguard.quarantine.repeat.escalation import settling as is_settling
from gpuguard.store.history import Episode, GpuHistory, Release

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


# -- the edges of each decision ------------------------------------------------------------------------------


def test_the_default_limits_are_three_episodes_in_seven_days_counted_30_s_after_they_open() -> None:
    assert Limits() == Limits(limit=3, window_s=7 * DAY, at_once_s=30.0)


@pytest.mark.parametrize(
    ("times", "limit", "found"),
    [
        ([NOW - 7 * DAY, NOW - DAY, NOW], 3, {"GPU-a": 3}),  # the window's first and last instants count
        ([NOW - 7 * DAY - 1, NOW - DAY, NOW], 3, {}),
        ([NOW - 2, NOW - 1, NOW + 1], 3, {}),  # a time after now is not within the window
        ([NOW - 1], 1, {"GPU-a": 1}),  # a limit of 1: the first episode
    ],
    ids=["edges", "a second too old", "one in the future", "limit 1"],
)
def test_the_window_counts_episodes_from_its_first_instant_to_now(
    times: list[float], limit: int, found: dict[str, int]
) -> None:
    assert repeat_offenders({"GPU-a": times}, Limits(limit=limit), NOW) == found


def test_a_fault_seen_again_with_the_same_reasons_leaves_the_history_as_it_was() -> None:
    """The same object: the repeat offenders see nothing changed, so nothing to escalate or save."""
    h = step({}, {"GPU-a": ("ecc", "xid-79")}, boot="a", now=1.0)
    assert step(h, {"GPU-a": ("xid-79",)}, boot="a", now=2.0)["GPU-a"] is h["GPU-a"]
    assert step(h, {"GPU-a": ("ecc", "xid-79")}, boot="a", now=3.0)["GPU-a"] is h["GPU-a"]


def test_after_a_release_each_gpu_is_judged_on_its_own_faults_in_either_loop() -> None:
    """GPU-a, released with Xid 79 in this boot, shows it again (no new episode); GPU-b after it still opens
    one, and GPU-c, healthy for the window, still ends its own."""
    h = step({}, {"GPU-a": ("xid-79",), "GPU-c": ("ecc",)}, boot="a", now=1.0)
    h = {**h, "GPU-a": replace(h["GPU-a"], escalated=1.0)}
    h, _ = release(h, "GPU-a", by="alice", at=2.0)
    h = observe(
        h,
        {"GPU-a": ("xid-79",), "GPU-b": ("xid-79",)},
        streaks={"GPU-a": 0, "GPU-b": 0, "GPU-c": 3},
        recover_after=3,
        boot_id="a",
        reset_cleared=frozenset(),
        now=3.0,
    )
    assert h["GPU-a"].open is None and len(h["GPU-a"].episodes) == 1
    assert h["GPU-b"].open is not None
    assert h["GPU-c"].episodes[-1].ended == "counter-reset"


def test_a_gpu_with_no_healthy_streak_yet_keeps_its_episode_open() -> None:
    h = step({}, {"GPU-a": ("ecc",)}, boot="a", now=1.0)
    after = observe(h, {}, streaks={}, recover_after=1, boot_id="a", reset_cleared=frozenset(), now=2.0)
    assert after["GPU-a"].open is not None


def node_step(
    h: Mapping[str, GpuHistory], faults: Mapping[str, tuple[str, ...]], now: float
) -> dict[str, GpuHistory]:
    """Both GPUs of a two-GPU node, the default at-once seconds."""
    return observe(
        h,
        faults,
        streaks={},
        recover_after=3,
        boot_id="a",
        reset_cleared=frozenset(),
        now=now,
        gpus=("GPU-a", "GPU-b"),
    )


@pytest.mark.parametrize(("delay", "shared"), [(30.0, ("xid-79",)), (31.0, ())])
def test_a_reason_both_gpus_of_a_two_gpu_node_show_within_30_s_is_the_nodes(
    delay: float, shared: tuple[str, ...]
) -> None:
    h = node_step({}, {"GPU-a": ("xid-79",)}, 0.0)
    h = node_step(h, {"GPU-a": ("xid-79",), "GPU-b": ("xid-79",)}, delay)
    assert [h[u].episodes[-1].shared for u in ("GPU-a", "GPU-b")] == [shared, shared]


def test_a_reason_shared_at_once_is_recorded_once_and_the_next_reason_judged_on_its_own() -> None:
    h = node_step({}, {"GPU-a": ("ecc",)}, 0.0)  # GPU-a's own, long before
    both = {"GPU-a": ("ecc", "xid-79"), "GPU-b": ("ecc", "xid-79")}
    h = node_step(h, both, 100.0)  # ecc: not at once; xid-79 (sorted after it): at once
    h = node_step(h, both, 105.0)
    assert [h[u].episodes[-1].shared for u in ("GPU-a", "GPU-b")] == [("xid-79",), ("xid-79",)]
    h = node_step({}, {"GPU-a": ("xid-79",), "GPU-b": ("xid-79",)}, 0.0)
    h = node_step(h, {"GPU-a": ("xid-79",), "GPU-b": ("xid-79",)}, 5.0)  # again, still at once
    assert [h[u].episodes[-1].shared for u in ("GPU-a", "GPU-b")] == [("xid-79",), ("xid-79",)]


def test_a_gpu_released_with_the_reason_is_no_evidence_that_the_reason_is_the_nodes() -> None:
    h = node_step({}, {"GPU-a": ("xid-79",)}, 0.0)
    h = {**h, "GPU-a": replace(h["GPU-a"], escalated=0.0)}
    h, _ = release(h, "GPU-a", by="alice", at=1.0)
    h = node_step(h, {"GPU-a": ("xid-79",), "GPU-b": ("xid-79",)}, 2.0)
    assert h["GPU-a"].open is None and h["GPU-b"].episodes[-1].shared == ()


def test_the_lag_is_how_far_the_clock_is_behind_the_history_plus_a_millisecond() -> None:
    h = {"GPU-a": GpuHistory(episodes=(Episode(("xid-79",), NOW, "a"),))}
    assert lag(h, NOW) == 0.0
    assert lag(h, NOW + 5) == 0.0
    assert lag(h, NOW - 10) == pytest.approx(10.001)
    assert lag({}, NOW) == 0.0


def test_a_release_of_every_gpu_releases_each_held_one_past_one_not_held() -> None:
    held_one = GpuHistory(episodes=(Episode(("xid-79",), NOW, "a"),), escalated=NOW)
    h = {"GPU-a": GpuHistory(episodes=(Episode(("ecc",), NOW, "a"),)), "GPU-b": held_one}
    after, released = release(h, ALL, by="alice", at=NOW + 1)
    assert released == ["GPU-b"] and held(after) == {}


def test_an_episode_stamped_at_the_release_instant_is_the_released_one_not_counted() -> None:
    h = GpuHistory(
        episodes=(Episode(("xid-79",), NOW, "a"), Episode(("xid-79",), NOW + 1, "b")),
        releases=(Release(by="alice", at=NOW),),
        escalated=NOW + 2,
    )
    assert held({"GPU-a": h}) == {"GPU-a": 1}


def test_the_held_fault_names_the_last_four_counted_episodes_and_how_many_came_before() -> None:
    t0 = datetime(2027, 1, 20, 8, 0, tzinfo=UTC).timestamp()
    ended = ("reboot", "reset", "counter-reset", "reboot", None)
    episodes = tuple(
        Episode(("ecc", "xid-79") if i == 4 else ("xid-79",), t0 + i * DAY, f"b{i}", ended=e)
        for i, e in enumerate(ended)
    )
    h = {"GPU-a": GpuHistory(episodes=episodes, escalated=t0 + 4 * DAY)}
    gpu = GpuReading(index=0, uuid="GPU-a")
    healthy = evaluate(Snapshot(gpus=(gpu,)), previous=None, settings=PolicySettings())
    (fault,) = held_faults(healthy, h, Limits(window_s=14 * DAY)).faults
    assert fault.detail == (
        "5 fault episodes (limit 3 in 14 days): 1 earlier, xid-79 2027-01-21T08:00Z (reset), "
        "xid-79 2027-01-22T08:00Z (counter-reset), xid-79 2027-01-23T08:00Z (reboot), "
        "ecc+xid-79 2027-01-24T08:00Z (open); held for repair until `gpuguard release` (GPU 0, GPU-a)"
    )
    four = {"GPU-a": replace(h["GPU-a"], episodes=episodes[1:])}
    (fault,) = held_faults(healthy, four, Limits()).faults
    assert fault.detail.startswith("4 fault episodes (limit 3 in 7 days): xid-79 2027-01-21T08:00Z (reset), ")


@pytest.mark.parametrize(
    ("history", "settling"),
    [
        ({"GPU-a": GpuHistory(episodes=(Episode(("xid-79",), NOW - 30, "a"),))}, True),  # 30 s: still
        ({"GPU-a": GpuHistory(episodes=(Episode(("xid-79",), NOW - 31, "a"),))}, False),
        (
            {
                "GPU-a": GpuHistory(episodes=(Episode(("xid-79",), NOW - 60, "a"),)),
                "GPU-b": GpuHistory(episodes=(Episode(("xid-79",), NOW - 1, "a"),)),
            },
            True,  # any GPU's
        ),
        ({"GPU-a": GpuHistory(episodes=(Episode(("xid-79",), NOW - 1, "a"),), escalated=NOW)}, False),
        ({"GPU-a": GpuHistory()}, False),
    ],
    ids=["30 s", "31 s", "one of two", "held", "no episode"],
)
def test_an_episode_settles_30_s_after_it_opens_unless_its_gpu_is_held(
    history: dict[str, GpuHistory], settling: bool
) -> None:
    assert is_settling(history, Limits(), NOW) is settling
