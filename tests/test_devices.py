"""The per-GPU quarantine (gpuguard.quarantine.gpu.rules): one bad GPU of eight is one DeviceTaintRule for
that device, node-level faults and nodes without DRA slices keep the node taint, recovery follows the evidence
rules."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from fractions import Fraction
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from gpuguard.core.config import Config, NodeSettings, PolicySettings
from gpuguard.core.errors import ConfigError, ConflictError, PermanentApiError
from gpuguard.core.metrics import Metrics
from gpuguard.core.model import (
    ECC,
    GPU_LOST,
    GPU_MISSING,
    GPU_UNREADABLE,
    NVML_INIT,
    REPEAT_OFFENDER,
    RESET_REQUIRED,
    ROW_REMAP,
    Fault,
    GpuReading,
    Snapshot,
    Verdict,
    XidEvent,
    recovery_reason,
)
from gpuguard.judge.policy import evaluate
from gpuguard.nvml.mock import MockBackend, parse_scenario
from gpuguard.quarantine.budget import VERIFY_SETTLE, Budget
from gpuguard.quarantine.gpu.order import rule_since, rules_past_limit, rules_share
from gpuguard.quarantine.gpu.plan import Split, per_gpu, split
from gpuguard.quarantine.gpu.quarantine import DeviceQuarantine
from gpuguard.quarantine.gpu.rules import (
    ANN_NODE_GPUS,
    DeviceRule,
    rule_body,
    rule_name,
    trim_rule,
)
from gpuguard.quarantine.gpu.rules import device_effect as device_effect_of
from gpuguard.quarantine.gpu.slices import SliceDevice, slice_devices
from gpuguard.quarantine.gpu.writers import DryRunDeviceSource
from gpuguard.quarantine.node.view import NodeView, Taint
from gpuguard.quarantine.reconciler import NodeReconciler
from gpuguard.quarantine.record import TAINT_KEY
from gpuguard.runtime.agent import Agent
from gpuguard.store.state import StateStore
from harness.clock import Clock
from harness.dra import DRIVER, gpu_uuid, nvidia_slice
from harness.fakes import FakeDeviceSource, FakeNodeWriter
from harness.judging import hand_over

NODE = "gpu-node-1"
SETTINGS = NodeSettings(name=NODE, retry_max_wait=0.01, recover_after=2)
UUIDS = [gpu_uuid(NODE, i) for i in range(8)]
NOW = datetime(2026, 12, 3, 1, tzinfo=UTC)


def reading(i: int, **kw: object) -> GpuReading:
    return GpuReading(index=i, uuid=UUIDS[i], **kw)  # type: ignore[arg-type]


def verdict(
    *,
    xid_on: int | None = None,
    ecc_on: int | None = None,
    lost: int | None = None,
    prev: Verdict | None = None,
) -> Verdict:
    gpus = tuple(reading(i, ecc_uncorrected=3 if i == ecc_on else 0, lost=i == lost) for i in range(8))
    xids = (XidEvent(gpu_index=xid_on, uuid=UUIDS[xid_on], code=79),) if xid_on is not None else ()
    return evaluate(Snapshot(gpus=gpus, xids=xids), previous=prev, settings=PolicySettings())


def make(
    slices: list[dict[str, object]] | None = None,
    settings: NodeSettings = SETTINGS,
    budget: Budget | None = None,
    *,
    memory: StateStore | None = None,
    restart_of: tuple[FakeNodeWriter, FakeDeviceSource] | None = None,
) -> tuple[FakeNodeWriter, FakeDeviceSource, NodeReconciler, Clock]:
    """`restart_of`: a new agent process on the same node and API server as an earlier one."""
    if restart_of is None:
        writer = FakeNodeWriter(NodeView(name=NODE, resource_version="1", boot_id="boot-1"))
        source = FakeDeviceSource([nvidia_slice(NODE)] if slices is None else slices)
    else:
        writer, source = restart_of
    clock = Clock()
    devices = DeviceQuarantine(
        source,
        settings,
        budget=(lambda: budget) if budget is not None else None,
        now=lambda: datetime(2026, 12, 3, tzinfo=UTC),
        clock=clock,
        memory=memory,
    )
    return writer, source, NodeReconciler(writer, settings, devices=devices, clock=clock), clock


def ecc_on_3_after(previous: Verdict) -> Verdict:
    """A second fault on GPU 3 (ECC), judged after `previous` (whose Xid stays)."""
    return evaluate(
        Snapshot(gpus=tuple(reading(i, ecc_uncorrected=4 if i == 3 else 0) for i in range(8))),
        previous=previous,
        settings=PolicySettings(),
    )


def run(r: NodeReconciler, v: Verdict, streak: int = 0) -> None:
    hand_over(r, v, streak)
    r.reconcile_now()


def test_an_xid_on_gpu_3_of_8_is_one_rule_for_that_device_and_no_node_taint() -> None:
    writer, source, r, _ = make()
    run(r, verdict(xid_on=3))
    (doc,) = source.store.values()
    assert doc["metadata"]["name"] == f"gpuguard.{NODE}.gpu-3"
    assert doc["spec"]["deviceSelector"] == {"driver": DRIVER, "pool": NODE, "device": "gpu-3"}
    assert doc["spec"]["taint"] == {"key": TAINT_KEY, "effect": "NoSchedule"}
    ann = doc["metadata"]["annotations"]
    assert ann["gpuguard.io/faults"] == f"xid-79/{UUIDS[3]}"
    assert (ann["gpuguard.io/boot-id"], ann["gpuguard.io/since"]) == ("boot-1", "2026-12-03T00:00:00Z")
    assert doc["metadata"]["labels"] == {"gpuguard.io/node": NODE, "app.kubernetes.io/managed-by": "gpuguard"}
    assert writer.node.our_taint is None and not writer.node.unschedulable
    assert [g.device for g in r.status.gpus] == ["gpu-3"]
    # The GPUHealthy condition still says False, and how many GPUs are out.
    assert writer.conditions[-1]["status"] == "False"
    assert "(1 of 8 GPUs unhealthy, 1 held out by device taints)" in writer.conditions[-1]["message"]


def test_the_same_fault_again_writes_nothing() -> None:
    _, source, r, _ = make()
    v = verdict(xid_on=3)
    run(r, v)
    calls = len(source.calls)
    run(r, verdict(prev=v))
    assert source.calls[calls:] == []


def test_a_lost_gpu_is_the_nodes_fault_and_taints_the_node() -> None:
    writer, source, r, _ = make()
    run(r, verdict(lost=5))
    assert source.store == {}
    assert writer.node.our_taint is not None and writer.node.record.primary_reason == GPU_LOST


def test_a_node_without_dra_slices_keeps_the_node_taint() -> None:
    writer, source, r, _ = make(slices=[])
    run(r, verdict(xid_on=3))
    assert source.store == {}
    assert writer.node.our_taint is not None and writer.node.record.primary_reason == "xid-79"


def test_quarantine_node_reads_no_slices_and_taints_the_node() -> None:
    writer, source, r, _ = make(settings=NodeSettings(name=NODE, quarantine="node"))
    run(r, verdict(xid_on=3))
    assert source.calls == [] and writer.node.our_taint is not None


def test_a_gpu_the_slices_do_not_publish_gets_the_node_taint() -> None:
    other = nvidia_slice(NODE, uuids=[f"GPU-elsewhere-{i}" for i in range(8)])
    writer, source, r, _ = make(slices=[other])
    run(r, verdict(ecc_on=2))
    assert source.store == {} and writer.node.our_taint is not None


def test_a_rule_the_api_server_refuses_falls_back_to_the_node_taint() -> None:
    writer, source, r, _ = make()
    source.inject_error(PermanentApiError("denied by policy", status=403))
    run(r, verdict(ecc_on=1))
    assert (
        source.store == {} and writer.node.our_taint is not None and writer.node.record.primary_reason == ECC
    )


def test_every_published_gpu_is_known_by_its_device_with_or_without_a_rule() -> None:
    """What the evictor matches pods' DRA claims with: GPU 1's rule was refused (node taint instead)."""
    _, source, r, _ = make()
    source.inject_error(PermanentApiError("denied by policy", status=403))
    run(r, verdict(ecc_on=1))
    assert r.devices is not None and r.status.gpus == ()
    published = r.devices.published
    assert len(published) == 8 and published[UUIDS[1]] == (DRIVER, NODE, "gpu-1")


def test_recovery_deletes_the_rule_when_the_ecc_counter_reads_zero_after_recover_after_checks() -> None:
    writer, source, r, _ = make()
    sick = verdict(ecc_on=6)
    run(r, sick)
    assert len(source.store) == 1
    healthy = verdict(prev=sick)
    run(r, healthy, streak=1)
    assert len(source.store) == 1, "one healthy check is not enough (--recover-after 2)"
    run(r, healthy, streak=2)
    assert source.store == {} and r.status.gpus == ()
    assert writer.node.our_taint is None


def test_an_xid_rule_stays_until_the_node_reboots() -> None:
    writer, source, r, clock = make()
    sick = verdict(xid_on=3)
    run(r, sick)
    # A new process (the Xid is not sticky any more) reads healthy: the Xid's evidence needs a reboot.
    healthy = verdict()
    run(r, healthy, streak=5)
    assert len(source.store) == 1
    writer.edit(boot_id="boot-2")
    clock.t += SETTINGS.node_resync + 1
    run(r, healthy, streak=6)
    assert source.store == {}


def test_a_rule_an_operator_deleted_is_not_recreated_for_the_same_fault_but_a_new_fault_makes_it_again() -> (
    None
):
    writer, source, r, clock = make()
    first = verdict(xid_on=3)
    run(r, first)
    source.operator_delete(f"gpuguard.{NODE}.gpu-3")
    clock.t += SETTINGS.node_resync + 1
    run(r, verdict(prev=first), streak=0)
    hand_over(r, verdict(prev=first), 0)
    r.reconcile_now()
    assert source.store == {} and writer.node.our_taint is None
    second = ecc_on_3_after(first)
    run(r, second)
    (doc,) = source.store.values()
    assert doc["metadata"]["annotations"]["gpuguard.io/faults"] == f"ecc/{UUIDS[3]},xid-79/{UUIDS[3]}"


def test_a_second_fault_on_the_same_gpu_is_added_to_the_rules_record() -> None:
    _, source, r, _ = make()
    first = verdict(xid_on=3)
    run(r, first)
    both = ecc_on_3_after(first)
    run(r, both)
    (doc,) = source.store.values()
    assert doc["metadata"]["annotations"]["gpuguard.io/faults"] == f"ecc/{UUIDS[3]},xid-79/{UUIDS[3]}"
    assert source.calls.count("create") == 1


def test_past_the_budget_the_rule_has_effect_none_and_escalates_when_there_is_room() -> None:
    budget = Budget(quarantined=1, limit=1)
    _, source, r, clock = make(budget=budget)
    sick = verdict(ecc_on=0)
    run(r, sick)
    (doc,) = source.store.values()
    assert doc["spec"]["taint"]["effect"] == "None"
    assert "gpuguard.io/quarantine-deferred" in doc["metadata"]["annotations"]
    # The budget frees up (the other node recovered): at the next re-check the rule takes effect.
    r.devices._budgets._budget = lambda: Budget(quarantined=0, limit=1)  # type: ignore[union-attr]
    clock.t += SETTINGS.budget_recheck + 1
    run(r, verdict(prev=sick, ecc_on=0))
    (doc,) = source.store.values()
    assert doc["spec"]["taint"]["effect"] == "NoSchedule"
    assert "gpuguard.io/quarantine-deferred" not in doc["metadata"]["annotations"]


def other_node_rules(
    node: str, count: int, *, since: str | None = "2026-12-03T00:00:00Z"
) -> list[DeviceRule]:
    """`count` blocking rules of another 8-GPU node (since None: rules without a since record)."""
    since_ann = {} if since is None else {"gpuguard.io/since": since}
    return [own_rule(node, f"gpu-{i}", annotations={ANN_NODE_GPUS: "8", **since_ann}) for i in range(count)]


def own_rule(pool: str, device: str, **kw: object) -> DeviceRule:
    """A rule as gpuguard writes it for `device` of node `pool` (name, labels, driver, key); kw: fields."""
    fields: dict[str, object] = {
        "name": rule_name(pool, device),
        "pool": pool,
        "device": device,
        "effect": "NoSchedule",
        "driver": DRIVER,
        "labels": {"gpuguard.io/node": pool, "app.kubernetes.io/managed-by": "gpuguard"},
    }
    return DeviceRule(**{**fields, **kw})  # type: ignore[arg-type]


def test_a_gpu_costs_its_share_of_a_node_in_the_budget() -> None:
    """Budget 1 node; 7 GPUs of 8-GPU nodes are held elsewhere (7/8): one more GPU fits, a second does not."""
    _, source, r, _ = make(budget=Budget(quarantined=0, limit=1))
    source.other_rules = other_node_rules("other", 7, since=None)
    first = verdict(ecc_on=0)
    run(r, first)
    assert [d["spec"]["taint"]["effect"] for d in source.store.values()] == ["NoSchedule"]
    second = evaluate(
        Snapshot(gpus=tuple(reading(i, ecc_uncorrected=3 if i in (0, 1) else 0) for i in range(8))),
        previous=first,
        settings=PolicySettings(),
    )
    run(r, second)
    effects = {
        d["spec"]["deviceSelector"]["device"]: d["spec"]["taint"]["effect"] for d in source.store.values()
    }
    assert effects == {"gpu-0": "NoSchedule", "gpu-1": "None"}


@pytest.mark.parametrize(
    "raw, share",
    [
        ("8", Fraction(1, 8)),
        ("", Fraction(1)),
        ("0", Fraction(1)),
        ("x", Fraction(1)),
        ("99999", Fraction(1)),
    ],
)
def test_a_missing_or_absurd_gpu_count_on_a_rule_counts_as_a_whole_node(raw: str, share: Fraction) -> None:
    assert (
        DeviceRule(
            name="r", pool="p", device="d", effect="NoSchedule", annotations={ANN_NODE_GPUS: raw}
        ).share
        == share
    )


def test_a_dry_run_without_a_cluster_creates_no_rule_and_plans_the_node_taint() -> None:
    writer = FakeNodeWriter(NodeView(name=NODE, resource_version="1", boot_id="b"))
    settings = NodeSettings(name=NODE, dry_run=True)
    devices = DeviceQuarantine(DryRunDeviceSource(None), settings)
    r = NodeReconciler(writer, settings, devices=devices)
    run(r, verdict(xid_on=3))
    assert writer.node.our_taint is not None and r.status.gpus == ()


@pytest.mark.parametrize(
    "reason, one_gpu",
    [
        (ECC, True),
        ("xid-79", True),
        (ROW_REMAP, True),
        (RESET_REQUIRED, True),
        (recovery_reason(1), True),
        (recovery_reason(4), True),
        (recovery_reason(2), False),
        (GPU_LOST, False),
        (GPU_MISSING, False),
        (GPU_UNREADABLE, False),
        (NVML_INIT, False),
    ],
)
def test_which_faults_belong_to_one_gpu(reason: str, one_gpu: bool) -> None:
    assert per_gpu(Fault(reason, "d", uuid="GPU-1", gpu_index=1)) is one_gpu
    assert per_gpu(Fault(reason, "d")) is False  # no GPU named: the node's


def test_the_rule_name_is_deterministic_and_unambiguous() -> None:
    assert rule_name("node-a", "gpu-3") == rule_name("node-a", "gpu-3") == "gpuguard.node-a.gpu-3"
    # The earlier names collided: node a-b's device c and node a's device b-c were both gpuguard-a-b-c.
    assert rule_name("a-b", "c") != rule_name("a", "b-c")
    assert rule_name("a.b", "c") == "gpuguard.a.b.c" != rule_name("a", "b.c")


@pytest.mark.parametrize("node, device", [("n" * 240, "gpu-3"), ("node-a", "b.c"), ("node-a", "GPU-3")])
def test_a_name_too_long_or_a_device_that_is_no_dns_label_has_no_rule_name(node: str, device: str) -> None:
    assert rule_name(node, device) is None


def test_a_uuid_published_twice_is_left_out() -> None:
    doubled = nvidia_slice(NODE, gpus=2, uuids=["GPU-same", "GPU-same"])
    assert slice_devices([doubled], driver=DRIVER, node=NODE) == {}


def test_slices_of_another_driver_or_pool_are_not_this_nodes() -> None:
    assert slice_devices([nvidia_slice("other")], driver=DRIVER, node=NODE) == {}
    assert slice_devices([nvidia_slice(NODE)], driver="example.com", node=NODE) == {}
    assert len(slice_devices([nvidia_slice(NODE)], driver=DRIVER, node=NODE)) == 8


def test_the_nodes_slice_after_another_ones_is_still_read_and_a_device_without_a_uuid_left_out() -> None:
    ours = nvidia_slice(NODE, gpus=3)
    ours["spec"]["devices"][0]["attributes"].pop("uuid")
    ours["spec"]["devices"][1]["attributes"]["uuid"] = {"string": ""}
    found = slice_devices([nvidia_slice("other"), ours], driver=DRIVER, node=NODE)
    assert [d.device for d in found.values()] == ["gpu-2"]


def test_quarantine_gpu_names_a_gpu_the_slices_do_not_publish_as_an_error_and_still_taints_the_node() -> None:
    settings = NodeSettings(name=NODE, quarantine="gpu")
    with capture_logs() as logs:
        writer, source, r, _ = make(slices=[], settings=settings)
        run(r, verdict(xid_on=3))
    assert writer.node.our_taint is not None and source.store == {}
    assert [e["uuid"] for e in logs if e["event"] == "device.unpublished"] == [UUIDS[3]]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"quarantine": "device"}, "--quarantine must be one of auto, node, gpu"),
        ({"dra_driver": "GPU.NVIDIA.COM"}, "--dra-driver"),
        ({"dra_driver": ""}, "--dra-driver"),
    ],
)
def test_a_bad_quarantine_setting_is_one_clear_error(change: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Config(node=NodeSettings(name=NODE, **change))  # type: ignore[arg-type]


def test_an_agent_whose_cluster_role_predates_dra_still_taints_the_node_for_a_gpu_fault() -> None:
    """A new agent with the old ClusterRole: listing ResourceSlices is refused (403). Never blind: the node
    taint, and an error line, rather than no quarantine at all."""
    writer, source, r, _ = make()
    source.slice_error = PermanentApiError("resourceslices is forbidden", status=403)
    with capture_logs() as logs:
        run(r, verdict(xid_on=3))
    assert writer.node.our_taint is not None and writer.node.record.primary_reason == "xid-79"
    assert [e["event"] for e in logs if e["event"].startswith("device.")] == ["device.read_rejected"]


def test_a_rule_changed_by_someone_else_is_read_again_not_fought_over() -> None:
    _, source, r, _ = make()
    first = verdict(xid_on=3)
    run(r, first)
    name = f"gpuguard.{NODE}.gpu-3"
    source.store[name]["metadata"]["resourceVersion"] = "99"  # another writer's change
    both = ecc_on_3_after(first)
    run(r, both)  # 409: no crash, the rules are read again at the next reconcile
    run(r, both)
    assert source.store[name]["metadata"]["annotations"]["gpuguard.io/faults"] == (
        f"ecc/{UUIDS[3]},xid-79/{UUIDS[3]}"
    )


def node_verdict(node: str, *, xid_on: int) -> Verdict:
    gpus = tuple(GpuReading(index=i, uuid=gpu_uuid(node, i)) for i in range(8))
    xids = (XidEvent(gpu_index=xid_on, uuid=gpu_uuid(node, xid_on), code=79),)
    return evaluate(Snapshot(gpus=gpus, xids=xids), previous=None, settings=PolicySettings())


def burst(
    nodes: tuple[str, ...],
) -> tuple[FakeDeviceSource, Clock, list[tuple[str, DeviceQuarantine, NodeReconciler]]]:
    """Agents of `nodes` on one API server, budget 1 node, 7 GPUs of 8-GPU nodes held since yesterday
    (room for one GPU's share): each faults on GPU 3 at the same instant, its list racing the others'
    creates (all see room)."""
    shared = FakeDeviceSource()
    shared.other_rules = other_node_rules("old", 7, since="2026-12-02T00:00:00Z")
    shared.lagging = list(shared.other_rules)
    clock = Clock()
    agents = []
    for node in nodes:
        settings = NodeSettings(name=node, retry_max_wait=0.01)
        devices = DeviceQuarantine(
            shared.for_node(node, [nvidia_slice(node)]),
            settings,
            budget=lambda: Budget(quarantined=0, limit=1),
            order=lambda: [],
            now=lambda: datetime(2026, 12, 3, tzinfo=UTC),
            clock=clock,
        )
        writer = FakeNodeWriter(NodeView(name=node, resource_version="1", boot_id="boot-1"))
        agents.append((node, devices, NodeReconciler(writer, settings, devices=devices, clock=clock)))
    for node, devices, r in agents:
        devices._source.lagging = shared.lagging  # type: ignore[attr-defined]
        run(r, node_verdict(node, xid_on=3))
    assert [d["spec"]["taint"]["effect"] for d in shared.store.values()] == ["NoSchedule"] * len(nodes)
    return shared, clock, agents


def test_the_node_counts_as_reconciled_for_readyz_only_once_its_first_reconcile_is_over() -> None:
    """/readyz (NodeStatus.reconciled): not at the first read of the node, while the device reads, the
    writes and the condition of the first reconcile are still to come (a rollout would count the node ready
    too early, and a fault right after /readyz met the first reconcile's requests)."""
    writer, source, r, _ = make()
    seen: list[bool] = []
    slices = source.slices

    def reading_slices() -> list[dict[str, object]] | None:
        seen.append(r.status.reconciled)
        return slices()

    source.slices = reading_slices  # type: ignore[method-assign]
    run(r, verdict())
    assert seen == [False] and r.status.reconciled
    assert writer.conditions  # the first reconcile wrote the condition before it counted


def test_the_order_check_ranks_this_nodes_new_rule_even_before_the_rules_watch_delivered_it() -> None:
    """The budget's rules come from a watch (quarantine/gpu/watch.py): right after the create it may hold the
    other agents' rules of the same burst and not yet this node's own. The order check takes this node's
    rules as its own writes answered, so the new rule is ranked at once: here one node's worth of rules
    came first (the budget, 1 node), and the new rule steps back in the same reconcile."""
    source = FakeDeviceSource([nvidia_slice(NODE)])
    earlier = other_node_rules("other", 8, since="2026-12-02T00:00:00Z")
    answers = [[], earlier]  # room (before the create): nothing yet; the order check: the other node's 8

    def watched() -> list[DeviceRule]:
        return list(answers.pop(0) if answers else earlier)

    clock = Clock()
    devices = DeviceQuarantine(
        source,
        SETTINGS,
        budget=lambda: Budget(quarantined=0, limit=1),
        order=lambda: [],
        now=lambda: datetime(2026, 12, 3, tzinfo=UTC),
        clock=clock,
        all_rules=watched,
    )
    writer = FakeNodeWriter(NodeView(name=NODE, resource_version="1", boot_id="boot-1"))
    r = NodeReconciler(writer, SETTINGS, devices=devices, clock=clock)
    with capture_logs() as logs:
        run(r, verdict(ecc_on=0))
    (doc,) = source.store.values()
    assert doc["spec"]["taint"]["effect"] == "None"
    assert [e["event"] for e in logs if e["event"].startswith("device.")][-1] == "device.rule_yielded"
    assert "all_rules" not in source.calls  # never the source's list: the watch's memory only


def test_agents_faulting_at_the_same_instant_keep_exactly_the_budgets_worth_of_rules_blocking() -> None:
    """Three agents fault at the same instant and all see room; after the order check settles, exactly one
    rule blocks (the earliest by (since, name)) and the others are deferred."""
    shared, clock, agents = burst(("gpu-node-c", "gpu-node-a", "gpu-node-b"))
    # The burst's writes have all landed; VERIFY_SETTLE later every agent checks the order again.
    for _, devices, _ in agents:
        devices._source.lagging = None  # type: ignore[attr-defined]
        assert devices.settling
    clock.t += VERIFY_SETTLE
    with capture_logs() as logs:
        for node, _, r in agents:
            run(r, node_verdict(node, xid_on=3))
    effects = {d["metadata"]["name"]: d["spec"]["taint"]["effect"] for d in shared.store.values()}
    assert effects == {
        "gpuguard.gpu-node-a.gpu-3": "NoSchedule",
        "gpuguard.gpu-node-b.gpu-3": "None",
        "gpuguard.gpu-node-c.gpu-3": "None",
    }
    for name in ("gpuguard.gpu-node-b.gpu-3", "gpuguard.gpu-node-c.gpu-3"):
        assert "gpuguard.io/quarantine-deferred" in shared.store[name]["metadata"]["annotations"]
    assert sorted(e["rule"] for e in logs if e["event"] == "device.rule_yielded") == [
        "gpuguard.gpu-node-b.gpu-3",
        "gpuguard.gpu-node-c.gpu-3",
    ]
    # Converged: no agent is waiting on another check, and the deferred rules stay deferred while the
    # budget is spent (the room re-check finds none).
    assert not any(d.settling for _, d, _ in agents)
    clock.t += SETTINGS.budget_recheck + 1
    for node, _, r in agents:
        run(r, node_verdict(node, xid_on=3))
    assert {d["metadata"]["name"]: d["spec"]["taint"]["effect"] for d in shared.store.values()} == effects


def test_the_order_check_names_only_rules_past_the_limit_never_a_node() -> None:
    old = "2026-12-02T00:00:00Z"
    new = "2026-12-03T00:00:00Z"
    rules = [
        own_rule(p, d, annotations={ANN_NODE_GPUS: "2", "gpuguard.io/since": s})
        for p, d, s in (("p", "early", old), ("p", "late-a", new), ("q", "late-b", new))
    ] + [own_rule("q", "deferred", effect="None", annotations={"gpuguard.io/since": old})]
    early, late_a, late_b = (rule_name(p, d) for p, d in (("p", "early"), ("p", "late-a"), ("q", "late-b")))
    # Limit 1: early (1/2) and late-a (1/2) fit; a node quarantined later and late-b do not.
    past = rules_past_limit([("2026-12-04T00:00:00Z", "node-x")], rules, 1, now=NOW)
    assert past == {late_b: Fraction(1)}
    # A node quarantined first takes the whole share: every rule after it is past the limit.
    assert set(rules_past_limit([(old, "a-node")], rules, 1, now=NOW)) == {early, late_a, late_b}


def test_a_step_back_that_conflicts_is_tried_again_at_the_next_settle_check() -> None:
    shared, clock, agents = burst(("gpu-node-a", "gpu-node-b"))
    for _, devices, _ in agents:
        devices._source.lagging = None  # type: ignore[attr-defined]
    agents[1][1]._source.inject_error(ConflictError("changed by the controller"))  # type: ignore[attr-defined]
    clock.t += VERIFY_SETTLE
    for node, _, r in agents:
        run(r, node_verdict(node, xid_on=3))
    assert shared.store["gpuguard.gpu-node-b.gpu-3"]["spec"]["taint"]["effect"] == "NoSchedule"
    assert agents[1][1].settling
    clock.t += VERIFY_SETTLE
    for node, _, r in agents:
        run(r, node_verdict(node, xid_on=3))
    effects = {d["metadata"]["name"]: d["spec"]["taint"]["effect"] for d in shared.store.values()}
    assert effects == {"gpuguard.gpu-node-a.gpu-3": "NoSchedule", "gpuguard.gpu-node-b.gpu-3": "None"}


def test_a_deferred_gpu_rule_is_exported_for_its_alert_and_a_blocking_one_is_not_counted_there() -> None:
    """gpuguard_gpus_quarantine_deferred (alert GpuguardGPUQuarantineBudgetSpent): a faulty GPU that stays
    in service because the budget deferred its rule; once the rule blocks, gpuguard_gpus_quarantined."""
    scenario = parse_scenario(
        f"devices:\n  - {{index: 0, uuid: {UUIDS[0]}}}\n  - {{index: 1, uuid: {UUIDS[1]}}}\n"
        "events:\n  - {at: 1.0, gpu: 0, ecc_uncorrected: 3}\n"
    )
    _, _, r, clock = make(
        slices=[nvidia_slice(NODE, gpus=2, uuids=UUIDS[:2])], budget=Budget(quarantined=1, limit=1)
    )
    backend = MockBackend(scenario, clock=clock, start_timer=False)
    backend.open(lambda: None)
    registry = CollectorRegistry()
    agent = Agent(
        backend=backend,
        reconciler=r,
        policy=PolicySettings(),
        interval=1.0,
        node_name=NODE,
        clock=clock,
        metrics=Metrics(registry),
    )

    def gauges() -> tuple[float | None, float | None]:
        labels = {"dry_run": "false"}
        return (
            registry.get_sample_value("gpuguard_gpus_quarantine_deferred", labels),
            registry.get_sample_value("gpuguard_gpus_quarantined", labels),
        )

    clock.t = 1.0
    agent.check_once()
    r.reconcile_now()
    agent.check_once()  # the gauges follow the reconciled status at the next check
    assert gauges() == (1.0, 0.0)
    r.devices._budgets._budget = lambda: Budget(quarantined=0, limit=1)  # type: ignore[union-attr]
    clock.t += SETTINGS.budget_recheck + 1
    agent.check_once()
    r.reconcile_now()
    agent.check_once()
    assert gauges() == (0.0, 1.0)


def test_a_gated_node_whose_gpu_rule_the_budget_deferred_keeps_its_gate_until_the_rule_blocks() -> None:
    """Defect 08 for rules: a never-verified node with a known fault is never schedulable. The GPU's rule is
    deferred (effect None, the budget spent), so it blocks nothing: the gate stays; once the rule takes
    effect the node's other GPUs are good and the gate lifts."""
    gate = Taint(key=SETTINGS.gate_taint_key, effect="NoSchedule")
    writer, source, r, clock = make(budget=Budget(quarantined=1, limit=1))
    writer.node = replace(writer.node, taints=(gate,))
    sick = verdict(ecc_on=0)
    run(r, sick)
    (doc,) = source.store.values()
    assert doc["spec"]["taint"]["effect"] == "None"
    assert gate in writer.node.taints
    r.devices._budgets._budget = lambda: Budget(quarantined=0, limit=1)  # type: ignore[union-attr]
    clock.t += SETTINGS.budget_recheck + SETTINGS.node_resync + 1
    run(r, verdict(prev=sick, ecc_on=0))
    (doc,) = source.store.values()
    assert doc["spec"]["taint"]["effect"] == "NoSchedule"
    assert gate not in writer.node.taints


def test_a_fully_quarantined_node_with_gpu_rules_counts_once_in_the_budget() -> None:
    """Budget 2 nodes; another node is fully quarantined and also holds rules for all its 8 GPUs: one node
    of the budget, not two (its node taint already covers its GPUs), so this node's GPU has room."""
    _, source, r, _ = make(budget=Budget(quarantined=1, limit=2))
    r.devices._budgets._order = lambda: [("2026-12-01T00:00:00Z", "other")]  # type: ignore[union-attr]
    source.other_rules = other_node_rules("other", 8)
    run(r, verdict(ecc_on=0))
    assert [d["spec"]["taint"]["effect"] for d in source.store.values()] == ["NoSchedule"]


def test_the_order_check_counts_a_fully_quarantined_nodes_rules_once() -> None:
    nodes = [("2026-12-01T00:00:00Z", "other")]
    ours = own_rule(
        NODE, "gpu-0", annotations={ANN_NODE_GPUS: "8", "gpuguard.io/since": "2026-12-03T00:00:01Z"}
    )
    assert rules_past_limit(nodes, [*other_node_rules("other", 8), ours], 2, now=NOW) == {}
    # A rule of a node not fully quarantined still counts its share.
    assert set(rules_past_limit(nodes, [*other_node_rules("third", 8), ours], 2, now=NOW)) == {ours.name}


def test_a_recovered_gpu_loses_its_rule_while_another_gpu_of_the_node_stays_bad() -> None:
    """Recovery of a rule follows its GPU's own healthy streak, not the node's: GPU 0's ECC count reads 0
    again for --recover-after checks while GPU 1's stays; the node is never healthy, GPU 0's rule goes."""
    scenario = parse_scenario(
        f"devices:\n  - {{index: 0, uuid: {UUIDS[0]}}}\n  - {{index: 1, uuid: {UUIDS[1]}}}\n"
        "events:\n"
        "  - {at: 1.0, gpu: 0, ecc_uncorrected: 3}\n"
        "  - {at: 1.0, gpu: 1, ecc_uncorrected: 3}\n"
        "  - {at: 3.0, gpu: 0, ecc_uncorrected: 0}\n"
    )
    clock = Clock()
    backend = MockBackend(scenario, clock=clock, start_timer=False)
    backend.open(lambda: None)
    _, source, r, _ = make(slices=[nvidia_slice(NODE, gpus=2, uuids=UUIDS[:2])])
    agent = Agent(
        backend=backend, reconciler=r, policy=PolicySettings(), interval=1.0, node_name=NODE, clock=clock
    )
    for t in (1.0, 2.0, 3.0):
        clock.t = t
        agent.check_once()
        r.reconcile_now()
    assert sorted(source.store) == [f"gpuguard.{NODE}.gpu-0", f"gpuguard.{NODE}.gpu-1"]
    clock.t = 4.0  # GPU 0 healthy for 2 checks (--recover-after 2); the node never was
    agent.check_once()
    r.reconcile_now()
    assert sorted(source.store) == [f"gpuguard.{NODE}.gpu-1"]
    assert [g.device for g in r.status.gpus] == ["gpu-1"]


@pytest.mark.parametrize(
    "forged",
    [
        "0000-01-01T00:00:00Z",  # before the rule was created
        "2026-12-02T23:00:00Z",  # an hour before it was created
        "2026-12-03T00:00:00.5Z",  # not gpuguard's form
        "yesterday",
        "2026-13-45T99:00:00Z",  # the form, but no time
        "2026-12-03T03:00:00Z",  # ahead of now by more than the skew
    ],
)
def test_a_rule_with_a_forged_or_malformed_since_is_ranked_last_in_the_order_check(forged: str) -> None:
    """Validated as a node's claim is (budget.quarantine_entry): gpuguard's RFC 3339 form, not ahead of now
    and not earlier than the rule's creation by more than the skew (the API server sets creationTimestamp,
    nobody can forge it). An invalid claim still counts its share (it cannot escape the limit) but comes
    after every valid one, so it cannot push an honest rule past the limit."""

    def rule(node: str, since: str, created: str) -> DeviceRule:
        return own_rule(
            node, "gpu-0", created=created, annotations={ANN_NODE_GPUS: "1", "gpuguard.io/since": since}
        )

    honest = rule("honest", "2026-12-03T00:00:00Z", "2026-12-03T00:00:01Z")  # one second's latency
    forger = rule("forger", forged, "2026-12-03T00:00:05Z")
    assert set(rules_past_limit([], [honest, forger], 1, now=NOW)) == {forger.name}


def test_a_rules_reason_is_clean_text_and_its_boot_id_record_compares_as_the_nodes_does() -> None:
    rule = DeviceRule(
        name="r",
        pool=NODE,
        device="gpu-0",
        effect="NoSchedule",
        annotations={"gpuguard.io/reason": "ecc\x1b[31m" + "x" * 5000, "gpuguard.io/boot-id": "boot-1"},
    )
    assert "\x1b" not in rule.reason and len(rule.reason.encode()) <= 1024
    assert not rule.from_earlier_boot("boot-1")
    assert not rule.from_earlier_boot("")  # the node's bootID unknown: nothing proven
    assert rule.from_earlier_boot("boot-2")


@pytest.mark.parametrize("noticed", [True, False], ids=["noticed-before", "deleted-while-down"])
def test_a_rule_an_operator_deleted_is_not_recreated_after_the_agent_restarts(
    tmp_path: Path, noticed: bool
) -> None:
    """The memory of rules made and deleted by hand is in the agent's durable state: a new process of the
    same boot neither makes the rule again (whether the old process saw the deletion or the operator deleted
    it while the agent was down) nor forgets a new fault."""
    rule = f"gpuguard.{NODE}.gpu-3"
    writer, source, r, clock = make(memory=StateStore(tmp_path, boot_id="host-boot-1"))
    first = verdict(xid_on=3)
    run(r, first)
    assert rule in source.store
    source.operator_delete(rule)
    if noticed:
        clock.t += SETTINGS.node_resync + 1
        run(r, verdict(prev=first))
    # A new process of the same boot: the Xid restored from the same state file.
    _, _, again, _ = make(memory=StateStore(tmp_path, boot_id="host-boot-1"), restart_of=(writer, source))
    restored = verdict(xid_on=3)
    run(again, restored)
    assert source.store == {} and writer.node.our_taint is None
    # A new fault on that GPU makes it again.
    second = ecc_on_3_after(restored)
    run(again, second)
    assert list(source.store) == [rule]


class Crash(BaseException):
    """The process dies here (SIGKILL): nothing after it runs."""


def test_a_rule_recovered_just_before_a_crash_is_not_taken_for_an_operators_deletion(tmp_path: Path) -> None:
    """The rule is forgotten before its delete is sent: an agent killed the instant its delete landed never
    holds the same fault back after the restart as "deleted by an operator" (a fault without quarantine)."""
    writer, source, r, _ = make(memory=StateStore(tmp_path, boot_id="host-boot-1"))
    sick = verdict(ecc_on=3)
    run(r, sick)
    healthy = verdict(prev=sick)
    run(r, healthy, streak=1)
    delete = source.delete

    def delete_then_die(rule: DeviceRule) -> None:
        delete(rule)
        raise Crash

    source.delete = delete_then_die  # type: ignore[method-assign]
    with pytest.raises(Crash):
        run(r, healthy, streak=2)
    assert source.store == {}
    _, _, again, _ = make(memory=StateStore(tmp_path, boot_id="host-boot-1"), restart_of=(writer, source))
    run(again, verdict(ecc_on=3))
    assert list(source.store) == [f"gpuguard.{NODE}.gpu-3"]


def test_slices_published_after_the_agent_started_are_read_after_the_write_of_a_fault_that_found_none() -> (
    None
):
    """A DRA driver that starts after the agent: the first per-GPU fault finds no device and gets the node
    taint at once (no request added before it); the slices are read again after that write, so the next
    fault gets a rule. A healthy node reads nothing meanwhile."""
    writer, source, r, clock = make(slices=[])
    run(r, verdict())
    source.slice_items = [nvidia_slice(NODE)]  # the driver publishes the node's GPUs
    clock.t += 3600.0
    before = len(source.calls)
    run(r, verdict(), streak=5)
    assert source.calls[before:] == [], "a healthy node costs no request"
    slices = source.slices
    writes_at_read: list[int] = []

    def recording() -> list[dict[str, object]] | None:
        writes_at_read.append(writer.writes)
        return slices()

    source.slices = recording  # type: ignore[method-assign]
    first = verdict(xid_on=3)
    run(r, first)
    assert writer.node.our_taint is not None and writer.node.record.primary_reason == "xid-79"
    assert writes_at_read == [1], "the slices are read once, after the node's taint was written"
    run(r, verdict(xid_on=5, prev=first))
    assert sorted(source.store) == [f"gpuguard.{NODE}.gpu-3", f"gpuguard.{NODE}.gpu-5"]
    assert writes_at_read == [1]


def test_a_fault_soon_after_the_last_slices_read_reads_no_slices_again() -> None:
    """--slice-refresh (600 s): a fault's transition keeps its three requests; a node whose slices were read
    a moment ago does not read them again for a fault that finds no device."""
    writer, source, r, clock = make(slices=[])
    run(r, verdict())
    clock.t += 10.0
    before = len(source.calls)
    run(r, verdict(xid_on=3))
    assert writer.node.our_taint is not None and source.calls[before:] == []


# -- reading and writing a rule ------------------------------------------------------------------------------


RULE_DOC = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceTaintRule",
    "metadata": {
        "name": "gpuguard-gpu-node-1-gpu-3",
        "uid": "u-7",
        "resourceVersion": "41",
        "creationTimestamp": "2026-12-03T00:00:01Z",
        "annotations": {
            "gpuguard.io/faults": "ecc/GPU-3,xid-79/GPU-3",
            "gpuguard.io/uuid": "GPU-3",
            "gpuguard.io/quarantine-deferred": "budget spent",
        },
    },
    "spec": {
        "deviceSelector": {"driver": DRIVER, "pool": NODE, "device": "gpu-3"},
        "taint": {"key": TAINT_KEY, "value": "xid-79", "effect": "None"},
    },
}


def test_a_rule_is_read_from_the_api_with_its_pool_device_taint_and_creation_time() -> None:
    rule = DeviceRule.from_api(RULE_DOC)
    assert rule == DeviceRule(
        name="gpuguard-gpu-node-1-gpu-3",
        pool=NODE,
        device="gpu-3",
        effect="None",
        taint_value="xid-79",
        uid="u-7",
        resource_version="41",
        annotations=RULE_DOC["metadata"]["annotations"],  # type: ignore[index]
        created="2026-12-03T00:00:01Z",
        driver=DRIVER,
        key=TAINT_KEY,
        labels={},
    )
    assert rule.uuid == "GPU-3"
    assert rule.faults == frozenset({"ecc/GPU-3", "xid-79/GPU-3"})  # the record split on ","
    assert rule.deferred


@pytest.mark.parametrize(
    "doc",
    [
        {},
        {"metadata": None, "spec": None},
        {"metadata": {"annotations": None}, "spec": {"deviceSelector": None, "taint": None}},
        {
            "spec": {
                "deviceSelector": {"pool": None, "device": None},
                "taint": {"effect": None, "value": None},
            }
        },
    ],
)
def test_a_rule_with_fields_absent_reads_as_empty_strings_not_none(doc: dict[str, object]) -> None:
    rule = DeviceRule.from_api(doc)
    fields = (
        rule.name,
        rule.pool,
        rule.device,
        rule.effect,
        rule.taint_value,
        rule.uid,
        rule.resource_version,
    )
    assert fields == ("", "", "", "", "", "", "")
    assert (rule.driver, rule.key, rule.labels) == ("", "", {})
    assert (rule.created, rule.uuid, rule.faults, rule.deferred) == ("", "", frozenset(), False)


def test_the_rule_written_for_a_gpu_carries_the_api_version_its_uuid_and_the_node_taints_record() -> None:
    n = NodeView(name=NODE, boot_id="boot-1")
    (dev,) = [
        d
        for d in slice_devices([nvidia_slice(NODE)], driver=DRIVER, node=NODE).values()
        if d.device == "gpu-3"
    ]
    faults = (
        Fault("xid-79", "fell off the bus", uuid=UUIDS[3], gpu_index=3),
        Fault(ECC, "3 errors", uuid=UUIDS[3], gpu_index=3),
    )
    body = rule_body(n, dev, faults, node_gpus=8, effect="NoSchedule", since="2026-12-03T00:00:00Z")
    assert body["apiVersion"] == "resource.k8s.io/v1" and body["kind"] == "DeviceTaintRule"
    assert body["metadata"]["name"] == rule_name(NODE, "gpu-3")
    assert body["metadata"]["labels"] == {
        "gpuguard.io/node": NODE,
        "app.kubernetes.io/managed-by": "gpuguard",
    }
    assert body["metadata"]["annotations"] == {
        "gpuguard.io/faults": f"ecc/{UUIDS[3]},xid-79/{UUIDS[3]}",
        "gpuguard.io/reason": "xid-79: fell off the bus; ecc: 3 errors",
        "gpuguard.io/since": "2026-12-03T00:00:00Z",
        "gpuguard.io/boot-id": "boot-1",
        "gpuguard.io/uuid": UUIDS[3],
        "gpuguard.io/node-gpus": "8",
    }
    assert body["spec"] == {
        "deviceSelector": {"driver": DRIVER, "pool": NODE, "device": "gpu-3"},
        "taint": {"key": TAINT_KEY, "effect": "NoSchedule"},
    }
    deferred = rule_body(n, dev, faults, node_gpus=8, effect="None", since="s", deferred=True)
    assert deferred["metadata"]["annotations"]["gpuguard.io/quarantine-deferred"] == "budget spent"
    read = DeviceRule.from_api(body)
    assert (read.uuid, read.faults, read.share) == (
        UUIDS[3],
        frozenset({f"ecc/{UUIDS[3]}", f"xid-79/{UUIDS[3]}"}),
        Fraction(1, 8),
    )


@pytest.mark.parametrize(
    ("faults", "reason"),
    [
        ((), None),
        ((Fault(ROW_REMAP, "d", uuid="GPU-1", gpu_index=1), Fault(ECC, "d", uuid="GPU-1", gpu_index=1)), ECC),
        ((Fault("xid-79", "d", uuid="GPU-1"), Fault(REPEAT_OFFENDER, "d", uuid="GPU-1")), REPEAT_OFFENDER),
    ],
)
def test_a_rules_taint_has_no_value_and_status_shows_its_most_severe_recorded_reason(
    faults: tuple[Fault, ...], reason: str | None
) -> None:
    node = NodeView(name=NODE, resource_version="1", boot_id="boot-1")
    dev = SliceDevice(driver=DRIVER, pool=NODE, device="gpu-1", uuid="GPU-1")
    body = rule_body(node, dev, faults, node_gpus=8, since="2026-01-01T00:00:00Z", effect="NoSchedule")
    assert "value" not in body["spec"]["taint"]
    assert DeviceRule.from_api(body).record.primary_reason == reason


@pytest.mark.parametrize(
    ("node_effect", "device_effect"),
    [
        ("NoSchedule", "NoSchedule"),
        ("NoExecute", "NoExecute"),
        ("PreferNoSchedule", "None"),
        ("Other", "NoSchedule"),
    ],
)
def test_the_device_taint_effect_follows_the_node_setting_and_a_soft_one_is_informational(
    node_effect: str, device_effect: str
) -> None:
    assert device_effect_of(node_effect) == device_effect


# -- exact boundaries ----------------------------------------------------------------------------------------


def test_a_rule_name_of_exactly_253_characters_is_made_and_a_longer_one_is_not() -> None:
    prefix = len("gpuguard..gpu-3")
    exact = rule_name("n" * (253 - prefix), "gpu-3")
    assert exact == f"gpuguard.{'n' * (253 - prefix)}.gpu-3" and len(exact) == 253
    assert rule_name("n" * (254 - prefix), "gpu-3") is None
    assert rule_name("node-a", "gpu.3") is None  # not a DNS label: the last dot would not split it back


@pytest.mark.parametrize(
    ("raw", "share"),
    [
        ("1", Fraction(1)),
        ("1024", Fraction(1, 1024)),  # the most GPUs a node may record
        ("1025", Fraction(1)),
        ("0008", Fraction(1, 8)),  # four digits
        ("00008", Fraction(1)),  # five
        ("-8", Fraction(1)),
        ("٨", Fraction(1)),  # a digit, but not ASCII
    ],
)
def test_a_rules_gpu_count_is_at_most_1024_in_at_most_4_ascii_digits(raw: str, share: Fraction) -> None:
    assert (
        DeviceRule(
            name="r", pool="p", device="d", effect="NoSchedule", annotations={ANN_NODE_GPUS: raw}
        ).share
        == share
    )


def _since_rule(since: str, created: str = "") -> DeviceRule:
    return DeviceRule(
        name="r",
        pool="p",
        device="d",
        effect="NoSchedule",
        created=created,
        annotations={"gpuguard.io/since": since},
    )


@pytest.mark.parametrize(
    ("since", "created", "valid"),
    [
        ("2026-12-03T01:05:00Z", "", True),  # exactly the 5 minutes' skew ahead of now
        ("2026-12-03T01:05:01Z", "", False),
        ("2026-12-03T00:00:00Z", "2026-12-03T00:05:00Z", True),  # created exactly 5 minutes after since
        ("2026-12-03T00:00:00Z", "2026-12-03T00:05:01Z", False),
        ("2026-12-03T00:05:00Z", "2026-12-03T00:00:00Z", True),  # since exactly 5 minutes after creation
        ("2026-12-03T00:05:01Z", "2026-12-03T00:00:00Z", False),
        ("2026-12-03T00:00:00Z", "not a time", True),  # an unreadable creation time proves nothing
    ],
)
def test_a_rules_since_ranks_within_five_minutes_of_now_and_of_its_creation(
    since: str, created: str, valid: bool
) -> None:
    assert rule_since(_since_rule(since, created), now=NOW) == (since if valid else None)
    assert rule_since(DeviceRule(name="r", pool="p", device="d", effect="NoSchedule"), now=NOW) is None


def test_the_order_skips_deferred_and_informational_rules_and_rules_of_fully_quarantined_nodes() -> None:
    def rule(pool: str, **kw: object) -> DeviceRule:
        base: dict[str, object] = {
            "annotations": {ANN_NODE_GPUS: "1", "gpuguard.io/since": "2026-12-03T00:00:00Z"}
        }
        return own_rule(pool, "gpu-0", **{**base, **kw})

    later = rule("b-later", annotations={ANN_NODE_GPUS: "1", "gpuguard.io/since": "2026-12-03T00:00:09Z"})
    rules = [
        rule("a-deferred", annotations={ANN_NODE_GPUS: "1", "gpuguard.io/quarantine-deferred": "x"}),
        rule("a-none", effect="None"),
        rule("full-node"),
        later,
    ]
    assert rules_past_limit([("2026-12-03T00:00:05Z", "full-node")], rules, 1, now=NOW) == {
        later.name: Fraction(1)
    }
    assert rules_past_limit([], [*rules[:2], later], 1, now=NOW) == {}
    # Exactly at the limit fits; the rule that would go over it is named with what precedes it.
    assert rules_past_limit([], [rule("a"), later], 2, now=NOW) == {}
    assert rules_past_limit([], [rule("a"), later], 1, now=NOW) == {later.name: Fraction(1)}
    # The same since: the name decides.
    assert rules_past_limit([], [rule("z"), rule("y")], 1, now=NOW) == {rule("z").name: Fraction(1)}


def test_the_budget_share_of_rules_leaves_out_deferred_ones_and_those_of_covered_nodes() -> None:
    rules = [
        own_rule("n1", "d", annotations={ANN_NODE_GPUS: "4"}),
        own_rule("n2", "d", annotations={ANN_NODE_GPUS: "2"}),
        own_rule("n3", "d", effect="None", annotations={"gpuguard.io/quarantine-deferred": "x"}),
    ]
    assert rules_share(rules) == Fraction(3, 4)
    assert rules_share(rules, covered=["n2"]) == Fraction(1, 4)
    assert rules_share([]) == 0


# -- every recovery action as a taint value ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "value"),
    [
        (1, "recovery-gpu-reset"),
        (2, "recovery-node-reboot"),
        (3, "recovery-drain-p2p"),
        (4, "recovery-drain-and-reset"),
        (5, "recovery-recover-imex-domain"),
        (6, "recovery-bus-reset"),
        (7, "recovery-system-reboot"),
        (9, "recovery-9"),
    ],
)
def test_every_recovery_action_is_its_own_taint_value_on_the_gpus_rule_or_the_node(
    action: int, value: str
) -> None:
    v = evaluate(
        Snapshot(gpus=(reading(0, recovery_action=action), reading(1))),
        previous=None,
        settings=PolicySettings(),
    )
    (fault,) = v.faults
    assert fault.reason == value and recovery_reason(action) == value
    # A reset of the GPU is one GPU's fault (its rule); every other action is beyond the GPU (the node taint).
    assert per_gpu(fault) is (action in (1, 4))


