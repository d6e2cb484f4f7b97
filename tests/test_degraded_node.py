"""The degraded level on the node: the degraded marks' plan (pure), and the reconciler that writes them
in the same pass as the fault's, never cordons for them and never counts them against the budget."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from structlog.testing import capture_logs

from gpuguard.core.config import NodeSettings, PolicySettings, QuarantineLimit
from gpuguard.core.model import Fault, GpuReading, GpuVerdict, Snapshot, Verdict
from gpuguard.judge.policy import evaluate
from gpuguard.quarantine.budget import Budget
from gpuguard.quarantine.node.budget import OtherNodes, QuarantineBudget, count_budget
from gpuguard.quarantine.node.degraded import (
    ANN_DEGRADED,
    LABEL_DEGRADED,
    MAX_DEGRADED_KEYS,
    DegradedRecord,
    degraded_text,
    plan_degraded,
    plan_degraded_condition,
)
from gpuguard.quarantine.node.view import LABEL_QUARANTINED, NodeView, Taint, apply_change
from gpuguard.quarantine.node.writers import DryRunNodeWriter
from gpuguard.quarantine.reconciler import NodeReconciler
from gpuguard.quarantine.record import DEGRADED_TAINT_KEY
from harness.fakes import FakeNodeWriter
from harness.judging import hand_over

NOW = datetime(2026, 12, 5, 9, 0, tzinfo=UTC)
NVLINK = Fault("nvlink-down", "link 3 inactive", uuid="GPU-0", gpu_index=0)
PCIE = Fault("pcie-width", "x8 of x16", uuid="GPU-1", gpu_index=1)
NODE = NodeView(name="gpu-1", resource_version="1", boot_id="b")


def degraded_verdict(*faults: Fault, sick: bool = False) -> Verdict:
    by_gpu = {
        0: tuple(f for f in faults if f.gpu_index == 0),
        1: tuple(f for f in faults if f.gpu_index == 1),
    }
    ecc = (Fault("ecc", "2 uncorrected", uuid="GPU-0", gpu_index=0),) if sick else ()
    return Verdict(
        gpus=(
            GpuVerdict(index=0, uuid="GPU-0", degraded=by_gpu[0], faults=ecc),
            GpuVerdict(index=1, uuid="GPU-1", degraded=by_gpu[1]),
        ),
        node_degraded=tuple(f for f in faults if f.uuid is None),
    )


def marks(node: NodeView, *faults: Fault, streak: int = 0, taint: bool = True) -> NodeView:
    """Apply plans until the node matches (at most 3 writes)."""
    for _ in range(3):
        change = plan_degraded(node, faults, clean_streak=streak, recover_after=3, taint=taint)
        if change is None:
            return node
        node = apply_change(node, change)
    raise AssertionError("the plan does not converge")


# -- the plan ----------------------------------------------------------------------------------------------


def test_a_degraded_gpu_gets_the_soft_taint_the_label_and_the_annotation_and_never_a_cordon() -> None:
    change = plan_degraded(NODE, (PCIE, NVLINK), clean_streak=0, recover_after=3, taint=True)
    assert change is not None and change.action == "degrade"
    assert change.taints == (Taint(DEGRADED_TAINT_KEY, "PreferNoSchedule"),)
    assert change.unschedulable is None
    assert change.labels == {LABEL_DEGRADED: "true"}
    assert json.loads(str(change.annotations[ANN_DEGRADED])) == ["nvlink-down/GPU-0", "pcie-width/GPU-1"]
    assert change.event is not None and (change.event.type, change.event.reason) == ("Warning", "GPUDegraded")
    assert "GPU-0" in change.event.message and "GPU-1" in change.event.message
    assert LABEL_QUARANTINED not in (change.labels or {})


def test_the_plan_is_idempotent_once_the_node_carries_the_marks() -> None:
    node = marks(NODE, NVLINK)
    assert plan_degraded(node, (NVLINK,), clean_streak=0, recover_after=3, taint=True) is None


def test_other_taints_are_carried_over_as_they_were() -> None:
    foreign = Taint("other.io/x", "NoSchedule", "y")
    node = marks(replace(NODE, taints=(foreign,)), NVLINK)
    assert node.taints[0] == foreign and len(node.taints) == 2


def test_a_new_signal_updates_the_record_keeps_the_taint_and_raises_a_new_event() -> None:
    node = marks(NODE, PCIE)
    change = plan_degraded(node, (PCIE, NVLINK), clean_streak=0, recover_after=3, taint=True)
    assert change is not None and change.event is not None and change.taints is None


def test_without_the_taint_setting_only_the_label_and_annotation_are_written() -> None:
    node = marks(NODE, NVLINK, taint=False)
    assert not any(t.key == DEGRADED_TAINT_KEY for t in node.taints)
    assert node.labels[LABEL_DEGRADED] == "true" and ANN_DEGRADED in node.annotations


def test_turning_the_taint_off_removes_ours() -> None:
    node = marks(NODE, NVLINK)
    node = marks(node, NVLINK, taint=False)
    assert not any(t.key == DEGRADED_TAINT_KEY for t in node.taints)


def test_a_taint_removed_by_hand_is_not_put_back_for_the_same_signals_only_for_new_ones() -> None:
    node = marks(NODE, NVLINK)
    node = replace(node, taints=())
    assert plan_degraded(node, (NVLINK,), clean_streak=0, recover_after=3, taint=True) is None
    assert any(t.key == DEGRADED_TAINT_KEY for t in marks(node, NVLINK, PCIE).taints)


def test_the_marks_stay_until_the_verdict_has_been_clean_for_the_recovery_window() -> None:
    node = marks(NODE, NVLINK)
    for streak in (1, 2):
        assert plan_degraded(node, (), clean_streak=streak, recover_after=3, taint=True) is None
    change = plan_degraded(node, (), clean_streak=3, recover_after=3, taint=True)
    assert change is not None and change.action == "degrade-clear"
    assert change.event is not None and change.event.reason == "GPUDegradedCleared"
    cleared = apply_change(node, change)
    assert cleared.taints == () and LABEL_DEGRADED not in cleared.labels
    assert ANN_DEGRADED not in cleared.annotations


def test_a_taint_and_label_gpuguard_did_not_place_are_never_removed() -> None:
    theirs = replace(
        NODE, taints=(Taint(DEGRADED_TAINT_KEY, "NoSchedule", "x"),), labels={LABEL_DEGRADED: "true"}
    )
    assert plan_degraded(theirs, (), clean_streak=99, recover_after=3, taint=True) is None


@pytest.mark.parametrize("effect", ["NoSchedule", "PreferNoSchedule"])
def test_an_operators_own_taint_with_the_degraded_key_is_neither_rewritten_nor_removed(effect: str) -> None:
    theirs = Taint(DEGRADED_TAINT_KEY, effect, "maintenance")
    node = marks(replace(NODE, taints=(theirs,)), NVLINK)
    assert node.taints == (theirs,)  # not weakened to PreferNoSchedule, its value kept
    assert node.labels[LABEL_DEGRADED] == "true" and ANN_DEGRADED in node.annotations
    change = plan_degraded(node, (), clean_streak=3, recover_after=3, taint=True)
    assert change is not None and change.action == "degrade-clear"
    assert apply_change(node, change).taints == (theirs,)
    assert marks(node, NVLINK, taint=False).taints == (theirs,)  # --no-degraded-taint: ours only


def test_its_own_taint_is_released_even_when_the_record_was_cut_to_its_first_keys() -> None:
    """More signals than the record keeps: the taint's value comes from the recorded keys, so the release
    still knows the taint for gpuguard's ("a-b/..." sorts before "a/...": reason "a" is not recorded)."""
    many = tuple(Fault("a-b", "x", uuid=f"GPU-{i:04}", gpu_index=i) for i in range(MAX_DEGRADED_KEYS))
    node = marks(NODE, *many, Fault("a", "x", uuid="GPU-9999", gpu_index=99))
    assert any(t.key == DEGRADED_TAINT_KEY for t in node.taints)
    change = plan_degraded(node, (), clean_streak=3, recover_after=3, taint=True)
    assert change is not None
    assert not any(t.key == DEGRADED_TAINT_KEY for t in apply_change(node, change).taints)


