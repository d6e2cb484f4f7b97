"""What the node writer decides to send for a given Node: idempotence, ownership, recovery rules.

Pure: plan() and apply_change() need no cluster. The real API server proves the same in tests/integration.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest

from gpuguard.core.config import NodeSettings, PolicySettings, QuarantineLimit
from gpuguard.core.model import REPEAT_OFFENDER, Fault, GpuReading, Snapshot, Verdict, XidEvent
from gpuguard.judge.policy import evaluate
from gpuguard.quarantine.budget import Budget
from gpuguard.quarantine.node.budget import limit, plan_yield, quarantine_rank
from gpuguard.quarantine.node.plan import evidence_gone, plan, plan_condition
from gpuguard.quarantine.node.view import (
    ANN_CORDONED,
    ANN_REPEAT_OFFENDERS,
    LABEL_QUARANTINED,
    UNVERIFIED_TAINT_KEY,
    NodeChange,
    NodeView,
    Taint,
    apply_change,
)
from gpuguard.quarantine.record import (
    ANN_BOOT_ID,
    ANN_DEFERRED,
    ANN_FAULTS,
    ANN_REASON,
    ANN_SINCE,
    TAINT_KEY,
    reason_text,
)

NOW = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)
SETTINGS = NodeSettings(name="gpu-1")
FOREIGN = Taint(
    key="example.com/maintenance", value="x", effect="NoExecute", time_added="2026-01-01T00:00:00Z"
)
GPUS = (GpuReading(index=0, uuid="GPU-0"), GpuReading(index=1, uuid="GPU-1"))


def verdict(*, ecc: int = 0, xid: int | None = None, lost: bool = False) -> Verdict:
    g0 = GpuReading(index=0, uuid="GPU-0", ecc_uncorrected=ecc, lost=lost)
    xids = (XidEvent(1, "GPU-1", xid),) if xid is not None else ()
    return evaluate(Snapshot(gpus=(g0, GPUS[1]), xids=xids), previous=None, settings=PolicySettings())


HEALTHY = verdict()


def node(**kw: object) -> NodeView:
    base: dict[str, object] = {"name": "gpu-1", "resource_version": "10", "boot_id": "boot-a"}
    base.update(kw)
    return NodeView(**base)  # type: ignore[arg-type]


def decide(
    n: NodeView, v: Verdict, *, streak: int = 0, settings: NodeSettings = SETTINGS
) -> NodeChange | None:
    return plan(n, v, healthy_streak=streak, settings=settings, now=NOW)


def tainted(v: Verdict, n: NodeView | None = None, settings: NodeSettings = SETTINGS) -> NodeView:
    n = n or node()
    change = decide(n, v, settings=settings)
    assert change is not None
    return apply_change(n, change)


def test_a_healthy_node_needs_no_write() -> None:
    assert decide(node(), HEALTHY, streak=100) is None


def test_the_first_fault_taints_cordons_and_annotates_in_one_change() -> None:
    change = decide(node(taints=(FOREIGN,)), verdict(ecc=3))
    assert change is not None and change.action == "taint"
    assert change.patch("10") == {
        "metadata": {
            "resourceVersion": "10",
            "annotations": {
                ANN_REASON: "ecc: 3 uncorrected volatile ECC errors (GPU 0, GPU-0)",
                ANN_SINCE: "2026-12-02T12:00:00Z",
                ANN_BOOT_ID: "boot-a",
                ANN_FAULTS: "ecc/GPU-0",
                ANN_CORDONED: "true",
            },
            "labels": {"gpuguard.io/quarantined": "true"},
        },
        "spec": {
            "taints": [
                {
                    "key": "example.com/maintenance",
                    "value": "x",
                    "effect": "NoExecute",
                    "timeAdded": "2026-01-01T00:00:00Z",
                },
                {"key": TAINT_KEY, "effect": "NoSchedule"},
            ],
            "unschedulable": True,
        },
    }
    assert change.event is not None and (change.event.type, change.event.reason) == (
        "Warning",
        "GPUUnhealthy",
    )


@pytest.mark.parametrize("effect", ["NoSchedule", "PreferNoSchedule", "NoExecute"])
def test_the_taint_effect_follows_the_setting(effect: str) -> None:
    n = tainted(verdict(xid=79), settings=NodeSettings(name="gpu-1", taint_effect=effect))
    assert n.our_taint == Taint(key=TAINT_KEY, effect=effect)


def test_no_cordon_taints_without_touching_unschedulable() -> None:
    change = decide(node(), verdict(ecc=1), settings=NodeSettings(name="gpu-1", cordon=False))
    assert change is not None and change.unschedulable is None
    assert ANN_CORDONED not in change.annotations


def test_an_admin_cordon_is_not_claimed_as_ours() -> None:
    change = decide(node(unschedulable=True), verdict(ecc=1))
    assert change is not None and change.unschedulable is None
    assert ANN_CORDONED not in change.annotations


def test_a_node_that_already_matches_gets_no_write_as_after_an_agent_restart() -> None:
    n = tainted(verdict(ecc=3))
    assert decide(n, verdict(ecc=3)) is None
    assert decide(n, verdict(ecc=7)) is None  # same fault, more errors: nothing new to say


def test_a_restarted_agent_that_no_longer_sees_the_xid_keeps_the_taint() -> None:
    n = tainted(verdict(xid=79))
    assert decide(n, HEALTHY, streak=1000) is None


def test_a_new_fault_on_a_tainted_node_adds_to_the_record_without_a_second_taint() -> None:
    n = tainted(verdict(ecc=3))
    v = evaluate(
        Snapshot(
            gpus=(GpuReading(index=0, uuid="GPU-0", ecc_uncorrected=3), GPUS[1]),
            xids=(XidEvent(1, "GPU-1", 79),),
        ),
        previous=None,
        settings=PolicySettings(),
    )
    change = decide(n, v)
    assert change is not None and change.action == "add-faults"
    assert change.taints is None and change.unschedulable is None
    assert change.annotations[ANN_FAULTS] == "ecc/GPU-0,xid-79/GPU-1"
    after = apply_change(n, change)
    assert after.our_taint == n.our_taint
    assert decide(after, v) is None


def test_a_taint_removed_by_hand_is_not_re_added_for_the_same_fault() -> None:
    n = tainted(verdict(ecc=3))
    by_hand = NodeView(**{**n.__dict__, "taints": ()})
    change = decide(by_hand, verdict(ecc=3))
    # The override is recorded (the label that counts against the budget goes), the taint is not re-added.
    assert change is not None and change.action == "override" and change.taints is None
    after = apply_change(by_hand, change)
    assert after.our_taint is None and LABEL_QUARANTINED not in after.labels
    assert after.recorded_faults == n.recorded_faults
    assert decide(after, verdict(ecc=3)) is None


def test_a_taint_removed_by_hand_comes_back_for_a_new_fault() -> None:
    n = tainted(verdict(ecc=3))
    by_hand = NodeView(**{**n.__dict__, "taints": ()})
    v = evaluate(
        Snapshot(
            gpus=(GpuReading(index=0, uuid="GPU-0", ecc_uncorrected=3), GPUS[1]),
            xids=(XidEvent(1, "GPU-1", 79),),
        ),
        previous=None,
        settings=PolicySettings(),
    )
    change = decide(by_hand, v)
    assert change is not None and change.action == "taint"
    assert apply_change(by_hand, change).our_taint == Taint(TAINT_KEY, "NoSchedule")


def test_ecc_recovers_after_enough_healthy_checks_once_the_counter_is_reset() -> None:
    n = tainted(verdict(ecc=3), node(taints=(FOREIGN,)))
    assert decide(n, HEALTHY, streak=2) is None  # --recover-after 3
    change = decide(n, HEALTHY, streak=3)
    assert change is not None and change.action == "recover"
    after = apply_change(n, change)
    assert after.taints == (FOREIGN,)
    assert after.unschedulable is False
    assert after.annotations == {}
    assert after.labels == {}
    assert change.event is not None and change.event.reason == "GPURecovered"
    assert decide(after, HEALTHY, streak=4) is None


def test_an_xid_recovers_only_after_the_node_rebooted() -> None:
    n = tainted(verdict(xid=79))
    assert decide(n, HEALTHY, streak=10) is None
    rebooted = NodeView(**{**n.__dict__, "boot_id": "boot-b"})
    change = decide(rebooted, HEALTHY, streak=3)
    assert change is not None and change.action == "recover"


def test_an_xid_a_driver_requested_gpu_reset_cleared_recovers_without_a_reboot() -> None:
    n = tainted(verdict(xid=79))
    key = next(iter(n.recorded_faults))
    reset = replace(HEALTHY, reset_cleared=frozenset({key}))
    change = decide(n, reset, streak=3)
    assert change is not None and change.action == "recover"
    assert decide(n, replace(HEALTHY, reset_cleared=frozenset({"xid-79/GPU-other"})), streak=10) is None


@pytest.mark.parametrize("v", [verdict(lost=True), verdict(xid=48)])
def test_non_ecc_faults_need_a_new_boot_id(v: Verdict) -> None:
    n = tainted(v)
    assert decide(n, HEALTHY, streak=10) is None
    assert decide(NodeView(**{**n.__dict__, "boot_id": "boot-b"}), HEALTHY, streak=10) is not None


def test_an_admins_own_cordon_survives_recovery() -> None:
    n = tainted(verdict(ecc=1), node(unschedulable=True))
    change = decide(n, HEALTHY, streak=3)
    assert change is not None
    after = apply_change(n, change)
    assert after.unschedulable is True and after.our_taint is None


def test_an_admin_who_uncordoned_during_the_fault_is_not_uncordoned_again() -> None:
    n = tainted(verdict(ecc=1))
    uncordoned = NodeView(**{**n.__dict__, "unschedulable": False})
    change = decide(uncordoned, HEALTHY, streak=3)
    assert change is not None and change.unschedulable is None
    assert change.annotations[ANN_CORDONED] is None  # our record of the cordon is cleaned up


def test_no_recover_keeps_the_taint_forever() -> None:
    n = tainted(verdict(ecc=1))
    assert decide(n, HEALTHY, streak=1000, settings=NodeSettings(name="gpu-1", recover=False)) is None


def test_foreign_taints_and_annotations_are_never_changed() -> None:
    n = node(taints=(FOREIGN,), annotations={"example.com/owner": "team-a"})
    t = tainted(verdict(ecc=1), n)
    change = decide(t, HEALTHY, streak=3)
    assert change is not None
    after = apply_change(t, change)
    assert FOREIGN in after.taints
    assert after.annotations == {"example.com/owner": "team-a"}
    assert all(k.startswith("gpuguard.io/") for k in change.annotations)


def test_a_recorded_boot_id_that_is_missing_blocks_reboot_based_recovery() -> None:
    n = tainted(verdict(xid=79))
    no_record = NodeView(
        **{
            **n.__dict__,
            "annotations": {k: v for k, v in n.annotations.items() if k != ANN_BOOT_ID},
            "boot_id": "boot-b",
        }
    )
    assert decide(no_record, HEALTHY, streak=10) is None


def test_since_is_kept_when_a_new_fault_re_taints() -> None:
    n = tainted(verdict(ecc=3))
    by_hand = NodeView(**{**n.__dict__, "taints": ()})
    later = plan(
        by_hand,
        verdict(ecc=3, xid=79),
        healthy_streak=0,
        settings=SETTINGS,
        now=datetime(2027, 1, 1, tzinfo=UTC),
    )
    assert later is not None and later.annotations[ANN_SINCE] == "2026-12-02T12:00:00Z"


def test_node_view_reads_the_api_object() -> None:
    obj = {
        "metadata": {"name": "gpu-1", "resourceVersion": "42", "uid": "u-1", "annotations": {"a": "b"}},
        "spec": {"taints": [{"key": "k", "effect": "NoSchedule"}], "unschedulable": True},
        "status": {"nodeInfo": {"bootID": "boot-z"}},
    }
    v = NodeView.from_api(obj)
    assert (v.name, v.resource_version, v.uid, v.unschedulable, v.boot_id) == (
        "gpu-1",
        "42",
        "u-1",
        True,
        "boot-z",
    )
    assert v.taints == (Taint(key="k", effect="NoSchedule"),)
    assert NodeView.from_api({"metadata": {"name": "bare"}}).taints == ()


# -- quarantine budget, startup gate, flapping -------------------------------------------------------------


def gated(n: NodeView, v: Verdict, budget: Budget | None) -> NodeChange | None:
    """The planner's full quarantine through the budget's gate, as the reconciler applies it."""
    return limit(plan(n, v, healthy_streak=0, settings=SETTINGS, now=NOW), n, v, budget, SETTINGS)


def test_past_the_budget_a_fault_gets_only_a_soft_taint_no_cordon_and_a_deferred_label() -> None:
    spent = Budget(gpu_nodes=40, quarantined=4, limit=4)
    change = gated(node(), verdict(ecc=1), spent)
    assert change is not None and change.action == "defer"
    after = apply_change(node(), change)
    assert after.our_taint == Taint(TAINT_KEY, "PreferNoSchedule")
    assert not after.unschedulable and ANN_CORDONED not in after.annotations
    assert after.labels == {LABEL_QUARANTINED: "deferred"}
    assert "4 of 40 GPU nodes" in after.annotations[ANN_DEFERRED]
    assert change.event is not None and change.event.reason == "GPUQuarantineDeferred"
    # Still no room: nothing to write on later checks.
    assert gated(after, verdict(ecc=1), spent) is None


def test_a_deferred_quarantine_escalates_when_the_budget_has_room() -> None:
    spent = Budget(gpu_nodes=40, quarantined=4, limit=4)
    deferred = apply_change(
        node(),
        gated(node(), verdict(ecc=1), spent),  # type: ignore[arg-type]
    )
    room = Budget(gpu_nodes=40, quarantined=3, limit=4)
    change = gated(deferred, verdict(ecc=1), room)
    assert change is not None and change.action == "escalate"
    after = apply_change(deferred, change)
    assert after.our_taint == Taint(TAINT_KEY, "NoSchedule")
    assert after.unschedulable and after.cordoned_by_us
    assert after.labels == {LABEL_QUARANTINED: "true"} and ANN_DEFERRED not in after.annotations


def test_a_deferred_node_recovers_like_any_other() -> None:
    spent = Budget(gpu_nodes=10, quarantined=1, limit=1)
    deferred = apply_change(
        node(),
        gated(node(), verdict(ecc=1), spent),  # type: ignore[arg-type]
    )
    change = decide(deferred, HEALTHY, streak=3)
    assert change is not None
    after = apply_change(deferred, change)
    assert after.our_taint is None and after.labels == {} and after.annotations == {}


@pytest.mark.parametrize(
    ("spec", "nodes", "limit"),
    [
        ("10%", 40, 4),
        ("10%", 5, 1),
        ("10%", 1, 1),
        ("0%", 40, 0),
        ("100%", 7, 7),
        ("3", 100, 3),
        ("12.5%", 8, 1),
    ],
)
def test_the_budget_limit_is_a_count_or_a_percentage_rounded_up(spec: str, nodes: int, limit: int) -> None:
    assert QuarantineLimit.parse(spec).of(nodes) == limit


def test_the_startup_gate_is_removed_after_the_first_healthy_check() -> None:
    gate = Taint(key=UNVERIFIED_TAINT_KEY, effect="NoSchedule")
    change = decide(node(taints=(gate, FOREIGN)), HEALTHY)
    assert change is not None and change.action == "verified"
    assert change.taints == (FOREIGN,)
    assert change.unschedulable is None and not change.annotations


def test_the_startup_gate_stays_next_to_the_unhealthy_taint_until_recovery() -> None:
    gate = Taint(key=UNVERIFIED_TAINT_KEY, effect="NoSchedule")
    change = decide(node(taints=(gate,)), verdict(xid=79))
    assert change is not None and change.action == "taint"
    assert change.taints == (gate, Taint(TAINT_KEY, "NoSchedule"))
    after = apply_change(node(taints=(gate,)), change)
    rebooted = NodeView(**{**after.__dict__, "boot_id": "boot-b"})
    recovered = decide(rebooted, HEALTHY, streak=3)
    assert recovered is not None and recovered.action == "recover" and recovered.taints == ()


def test_the_startup_gate_waits_for_a_check_that_saw_gpus() -> None:
    gate = Taint(key=UNVERIFIED_TAINT_KEY, effect="NoSchedule")
    from gpuguard.core.model import Verdict as V

    assert decide(node(taints=(gate,)), V()) is None


def test_a_flapping_gpu_keeps_the_node_quarantined() -> None:
    n = tainted(verdict(ecc=1))
    assert plan(n, HEALTHY, healthy_streak=10, settings=SETTINGS, now=NOW, flapping=True) is None
    assert plan(n, HEALTHY, healthy_streak=10, settings=SETTINGS, now=NOW, flapping=False) is not None


# -- the quarantine order: agents that faulted at the same instant and all saw room ------------------------


def test_the_quarantine_order_is_since_then_name_and_leaves_this_node_out() -> None:
    order = [("2026-12-02T10:00:00Z", "b"), ("2026-12-02T10:00:00Z", "a"), ("2026-12-02T09:00:00Z", "z")]
    assert quarantine_rank(order, ("2026-12-02T10:00:00Z", "b")) == 2  # z (earlier), a (same second, name)
    assert quarantine_rank(order, ("2026-12-02T10:00:00Z", "a")) == 1
    assert quarantine_rank(order, ("2026-12-02T09:00:00Z", "z")) == 0
    assert quarantine_rank([*order, *order], ("2026-12-02T11:00:00Z", "c")) == 3  # a duplicate counts once


def test_a_full_quarantine_past_the_limit_yields_to_a_soft_taint_and_lifts_only_its_own_cordon() -> None:
    full = apply_change(node(), gated(node(), verdict(ecc=1), None))  # type: ignore[arg-type]
    assert full.unschedulable and full.cordoned_by_us
    assert plan_yield(full, ahead=3, limit=4, settings=SETTINGS) is None  # within the limit
    change = plan_yield(full, ahead=4, limit=4, settings=SETTINGS)
    assert change is not None and change.action == "yield"
    after = apply_change(full, change)
    assert after.our_taint == Taint(TAINT_KEY, "PreferNoSchedule")
    assert not after.unschedulable and ANN_CORDONED not in after.annotations
    assert after.labels == {LABEL_QUARANTINED: "deferred"} and after.deferred
    assert "4 GPU nodes were quarantined before this one, limit 4" in after.annotations[ANN_DEFERRED]
    assert change.event is not None and change.event.reason == "GPUQuarantineDeferred"
    assert (
        after.recorded_faults == full.recorded_faults
        and after.annotations[ANN_SINCE] == full.annotations[ANN_SINCE]
    )
    # Deferred now: nothing more to yield, and no escalation while the budget has no room.
    assert plan_yield(after, ahead=4, limit=4, settings=SETTINGS) is None
    spent = Budget(gpu_nodes=40, quarantined=4, limit=4)
    assert gated(after, verdict(ecc=1), spent) is None


def test_a_yield_keeps_a_cordon_it_did_not_place_and_every_foreign_taint() -> None:
    foreign = Taint("other.io/x", "NoSchedule")
    cordoned = node(taints=(foreign,), unschedulable=True)
    full = apply_change(cordoned, gated(cordoned, verdict(ecc=1), None))  # type: ignore[arg-type]
    assert not full.cordoned_by_us
    change = plan_yield(full, ahead=1, limit=1, settings=SETTINGS)
    assert change is not None and change.unschedulable is None
    after = apply_change(full, change)
    assert after.unschedulable and after.taints[0] == foreign


def test_nothing_to_yield_on_a_node_that_is_not_fully_quarantined_by_us() -> None:
    assert plan_yield(node(), ahead=9, limit=1, settings=SETTINGS) is None


# -- the planner's side of the review's fixes (the Node itself: tests/integration/test_agent_cluster.py) -----


def rebooted(n: NodeView, boot_id: str = "boot-b") -> NodeView:
    return NodeView(**{**n.__dict__, "boot_id": boot_id})


def test_a_repeat_offenders_taint_removed_by_hand_is_put_back() -> None:
    """A GPU held as a repeat offender is released only by gpuguard.io/release (which an agent's token cannot
    write): a stolen token removed the taint, and the agent took that for an operator's override."""
    held = Fault(REPEAT_OFFENDER, "3 fault episodes in 7 days", uuid="GPU-0", gpu_index=0)
    v = replace(verdict(ecc=3), node_faults=(held,))  # as escalation.held_faults adds a held GPU's fault
    n = tainted(v)
    by_hand = NodeView(**{**n.__dict__, "taints": ()})
    change = decide(by_hand, v)
    assert change is not None and change.taints is not None
    assert [t.key for t in change.taints] == [TAINT_KEY]
    assert LABEL_QUARANTINED in apply_change(by_hand, change).labels