def test_a_rule_left_to_its_defaults_has_no_record_and_proves_no_reboot() -> None:
    rule = DeviceRule(name="r", pool="p", device="d", effect="NoSchedule")
    assert (rule.taint_value, rule.uid, rule.resource_version, rule.created, rule.reason, rule.driver) == (
        "",
        "",
        "",
        "",
        "",
        "",
    )
    assert (rule.key, rule.labels, rule.annotations) == (TAINT_KEY, {}, {})
    assert not rule.from_earlier_boot("boot-2") and rule.share == 1 and not rule.deferred


def test_a_gpus_uuid_on_its_rule_is_at_most_128_bytes() -> None:
    n = NodeView(name=NODE, boot_id="b")
    dev = SliceDevice(driver=DRIVER, pool=NODE, device="gpu-0", uuid="U" * 200)
    body = rule_body(n, dev, (), node_gpus=1, effect="NoSchedule", since="s")
    assert body["metadata"]["annotations"]["gpuguard.io/uuid"] == "U" * 125 + "..."


def test_with_quarantine_node_every_fault_stays_with_the_node() -> None:
    sick = verdict(ecc_on=0)
    devices = slice_devices([nvidia_slice(NODE)], driver=DRIVER, node=NODE)
    assert split(sick, devices, mode="node", held=frozenset()) == Split(node_verdict=sick, by_gpu={})
    moved = split(sick, devices, mode="auto", held=frozenset())
    assert set(moved.by_gpu) == {UUIDS[0]} and moved.node_verdict.healthy
    held = split(sick, devices, mode="auto", held=frozenset({UUIDS[0]}))
    assert held.by_gpu == {} and held.node_verdict == sick