def test_a_malformed_or_oversized_record_is_read_as_bounded_keys_or_none() -> None:
    assert DegradedRecord.read({ANN_DEGRADED: "{not json"}) == DegradedRecord(present=True)
    assert DegradedRecord.read({ANN_DEGRADED: '{"a": 1}'}).keys == frozenset()
    many = json.dumps([f"r/GPU-{i}" for i in range(1000)] + [7, None, "bad key,x"])
    record = DegradedRecord.read({ANN_DEGRADED: many})
    assert len(record.keys) == MAX_DEGRADED_KEYS and all("," not in k for k in record.keys)


def test_the_written_record_is_bounded_however_many_signals() -> None:
    faults = tuple(Fault("nvlink-down", "x", uuid=f"GPU-{i:04}", gpu_index=i) for i in range(500))
    change = plan_degraded(NODE, faults, clean_streak=0, recover_after=3, taint=True)
    assert change is not None and len(json.loads(str(change.annotations[ANN_DEGRADED]))) == MAX_DEGRADED_KEYS


@pytest.mark.parametrize("value", ["pcie-width", "degraded"])
def test_a_degraded_taint_an_earlier_version_gave_the_first_reason_loses_it_in_one_patch(value: str) -> None:
    """Earlier versions valued the taint with the recorded keys' first reason ("degraded" where the record
    is unreadable): still gpuguard's, rewritten without a value in place, and removed at the release."""
    node = marks(NODE, PCIE)
    annotations = dict(node.annotations) if value != "degraded" else {ANN_DEGRADED: "{not json"}
    old = replace(
        node, taints=(Taint(DEGRADED_TAINT_KEY, "PreferNoSchedule", value),), annotations=annotations
    )
    change = plan_degraded(old, (PCIE,), clean_streak=0, recover_after=3, taint=True)
    assert change is not None and change.taints == (Taint(DEGRADED_TAINT_KEY, "PreferNoSchedule"),)
    cleared = plan_degraded(old, (), clean_streak=3, recover_after=3, taint=True)
    assert cleared is not None and apply_change(old, cleared).taints == ()