def test_the_same_fault_after_a_reboot_is_a_new_fault_even_after_an_override() -> None:
    n = tainted(verdict(xid=79))
    by_hand = NodeView(**{**n.__dict__, "taints": ()})
    overridden = apply_change(by_hand, decide(by_hand, verdict(xid=79)))  # type: ignore[arg-type]
    assert decide(overridden, verdict(xid=79)) is None  # same boot: not re-added
    change = decide(rebooted(overridden), verdict(xid=79))
    assert change is not None and change.action == "taint"
    assert change.annotations[ANN_BOOT_ID] == "boot-b"


def test_a_fault_that_recurs_on_a_tainted_node_after_a_reboot_records_the_new_boot() -> None:
    n = rebooted(tainted(verdict(xid=79)))
    change = decide(n, verdict(xid=79))
    assert change is not None and change.action == "add-faults" and change.taints is None
    assert change.annotations[ANN_BOOT_ID] == "boot-b"
    after = apply_change(n, change)
    assert decide(after, HEALTHY, streak=10) is None  # the record is of this boot now: no recovery


def test_a_cordon_lifted_by_someone_is_no_longer_claimed() -> None:
    n = tainted(verdict(ecc=1))
    uncordoned = NodeView(**{**n.__dict__, "unschedulable": False})
    change = decide(uncordoned, verdict(ecc=1))
    assert change is not None and change.action == "release-cordon"
    assert change.annotations == {ANN_CORDONED: None} and change.unschedulable is None
    recordoned = NodeView(**{**apply_change(uncordoned, change).__dict__, "unschedulable": True})
    recovery = decide(recordoned, HEALTHY, streak=3)
    assert recovery is not None and recovery.action == "recover" and recovery.unschedulable is None


