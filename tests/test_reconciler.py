"""The reconciler: optimistic concurrency, retries of transient failures, no tight loop on a 4xx."""

from __future__ import annotations

import re
from collections.abc import MutableMapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from structlog.testing import capture_logs

from gpuguard.core.config import NodeSettings, PolicySettings, QuarantineLimit
from gpuguard.core.errors import ConflictError, PermanentApiError, TransientApiError
from gpuguard.core.model import GpuReading, Snapshot, XidEvent
from gpuguard.judge.policy import evaluate
from gpuguard.quarantine.apistate import REFUSAL_BACKOFF
from gpuguard.quarantine.node.budget import QuarantineBudget
from gpuguard.quarantine.node.view import NodeView, Taint
from gpuguard.quarantine.node.writers import DryRunNodeWriter
from gpuguard.quarantine.reconciler import NodeReconciler
from gpuguard.quarantine.record import TAINT_KEY
from harness.clock import Clock
from harness.fakes import FakeNodeWriter
from harness.judging import hand_over

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = NodeSettings(name="gpu-1", retry_max_wait=0.01)
SICK = evaluate(
    Snapshot(gpus=(GpuReading(index=0, uuid="GPU-0", ecc_uncorrected=2),)),
    previous=None,
    settings=PolicySettings(),
)
HEALTHY = evaluate(
    Snapshot(gpus=(GpuReading(index=0, uuid="GPU-0"),)), previous=None, settings=PolicySettings()
)


def make(**kw: object) -> tuple[FakeNodeWriter, NodeReconciler]:
    writer = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b"))
    budget = QuarantineBudget(writer, SETTINGS)
    return writer, NodeReconciler(writer, SETTINGS, budget=budget, **kw)  # type: ignore[arg-type]


def budget_of(r: NodeReconciler) -> QuarantineBudget:
    assert r.budget is not None
    return r.budget


def test_a_healthy_node_costs_one_read_at_start_and_nothing_after() -> None:
    writer, r = make()
    for _ in range(50):
        hand_over(r, HEALTHY, 1)
        r.reconcile_now()
    assert (writer.reads, writer.writes) == (1, 0)
    assert r.status.reconciled and not r.status.tainted


def test_a_fault_is_one_write_and_one_event() -> None:
    writer, r = make()
    hand_over(r, SICK, 0)
    r.reconcile_now()
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert writer.writes == 1 and [e.reason for e in writer.events] == ["GPUUnhealthy"]
    assert r.status.tainted and r.status.cordoned


def test_a_conflict_re_reads_and_keeps_the_other_writers_taint() -> None:
    writer, r = make()
    hand_over(r, HEALTHY, 1)
    r.reconcile_now()  # caches resourceVersion 1
    foreign = Taint(key="other.io/x", effect="NoSchedule")
    writer.edit(taints=(foreign,))  # resourceVersion 2 behind our back
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert writer.node.taints[0] == foreign
    assert writer.node.our_taint is not None and writer.node.our_taint.key == TAINT_KEY
    assert writer.reads == 2


def test_transient_failures_are_retried_until_the_write_lands() -> None:
    writer, r = make()
    writer.inject_error(TransientApiError("connection refused"), TransientApiError("503"))
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert writer.writes == 1


def test_retry_after_is_honoured() -> None:
    waits: list[float] = []
    writer, r = make()
    r._sleep = waits.append  # type: ignore[method-assign,assignment]
    writer.inject_error(TransientApiError("429", retry_after=1.5))
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert waits and waits[0] >= 1.5
    assert writer.writes == 1


def test_a_permanent_error_is_not_retried_in_a_loop() -> None:
    writer, r = make()
    hand_over(r, HEALTHY, 1)
    r.reconcile_now()
    writer.inject_error(PermanentApiError("403 forbidden", status=403))
    hand_over(r, SICK, 0)
    r.reconcile_now()
    for _ in range(20):
        hand_over(r, SICK, 0)
        r.reconcile_now()
    # one refused attempt, one re-read after it, then silence until the backoff expires
    assert writer.writes == 0
    assert writer.reads <= 2


def test_a_conflict_storm_is_ridden_out_and_the_write_lands() -> None:
    writer, r = make(max_conflicts=3)
    writer.inject_error(*[ConflictError("x")] * 50)
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert writer.writes == 1
    assert writer.reads >= 50 // 3


