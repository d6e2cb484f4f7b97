"""The reconciler: optimistic concurrency, retries of transient failures, no tight loop on a 4xx."""

from __future__ import annotations

from gpuguard.config import NodeSettings, PolicySettings
from gpuguard.errors import ConflictError, PermanentApiError, TransientApiError
from gpuguard.model import GpuReading, Snapshot
from gpuguard.node.budget import QuarantineBudget
from gpuguard.node.reconciler import NodeReconciler
from gpuguard.node.view import TAINT_KEY, NodeView, Taint
from gpuguard.policy import evaluate
from tests.fakes import FakeNodeWriter

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
        r.submit(HEALTHY, 1)
        r.reconcile_now()
    assert (writer.reads, writer.writes) == (1, 0)
    assert r.status.reconciled and not r.status.tainted


def test_a_fault_is_one_write_and_one_event() -> None:
    writer, r = make()
    r.submit(SICK, 0)
    r.reconcile_now()
    r.submit(SICK, 0)
    r.reconcile_now()
    assert writer.writes == 1 and [e.reason for e in writer.events] == ["GPUUnhealthy"]
    assert r.status.tainted and r.status.cordoned


def test_a_conflict_re_reads_and_keeps_the_other_writers_taint() -> None:
    writer, r = make()
    r.submit(HEALTHY, 1)
    r.reconcile_now()  # caches resourceVersion 1
    foreign = Taint(key="other.io/x", effect="NoSchedule")
    writer.edit(taints=(foreign,))  # resourceVersion 2 behind our back
    r.submit(SICK, 0)
    r.reconcile_now()
    assert writer.node.taints[0] == foreign
    assert writer.node.our_taint is not None and writer.node.our_taint.key == TAINT_KEY
    assert writer.reads == 2


def test_transient_failures_are_retried_until_the_write_lands() -> None:
    writer, r = make()
    writer.inject_error(TransientApiError("connection refused"), TransientApiError("503"))
    r.submit(SICK, 0)
    r.reconcile_now()
    assert writer.writes == 1


def test_retry_after_is_honoured() -> None:
    waits: list[float] = []
    writer, r = make()
    r._sleep = waits.append  # type: ignore[method-assign,assignment]
    writer.inject_error(TransientApiError("429", retry_after=1.5))
    r.submit(SICK, 0)
    r.reconcile_now()
    assert waits and waits[0] >= 1.5
    assert writer.writes == 1


def test_a_permanent_error_is_not_retried_in_a_loop() -> None:
    writer, r = make()
    r.submit(HEALTHY, 1)
    r.reconcile_now()
    writer.inject_error(PermanentApiError("403 forbidden", status=403))
    r.submit(SICK, 0)
    r.reconcile_now()
    for _ in range(20):
        r.submit(SICK, 0)
        r.reconcile_now()
    # one refused attempt, one re-read after it, then silence until the backoff expires
    assert writer.writes == 0
    assert writer.reads <= 2


def test_a_conflict_storm_is_ridden_out_and_the_write_lands() -> None:
    writer, r = make(max_conflicts=3)
    writer.inject_error(*[ConflictError("x")] * 50)
    r.submit(SICK, 0)
    r.reconcile_now()
    assert writer.writes == 1
    assert writer.reads >= 50 // 3


def test_endless_conflicts_stop_at_the_retry_deadline_without_hanging() -> None:
    writer, r = make(retry_deadline=0.2, max_conflicts=3)
    writer.inject_error(*[ConflictError("x")] * 100_000)
    r.submit(SICK, 0)
    r.reconcile_now()  # does not raise, does not hang
    assert writer.writes == 0


def test_the_background_thread_applies_the_latest_verdict() -> None:
    writer, r = make()
    r.start()
    try:
        r.submit(SICK, 0)
        assert r.wait_idle(5)
        assert writer.writes == 1
    finally:
        r.stop()