def test_a_gpu_unhealthy_taint_without_gpuguards_record_is_never_removed() -> None:
    manual = Taint(TAINT_KEY, "NoSchedule", "manual")
    n = node(taints=(manual,))
    assert n.our_taint is None
    assert decide(n, HEALTHY, streak=100) is None
    # A real fault takes it over: one taint with our key, with the record.
    change = decide(n, verdict(ecc=1))
    assert change is not None and change.action == "taint"
    assert change.taints == (Taint(TAINT_KEY, "NoSchedule"),)


# -- the gate's key and who lifts it (--gate-taint-key, --gate-removal) --------------------------------------

CLUSTER_AUTOSCALER_GATE = "startup-taint.cluster-autoscaler.kubernetes.io/gpuguard"
KARPENTER_GATE = "example.com/gpu-unverified"  # Karpenter's startupTaints take any key
READINESS_GATE = "readiness.k8s.io/gpu-healthy"


@pytest.mark.parametrize("key", [CLUSTER_AUTOSCALER_GATE, KARPENTER_GATE])
def test_a_configured_gate_key_is_lifted_after_the_first_healthy_check_and_the_default_one_is_not(
    key: str,
) -> None:
    settings = NodeSettings(name="gpu-1", gate_taint_key=key)
    gate = Taint(key=key, effect="NoSchedule")
    default_gate = Taint(key=UNVERIFIED_TAINT_KEY, effect="NoSchedule")
    change = decide(node(taints=(default_gate, gate, FOREIGN)), HEALTHY, settings=settings)
    assert change is not None and change.action == "verified"
    assert change.taints == (default_gate, FOREIGN)