def test_endless_conflicts_stop_at_the_retry_deadline_without_hanging() -> None:
    writer, r = make(retry_deadline=0.2, max_conflicts=3)
    writer.inject_error(*[ConflictError("x")] * 100_000)
    hand_over(r, SICK, 0)
    r.reconcile_now()  # does not raise, does not hang
    assert writer.writes == 0


def test_the_background_thread_applies_the_latest_verdict() -> None:
    writer, r = make()
    r.start()
    try:
        hand_over(r, SICK, 0)
        assert r.wait_idle(5)
        assert writer.writes == 1
    finally:
        r.stop()


def test_a_fault_reads_the_budget_once_and_defers_when_it_is_spent() -> None:
    from gpuguard.quarantine.budget import Budget

    writer, r = make()
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=1, limit=1)
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert writer.budget_lists == 1
    assert writer.node.our_taint is not None and writer.node.our_taint.effect == "PreferNoSchedule"
    # While deferred: the budget is re-read at most once a minute, not at every check.
    for _ in range(20):
        hand_over(r, SICK, 0)
        r.reconcile_now()
    assert writer.budget_lists == 1 and writer.writes == 1
    assert r.status.deferred and r.status.tainted and not r.status.cordoned
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=0, limit=1)
    budget_of(r).checked -= 61
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert writer.budget_lists == 2
    assert writer.node.our_taint is not None and writer.node.our_taint.effect == "NoSchedule"
    assert writer.node.unschedulable


def test_no_budget_list_when_the_budget_is_unlimited() -> None:
    writer = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b"))
    unlimited = NodeSettings(name="gpu-1", max_quarantined=QuarantineLimit.parse("100%"))
    r = NodeReconciler(writer, unlimited, budget=QuarantineBudget(writer, unlimited))
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert writer.budget_lists == 0 and writer.writes == 1


def test_the_gpu_healthy_condition_is_written_only_when_it_changes() -> None:
    writer, r = make()
    for _ in range(5):
        hand_over(r, HEALTHY, 1)
        r.reconcile_now()
    for _ in range(5):
        hand_over(r, SICK, 0)
        r.reconcile_now()
    assert [c["status"] for c in writer.conditions] == ["True", "False"]
    assert writer.conditions[1]["reason"] == "GPUFault"
    assert writer.conditions[1]["message"].startswith("ecc: 2 uncorrected")


def test_a_restarted_agent_does_not_rewrite_a_condition_that_already_matches() -> None:
    writer = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b", gpu_condition="True"))
    r = NodeReconciler(writer, SETTINGS)
    hand_over(r, HEALTHY, 1)
    r.reconcile_now()
    assert writer.conditions == [] and writer.writes == 0


def test_a_conflict_re_plan_reuses_the_budget_it_just_listed() -> None:
    from gpuguard.quarantine.budget import Budget

    writer, r = make()
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=0, limit=1)
    writer.inject_error(ConflictError("x"), ConflictError("y"))
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert writer.writes == 1 and writer.budget_lists == 1


def test_an_escalation_that_meets_a_conflict_still_escalates_on_the_re_plan() -> None:
    from gpuguard.quarantine.budget import Budget

    writer, r = make()
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=1, limit=1)
    hand_over(r, SICK, 0)
    r.reconcile_now()  # deferred: the soft taint
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=0, limit=1)
    budget_of(r).checked -= 61
    writer.inject_error(ConflictError("x"))
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert writer.budget_lists == 2  # the re-plan after the 409 reused the list of this call
    assert writer.node.our_taint is not None and writer.node.our_taint.effect == "NoSchedule"
    assert writer.node.unschedulable


def test_the_next_reconcile_lists_the_budget_again() -> None:
    from gpuguard.quarantine.budget import Budget

    writer, r = make()
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=0, limit=1)
    writer.inject_error(TransientApiError("down"))  # the first call fails before its write lands
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert writer.writes == 1 and writer.budget_lists == 2  # the retry counted again: time has passed


def test_a_burst_that_overshoots_the_budget_steps_back_the_node_past_the_limit() -> None:
    """Two agents listed at the same instant and both saw room for one: the later in the quarantine order
    (since, then name) steps back to the soft taint right after its write."""
    from gpuguard.quarantine.budget import Budget
    from gpuguard.quarantine.record import ANN_SINCE

    writer, r = make()
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=0, limit=1)
    writer.order = [("2026-12-02T00:00:00Z", "gpu-0")]  # quarantined first, by another agent
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert [p.action for p in writer.patches] == ["taint", "yield"]
    assert writer.order_lists == 1
    n = writer.node
    assert n.our_taint is not None and n.our_taint.effect == "PreferNoSchedule"
    assert not n.unschedulable and n.deferred and n.annotations[ANN_SINCE]
    assert [e.reason for e in writer.events] == ["GPUUnhealthy", "GPUQuarantineDeferred"]
    assert r.status.deferred and not r.status.cordoned
    # The settle check is not needed any more: a deferred node costs one budget list a minute, no more.
    for _ in range(5):
        hand_over(r, SICK, 0)
        r.reconcile_now()
    assert writer.order_lists == 1 and len(writer.patches) == 2


