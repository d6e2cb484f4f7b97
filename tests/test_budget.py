"""The node budget over time (gpuguard.quarantine.node.budget), driven directly with a clock and a fake
fleet: the gate (when it lists, what it defers), the two order checks after a full quarantine, the step back
it asks for, and the pure parts' exact texts and bounds."""

from __future__ import annotations

from datetime import UTC, datetime
from fractions import Fraction
from typing import Any

import pytest

from gpuguard.core.config import NodeSettings, PolicySettings, QuarantineLimit
from gpuguard.core.errors import NodeUpdateError
from gpuguard.core.model import GpuReading, Snapshot, Verdict
from gpuguard.judge.policy import evaluate
from gpuguard.quarantine.budget import Budget
from gpuguard.quarantine.node.budget import OtherNodes, QuarantineBudget, limit, plan_yield
from gpuguard.quarantine.node.plan import plan
from gpuguard.quarantine.node.view import (
    ANN_CORDONED,
    LABEL_QUARANTINED,
    NodeChange,
    NodeView,
    Taint,
    apply_change,
)
from gpuguard.quarantine.record import ANN_DEFERRED, ANN_FAULTS, ANN_REASON, ANN_SINCE, TAINT_KEY
from harness.clock import Clock

NOW = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)
SETTINGS = NodeSettings(name="b", max_quarantined=QuarantineLimit.parse("1"), budget_recheck=60.0)


class Fleet:
    """The budget source: the budget, the quarantine order, a change counter; every read counted."""

    def __init__(self, budget: Budget | None = None, order: list[tuple[str, str]] | None = None) -> None:
        self.the_budget = budget if budget is not None else Budget(quarantined=0, limit=1)
        self.order = order or []
        self.moved = 0
        self.fail_order = False
        self.reads: list[str] = []

    def budget(self, spec: QuarantineLimit, *, exclude: str) -> Budget | None:
        self.reads.append("budget")
        return self.the_budget

    def quarantine_order(self) -> list[tuple[str, str]]:
        self.reads.append("order")
        if self.fail_order:
            raise NodeUpdateError("list failed")
        return list(self.order)

    def changes(self) -> int:
        return self.moved


def sick() -> Verdict:
    return evaluate(
        Snapshot(gpus=(GpuReading(0, "GPU-0", ecc_uncorrected=1),)), previous=None, settings=PolicySettings()
    )


def full_node(since: str = "2026-12-02T11:00:00Z", **kw: Any) -> NodeView:
    base: dict[str, Any] = {
        "name": "b",
        "resource_version": "3",
        "boot_id": "boot",
        "taints": (Taint(TAINT_KEY, "NoSchedule", "ecc"),),
        "unschedulable": True,
        "annotations": {
            ANN_FAULTS: "ecc/GPU-0",
            ANN_SINCE: since,
            ANN_REASON: "ecc: 1 error",
            ANN_CORDONED: "true",
        },
        "labels": {LABEL_QUARANTINED: "true"},
    }
    base.update(kw)
    return NodeView(**base)


TAINT = NodeChange(action="taint")


def quarantined(fleet: Fleet, clock: Clock) -> tuple[QuarantineBudget, bool]:
    """A QuarantineBudget that just fully quarantined node b: gate, then the write."""
    b = QuarantineBudget(fleet, SETTINGS, clock=clock)
    b.begin(NodeView(name="b"))
    change = plan(NodeView(name="b", boot_id="boot"), sick(), healthy_streak=0, settings=SETTINGS, now=NOW)
    assert b.gate(NodeView(name="b"), change, sick()) is change
    return b, b.written(full_node(), TAINT)


def test_a_new_budget_is_not_settling_even_when_the_fleet_moves() -> None:
    fleet = Fleet()
    b = QuarantineBudget(fleet, SETTINGS, clock=Clock(100.0))
    fleet.moved += 1
    assert not b.settling


def test_a_full_quarantine_within_the_limit_is_kept_and_checked_again_exactly_10_s_later() -> None:
    fleet, clock = Fleet(order=[("2026-12-02T11:00:00Z", "b")]), Clock(100.0)
    b, past = quarantined(fleet, clock)
    assert past is False and b.settling
    assert fleet.reads == ["budget", "order"]
    clock.t += 9.9
    b.begin(full_node())
    assert fleet.reads == ["budget", "order"] and b.settling
    clock.t += 0.1  # exactly 10 s after the write
    b.begin(full_node())
    assert fleet.reads == ["budget", "order", "order"] and not b.settling
    assert b.pending_yield(full_node()) is None