@pytest.mark.parametrize("key", [CLUSTER_AUTOSCALER_GATE, KARPENTER_GATE])
def test_a_configured_gate_stays_beside_the_unhealthy_taint_and_goes_with_it_at_recovery(key: str) -> None:
    settings = NodeSettings(name="gpu-1", gate_taint_key=key)
    gate = Taint(key=key, effect="NoSchedule")
    change = decide(node(taints=(gate,)), verdict(xid=79), settings=settings)
    assert change is not None and change.action == "taint"
    assert change.taints == (gate, Taint(TAINT_KEY, "NoSchedule"))
    rebooted = NodeView(**{**apply_change(node(taints=(gate,)), change).__dict__, "boot_id": "boot-b"})
    recovered = decide(rebooted, HEALTHY, streak=3, settings=settings)
    assert recovered is not None and recovered.action == "recover" and recovered.taints == ()


def test_with_external_gate_removal_a_healthy_gated_node_gets_no_taint_write() -> None:
    """The readiness-controller pattern: the controller lifts readiness.k8s.io/... from the GPUHealthy
    condition (written by the reconciler), gpuguard never touches the gate."""
    settings = NodeSettings(name="gpu-1", gate_taint_key=READINESS_GATE, gate_removal="external")
    gate = Taint(key=READINESS_GATE, effect="NoSchedule")
    assert decide(node(taints=(gate, FOREIGN)), HEALTHY, streak=10, settings=settings) is None