def test_the_first_in_the_order_stays_and_checks_once_more_after_the_burst_settled() -> None:
    from gpuguard.quarantine.budget import Budget
    from gpuguard.quarantine.record import ANN_SINCE

    writer, r = make()
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=0, limit=1)
    writer.order = [("2999-01-01T00:00:00Z", "gpu-9")]  # quarantined after us
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert [p.action for p in writer.patches] == ["taint"] and writer.order_lists == 1
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert writer.order_lists == 1  # not due yet
    # A slow writer landed after our first check, with an earlier since: the second check sees it.
    writer.order.append(("2000-01-01T00:00:00Z", "gpu-0"))
    settle = budget_of(r).settle
    assert settle is not None
    budget_of(r).settle = (settle[0], 0.0)
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert writer.order_lists == 2
    assert [p.action for p in writer.patches] == ["taint", "yield"]
    assert writer.node.deferred and writer.node.annotations[ANN_SINCE]
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert writer.order_lists == 2 and budget_of(r).settle is None


def test_a_watched_fleet_is_checked_again_at_each_change_and_a_node_now_past_the_limit_steps_back() -> None:
    """A source kept in memory by a watch (budgetwatch.WatchedBudget): the order costs no request, so a fully
    quarantined node checks it again whenever the watch delivered a change, not only 10 s after its write."""
    from gpuguard.quarantine.budget import Budget

    writer, r = make()
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=0, limit=1)
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert [p.action for p in writer.patches] == ["taint"] and writer.order_lists == 1
    for _ in range(3):  # nothing changed: no check, and an unchanged verdict does not wake the writer
        hand_over(r, SICK, 0)
        r.reconcile_now()
    assert writer.order_lists == 1 and budget_of(r).settle is not None  # the 10 s check is still to come
    # Another agent's quarantine with an earlier since lands: the watch delivers it.
    writer.order.append(("2000-01-01T00:00:00Z", "gpu-0"))
    writer.generation += 1
    assert budget_of(r).settling
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert writer.order_lists == 2
    assert [p.action for p in writer.patches] == ["taint", "yield"] and writer.node.deferred
    writer.generation += 1  # a deferred node holds no full quarantine: no order check
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert writer.order_lists == 2


def test_a_failed_order_check_keeps_the_quarantine_and_checks_again_later() -> None:
    from gpuguard.quarantine.budget import Budget

    writer, r = make()
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=0, limit=1)
    writer.order_error = TransientApiError("list failed")
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert [p.action for p in writer.patches] == ["taint"] and writer.node.unschedulable
    assert budget_of(r).settle is not None


def test_no_order_check_without_a_budget() -> None:
    writer = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b"))
    unlimited = NodeSettings(name="gpu-1", max_quarantined=QuarantineLimit.parse("100%"))
    r = NodeReconciler(writer, unlimited, budget=QuarantineBudget(writer, unlimited))
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert writer.order_lists == 0 and budget_of(r).settle is None


def test_with_external_gate_removal_the_condition_is_written_and_the_gate_left_alone() -> None:
    """The readiness-controller pattern: gpuguard writes GPUHealthy=True and no taint change."""
    gate = Taint(key="readiness.k8s.io/gpu-healthy", effect="NoSchedule")
    settings = NodeSettings(
        name="gpu-1", retry_max_wait=0.01, gate_taint_key=gate.key, gate_removal="external"
    )
    writer = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b", taints=(gate,)))
    r = NodeReconciler(writer, settings)
    hand_over(r, HEALTHY, 1)
    r.reconcile_now()
    assert [c["status"] for c in writer.conditions] == ["True"]
    assert writer.writes == 0 and writer.node.taints == (gate,)