def test_a_rule_kept_for_the_budget_holds_only_what_the_budget_reads_each_value_cut_to_256() -> None:
    doc = {
        "apiVersion": "resource.k8s.io/v1",
        "metadata": {
            "name": "gpuguard.n.gpu-0",
            "uid": "u",
            "resourceVersion": "7",
            "creationTimestamp": "2026-12-03T00:00:00Z",
            "generation": 3,
            "labels": {"gpuguard.io/node": "n", "app.kubernetes.io/managed-by": "gpuguard", "x": "y"},
            "annotations": {ANN_NODE_GPUS: "8", "gpuguard.io/since": "s" * 300, "gpuguard.io/reason": "r"},
        },
        "spec": {
            "deviceSelector": {"driver": DRIVER, "pool": "n", "device": "gpu-0", "extra": "e"},
            "taint": {"key": TAINT_KEY, "value": "ecc", "effect": "NoSchedule", "timeAdded": "t"},
        },
    }
    assert trim_rule(doc) == {
        "metadata": {
            "name": "gpuguard.n.gpu-0",
            "uid": "u",
            "resourceVersion": "7",
            "creationTimestamp": "2026-12-03T00:00:00Z",
            "labels": {"gpuguard.io/node": "n", "app.kubernetes.io/managed-by": "gpuguard"},
            "annotations": {ANN_NODE_GPUS: "8", "gpuguard.io/since": "s" * 256},
        },
        "spec": {
            "deviceSelector": {"driver": DRIVER, "pool": "n", "device": "gpu-0"},
            "taint": {"key": TAINT_KEY, "value": "ecc", "effect": "NoSchedule"},
        },
    }
    empty: dict[str, dict[str, dict[str, str]]] = {
        "metadata": {"labels": {}, "annotations": {}},
        "spec": {"deviceSelector": {}, "taint": {}},
    }
    assert trim_rule({}) == empty and trim_rule({"metadata": None, "spec": None}) == empty