def test_a_full_quarantine_past_the_limit_asks_for_the_step_back_with_its_place_in_the_order() -> None:
    order = [("2026-12-02T10:00:00Z", "a"), ("2026-12-02T10:30:00Z", "c"), ("2026-12-02T11:00:00Z", "b")]
    fleet, clock = Fleet(order=order), Clock(100.0)
    b, past = quarantined(fleet, clock)
    assert past is True
    change = b.pending_yield(full_node())
    assert change is not None and change.action == "yield"
    assert change.annotations[ANN_DEFERRED] == (
        "quarantine budget spent: 2 GPU nodes were quarantined before this one, limit 1 (--max-quarantined 1)"
    )
    assert change.event is not None and (change.event.type, change.event.reason) == (
        "Warning",
        "GPUQuarantineDeferred",
    )
    assert change.event.message.startswith("ecc: 1 error; quarantine budget spent: 2 GPU nodes")
    # The step back landed: no yield pending, nothing settling.
    assert b.written(apply_change(full_node(), change), change) is False
    assert b.pending_yield(full_node()) is None and not b.settling


def test_a_failed_order_list_keeps_the_quarantine_and_lists_again_10_s_later_not_sooner() -> None:
    fleet, clock = Fleet(order=[("2026-12-02T10:00:00Z", "a")]), Clock(100.0)
    fleet.fail_order = True
    b, past = quarantined(fleet, clock)
    assert past is False and b.settling and b.pending_yield(full_node()) is None
    fleet.fail_order = False
    clock.t += 9
    b.begin(full_node())
    assert fleet.reads.count("order") == 1
    clock.t += 1
    b.begin(full_node())
    assert fleet.reads.count("order") == 2 and b.pending_yield(full_node()) is not None


def test_a_second_check_on_a_node_that_recovered_meanwhile_reads_nothing() -> None:
    fleet, clock = Fleet(order=[("2026-12-02T10:00:00Z", "a")]), Clock(100.0)
    fleet.fail_order = True
    b, _ = quarantined(fleet, clock)
    clock.t += 10
    b.begin(NodeView(name="b"))
    assert fleet.reads.count("order") == 1 and b.pending_yield(full_node()) is None


def test_a_fully_quarantined_node_checks_the_order_again_whenever_the_fleet_moves() -> None:
    fleet, clock = Fleet(order=[("2026-12-02T11:00:00Z", "b")]), Clock(100.0)
    b, _ = quarantined(fleet, clock)
    clock.t += 10
    b.begin(full_node())  # the second check: nothing settling now
    assert not b.settling
    fleet.moved += 1
    assert b.settling
    fleet.order = [("2026-12-02T10:00:00Z", "a"), *fleet.order]
    b.begin(full_node())
    assert not b.settling and b.pending_yield(full_node()) is not None
    # A node that is not fully quarantined does not follow the fleet.
    other = QuarantineBudget(fleet, SETTINGS, clock=clock)
    other.begin(NodeView(name="b"))
    fleet.moved += 1
    assert not other.settling


def test_a_deferred_node_escalates_at_its_first_check_and_then_at_most_once_per_recheck_interval() -> None:
    fleet, clock = Fleet(Budget(quarantined=1, limit=1)), Clock(100.0)
    b = QuarantineBudget(fleet, SETTINGS, clock=clock)
    escalate = NodeChange(action="escalate")
    deferred = full_node(labels={LABEL_QUARANTINED: "deferred"})
    b.begin(deferred)
    assert b.gate(deferred, escalate, sick()) is None  # no room: only new faults would be recorded
    assert fleet.reads == ["budget"]
    fleet.the_budget = Budget(quarantined=0, limit=1)
    clock.t += SETTINGS.budget_recheck - 1
    b.begin(deferred)
    assert b.gate(deferred, escalate, sick()) is None and fleet.reads == ["budget"]
    clock.t += 1  # exactly the interval
    b.begin(deferred)
    assert b.gate(deferred, escalate, sick()) is escalate and fleet.reads == ["budget", "budget"]


def test_an_unlimited_budget_lists_nothing_and_passes_the_change() -> None:
    fleet = Fleet(Budget(quarantined=9, limit=1))
    unlimited = NodeSettings(name="b", max_quarantined=QuarantineLimit.parse("100%"))
    b = QuarantineBudget(fleet, unlimited, clock=Clock(100.0))
    change = plan(NodeView(name="b"), sick(), healthy_streak=0, settings=SETTINGS, now=NOW)
    assert b.gate(NodeView(name="b"), change, sick()) is change and fleet.reads == []


@pytest.mark.parametrize("text", ["100%", "100.0%", "100.000%", "100.00%"])
def test_defect_max_quarantined_100_0_percent_missed_the_no_budget_path(text: str) -> None:
    """--max-quarantined 100.0% passed validation but only the literal "100%" skipped the budget: any
    spelling of 100% is no budget, so a fault lists nothing and passes as planned."""
    fleet = Fleet(Budget(quarantined=9, limit=1))
    unlimited = NodeSettings(name="b", max_quarantined=QuarantineLimit.parse(text))
    b = QuarantineBudget(fleet, unlimited, clock=Clock(100.0))
    change = plan(NodeView(name="b"), sick(), healthy_streak=0, settings=SETTINGS, now=NOW)
    assert b.gate(NodeView(name="b"), change, sick()) is change and fleet.reads == []