def test_a_fault_added_to_a_cordoned_node_is_logged_with_the_node_still_cordoned() -> None:
    """`node.fault_added cordoned=...` is the node's cordon after the write: the taint's write cordoned it,
    the added fault leaves it so."""
    from structlog.testing import capture_logs

    w, r = make()
    xid = evaluate(
        Snapshot(
            gpus=(GpuReading(index=0, uuid="GPU-a", ecc_uncorrected=2), GpuReading(index=1, uuid="GPU-b"))
        ),
        previous=None,
        settings=PolicySettings(),
    )
    both = evaluate(
        Snapshot(
            gpus=(
                GpuReading(index=0, uuid="GPU-a", ecc_uncorrected=2),
                GpuReading(index=1, uuid="GPU-b", ecc_uncorrected=1),
            )
        ),
        previous=xid,
        settings=PolicySettings(),
    )
    with capture_logs() as logs:
        for v in (xid, both):
            hand_over(r, v, 0)
            r.reconcile_now()
    lines = {e["event"]: e for e in logs if e["event"] in ("node.tainted", "node.fault_added")}
    assert (lines["node.tainted"]["cordoned"], lines["node.tainted"]["uncordoned"]) == (True, False)
    assert (lines["node.fault_added"]["cordoned"], lines["node.fault_added"]["uncordoned"]) == (True, False)
    assert w.node.unschedulable


# Issue 12's review, defect 13: logs.
def test_defect_13_the_fault_added_line_is_about_the_fault_it_added() -> None:
    writer = DryRunNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b"))
    r = NodeReconciler(writer, NodeSettings(name="gpu-1", dry_run=True))
    healthy = (GpuReading(index=0, uuid="GPU-a"), GpuReading(index=1, uuid="GPU-b"))
    first = evaluate(
        Snapshot(gpus=healthy, xids=(XidEvent(0, "GPU-a", 79),)), previous=None, settings=PolicySettings()
    )
    sick = (healthy[0], GpuReading(index=1, uuid="GPU-b", ecc_uncorrected=4))
    second = evaluate(Snapshot(gpus=sick), previous=first, settings=PolicySettings())
    assert {f.reason for f in second.faults} == {"xid-79", "ecc"}  # the taint still names the Xid
    with capture_logs() as logs:
        for v in (first, second):
            hand_over(r, v, 0)
            r.reconcile_now()
    added = [e for e in logs if e.get("transition") == "node.fault_added"]  # a dry run's one line
    assert len(added) == 1 and added[0]["event"] == "node.dry_run"
    assert (added[0]["reason"], added[0]["gpu"], added[0]["uuid"]) == ("ecc", 1, "GPU-b")
    assert added[0]["detail"].startswith("ecc: 4 uncorrected")


def make_clocked(**kw: object) -> tuple[FakeNodeWriter, NodeReconciler, Clock]:
    """The reconciler's monotonic time and its wall time (the `since` it writes) on one clock."""
    clock = Clock(1000.0, epoch=datetime(2026, 12, 4, tzinfo=UTC))
    writer = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b"))
    r = NodeReconciler(writer, SETTINGS, clock=clock, now=clock.wall, **kw)  # type: ignore[arg-type]
    return writer, r, clock


def events(logs: list[MutableMapping[str, Any]], prefix: str = "") -> list[str]:
    return [str(e["event"]) for e in logs if str(e["event"]).startswith(prefix) and e["log_level"] != "debug"]


def test_a_refused_patch_is_sent_once_per_backoff_although_each_plan_carries_a_new_since() -> None:
    """The refusal was remembered by the patch's bytes: a new gpuguard.io/since at every plan made every
    check (every 3 s) send it again, with an ERROR line each time."""
    writer, r, clock = make_clocked()
    writer.inject_error(*[PermanentApiError("patch node gpu-1: HTTP 403: denied", status=403)] * 100)
    with capture_logs() as logs:
        for _ in range(100):  # 297 s of checks, 3 s apart: all within the backoff
            hand_over(r, SICK, 0)
            r.reconcile_now()
            clock.t += 2.97
    assert writer.patch_attempts == 1
    assert [e for e in events(logs) if e != "node.conflict"] == ["node.write_rejected"]
    (line,) = [e for e in logs if e["event"] == "node.write_rejected"]
    assert (
        line["log_level"] == "error" and line["retry_in_s"] == 300 and line["request"] == "patch node gpu-1"
    )
    assert r.api.health.state == "refused" and r.api.health.error == "patch node gpu-1: HTTP 403: denied"
    clock.t += 3.1  # 300 s after the refusal: sent once more, refused once more, one more line
    with capture_logs() as logs:
        for _ in range(3):
            hand_over(r, SICK, 0)
            r.reconcile_now()
    assert writer.patch_attempts == 2 and events(logs) == ["node.write_rejected"]
    writer._patch_errors.clear()  # the policy is fixed
    clock.t += 300
    with capture_logs() as logs:
        hand_over(r, SICK, 0)
        r.reconcile_now()
    assert writer.writes == 1 and r.status.tainted
    assert "node.request_accepted" in events(logs) and "node.write_rejected" not in events(logs)
    (accepted,) = [e for e in logs if e["event"] == "node.request_accepted"]
    assert accepted["refused_for_s"] == 600
    assert r.api.health.state == "ok"