def test_with_external_gate_removal_recovery_removes_only_gpuguards_taint() -> None:
    settings = NodeSettings(name="gpu-1", gate_taint_key=READINESS_GATE, gate_removal="external")
    gate = Taint(key=READINESS_GATE, effect="NoSchedule")
    change = decide(node(taints=(gate,)), verdict(xid=79), settings=settings)
    assert change is not None and change.taints == (gate, Taint(TAINT_KEY, "NoSchedule"))
    rebooted = NodeView(**{**apply_change(node(taints=(gate,)), change).__dict__, "boot_id": "boot-b"})
    recovered = decide(rebooted, HEALTHY, streak=3, settings=settings)
    assert recovered is not None and recovered.action == "recover" and recovered.taints == (gate,)


def test_nodes_behind_the_gate_do_not_count_as_quarantined_in_the_budget() -> None:
    from gpuguard.quarantine.node.budget import count_budget, quarantine_entry

    def meta(name: str, labels: dict[str, str], annotations: dict[str, str]) -> dict[str, object]:
        return {"name": name, "labels": labels, "annotations": annotations}

    # Gated nodes carry only the gate's taint: no quarantine label, so they are GPU nodes, not quarantined.
    metas = [meta(f"gated-{i}", {}, {}) for i in range(5)]
    metas.append(meta("bad", {LABEL_QUARANTINED: "true"}, {ANN_SINCE: "2026-12-01T00:00:00Z"}))
    now = datetime(2026, 12, 2, tzinfo=UTC)
    entries = [e for m in metas if isinstance(e := quarantine_entry(m, now=now), tuple)]
    items = [{"metadata": m} for m in metas]
    budget = count_budget(items, QuarantineLimit.parse("20%"), exclude="gpu-1", quarantined=entries)
    assert (budget.gpu_nodes, budget.quarantined, budget.limit) == (7, 1, 2)
    assert budget.has_room


# -- reading the Node from the API ---------------------------------------------------------------------------


def test_node_view_reads_annotations_labels_foreign_taints_and_the_gpu_healthy_condition() -> None:
    obj = {
        "metadata": {
            "name": "gpu-1",
            "annotations": {ANN_FAULTS: "ecc/GPU-0", "other.io/x": "y"},
            "labels": {LABEL_QUARANTINED: "deferred", "zone": "a"},
        },
        "spec": {
            "taints": [
                {
                    "key": "example.com/maintenance",
                    "value": "x",
                    "effect": "NoExecute",
                    "timeAdded": "2026-01-01T00:00:00Z",
                },
                {"key": TAINT_KEY, "value": "ecc", "effect": "PreferNoSchedule"},
            ]
        },
        "status": {
            "conditions": [
                {"type": "Ready", "status": "True"},
                {"type": "GPUHealthy", "status": "False", "message": "xid-79 on GPU 1"},
            ],
            "nodeInfo": {"bootID": "boot-z"},
        },
    }
    v = NodeView.from_api(obj)
    assert v.annotations == {ANN_FAULTS: "ecc/GPU-0", "other.io/x": "y"}
    assert v.labels == {LABEL_QUARANTINED: "deferred", "zone": "a"}
    assert v.taints == (FOREIGN, Taint(TAINT_KEY, "PreferNoSchedule", "ecc"))
    assert v.taints[0].to_api() == obj["spec"]["taints"][0]  # type: ignore[index]
    assert (v.gpu_condition, v.gpu_condition_message) == ("False", "xid-79 on GPU 1")
    assert v.deferred and v.our_taint == Taint(TAINT_KEY, "PreferNoSchedule", "ecc")


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ({}, ("", "", "", False, "", {}, {}, None, ())),
        (
            {"metadata": None, "spec": None, "status": None},
            ("", "", "", False, "", {}, {}, None, ()),
        ),
        (
            {
                "metadata": {"annotations": None, "labels": None},
                "spec": {"taints": None},
                "status": {"nodeInfo": None, "conditions": None},
            },
            ("", "", "", False, "", {}, {}, None, ()),
        ),
        ({"spec": {"unschedulable": False}}, ("", "", "", False, "", {}, {}, None, ())),
        (
            {"status": {"conditions": [{"type": "Ready", "status": "True"}]}},
            ("", "", "", False, "", {}, {}, None, ()),
        ),
        ({"spec": {"taints": [{}]}}, ("", "", "", False, "", {}, {}, None, (Taint("", ""),))),
    ],
)
def test_node_view_reads_absent_fields_as_empty_schedulable_and_no_condition(
    obj: dict[str, object], expected: tuple[object, ...]
) -> None:
    v = NodeView.from_api(obj)
    got = (
        v.name,
        v.resource_version,
        v.uid,
        v.unschedulable,
        v.boot_id,
        v.annotations,
        v.labels,
        v.gpu_condition,
        v.taints,
    )
    assert got == expected