def test_a_fault_reads_the_budget_once_and_defers_when_it_is_spent() -> None:
    from gpuguard.node.budget import Budget

    writer, r = make()
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=1, limit=1)
    r.submit(SICK, 0)
    r.reconcile_now()
    assert writer.budget_lists == 1
    assert writer.node.our_taint is not None and writer.node.our_taint.effect == "PreferNoSchedule"
    # While deferred: the budget is re-read at most once a minute, not at every check.
    for _ in range(20):
        r.submit(SICK, 0)
        r.reconcile_now()
    assert writer.budget_lists == 1 and writer.writes == 1
    assert r.status.deferred and r.status.tainted and not r.status.cordoned
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=0, limit=1)
    budget_of(r).checked -= 61
    r.submit(SICK, 0)
    r.reconcile_now()
    assert writer.budget_lists == 2
    assert writer.node.our_taint is not None and writer.node.our_taint.effect == "NoSchedule"
    assert writer.node.unschedulable


def test_no_budget_list_when_the_budget_is_unlimited() -> None:
    writer = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b"))
    unlimited = NodeSettings(name="gpu-1", max_quarantined="100%")
    r = NodeReconciler(writer, unlimited, budget=QuarantineBudget(writer, unlimited))
    r.submit(SICK, 0)
    r.reconcile_now()
    assert writer.budget_lists == 0 and writer.writes == 1


def test_the_gpu_healthy_condition_is_written_only_when_it_changes() -> None:
    writer, r = make()
    for _ in range(5):
        r.submit(HEALTHY, 1)
        r.reconcile_now()
    for _ in range(5):
        r.submit(SICK, 0)
        r.reconcile_now()
    assert [c["status"] for c in writer.conditions] == ["True", "False"]
    assert writer.conditions[1]["reason"] == "GPUFault"
    assert writer.conditions[1]["message"].startswith("ecc: 2 uncorrected")


def test_a_restarted_agent_does_not_rewrite_a_condition_that_already_matches() -> None:
    writer = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b", gpu_condition="True"))
    r = NodeReconciler(writer, SETTINGS)
    r.submit(HEALTHY, 1)
    r.reconcile_now()
    assert writer.conditions == [] and writer.writes == 0


def test_a_conflict_re_plan_reuses_the_budget_it_just_listed() -> None:
    from gpuguard.node.budget import Budget

    writer, r = make()
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=0, limit=1)
    writer.inject_error(ConflictError("x"), ConflictError("y"))
    r.submit(SICK, 0)
    r.reconcile_now()
    assert writer.writes == 1 and writer.budget_lists == 1


def test_an_escalation_that_meets_a_conflict_still_escalates_on_the_re_plan() -> None:
    from gpuguard.node.budget import Budget

    writer, r = make()
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=1, limit=1)
    r.submit(SICK, 0)
    r.reconcile_now()  # deferred: the soft taint
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=0, limit=1)
    budget_of(r).checked -= 61
    writer.inject_error(ConflictError("x"))
    r.submit(SICK, 0)
    r.reconcile_now()
    assert writer.budget_lists == 2  # the re-plan after the 409 reused the list of this call
    assert writer.node.our_taint is not None and writer.node.our_taint.effect == "NoSchedule"
    assert writer.node.unschedulable


def test_the_next_reconcile_lists_the_budget_again() -> None:
    from gpuguard.node.budget import Budget

    writer, r = make()
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=0, limit=1)
    writer.inject_error(TransientApiError("down"))  # the first call fails before its write lands
    r.submit(SICK, 0)
    r.reconcile_now()
    assert writer.writes == 1 and writer.budget_lists == 2  # the retry counted again: time has passed


def test_a_burst_that_overshoots_the_budget_steps_back_the_node_past_the_limit() -> None:
    """Two agents listed at the same instant and both saw room for one: the later in the quarantine order
    (since, then name) steps back to the soft taint right after its write."""
    from gpuguard.node.budget import Budget
    from gpuguard.node.view import ANN_SINCE

    writer, r = make()
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=0, limit=1)
    writer.order = [("2026-12-02T00:00:00Z", "gpu-0")]  # quarantined first, by another agent
    r.submit(SICK, 0)
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
        r.submit(SICK, 0)
        r.reconcile_now()
    assert writer.order_lists == 1 and len(writer.patches) == 2