def test_the_condition_names_the_reasons_and_uuids_and_clears_after_the_window() -> None:
    c = plan_degraded_condition(
        None, (NVLINK, PCIE), last_keys=None, clean_streak=0, recover_after=3, now=NOW
    )
    assert c is not None and c["status"] == "True" and c["type"] == "GPUDegraded"
    assert "nvlink-down" in c["message"] and "GPU-1" in c["message"] and c["message"].startswith("2 GPUs")
    keys = frozenset({"nvlink-down/GPU-0", "pcie-width/GPU-1"})
    same = plan_degraded_condition(
        "True", (NVLINK, PCIE), last_keys=keys, clean_streak=0, recover_after=3, now=NOW
    )
    assert same is None
    assert (
        plan_degraded_condition("True", (), last_keys=keys, clean_streak=2, recover_after=3, now=NOW) is None
    )
    off = plan_degraded_condition("True", (), last_keys=keys, clean_streak=3, recover_after=3, now=NOW)
    assert off is not None and off["status"] == "False"
    # A node never degraded gets no condition at all (no request on a healthy fleet).
    assert plan_degraded_condition(None, (), last_keys=None, clean_streak=9, recover_after=3, now=NOW) is None


def test_the_record_keeps_at_most_64_keys_written_compactly() -> None:
    faults = tuple(Fault("nvlink-down", "x", uuid=f"GPU-{i:04}", gpu_index=i) for i in range(65))
    change = plan_degraded(NODE, faults, clean_streak=0, recover_after=3, taint=True)
    assert change is not None
    text = str(change.annotations[ANN_DEGRADED])
    assert text == json.dumps([f"nvlink-down/GPU-{i:04}" for i in range(64)]).replace(", ", ",")