def test_a_taint_without_value_or_time_added_writes_neither() -> None:
    assert Taint(TAINT_KEY, "NoSchedule").to_api() == {"key": TAINT_KEY, "effect": "NoSchedule"}
    assert Taint.from_api({"key": "k", "effect": "NoSchedule", "value": "v", "timeAdded": "t"}) == Taint(
        "k", "NoSchedule", "v", "t"
    )


def test_a_patch_without_taints_or_cordon_has_no_spec_and_one_with_them_has_exactly_them() -> None:
    bare = NodeChange(action="add-faults", annotations={ANN_FAULTS: "ecc/GPU-0"})
    assert bare.patch("7") == {"metadata": {"resourceVersion": "7", "annotations": {ANN_FAULTS: "ecc/GPU-0"}}}
    assert NodeChange(action="taint", unschedulable=False).patch("7") == {
        "metadata": {"resourceVersion": "7"},
        "spec": {"unschedulable": False},
    }
    assert NodeChange(action="taint", taints=()).patch("7") == {
        "metadata": {"resourceVersion": "7"},
        "spec": {"taints": []},
    }


def test_applying_a_change_bumps_the_resource_version_or_takes_the_servers() -> None:
    n = node(resource_version="")
    change = NodeChange(action="taint", labels={"a": "b"})
    assert apply_change(n, change).resource_version == "1"
    assert apply_change(node(), change).resource_version == "11"
    assert apply_change(node(), change, resource_version="99").resource_version == "99"


@pytest.mark.parametrize(
    ("annotations", "labels", "gate", "holds"),
    [
        ({}, {}, False, False),
        ({"other.io/x": "y"}, {"zone": "a"}, False, False),
        ({ANN_BOOT_ID: "b"}, {}, False, True),
        ({ANN_DEFERRED: "x"}, {}, False, True),
        ({}, {LABEL_QUARANTINED: "true"}, False, True),
        ({}, {}, True, True),
    ],
)
def test_what_counts_as_gpuguard_state_on_a_node(
    annotations: dict[str, str], labels: dict[str, str], gate: bool, holds: bool
) -> None:
    taints = (Taint(UNVERIFIED_TAINT_KEY, "NoSchedule"),) if gate else ()
    assert node(annotations=annotations, labels=labels, taints=taints).holds_gpuguard_state() is holds


@pytest.mark.parametrize(
    ("recorded", "current", "earlier"),
    [("boot-a", "boot-b", True), ("boot-a", "boot-a", False), ("", "boot-b", False), ("boot-a", "", False)],
)
def test_a_record_is_from_an_earlier_boot_only_when_both_boot_ids_are_known_and_differ(
    recorded: str, current: str, earlier: bool
) -> None:
    n = node(annotations={ANN_BOOT_ID: recorded, ANN_FAULTS: "xid-79/GPU-1"}, boot_id=current)
    assert n.record_from_earlier_boot is earlier
    assert n.current_faults == (frozenset() if earlier else frozenset({"xid-79/GPU-1"}))


# -- escalating and overriding a deferred quarantine --------------------------------------------------------


def deferred_node(**kw: object) -> NodeView:
    """A node whose quarantine the budget deferred: soft taint, label deferred, no cordon."""
    spent = Budget(gpu_nodes=40, quarantined=4, limit=4)
    change = gated(node(**kw), verdict(ecc=1), spent)
    assert change is not None and change.action == "defer"
    return apply_change(node(**kw), change)


ROOM = Budget(gpu_nodes=40, quarantined=3, limit=4)


def test_with_no_cordon_an_escalation_taints_in_full_but_never_cordons() -> None:
    settings = NodeSettings(name="gpu-1", cordon=False)
    n = deferred_node()
    change = limit(
        plan(n, verdict(ecc=1), healthy_streak=0, settings=settings, now=NOW),
        n,
        verdict(ecc=1),
        ROOM,
        settings,
    )
    assert change is not None and change.action == "escalate"
    assert change.unschedulable is None and ANN_CORDONED not in change.annotations
    after = apply_change(n, change)
    assert after.our_taint == Taint(TAINT_KEY, "NoSchedule") and not after.unschedulable


def test_an_escalation_on_a_node_an_administrator_cordoned_does_not_claim_the_cordon() -> None:
    n = deferred_node(unschedulable=True)
    change = gated(n, verdict(ecc=1), ROOM)
    assert change is not None and change.action == "escalate"
    assert change.unschedulable is None and ANN_CORDONED not in change.annotations
    assert not apply_change(n, change).cordoned_by_us


def test_an_escalation_after_a_reboot_records_the_new_boot_id() -> None:
    n = replace(deferred_node(), boot_id="boot-b")
    assert n.annotations[ANN_BOOT_ID] == "boot-a"
    change = gated(n, verdict(ecc=1), ROOM)
    assert change is not None and change.action == "escalate"
    assert change.annotations[ANN_BOOT_ID] == "boot-b"
    assert change.annotations[ANN_FAULTS] == "ecc/GPU-0" and change.annotations[ANN_DEFERRED] is None
    assert change.event is not None and (change.event.type, change.event.reason) == (
        "Warning",
        "GPUUnhealthy",
    )
    assert change.event.message.startswith("quarantine budget has room: ecc: ")
    # In the same boot the record's boot ID is left as it is.
    same = gated(deferred_node(), verdict(ecc=1), ROOM)
    assert same is not None and ANN_BOOT_ID not in same.annotations


def test_an_override_of_a_deferred_quarantine_drops_the_deferred_record_and_says_so_in_a_normal_event() -> (
    None
):
    n = deferred_node()
    by_hand = replace(n, taints=())
    change = decide(by_hand, verdict(ecc=1))
    assert change is not None and change.action == "override"
    assert change.annotations == {ANN_DEFERRED: None}
    assert change.labels == {LABEL_QUARANTINED: None}
    assert change.event is not None
    assert (change.event.type, change.event.reason) == ("Normal", "GPUQuarantineOverridden")
    after = apply_change(by_hand, change)
    assert ANN_DEFERRED not in after.annotations and after.recorded_faults == n.recorded_faults
    assert decide(after, verdict(ecc=1)) is None


def test_an_override_of_a_full_quarantine_has_no_deferred_record_to_drop() -> None:
    n = replace(tainted(verdict(ecc=3)), taints=())
    change = decide(n, verdict(ecc=3))
    assert change is not None and change.annotations == {} and change.labels == {LABEL_QUARANTINED: None}


