"""Issue 29's second level on a DRA node: a degraded GPU published in a ResourceSlice gets an effect-None
DeviceTaintRule of its own (gpuguard-degraded.<node>.<device>), deleted once clean for the recovery window;
it is never counted by the GPU budget, and a rule gpuguard cannot prove its own is left alone."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

from structlog.testing import capture_logs

from gpuguard.core.config import NodeSettings
from gpuguard.core.errors import PermanentApiError
from gpuguard.core.model import Fault, GpuVerdict, Verdict
from gpuguard.quarantine.gpu.degraded import degraded_rule_name, own_degraded, plan_rules
from gpuguard.quarantine.gpu.order import rules_share
from gpuguard.quarantine.gpu.quarantine import DeviceQuarantine
from gpuguard.quarantine.gpu.rules import DeviceRule
from gpuguard.quarantine.gpu.slices import SliceDevice
from gpuguard.quarantine.gpu.trust import countable
from gpuguard.quarantine.node.degraded import LABEL_DEGRADED
from gpuguard.quarantine.node.view import NodeView
from gpuguard.quarantine.reconciler import NodeReconciler
from gpuguard.quarantine.record import DEGRADED_TAINT_KEY, TAINT_KEY
from harness.clock import Clock
from harness.dra import DRIVER, gpu_uuid, nvidia_slice
from harness.fakes import FakeDeviceSource, FakeNodeWriter
from harness.judging import hand_over

NODE = "gpu-node-1"
SETTINGS = NodeSettings(name=NODE, retry_max_wait=0.01, recover_after=2)
UUIDS = [gpu_uuid(NODE, i) for i in range(8)]
NAME = f"gpuguard-degraded.{NODE}.gpu-2"


def nvlink(i: int) -> Fault:
    return Fault("nvlink-down", f"link {i} inactive", uuid=UUIDS[i], gpu_index=i)


def verdict(*degraded: Fault, ecc_on: int | None = None, node: tuple[Fault, ...] = ()) -> Verdict:
    return Verdict(
        gpus=tuple(
            GpuVerdict(
                index=i,
                uuid=UUIDS[i],
                degraded=tuple(f for f in degraded if f.gpu_index == i),
                faults=(Fault("ecc", "3 uncorrected", uuid=UUIDS[i], gpu_index=i),) if i == ecc_on else (),
            )
            for i in range(8)
        ),
        node_degraded=node,
    )


def make(source: FakeDeviceSource | None = None) -> tuple[FakeNodeWriter, FakeDeviceSource, NodeReconciler]:
    writer = FakeNodeWriter(NodeView(name=NODE, resource_version="1", boot_id="boot-1"))
    source = source or FakeDeviceSource([nvidia_slice(NODE)])
    devices = DeviceQuarantine(source, SETTINGS, now=lambda: datetime(2026, 12, 5, tzinfo=UTC), clock=Clock())
    return writer, source, NodeReconciler(writer, SETTINGS, devices=devices)


def run(r: NodeReconciler, v: Verdict) -> None:
    hand_over(r, v, 0 if v.faults else 1)
    r.reconcile_now()


def test_a_degraded_gpu_gets_an_effect_none_rule_for_its_device_and_the_node_no_taint() -> None:
    writer, source, r = make()
    run(r, verdict(nvlink(2)))
    (doc,) = source.store.values()
    assert doc["metadata"]["name"] == NAME
    assert doc["metadata"]["labels"] == {"gpuguard.io/node": NODE, "app.kubernetes.io/managed-by": "gpuguard"}
    assert doc["spec"]["deviceSelector"] == {"driver": DRIVER, "pool": NODE, "device": "gpu-2"}
    assert doc["spec"]["taint"] == {"key": DEGRADED_TAINT_KEY, "value": "nvlink-down", "effect": "None"}
    assert doc["metadata"]["annotations"]["gpuguard.io/faults"] == f"nvlink-down/{UUIDS[2]}"
    # The rule shows it: no node taint for it; the condition still names it.
    assert writer.node.taints == () and LABEL_DEGRADED not in writer.node.labels
    assert writer.node.degraded_condition == "True"


def test_the_rule_is_deleted_once_its_gpu_has_been_clean_for_the_window_and_not_before() -> None:
    _, source, r = make()
    run(r, verdict(nvlink(2), nvlink(5)))
    assert len(source.store) == 2
    run(r, verdict(nvlink(5)))  # GPU 2 clean for 1 check (window: 2)
    assert NAME in source.store
    run(r, verdict(nvlink(5)))
    assert set(source.store) == {f"gpuguard-degraded.{NODE}.gpu-5"}  # GPU 5 still degraded: kept


def test_new_signals_update_the_rule_in_place() -> None:
    _, source, r = make()
    run(r, verdict(nvlink(2)))
    pcie = Fault("clock-power-brake", "12 of 20", uuid=UUIDS[2], gpu_index=2)
    run(r, verdict(nvlink(2), pcie))
    doc = source.store[NAME]
    assert doc["spec"]["taint"]["value"] == "clock-power-brake"
    assert doc["metadata"]["annotations"]["gpuguard.io/faults"].split(",") == [
        f"clock-power-brake/{UUIDS[2]}",
        f"nvlink-down/{UUIDS[2]}",
    ]


def test_a_gpu_both_faulty_and_degraded_gets_both_rules_and_the_budget_counts_only_the_fault() -> None:
    _, source, r = make()
    run(r, verdict(nvlink(2), ecc_on=2))
    assert set(source.store) == {NAME, f"gpuguard.{NODE}.gpu-2"}
    rules = source.all_rules()
    assert [x.key for x in countable(rules)] == [TAINT_KEY]
    assert rules_share(rules) == rules_share([x for x in rules if x.key == TAINT_KEY])


def test_the_fault_quarantine_never_takes_a_degraded_rule_for_one_of_its_own() -> None:
    _, source, r = make()
    run(r, verdict(nvlink(2)))
    with capture_logs() as logs:
        r2 = make(source)[2]  # a restarted agent reads the node's rules
        run(r2, verdict(nvlink(2)))
    assert not [e for e in logs if e["event"] == "device.rule_untrusted"]
    assert (
        len(source.store) == 1 and source.calls.count("create") == 1
    )  # adopted from the list, not made again


def test_a_rule_under_the_degraded_name_that_is_not_provably_ours_is_left_alone() -> None:
    _, source, r = make()
    run(r, verdict(nvlink(2)))
    doc = source.store[NAME]
    doc["spec"]["taint"]["effect"] = "NoExecute"  # someone made it hard
    with capture_logs() as logs:
        r2 = make(source)[2]
        run(r2, verdict())
        run(r2, verdict())
        run(r2, verdict())
    assert NAME in source.store  # never deleted
    assert [e["rule"] for e in logs if e["event"] == "device.degraded_rule_untrusted"] == [NAME]


def test_a_refused_rule_leaves_the_signal_with_the_node_marks() -> None:
    writer, source, r = make()
    source.inject_error(PermanentApiError("forbidden", status=403))
    run(r, verdict(nvlink(2)))
    assert source.store == {}
    assert writer.node.labels.get(LABEL_DEGRADED) == "true"
    assert any(t.key == DEGRADED_TAINT_KEY for t in writer.node.taints)


def test_a_node_wide_degraded_signal_stays_with_the_node_on_a_dra_node() -> None:
    writer, source, r = make()
    run(r, verdict(node=(Fault("fabric-degraded", "bandwidth"),)))
    assert source.store == {}
    assert any(t.key == DEGRADED_TAINT_KEY for t in writer.node.taints)


def test_with_quarantine_node_degraded_gpus_get_the_node_marks() -> None:
    writer = FakeNodeWriter(NodeView(name=NODE, resource_version="1", boot_id="boot-1"))
    source = FakeDeviceSource([nvidia_slice(NODE)])
    settings = replace(SETTINGS, quarantine="node")
    r = NodeReconciler(writer, settings, devices=DeviceQuarantine(source, settings, clock=Clock()))
    run(r, verdict(nvlink(2)))
    assert source.store == {} and writer.node.labels.get(LABEL_DEGRADED) == "true"


def test_the_plan_keeps_unpublished_gpus_for_the_node_and_names_are_exact() -> None:
    dev = SliceDevice(driver=DRIVER, pool=NODE, device="gpu-2", uuid=UUIDS[2])
    plan = plan_rules(
        verdict(nvlink(2), nvlink(3)),
        {UUIDS[2]: dev},
        {},
        held=frozenset(),
        streaks={},
        recover_after=2,
    )
    assert set(plan.create) == {UUIDS[2]}
    assert [g.index for g in plan.node_verdict.gpus if g.degraded] == [3]
    assert degraded_rule_name(NODE, "gpu_2") is None  # no DNS label
    assert degraded_rule_name("n" * 250, "gpu-2") is None
    forged = DeviceRule(
        name=NAME,
        pool="other-node",
        device="gpu-2",
        effect="None",
        driver=DRIVER,
        key=DEGRADED_TAINT_KEY,
        labels={"gpuguard.io/node": NODE, "app.kubernetes.io/managed-by": "gpuguard"},
    )
    assert not own_degraded(forged, NODE)
    assert own_degraded(replace(forged, pool=NODE), NODE)


def test_a_node_with_only_degraded_rules_costs_no_periodic_read() -> None:
    writer = FakeNodeWriter(NodeView(name=NODE, resource_version="1", boot_id="boot-1"))
    source = FakeDeviceSource([nvidia_slice(NODE)])
    clock = Clock()
    devices = DeviceQuarantine(source, SETTINGS, clock=clock)
    r = NodeReconciler(writer, SETTINGS, devices=devices, clock=clock)
    run(r, verdict(nvlink(2)))
    reads = (writer.reads, source.calls.count("rules"), source.calls.count("slices"))
    for _ in range(5):
        clock.t += SETTINGS.node_resync + 1
        run(r, verdict(nvlink(2)))
    assert (writer.reads, source.calls.count("rules"), source.calls.count("slices")) == reads


def test_a_degraded_rule_deleted_by_someone_is_made_again_while_its_gpu_is_degraded() -> None:
    _, source, r = make()
    run(r, verdict(nvlink(2)))
    source.operator_delete(NAME)
    source.inject_error(PermanentApiError("not found", status=404))  # the update's patch meets it gone
    pcie = Fault("pcie-width", "x8 of x16", uuid=UUIDS[2], gpu_index=2)
    run(r, verdict(nvlink(2), pcie))
    assert NAME not in source.store
    run(r, verdict(nvlink(2), pcie))
    assert source.store[NAME]["metadata"]["annotations"]["gpuguard.io/faults"].count("/") == 2