@pytest.mark.parametrize("value", ["degraded", "maintenance"])
@pytest.mark.parametrize("taint", [True, False], ids=["taint", "no-degraded-taint"])
def test_an_operators_soft_degraded_taint_placed_before_our_record_stays_theirs(
    value: str, taint: bool
) -> None:
    """PreferNoSchedule like gpuguard's, valued "degraded" (a name an operator may well choose): once our
    record existed, the next plan took it for gpuguard's, rewrote it to the signal's reason (or removed it
    under --no-degraded-taint) and removed it at the release."""
    theirs = Taint(DEGRADED_TAINT_KEY, "PreferNoSchedule", value)
    node = marks(replace(NODE, taints=(theirs,)), PCIE, taint=taint)  # our record says pcie-width
    assert node.taints == (theirs,)
    change = plan_degraded(node, (), clean_streak=3, recover_after=3, taint=taint)
    assert change is not None and apply_change(node, change).taints == (theirs,)


def test_with_our_record_unreadable_only_a_soft_taint_valued_degraded_is_taken_for_ours() -> None:
    """An unreadable record is still gpuguard's (rewritten at the next degraded verdict); the value its taint
    would have is that of no recorded keys."""
    ours = Taint(DEGRADED_TAINT_KEY, "PreferNoSchedule", "degraded")
    node = replace(NODE, taints=(ours,), annotations={ANN_DEGRADED: "{not json"})
    change = plan_degraded(node, (), clean_streak=3, recover_after=3, taint=True)
    assert change is not None and apply_change(node, change).taints == ()


def test_the_cleared_event_names_the_signals_that_were_recorded() -> None:
    node = marks(NODE, NVLINK, PCIE)
    change = plan_degraded(node, (), clean_streak=3, recover_after=3, taint=True)
    assert change is not None and change.event is not None
    assert (change.event.type, change.event.message) == (
        "Normal",
        "no degraded GPU signal for the recovery window (was: nvlink-down/GPU-0, pcie-width/GPU-1)",
    )
    unreadable = replace(node, annotations={ANN_DEGRADED: "{not json"})
    change = plan_degraded(unreadable, (), clean_streak=3, recover_after=3, taint=True)
    assert change is not None and change.event is not None
    assert change.event.message == "no degraded GPU signal for the recovery window"


def test_the_degraded_text_lists_each_signal_by_reason_then_place_the_node_first() -> None:
    on_gpu = Fault("pcie-width", "x8 of x16", uuid="GPU-1", gpu_index=1)
    on_gpu_0 = Fault("pcie-width", "", uuid="GPU-0", gpu_index=0)
    on_node = Fault("pcie-width", "fabric")
    assert degraded_text((on_gpu, NVLINK, on_gpu_0, on_node)) == (
        "nvlink-down on GPU 0 (GPU-0): link 3 inactive; pcie-width on the node: fabric; "
        "pcie-width on GPU 0 (GPU-0); pcie-width on GPU 1 (GPU-1): x8 of x16"
    )


def test_the_degraded_text_and_condition_message_are_cut_to_4096_bytes() -> None:
    faults = tuple(Fault("nvlink-down", "y" * 100, uuid=f"GPU-{i:04}", gpu_index=i) for i in range(64))
    assert len(degraded_text(faults).encode()) == 4096
    c = plan_degraded_condition(None, faults, last_keys=None, clean_streak=0, recover_after=3, now=NOW)
    assert c is not None and len(c["message"].encode()) == 4096