def test_a_different_write_is_not_held_back_by_an_earlier_refusal() -> None:
    writer, r, _clock = make_clocked()
    writer.inject_error(PermanentApiError("denied", status=403))
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert writer.patch_attempts == 1
    other = evaluate(
        Snapshot(gpus=(GpuReading(index=0, uuid="GPU-0", ecc_uncorrected=2, lost=True),)),
        previous=None,
        settings=PolicySettings(),
    )
    hand_over(r, other, 0)
    r.reconcile_now()
    assert writer.patch_attempts == 2 and writer.writes == 1


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_first_read_is_sent_once_per_backoff_with_one_error_line(status: int) -> None:
    writer, r, clock = make_clocked()
    writer.inject_error(
        *[PermanentApiError(f"read node gpu-1: HTTP {status}", status=status)] * 100, on="read"
    )
    with capture_logs() as logs:
        for _ in range(50):
            hand_over(r, HEALTHY, 1)
            r.reconcile_now()
            clock.t += 3
    assert writer.reads == 1
    assert events(logs) == ["node.read_rejected"]
    assert [e["log_level"] for e in logs] == ["error"]
    assert r.api.health.state == "refused" and not r.status.reconciled
    clock.t += 150  # 300 s after the refusal
    writer._read_errors.clear()
    with capture_logs() as logs:
        hand_over(r, HEALTHY, 1)
        r.reconcile_now()
    assert writer.reads == 2 and r.status.reconciled
    assert events(logs, "node.re") == ["node.request_accepted"] and r.api.health.state == "ok"


def test_the_shipped_refusal_backoff_is_the_5_minutes_the_docs_state() -> None:
    assert REFUSAL_BACKOFF == 300.0
    assert NodeReconciler(FakeNodeWriter(NodeView(name="n")), SETTINGS).api.backoff == 300.0
    assert NodeSettings().refusal_backoff == 300.0
    for doc in ("docs/design.md", "docs/security.md", "docs/reliability.md"):
        assert "5 minutes" in (ROOT / doc).read_text()


def test_an_outage_is_logged_when_it_starts_every_30_s_while_it_lasts_and_when_it_ends() -> None:
    """After api.unavailable nothing was logged for about 60 s (the retry deadline)."""
    writer, r, clock = make_clocked(retry_deadline=60.0)

    def slow_sleep(seconds: float) -> None:
        clock.t += seconds  # the retries' waits pass on the test's clock, in no real time

    r._sleep = slow_sleep  # type: ignore[method-assign]
    writer.inject_error(*[TransientApiError("read node gpu-1: timed out")] * 10_000, on="read")
    # tenacity measures the retry deadline with time.monotonic: the test's clock for the length of the call.
    with mock.patch("time.monotonic", clock), capture_logs() as logs:
        hand_over(r, SICK, 0)
        r.reconcile_now()
    lines = [e for e in logs if e["event"].startswith("api.") and e["log_level"] != "debug"]
    assert [e["event"] for e in lines][:2] == ["api.unavailable", "api.still_unavailable"]
    assert {e["event"] for e in lines[1:]} == {"api.still_unavailable"}
    downs = [e["down_for_s"] for e in lines[1:]]
    assert all(30 <= b - a <= 32 for a, b in zip([0, *downs], downs, strict=False)), downs
    assert r.api.health.state == "unreachable" and r.api.health.error == "read node gpu-1: timed out"
    writer._read_errors.clear()
    with capture_logs() as logs:
        hand_over(r, SICK, 0)
        r.reconcile_now()
    assert events(logs, "api.") == ["api.available"] and writer.writes == 1
    assert r.api.health.state == "ok"


# Words in the names of the lines an API incident (an outage, a refusal) logs.
_INCIDENT = re.compile(
    r"\.(\w*_)?(rejected|failed|broken|unavailable|deferred|unreadable|available|accepted|watching)$"
)