def test_the_gate_lists_the_budget_only_for_a_full_quarantine() -> None:
    fleet = Fleet(Budget(quarantined=9, limit=1))
    b = QuarantineBudget(fleet, SETTINGS, clock=Clock(100.0))
    recover = NodeChange(action="recover")
    assert (
        b.gate(NodeView(name="b"), recover, sick()) is recover
        and b.gate(NodeView(name="b"), None, sick()) is None
    )
    assert fleet.reads == []


# -- the pure gate and step back --------------------------------------------------------------------------


def test_a_deferral_by_a_count_budget_says_how_many_and_the_limit_and_keeps_the_faults_event() -> None:
    n = NodeView(name="b", boot_id="boot")
    change = limit(
        plan(n, sick(), healthy_streak=0, settings=SETTINGS, now=NOW), n, sick(), Budget(1, 1), SETTINGS
    )
    assert change is not None and change.action == "defer"
    assert change.annotations[ANN_DEFERRED] == (
        "quarantine budget spent: 1 GPU node quarantined, limit 1 (--max-quarantined 1)"
    )
    assert change.event is not None and (change.event.type, change.event.reason) == (
        "Warning",
        "GPUQuarantineDeferred",
    )
    assert change.event.message == (
        "ecc: 1 uncorrected volatile ECC error (GPU 0, GPU-0); quarantine budget spent: 1 GPU node "
        "quarantined, limit 1 (--max-quarantined 1): soft taint only"
    )


def test_without_room_an_escalation_records_only_the_new_faults_and_other_changes_pass() -> None:
    deferred = full_node(labels={LABEL_QUARANTINED: "deferred"}, annotations={ANN_FAULTS: "xid-79/GPU-1"})
    change = limit(NodeChange(action="escalate"), deferred, sick(), Budget(1, 1), SETTINGS)
    assert change is not None and change.action == "add-faults"
    assert change.annotations[ANN_FAULTS] == "ecc/GPU-0,xid-79/GPU-1"
    recover = NodeChange(action="recover")
    assert limit(recover, deferred, sick(), Budget(1, 1), SETTINGS) is recover
    assert limit(recover, deferred, sick(), None, SETTINGS) is recover


def test_a_step_back_of_a_node_without_a_recorded_reason_says_only_why() -> None:
    n = full_node(
        annotations={ANN_FAULTS: "ecc/GPU-0", ANN_SINCE: "2026-12-02T11:00:00Z"}, unschedulable=False
    )
    change = plan_yield(n, ahead=1, limit=1, settings=SETTINGS)
    assert change is not None and change.event is not None
    assert change.event.message == (
        "; quarantine budget spent: 1 GPU node was quarantined before this one, limit 1 "
        "(--max-quarantined 1): soft taint only"
    )


@pytest.mark.parametrize(("spec", "nodes", "expected"), [("50%", 202, 101), ("1%", 10100, 101), ("7", 3, 7)])
def test_a_percentage_budget_is_exact(spec: str, nodes: int, expected: int) -> None:
    assert QuarantineLimit.parse(spec).of(nodes) == expected


# Issue 12's review, defect 5: percentages in floats.
def test_defect_05_percentage_budgets_are_exact_not_floats() -> None:
    assert QuarantineLimit.parse("8.8%").of(375) == 33  # floats: 34
    wrong = [
        (f"{tenths / 10}%", size)
        for tenths in range(0, 1001)
        for size in range(1, 401)
        if QuarantineLimit.parse(f"{tenths / 10}%").of(size) != -(-(Fraction(tenths, 10) * size) // 100)
    ]
    assert wrong == []


def test_an_unquarantined_node_in_the_list_does_not_hide_the_claims_after_it() -> None:
    plain = {"metadata": {"name": "a", "labels": {}}}
    claim = {
        "metadata": {
            "name": "c",
            "labels": {LABEL_QUARANTINED: "true"},
            "annotations": {ANN_SINCE: "2026-12-02T10:00:00Z"},
        }
    }
    assert OtherNodes(clock=lambda: NOW).quarantined([plain, claim]) == [("2026-12-02T10:00:00Z", "c")]


def test_an_escalation_written_is_checked_in_the_order_like_a_taint() -> None:
    fleet, clock = Fleet(order=[("2026-12-02T10:00:00Z", "a")]), Clock(100.0)
    b = QuarantineBudget(fleet, SETTINGS, clock=clock)
    deferred = full_node(labels={LABEL_QUARANTINED: "deferred"})
    escalate = NodeChange(action="escalate")
    b.begin(deferred)
    assert b.gate(deferred, escalate, sick()) is escalate
    assert b.written(full_node(), escalate) is True and b.settling
    assert fleet.reads == ["budget", "order"]


def test_a_write_that_left_the_node_not_fully_quarantined_checks_no_order() -> None:
    fleet, clock = Fleet(order=[("2026-12-02T10:00:00Z", "a")]), Clock(100.0)
    b = QuarantineBudget(fleet, SETTINGS, clock=clock)
    change = plan(NodeView(name="b", boot_id="boot"), sick(), healthy_streak=0, settings=SETTINGS, now=NOW)
    b.gate(NodeView(name="b"), change, sick())
    assert b.written(NodeView(name="b"), TAINT) is False and fleet.reads == ["budget"]