# -- what is gpuguard's, recovery's Event, the condition ----------------------------------------------------


@pytest.mark.parametrize(
    ("annotations", "labels"),
    [({}, {LABEL_QUARANTINED: "true"}), ({ANN_SINCE: "2026-12-02T11:00:00Z"}, {})],
    ids=["label-only", "one-annotation"],
)
def test_a_lone_piece_of_gpuguards_record_is_removed_at_recovery(
    annotations: dict[str, str], labels: dict[str, str]
) -> None:
    n = node(annotations=annotations, labels=labels)
    change = decide(n, HEALTHY, streak=3)
    assert change is not None and change.action == "recover"
    after = apply_change(n, change)
    assert after.annotations == {} and after.labels == {}
    assert (
        change.event is not None
        and change.event.message == "GPUs healthy again and the fault's evidence is gone"
    )


def test_recovery_is_a_normal_event_that_names_what_the_node_was_quarantined_for() -> None:
    n = tainted(verdict(ecc=3))
    change = decide(n, HEALTHY, streak=3)
    assert change is not None and change.event is not None
    assert (change.event.type, change.event.reason) == ("Normal", "GPURecovered")
    assert change.event.message == (
        "GPUs healthy again and the fault's evidence is gone (was: ecc: 3 uncorrected volatile ECC errors "
        "(GPU 0, GPU-0))"
    )


def test_while_recovery_waits_a_cordon_lifted_by_someone_is_no_longer_claimed() -> None:
    n = replace(tainted(verdict(ecc=3)), unschedulable=False)
    change = decide(n, HEALTHY, streak=1)
    assert change is not None and change.action == "release-cordon"
    assert change.annotations == {ANN_CORDONED: None} and change.event is None


def test_a_new_fault_recorded_on_a_tainted_node_is_a_warning_event() -> None:
    n = tainted(verdict(ecc=3))
    change = decide(n, verdict(ecc=3, xid=79))
    assert change is not None and change.action == "add-faults" and change.event is not None
    assert (change.event.type, change.event.reason) == ("Warning", "GPUUnhealthy")
    assert change.event.message == "xid-79: GPU has fallen off the bus (GPU 1, GPU-1)"


@pytest.mark.parametrize(
    ("recorded", "gone"),
    [
        ("ecc/GPU-0", True),
        ("ecc/GPU-0,xid-79/GPU-1", False),
        ("xid-79/GPU-1", False),
    ],
)
def test_evidence_is_gone_only_when_every_recorded_fault_clears_without_a_reboot(
    recorded: str, gone: bool
) -> None:
    assert evidence_gone(node(annotations={ANN_FAULTS: recorded, ANN_BOOT_ID: "boot-a"})) is gone
    assert evidence_gone(node(annotations={ANN_FAULTS: recorded, ANN_BOOT_ID: "boot-a"}, boot_id="boot-b"))


def test_the_gpu_healthy_condition_is_written_whole() -> None:
    healthy = plan_condition(None, HEALTHY, last_keys=None, now=NOW)
    assert healthy == {
        "type": "GPUHealthy",
        "status": "True",
        "reason": "GPUsHealthy",
        "message": "2 GPUs healthy (gpuguard)",
        "lastHeartbeatTime": "2026-12-02T12:00:00Z",
        "lastTransitionTime": "2026-12-02T12:00:00Z",
    }
    sick = plan_condition("True", verdict(ecc=3), last_keys=None, now=NOW)
    assert sick is not None and (sick["status"], sick["reason"]) == ("False", "GPUFault")
    assert sick["message"] == "ecc: 3 uncorrected volatile ECC errors (GPU 0, GPU-0) (1 of 2 GPUs unhealthy)"
    held = plan_condition("True", verdict(ecc=3), last_keys=None, now=NOW, device_tainted=1)
    assert held is not None and held["message"].endswith(
        "(1 of 2 GPUs unhealthy, 1 held out by device taints)"
    )


def test_the_reason_annotation_is_at_most_1024_bytes() -> None:
    faults = tuple(Fault("xid-79", "x" * 300, uuid=f"GPU-{i}", gpu_index=i) for i in range(5))
    text = reason_text(faults)
    assert len(text.encode()) == 1024 and text.endswith("...")


def test_a_node_view_left_to_its_defaults_holds_nothing_of_gpuguards() -> None:
    n = NodeView(name="n")
    assert (n.resource_version, n.uid, n.boot_id, n.gpu_condition, n.taints) == ("", "", "", None, ())
    assert not n.record_from_earlier_boot and not n.holds_gpuguard_state() and n.our_taint is None
    # A record without a boot ID proves no reboot, whatever the node's boot ID.
    assert not node(annotations={ANN_FAULTS: "xid-79/GPU-1"}, boot_id="boot-b").record_from_earlier_boot


def test_the_conditions_counts_read_as_english_with_one_gpu_and_with_none() -> None:
    one = evaluate(
        Snapshot(gpus=(GpuReading(index=0, uuid="GPU-0"),)), previous=None, settings=PolicySettings()
    )
    healthy = plan_condition(None, one, last_keys=None, now=NOW)
    assert healthy is not None and healthy["message"] == "1 GPU healthy (gpuguard)"
    sick_one = evaluate(
        Snapshot(gpus=(GpuReading(index=0, uuid="GPU-0", ecc_uncorrected=1),)),
        previous=None,
        settings=PolicySettings(),
    )
    sick = plan_condition("True", sick_one, last_keys=None, now=NOW)
    assert sick is not None
    assert sick["message"] == "ecc: 1 uncorrected volatile ECC error (GPU 0, GPU-0) (1 of 1 GPU unhealthy)"
    # NVML down: no GPU was read, so no "0 of 0" count.
    down = evaluate(
        Snapshot(gpus=(), init_error="DRIVER_NOT_LOADED"), previous=None, settings=PolicySettings()
    )
    message = plan_condition("True", down, last_keys=None, now=NOW)
    assert message is not None and message["message"].startswith("nvml-init: ")
    assert "of 0" not in message["message"] and not message["message"].endswith(")"), message["message"]