def test_a_rule_selects_a_device_only_as_its_nodes_own_rule_for_that_driver_and_device() -> None:
    dev = SliceDevice(driver=DRIVER, pool=NODE, device="gpu-0", uuid="GPU-x")
    assert own_rule(NODE, "gpu-0").selects(dev)
    assert not own_rule(NODE, "gpu-0", driver="example.com").selects(dev)
    assert not own_rule(NODE, "gpu-1").selects(dev)
    assert not own_rule("other", "gpu-0").selects(dev)
    earlier = own_rule(NODE, "gpu-0", name=f"gpuguard-{NODE}-gpu-0")
    assert earlier.own(NODE) and not own_rule(NODE, "gpu-0", name="gpuguard-other-gpu-0").own(NODE)
    assert not own_rule(NODE, "gpu-0", labels={"gpuguard.io/node": NODE}).own(NODE)


def test_a_node_counts_at_most_one_nodes_worth_in_the_order_however_many_rules_it_claims() -> None:
    def claim(pool: str, device: str, since: str) -> DeviceRule:
        return own_rule(pool, device, annotations={ANN_NODE_GPUS: "1", "gpuguard.io/since": since})

    greedy = [claim("greedy", f"gpu-{i}", f"2026-12-03T00:00:0{i}Z") for i in range(3)]
    honest = claim("honest", "gpu-0", "2026-12-03T00:00:05Z")
    # greedy's three whole-node claims count one node; honest's rule fits a limit of 2.
    assert rules_past_limit([], [*greedy, honest], 2, now=NOW) == {}
    assert rules_past_limit([], [*greedy, honest], 1, now=NOW) == {honest.name: Fraction(1)}
    assert rules_share([*greedy, honest]) == 2


def test_a_rule_of_a_fully_quarantined_node_is_skipped_and_the_rules_after_it_still_take_their_place() -> (
    None
):
    def rule(pool: str, since: str) -> DeviceRule:
        return own_rule(pool, "gpu-0", annotations={ANN_NODE_GPUS: "1", "gpuguard.io/since": since})

    covered, after = rule("a-full", "2026-12-03T00:00:00Z"), rule("b", "2026-12-03T00:00:09Z")
    nodes = [("2026-12-03T00:00:05Z", "a-full")]
    assert rules_past_limit(nodes, [covered, after], 1, now=NOW) == {after.name: Fraction(1)}
    assert rules_past_limit(nodes, [covered, after], 2, now=NOW) == {}
    # Two fully quarantined nodes count a whole node each, and neither is ever named.
    two = [*nodes, ("2026-12-03T00:00:06Z", "c-full")]
    assert rules_past_limit(two, [after], 2, now=NOW) == {after.name: Fraction(2)}
    assert rules_past_limit(two, [], 1, now=NOW) == {}