def test_every_line_an_api_incident_logs_is_explained_in_operations_md() -> None:
    code = set()
    # The kept state's retry lines are named in store/retry.py's KEPT table.
    code |= set(
        re.findall(r'"(state\.(?:unavailable|resumed))"', (ROOT / "gpuguard/store/retry.py").read_text())
    )
    paths = [*(ROOT / "gpuguard" / "quarantine").rglob("*.py"), ROOT / "gpuguard" / "store" / "state.py"]
    for path in [*paths, ROOT / "gpuguard" / "kube" / "client.py"]:  # the client: objects dropped unread
        code |= set(re.findall(r'log\.\w+\(\s*"([a-z_]+\.[a-z_]+)"', path.read_text()))

        code |= set(re.findall(r'"(node\.(?:read|write)_rejected)"', path.read_text()))
    doc = (ROOT / "docs" / "operations.md").read_text()
    section = doc.split("## When the API server refuses or does not answer", 1)[1].split("\n## ", 1)[0]
    table = set(re.findall(r"^\| `([a-z_.]+)` \|", section, re.M))
    # Not the API's doing: a bug's traceback, the budget's own deferral (docs/operations.md explains it).
    incident = {e for e in code if _INCIDENT.search(e)} - {
        "node.reconcile_failed",
        "node.quarantine_deferred",
    }
    assert incident - table == set(), "logged in an incident, not explained in docs/operations.md"
    assert table - code == set(), "explained in docs/operations.md, logged nowhere"


def test_a_restarted_agent_rewrites_an_unhealthy_condition_so_it_names_this_runs_faults() -> None:
    """The False condition a previous run wrote names that run's faults (an Xid since cleared by a reset,
    say); the restarted agent that reads other faults must not leave the old ones in the message."""
    writer = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b", gpu_condition="False"))
    r = NodeReconciler(writer, SETTINGS)
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert [c["status"] for c in writer.conditions] == ["False"]
    assert writer.conditions[0]["message"].startswith("ecc: 2 uncorrected")
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert len(writer.conditions) == 1  # once per start, then only on change


def test_a_restarted_agent_leaves_an_unhealthy_condition_that_already_names_its_faults() -> None:
    """The restart of an agent whose node is still out for the same faults writes nothing (issue 7's
    idempotence): the condition's message read from the node is the one this run would write."""
    first = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b", gpu_condition="True"))
    r = NodeReconciler(first, SETTINGS)
    hand_over(r, SICK, 0)
    r.reconcile_now()
    written = [c for c in first.conditions if c["type"] == "GPUHealthy"][-1]
    view = NodeView(
        name="gpu-1",
        resource_version="1",
        boot_id="b",
        gpu_condition="False",
        gpu_condition_message=written["message"],
    )
    writer = FakeNodeWriter(view)
    restarted = NodeReconciler(writer, SETTINGS)
    hand_over(restarted, SICK, 0)
    restarted.reconcile_now()
    assert [c for c in writer.conditions if c["type"] == "GPUHealthy"] == []


def test_a_new_fault_during_a_refused_reads_backoff_is_read_for_and_written_at_once() -> None:
    """The backoff holds back the refused request, not a new fault: a node read refused (403, RBAC removed)
    while healthy is not sent again for the same verdict, but an ECC fault a second later reads again at once,
    and once RBAC is back the taint is written."""
    writer, r = make()
    writer.inject_error(PermanentApiError("403 forbidden", status=403), on="read")
    hand_over(r, HEALTHY, 1)
    r.reconcile_now()
    hand_over(r, HEALTHY, 2)
    r.reconcile_now()
    assert writer.reads == 1  # the same read, within its backoff: not sent again
    hand_over(r, SICK, 0)
    r.reconcile_now()
    assert writer.reads == 2 and writer.writes == 1
    assert writer.node.our_taint is not None and r.api.health.state == "ok"


def test_a_fault_a_refusal_leaves_off_the_node_is_named_in_the_log() -> None:
    writer, r = make()
    hand_over(r, HEALTHY, 1)
    r.reconcile_now()
    writer.inject_error(PermanentApiError("403 forbidden", status=403))
    with capture_logs() as logs:
        hand_over(r, SICK, 0)
        r.reconcile_now()
    (line,) = [e for e in logs if e["event"] == "node.write_rejected"]
    assert line["faults_unwritten"] == sorted(f.key for f in SICK.faults)
    assert line["request"] == "patch node gpu-1"