def test_the_first_in_the_order_stays_and_checks_once_more_after_the_burst_settled() -> None:
    from gpuguard.node.budget import Budget
    from gpuguard.node.view import ANN_SINCE

    writer, r = make()
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=0, limit=1)
    writer.order = [("2999-01-01T00:00:00Z", "gpu-9")]  # quarantined after us
    r.submit(SICK, 0)
    r.reconcile_now()
    assert [p.action for p in writer.patches] == ["taint"] and writer.order_lists == 1
    r.submit(SICK, 0)
    r.reconcile_now()
    assert writer.order_lists == 1  # not due yet
    # A slow writer landed after our first check, with an earlier since: the second check sees it.
    writer.order.append(("2000-01-01T00:00:00Z", "gpu-0"))
    settle = budget_of(r).settle
    assert settle is not None
    budget_of(r).settle = (settle[0], 0.0)
    r.submit(SICK, 0)
    r.reconcile_now()
    assert writer.order_lists == 2
    assert [p.action for p in writer.patches] == ["taint", "yield"]
    assert writer.node.deferred and writer.node.annotations[ANN_SINCE]
    r.submit(SICK, 0)
    r.reconcile_now()
    assert writer.order_lists == 2 and budget_of(r).settle is None


def test_a_watched_fleet_is_checked_again_at_each_change_and_a_node_now_past_the_limit_steps_back() -> None:
    """A source kept in memory by a watch (fleet.WatchedBudget): the order costs no request, so a fully
    quarantined node checks it again whenever the watch delivered a change, not only 10 s after its write."""
    from gpuguard.node.budget import Budget

    writer, r = make()
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=0, limit=1)
    r.submit(SICK, 0)
    r.reconcile_now()
    assert [p.action for p in writer.patches] == ["taint"] and writer.order_lists == 1
    for _ in range(3):  # nothing changed: no check, and an unchanged verdict does not wake the writer
        r.submit(SICK, 0)
        r.reconcile_now()
    assert writer.order_lists == 1 and budget_of(r).settle is not None  # the 10 s check is still to come
    # Another agent's quarantine with an earlier since lands: the watch delivers it.
    writer.order.append(("2000-01-01T00:00:00Z", "gpu-0"))
    writer.generation += 1
    assert budget_of(r).settling
    r.submit(SICK, 0)
    r.reconcile_now()
    assert writer.order_lists == 2
    assert [p.action for p in writer.patches] == ["taint", "yield"] and writer.node.deferred
    writer.generation += 1  # a deferred node holds no full quarantine: no order check
    r.submit(SICK, 0)
    r.reconcile_now()
    assert writer.order_lists == 2


def test_a_failed_order_check_keeps_the_quarantine_and_checks_again_later() -> None:
    from gpuguard.node.budget import Budget

    writer, r = make()
    writer.quarantine_budget = Budget(gpu_nodes=10, quarantined=0, limit=1)
    writer.order_error = TransientApiError("list failed")
    r.submit(SICK, 0)
    r.reconcile_now()
    assert [p.action for p in writer.patches] == ["taint"] and writer.node.unschedulable
    assert budget_of(r).settle is not None


def test_no_order_check_without_a_budget() -> None:
    writer = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b"))
    unlimited = NodeSettings(name="gpu-1", max_quarantined="100%")
    r = NodeReconciler(writer, unlimited, budget=QuarantineBudget(writer, unlimited))
    r.submit(SICK, 0)
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
    r.submit(HEALTHY, 1)
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
            r.submit(v, 0)
            r.reconcile_now()
    lines = {e["event"]: e for e in logs if e["event"] in ("node.tainted", "node.fault_added")}
    assert (lines["node.tainted"]["cordoned"], lines["node.tainted"]["uncordoned"]) == (True, False)
    assert (lines["node.fault_added"]["cordoned"], lines["node.fault_added"]["uncordoned"]) == (True, False)
    assert w.node.unschedulable
