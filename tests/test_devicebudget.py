"""The per-GPU quarantine's budget over time (gpuguard.quarantine.gpu.budget.RuleBudget), driven directly
with a clock and fake reads: when one more GPU fits, how often a deferred rule asks again, and the order
check of the rules this node made blocking (when it runs, what it steps back, what it does when a read
fails)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from gpuguard.core.config import NodeSettings, QuarantineLimit
from gpuguard.core.errors import NodeUpdateError
from gpuguard.quarantine.budget import VERIFY_SETTLE, Budget
from gpuguard.quarantine.gpu.budget import RuleBudget
from gpuguard.quarantine.gpu.rules import ANN_NODE_GPUS, DeviceRule, rule_name
from gpuguard.quarantine.node.view import NodeView
from gpuguard.quarantine.record import ANN_DEFERRED, ANN_SINCE, TAINT_KEY
from harness.clock import Clock

NODE = NodeView(name="node-b", boot_id="boot-1")
SETTINGS = NodeSettings(name="node-b", budget_recheck=60.0, max_quarantined=QuarantineLimit.parse("1"))
NOW = datetime(2026, 12, 3, 1, tzinfo=UTC)


def rule(node: str, device: str = "gpu-0", *, since: str = "2026-12-03T00:00:00Z", **kw: Any) -> DeviceRule:
    base: dict[str, Any] = {
        "name": rule_name(node, device),
        "pool": node,
        "device": device,
        "effect": "NoSchedule",
        "taint_value": "",
        "resource_version": "5",
        "annotations": {ANN_NODE_GPUS: "1", ANN_SINCE: since},
        "driver": "gpu.nvidia.com",
        "labels": {"gpuguard.io/node": node, "app.kubernetes.io/managed-by": "gpuguard"},
    }
    base.update(kw)
    return DeviceRule(**base)


class Fleet:
    """The reads RuleBudget makes, counted, with a failure to inject."""

    def __init__(self, budget: Budget | None, rules: list[DeviceRule] | None = None) -> None:
        self.the_budget = budget
        self.rules = rules or []
        self.fail: NodeUpdateError | None = None
        self.reads = 0

    def budget(self) -> Budget | None:
        self.reads += 1
        if self.fail is not None:
            raise self.fail
        return self.the_budget

    def all_rules(self) -> list[DeviceRule]:
        if self.fail is not None:
            raise self.fail
        return list(self.rules)


class Patches:
    def __init__(self, *, lands: bool = True) -> None:
        self.lands = lands
        self.bodies: list[tuple[str, Mapping[str, Any]]] = []

    def __call__(self, r: DeviceRule, body: Mapping[str, Any]) -> DeviceRule | None:
        self.bodies.append((r.name, body))
        if not self.lands:
            return None
        return DeviceRule(
            name=r.name, pool=r.pool, device=r.device, effect="None", taint_value=r.taint_value,
            annotations={**r.annotations, ANN_DEFERRED: "x"},
        )  # fmt: skip


def make(fleet: Fleet, clock: Clock, *, budget: bool = True) -> RuleBudget:
    return RuleBudget(
        SETTINGS,
        all_rules=fleet.all_rules,
        budget=fleet.budget if budget else None,
        order=lambda: [],
        now=lambda: NOW,
        clock=clock,
    )


def test_a_deferred_rule_asks_for_room_at_most_once_per_recheck_interval_and_again_at_exactly_it() -> None:
    clock, fleet = Clock(1000.0), Fleet(Budget(quarantined=1, limit=1))
    b = make(fleet, clock)
    deferred = rule("node-b", effect="None", annotations={ANN_DEFERRED: "x"})
    assert b.room(NODE, deferred, node_gpus=8) is False
    assert fleet.reads == 1
    clock.t += SETTINGS.budget_recheck - 0.5
    assert b.room(NODE, deferred, node_gpus=8) is False and fleet.reads == 1  # throttled: no read
    fleet.the_budget = Budget(quarantined=0, limit=1)
    clock.t += 0.5  # exactly the interval since the last read
    assert b.room(NODE, deferred, node_gpus=8) is True and fleet.reads == 2


def test_a_new_fault_asks_for_room_every_time_without_the_throttle() -> None:
    clock, fleet = Clock(1000.0), Fleet(Budget(quarantined=0, limit=1))
    b = make(fleet, clock)
    assert b.room(NODE, None, node_gpus=8) and b.room(NODE, None, node_gpus=8)
    assert fleet.reads == 2


@pytest.mark.parametrize(
    ("others", "node_gpus", "room"),
    [
        ([], 1, True),  # exactly the limit: 0 + 1 <= 1
        ([rule("node-a")], 1, False),
        ([rule("node-a", annotations={ANN_NODE_GPUS: "2"})], 2, True),  # 1/2 + 1/2
        ([rule("node-a", annotations={ANN_NODE_GPUS: "2"})], 1, False),
        (
            [rule("node-a", effect="None", annotations={ANN_DEFERRED: "x"})],
            1,
            True,
        ),  # deferred: costs nothing
        ([rule("node-b")], 1, True),  # this very rule is not counted twice
        # This node's other rules already claim its whole node: one more GPU of it costs nothing more.
        ([rule("node-b", "gpu-1")], 8, True),
        ([rule("node-b", "gpu-1", annotations={ANN_NODE_GPUS: "2"})], 4, True),  # 1/2 + min(1/4, 1/2)
        ([rule("node-b", "gpu-1", annotations={ANN_NODE_GPUS: "2"}), rule("node-a")], 8, False),
        ([], 0, True),  # a node that publishes no GPU: its one GPU counts as a whole node
    ],
)
def test_one_more_gpu_fits_when_the_shares_and_it_stay_within_the_limit(
    others: list[DeviceRule], node_gpus: int, room: bool
) -> None:
    b = make(Fleet(Budget(quarantined=0, limit=1), others), Clock(1000.0))
    assert b.room(NODE, rule("node-b"), node_gpus=node_gpus) is room


def test_no_budget_at_all_is_always_room_and_no_order_check() -> None:
    clock, fleet = Clock(1000.0), Fleet(Budget(quarantined=5, limit=1))
    b = make(fleet, clock, budget=False)
    assert b.room(NODE, rule("node-b"), node_gpus=1) is True
    b.blocking(rule("node-b"))
    assert not b.settling
    assert b.verify(NODE, {rule("node-b").name: rule("node-b")}, Patches()) == []
    assert fleet.reads == 0


def test_a_budget_source_that_answers_none_is_room_and_settles_the_order_check() -> None:
    clock, fleet = Clock(1000.0), Fleet(None)
    b = make(fleet, clock)
    assert b.room(NODE, None, node_gpus=1) is True
    mine = rule("node-b")
    b.blocking(mine)
    patch = Patches()
    assert b.verify(NODE, {mine.name: mine}, patch) == [] and b.settling
    clock.t += VERIFY_SETTLE
    assert b.verify(NODE, {mine.name: mine}, patch) == [] and not b.settling
    assert patch.bodies == []


def test_an_informational_rule_made_is_not_checked_in_the_order() -> None:
    b = make(Fleet(Budget(quarantined=0, limit=1)), Clock(1000.0))
    b.blocking(rule("node-b", effect="None"))
    assert not b.settling and b.verify(NODE, {}, Patches()) == []


def test_the_order_check_steps_back_a_rule_past_the_limit_with_one_patch_and_returns_it() -> None:
    clock = Clock(1000.0)
    earlier = rule("node-a", since="2026-12-03T00:00:00Z")
    mine = rule("node-b", since="2026-12-03T00:00:01Z")
    b = make(Fleet(Budget(quarantined=0, limit=1), [earlier]), clock)
    b.blocking(mine)
    patch = Patches()
    stepped = b.verify(NODE, {mine.name: mine}, patch)
    assert [(r.name, r.effect) for r in stepped] == [(mine.name, "None")]
    assert patch.bodies == [
        (
            mine.name,
            {
                "metadata": {
                    "annotations": {
                        ANN_DEFERRED: "quarantine budget spent: 1 GPU node's worth quarantined before "
                        "this rule, limit 1 (--max-quarantined 1)"
                    },
                    "resourceVersion": "5",
                },
                "spec": {"taint": {"key": TAINT_KEY, "effect": "None"}},
            },
        )
    ]
    # Stepped back: nothing fresh is left, and the next room check for it waits the interval.
    assert b.verify(NODE, {mine.name: mine}, patch) == [] and not b.settling
    assert b.room(NODE, stepped[0], node_gpus=1) is False


def test_the_first_in_the_order_stays_and_is_checked_once_more_after_the_settle_time() -> None:
    clock = Clock(1000.0)
    fleet = Fleet(Budget(quarantined=0, limit=1), [])
    b = make(fleet, clock)
    mine = rule("node-b")
    b.blocking(mine)
    assert b.verify(NODE, {mine.name: mine}, Patches()) == [] and b.settling
    reads = fleet.reads
    clock.t += VERIFY_SETTLE - 1
    assert b.verify(NODE, {mine.name: mine}, Patches()) == [] and fleet.reads == reads  # not due yet
    # Another agent's earlier rule landed meanwhile: the settle check steps this one back.
    fleet.rules = [rule("node-a", since="2026-12-02T23:59:59Z")]
    clock.t += 1
    stepped = b.verify(NODE, {mine.name: mine}, Patches())
    assert [r.name for r in stepped] == [mine.name] and not b.settling


def test_a_failed_list_during_the_order_check_keeps_the_rule_fresh_and_checks_again_later() -> None:
    clock = Clock(1000.0)
    fleet = Fleet(Budget(quarantined=0, limit=1), [rule("node-a")])
    b = make(fleet, clock)
    mine = rule("node-b", since="2026-12-03T00:00:01Z")
    b.blocking(mine)
    fleet.fail = NodeUpdateError("list failed")
    assert b.verify(NODE, {mine.name: mine}, Patches()) == [] and b.settling
    fleet.fail = None
    clock.t += VERIFY_SETTLE
    assert [r.name for r in b.verify(NODE, {mine.name: mine}, Patches())] == [mine.name]


def test_a_step_back_that_does_not_land_is_tried_again_at_the_settle_check() -> None:
    clock = Clock(1000.0)
    b = make(Fleet(Budget(quarantined=0, limit=1), [rule("node-a")]), clock)
    mine = rule("node-b", since="2026-12-03T00:00:01Z")
    b.blocking(mine)
    assert b.verify(NODE, {mine.name: mine}, Patches(lands=False)) == [] and b.settling
    clock.t += VERIFY_SETTLE
    assert [r.name for r in b.verify(NODE, {mine.name: mine}, Patches())] == [mine.name]
    assert not b.settling


@pytest.mark.parametrize(
    "changed",
    [
        None,  # deleted (recovered) between the write and the check
        rule("node-b", since="2026-12-03T00:00:01Z", effect="None"),
        rule("node-b", since="2026-12-03T00:00:01Z", annotations={ANN_DEFERRED: "x", ANN_NODE_GPUS: "1"}),
    ],
    ids=["deleted", "informational", "deferred"],
)
def test_a_rule_that_changed_between_the_write_and_the_check_is_not_stepped_back(
    changed: DeviceRule | None,
) -> None:
    clock = Clock(1000.0)
    b = make(Fleet(Budget(quarantined=0, limit=1), [rule("node-a")]), clock)
    mine = rule("node-b", since="2026-12-03T00:00:01Z")
    b.blocking(mine)
    patch = Patches()
    now = {mine.name: changed} if changed is not None else {}
    assert b.verify(NODE, now, patch) == [] and patch.bodies == []
    clock.t += VERIFY_SETTLE
    assert b.verify(NODE, now, patch) == [] and not b.settling


def test_with_nothing_fresh_the_check_reads_nothing_and_stops_settling() -> None:
    clock = Clock(1000.0)
    fleet = Fleet(Budget(quarantined=0, limit=1))
    b = make(fleet, clock)
    assert b.verify(NODE, {}, Patches()) == [] and fleet.reads == 0 and not b.settling


def test_this_nodes_rules_count_as_its_own_writes_answered_not_as_the_fleets_list_had_them() -> None:
    """The fleet's list still has this node's rule blocking at an early since; the node's own answer has it
    deferred: only the node's own copy counts, so the other node's rule is not pushed past the limit."""
    clock = Clock(1000.0)
    stale_mine = rule("node-b", "gpu-1", since="2026-12-02T00:00:00Z")
    fresh_mine = rule(
        "node-b", "gpu-1", since="2026-12-02T00:00:00Z", effect="None", annotations={ANN_DEFERRED: "x"}
    )
    new = rule("node-b", "gpu-2", since="2026-12-03T00:00:01Z")
    b = make(Fleet(Budget(quarantined=0, limit=1), [stale_mine]), clock)
    b.blocking(new)
    assert b.verify(NODE, {fresh_mine.name: fresh_mine, new.name: new}, Patches()) == []


def test_a_rule_that_settled_is_not_checked_again_with_the_next_fresh_rule() -> None:
    """Kept at both checks, rule 1 settles; a later rule's check must not step it back, even if the fleet has
    changed since (the order is only ever checked for rules just made blocking)."""
    clock = Clock(1000.0)
    fleet = Fleet(Budget(quarantined=0, limit=2), [])
    b = make(fleet, clock)
    first = rule("node-b", "gpu-1", annotations={ANN_NODE_GPUS: "2", ANN_SINCE: "2026-12-03T00:00:01Z"})
    b.blocking(first)
    b.verify(NODE, {first.name: first}, Patches())
    clock.t += VERIFY_SETTLE
    assert b.verify(NODE, {first.name: first}, Patches()) == [] and not b.settling
    fleet.rules = [
        rule("node-a", "gpu-0", since="2026-12-03T00:00:00Z"),
        rule("node-c", since="2026-12-02T00:00:00Z"),
    ]
    second = rule("node-b", "gpu-2", annotations={ANN_NODE_GPUS: "2", ANN_SINCE: "2026-12-03T00:00:02Z"})
    b.blocking(second)
    patch = Patches()
    stepped = b.verify(NODE, {first.name: first, second.name: second}, patch)
    assert [r.name for r in stepped] == [second.name] and [n for n, _ in patch.bodies] == [second.name]


def test_a_failed_list_at_the_settle_check_keeps_checking() -> None:
    clock = Clock(1000.0)
    fleet = Fleet(Budget(quarantined=0, limit=1), [])
    b = make(fleet, clock)
    mine = rule("node-b", since="2026-12-03T00:00:01Z")
    b.blocking(mine)
    assert b.verify(NODE, {mine.name: mine}, Patches()) == []
    clock.t += VERIFY_SETTLE
    fleet.fail = NodeUpdateError("list failed")
    assert b.verify(NODE, {mine.name: mine}, Patches()) == [] and b.settling
    fleet.fail = None
    fleet.rules = [rule("node-a")]
    clock.t += VERIFY_SETTLE
    assert [r.name for r in b.verify(NODE, {mine.name: mine}, Patches())] == [mine.name]


def test_a_rule_gone_before_its_first_check_leaves_nothing_to_settle() -> None:
    clock = Clock(1000.0)
    b = make(Fleet(Budget(quarantined=0, limit=1), [rule("node-a")]), clock)
    mine = rule("node-b", since="2026-12-03T00:00:01Z")
    b.blocking(mine)
    assert b.verify(NODE, {}, Patches()) == []
    assert b.verify(NODE, {}, Patches()) == [] and not b.settling  # no wait for the settle time


@pytest.mark.parametrize(
    ("ahead", "worth"), [(["node-a"], "1 GPU node's worth"), (["node-a", "node-c"], "2 GPU nodes' worth")]
)
def test_a_stepped_back_rule_says_how_many_nodes_worth_came_before_it(ahead: list[str], worth: str) -> None:
    earlier = [rule(n, since=f"2026-12-03T00:00:0{i}Z") for i, n in enumerate(ahead)]
    mine = rule("node-b", since="2026-12-03T00:00:09Z")
    limit = len(ahead)
    settings = replace(SETTINGS, max_quarantined=QuarantineLimit.parse(str(limit)))
    fleet = Fleet(Budget(quarantined=0, limit=limit), earlier)
    b = RuleBudget(
        settings,
        all_rules=fleet.all_rules,
        budget=fleet.budget,
        order=lambda: [],
        now=lambda: NOW,
        clock=Clock(1000.0),
    )
    b.blocking(mine)
    patch = Patches()
    assert [r.name for r in b.verify(NODE, {mine.name: mine}, patch)] == [mine.name]
    ((_, body),) = patch.bodies
    assert body["metadata"]["annotations"][ANN_DEFERRED] == (
        f"quarantine budget spent: {worth} quarantined before this rule, limit {limit} "
        f"(--max-quarantined {limit})"
    )