def test_the_condition_is_written_whole_degraded_and_cleared() -> None:
    stamp = "2026-12-05T09:00:00Z"
    on = plan_degraded_condition(None, (NVLINK,), last_keys=None, clean_streak=0, recover_after=3, now=NOW)
    assert on == {
        "type": "GPUDegraded",
        "status": "True",
        "reason": "GPUDegraded",
        "message": "1 GPU degraded (gpuguard): nvlink-down on GPU 0 (GPU-0): link 3 inactive",
        "lastHeartbeatTime": stamp,
        "lastTransitionTime": stamp,
    }
    off = plan_degraded_condition("True", (), last_keys=None, clean_streak=3, recover_after=3, now=NOW)
    assert off == {
        "type": "GPUDegraded",
        "status": "False",
        "reason": "GPUsNotDegraded",
        "message": "no degraded GPU signal (gpuguard)",
        "lastHeartbeatTime": stamp,
        "lastTransitionTime": stamp,
    }


# -- the reconciler ----------------------------------------------------------------------------------------


def make(budget: Budget | None = None) -> tuple[FakeNodeWriter, NodeReconciler]:
    settings = NodeSettings(name="gpu-1", retry_max_wait=0.01, max_quarantined=QuarantineLimit.parse("1"))
    writer = FakeNodeWriter(NODE)
    writer.quarantine_budget = budget
    return writer, NodeReconciler(writer, settings, budget=QuarantineBudget(writer, settings))


def step(r: NodeReconciler, verdict: Verdict, streak: int = 0) -> None:
    hand_over(r, verdict, streak)
    r.reconcile_now()


def test_the_reconciler_marks_a_degraded_node_without_cordon_and_releases_it_when_clean() -> None:
    writer, r = make()
    step(r, degraded_verdict(NVLINK))
    node = writer.node
    assert any(t.key == DEGRADED_TAINT_KEY and t.effect == "PreferNoSchedule" for t in node.taints)
    assert not node.unschedulable and LABEL_QUARANTINED not in node.labels
    assert node.degraded_condition == "True"
    assert [e.reason for e in writer.events] == ["GPUDegraded"]
    writes = writer.writes
    step(r, degraded_verdict(NVLINK))  # steady: nothing more
    assert writer.writes == writes
    for _ in range(2):
        step(r, degraded_verdict(), streak=1)
    assert any(t.key == DEGRADED_TAINT_KEY for t in writer.node.taints)  # within the window
    step(r, degraded_verdict(), streak=1)
    node = writer.node
    assert node.taints == () and LABEL_DEGRADED not in node.labels and node.degraded_condition == "False"
    assert [e.reason for e in writer.events] == ["GPUDegraded", "GPUDegradedCleared"]


def test_after_a_restart_the_condition_follows_signals_that_changed_while_the_agent_was_down() -> None:
    """The node holds the marks and GPUDegraded=True for nvlink-down (the last run's); the new run's first
    verdict has pcie-width only: the condition must not keep naming nvlink-down for as long as it lasts."""
    writer, r = make()
    step(r, degraded_verdict(NVLINK))
    assert "nvlink-down" in writer.conditions[-1]["message"]
    restarted = NodeReconciler(writer, r._settings, budget=QuarantineBudget(writer, r._settings))
    step(restarted, degraded_verdict(PCIE))
    assert "pcie-width" in writer.conditions[-1]["message"]
    assert "nvlink-down" not in writer.conditions[-1]["message"]


def test_one_pass_writes_the_fault_quarantine_and_the_degraded_marks() -> None:
    writer, r = make()
    step(r, degraded_verdict(PCIE, sick=True))
    keys = {t.key for t in writer.node.taints}
    assert keys == {"gpuguard.io/gpu-unhealthy", DEGRADED_TAINT_KEY}
    assert [p.action for p in writer.patches] == ["taint", "degrade"]


def test_a_spent_budget_never_defers_the_degraded_marks_and_they_never_count_against_it() -> None:
    writer, r = make(budget=Budget(quarantined=1, limit=1))
    step(r, degraded_verdict(NVLINK))
    assert writer.node.labels.get(LABEL_DEGRADED) == "true"
    assert LABEL_QUARANTINED not in writer.node.labels
    assert writer.quarantine_order() == []  # the budget's own count of this node: nothing