def test_with_no_gpu_to_count_the_condition_names_only_the_gpus_device_taints_hold_out() -> None:
    down = evaluate(Snapshot(init_error="DRIVER_NOT_LOADED"), previous=None, settings=PolicySettings())
    alone = plan_condition("True", down, last_keys=None, now=NOW)
    assert (
        alone is not None and alone["message"] == "nvml-init: NVML initialization failed: DRIVER_NOT_LOADED"
    )
    held = plan_condition("True", down, last_keys=None, now=NOW, device_tainted=2)
    assert held is not None
    assert (
        held["message"]
        == "nvml-init: NVML initialization failed: DRIVER_NOT_LOADED (2 held out by device taints)"
    )


def test_the_fault_taint_carries_no_value_so_a_toleration_with_exists_or_an_empty_value_matches_it() -> None:
    n = tainted(verdict(xid=79))
    assert n.our_taint == Taint(TAINT_KEY, "NoSchedule") and n.our_taint.to_api() == {
        "key": TAINT_KEY,
        "effect": "NoSchedule",
    }
    assert n.annotations[ANN_REASON].startswith("xid-79: ") and n.record.primary_reason == "xid-79"


@pytest.mark.parametrize(
    ("v", "streak"),
    [(verdict(xid=79), 0), (verdict(xid=79, ecc=2), 0), (HEALTHY, 1)],
    ids=["same fault", "a new fault too", "healthy, recovery not due"],
)
def test_a_taint_an_earlier_version_gave_the_reason_as_value_loses_it_in_the_same_one_patch(
    v: Verdict, streak: int
) -> None:
    """Upgrading from a version that wrote `gpu-unhealthy=xid-79`: the one write that carries the whole
    taint list swaps the taint for one without a value (its effect and timeAdded kept), under the
    resourceVersion precondition; the node is never without it."""
    ours = Taint(TAINT_KEY, "NoExecute", "xid-79", time_added="2026-12-01T00:00:00Z")
    settings = replace(SETTINGS, taint_effect="NoExecute")
    old = apply_change(tainted(verdict(xid=79), settings=settings), NodeChange(action="taint"))
    old = replace(old, taints=(FOREIGN, ours))
    change = decide(old, v, streak=streak, settings=settings)
    assert change is not None and change.taints == (FOREIGN, replace(ours, value=None))
    assert change.patch(old.resource_version)["metadata"]["resourceVersion"] == old.resource_version
    assert decide(apply_change(old, change), v, streak=streak, settings=settings) is None


def test_a_valued_taint_with_our_key_but_without_our_record_stays_as_it_is() -> None:
    theirs = Taint(TAINT_KEY, "NoSchedule", "rma-123")
    assert decide(node(taints=(theirs,)), HEALTHY, streak=100) is None


@pytest.mark.parametrize(
    ("annotation", "held"),
    [
        (None, {}),
        ('{"GPU-a": 3, "GPU-b": 2}', {"GPU-a": 3, "GPU-b": 2}),
        ('{"GPU-a": 3, "GPU-b": true, "GPU-c": "2", "GPU-d": 1.5}', {"GPU-a": 3}),
        ('["GPU-a"]', {}),
        ("{not json", {}),
        ("[" * 100_000, {}),
    ],
)
def test_the_held_repeat_offenders_are_read_from_the_annotation_and_anything_malformed_is_none(
    annotation: str | None, held: dict[str, int]
) -> None:
    """The annotation is the node's, which a stolen token could write: only GPU -> whole count entries are
    read; a non-object, bad JSON or one nested past the stack hold none."""
    annotations = {} if annotation is None else {ANN_REPEAT_OFFENDERS: annotation}
    assert NodeView(name="n", annotations=annotations).repeat_offenders == held


def test_node_view_reads_the_whole_accelerated_hardware_condition_and_none_when_absent() -> None:
    """The repairers' condition (AcceleratedHardwareReady) is read whole: status, reason, message and when it
    last changed, each as text, a field absent left out; another condition type is not it."""
    obj = {
        "metadata": {"name": "n"},
        "status": {
            "conditions": [
                {"type": "GPUHealthy", "status": "True", "reason": "GPUsHealthy"},
                {
                    "type": "AcceleratedHardwareReady",
                    "status": "False",
                    "reason": "GPUUnhealthy",
                    "message": "xid-79",
                    "lastTransitionTime": "2026-12-06T01:02:03Z",
                    "lastHeartbeatTime": "2026-12-06T01:02:04Z",
                },
            ]
        },
    }
    assert NodeView.from_api(obj).accelerated_condition == {
        "status": "False",
        "reason": "GPUUnhealthy",
        "message": "xid-79",
        "lastTransitionTime": "2026-12-06T01:02:03Z",
    }
    bare = {
        "metadata": {"name": "n"},
        "status": {"conditions": [{"type": "AcceleratedHardwareReady", "status": True}]},
    }
    assert NodeView.from_api(bare).accelerated_condition == {"status": "True"}
    assert NodeView.from_api({"metadata": {"name": "n"}}).accelerated_condition is None
    other = {"metadata": {"name": "n"}, "status": {"conditions": [{"type": "GPUHealthy", "status": "True"}]}}
    assert NodeView.from_api(other).accelerated_condition is None


def test_a_taint_valued_before_the_hold_loses_its_value_in_one_write_keeping_every_other_taint() -> None:
    """The node's taint says `ecc` (written by an older agent, before its GPU was held): with nothing else to
    write, the planner drops the value alone ("unvalue"), keeping every other taint: the hold's taint, as
    every gpuguard taint, carries no value."""
    held = Fault(REPEAT_OFFENDER, "3 fault episodes in 7 days", uuid="GPU-0", gpu_index=0)
    v = replace(verdict(ecc=3), node_faults=(held,))
    n = tainted(v)
    foreign = Taint("example.com/maintenance", "NoSchedule")
    older = NodeView(
        **{
            **n.__dict__,
            "taints": (foreign, *(replace(t, value="ecc") if t.key == TAINT_KEY else t for t in n.taints)),
        }
    )
    change = decide(older, v)
    assert change is not None and change.action == "unvalue" and change.taints is not None
    assert [(t.key, t.value) for t in change.taints] == [
        ("example.com/maintenance", None),
        (TAINT_KEY, None),
    ]