def test_a_healthy_node_still_costs_nothing_after_its_first_read() -> None:
    writer, r = make()
    healthy = evaluate(
        Snapshot(gpus=(GpuReading(index=0, uuid="GPU-0"),)), previous=None, settings=PolicySettings()
    )
    for _ in range(20):
        step(r, healthy, 1)
    assert (writer.reads, writer.writes, writer.conditions[1:]) == (1, 0, [])


def test_the_budget_never_counts_a_degraded_only_node_whatever_its_marks() -> None:
    """The budget (node/budget.py, and budgetwatch.py's watch of `gpuguard.io/quarantined=true`) counts only
    the quarantine label with gpuguard's since: the degraded marks are neither."""
    node = marks(NODE, NVLINK)
    meta = {
        "metadata": {
            "name": node.name,
            "labels": dict(node.labels),
            "annotations": dict(node.annotations),
            "creationTimestamp": "2026-12-01T00:00:00Z",
        }
    }
    others = OtherNodes(clock=lambda: NOW)
    claims = others.quarantined([meta])
    assert claims == []
    budget = count_budget([meta], QuarantineLimit.parse("50%"), exclude="other", quarantined=claims)
    assert (budget.quarantined, budget.gpu_nodes) == (0, 2)
    assert not node.fully_quarantined and not node.deferred and not node.holds_gpuguard_state()


def test_a_dry_run_logs_the_degraded_patch_and_condition_it_would_write() -> None:
    writer = DryRunNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="dry-run"))
    r = NodeReconciler(writer, NodeSettings(name="gpu-1", dry_run=True))
    with capture_logs() as logs:
        step(r, degraded_verdict(NVLINK))
    node = writer.read()
    assert node.labels.get(LABEL_DEGRADED) == "true" and node.degraded_condition == "True"
    events = [(e["event"], e.get("transition")) for e in logs]
    assert ("node.dry_run", "node.degraded") in events and ("node.degraded", None) not in events
    assert ("node.dry_run_condition", None) in events


def test_the_writer_thread_wakes_for_the_degraded_signals_and_their_clean_streak() -> None:
    """Through the hand-off (not reconcile_now): a degraded verdict wakes the writer, and so does each
    clean check up to --recover-after, so the marks go without any other change to the verdict."""
    writer, r = make()
    r.start()
    try:
        clean = degraded_verdict()
        hand_over(r, clean, 1)
        assert r.wait_idle(5)
        hand_over(r, degraded_verdict(NVLINK), 1)  # the same healthy streak: only the signals differ
        assert r.wait_idle(5)
        assert writer.node.labels.get(LABEL_DEGRADED) == "true"
        for streak in (3, 4, 5):  # past --recover-after for the faults: only the clean streak moves
            hand_over(r, clean, streak)
            assert r.wait_idle(5)
        assert LABEL_DEGRADED not in writer.node.labels and writer.node.degraded_condition == "False"
    finally:
        r.stop()


def test_a_first_reason_no_taint_value_can_hold_was_written_by_earlier_versions_as_degraded() -> None:
    """Earlier versions valued the taint "degraded" where the first recorded reason was no valid taint value
    (longer than a label value's 63 characters): that taint is still gpuguard's, rewritten without it."""
    long = Fault("r" * 70, "x", uuid="GPU-0", gpu_index=0)
    node = marks(NODE, long)
    assert DegradedRecord.read(dict(node.annotations)).keys == {f"{'r' * 70}/GPU-0"}
    old = replace(node, taints=(Taint(DEGRADED_TAINT_KEY, "PreferNoSchedule", "degraded"),))
    change = plan_degraded(old, (long,), clean_streak=0, recover_after=3, taint=True)
    assert change is not None and change.taints == (Taint(DEGRADED_TAINT_KEY, "PreferNoSchedule"),)
    theirs = replace(node, taints=(Taint(DEGRADED_TAINT_KEY, "PreferNoSchedule", "rrr"),))
    assert plan_degraded(theirs, (long,), clean_streak=0, recover_after=3, taint=True) is None
