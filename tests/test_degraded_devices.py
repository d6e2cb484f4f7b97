"""The degraded level on a DRA node: a degraded GPU published in a ResourceSlice gets an effect-None
DeviceTaintRule of its own (gpuguard-degraded.<node>.<device>), deleted once clean for the recovery window;
it is never counted by the GPU budget, and a rule gpuguard cannot prove its own is left alone."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest
from structlog.testing import capture_logs

from gpuguard.core.config import NodeSettings
from gpuguard.core.errors import PermanentApiError
from gpuguard.core.model import Fault, GpuVerdict, Verdict
from gpuguard.core.validation import clean_text
from gpuguard.quarantine.gpu.degraded import (
    degraded_rule_body,
    degraded_rule_name,
    degraded_update,
    is_degraded_rule,
    own_degraded,
    plan_rules,
)
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
    assert doc["spec"]["taint"] == {"key": DEGRADED_TAINT_KEY, "effect": "None"}
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
    assert "value" not in doc["spec"]["taint"]
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


def test_a_degraded_rule_name_may_be_253_characters_and_not_254() -> None:
    # "gpuguard-degraded." (18) + node + "." + "gpu-2" (5): a node name of 229 makes 253.
    assert degraded_rule_name("n" * 229, "gpu-2") == f"gpuguard-degraded.{'n' * 229}.gpu-2"
    assert degraded_rule_name("n" * 230, "gpu-2") is None


@pytest.mark.parametrize(
    ("name", "key", "degraded"),
    [
        (NAME, DEGRADED_TAINT_KEY, True),
        (NAME, TAINT_KEY, True),  # the degraded name alone
        (f"gpuguard.{NODE}.gpu-2", DEGRADED_TAINT_KEY, True),  # the degraded key alone
        (f"gpuguard.{NODE}.gpu-2", TAINT_KEY, False),
    ],
)
def test_a_rule_under_the_degraded_name_or_key_is_a_degraded_rule(
    name: str, key: str, degraded: bool
) -> None:
    rule = DeviceRule(name=name, pool=NODE, device="gpu-2", effect="None", driver=DRIVER, key=key)
    assert is_degraded_rule(rule) is degraded


def test_the_degraded_rule_records_the_uuid_cut_to_128_bytes_and_at_least_one_gpu_for_the_node() -> None:
    node = NodeView(name=NODE, resource_version="1", boot_id="boot-1")
    dev = SliceDevice(driver=DRIVER, pool=NODE, device="gpu-2", uuid="GPU-" + "a" * 130)
    body = degraded_rule_body(node, dev, (nvlink(2),), node_gpus=0, since="2026-12-05T00:00:00Z")
    annotations = body["metadata"]["annotations"]
    assert annotations["gpuguard.io/uuid"] == clean_text(dev.uuid, max_bytes=128)
    assert len(annotations["gpuguard.io/uuid"].encode()) == 128
    assert annotations["gpuguard.io/node-gpus"] == "1"
    eight = degraded_rule_body(node, replace(dev, uuid=UUIDS[2]), (nvlink(2),), node_gpus=8, since="x")
    assert eight["metadata"]["annotations"]["gpuguard.io/node-gpus"] == "8"
    assert eight["metadata"]["annotations"]["gpuguard.io/uuid"] == UUIDS[2]


def test_an_update_patches_the_held_rules_record_and_taint_only_when_its_signals_changed() -> None:
    rule = DeviceRule(
        name=NAME,
        pool=NODE,
        device="gpu-2",
        effect="None",
        driver=DRIVER,
        key=DEGRADED_TAINT_KEY,
        annotations={"gpuguard.io/faults": f"nvlink-down/{UUIDS[2]}"},
        resource_version="7",
    )
    assert degraded_update(rule, (nvlink(2),)) is None
    pcie = Fault("clock-power-brake", "12 of 20", uuid=UUIDS[2], gpu_index=2)
    patch = degraded_update(rule, (nvlink(2), pcie))
    assert patch is not None
    assert patch["metadata"]["resourceVersion"] == "7"
    assert patch["metadata"]["annotations"]["gpuguard.io/faults"] == (
        f"clock-power-brake/{UUIDS[2]},nvlink-down/{UUIDS[2]}"
    )
    assert patch["spec"] == {"taint": {"key": DEGRADED_TAINT_KEY, "effect": "None"}}


def test_the_plan_hands_the_node_every_gpu_and_keeps_a_rule_whose_gpu_has_no_streak_yet() -> None:
    dev = SliceDevice(driver=DRIVER, pool=NODE, device="gpu-2", uuid=UUIDS[2])
    rule = DeviceRule(
        name=NAME, pool=NODE, device="gpu-2", effect="None", driver=DRIVER, key=DEGRADED_TAINT_KEY
    )
    plan = plan_rules(verdict(nvlink(2)), {UUIDS[2]: dev}, {}, held=frozenset(), streaks={}, recover_after=1)
    assert [g.uuid for g in plan.node_verdict.gpus] == UUIDS  # GPU 2 too, its signals with its rule
    assert plan.node_verdict.gpus[2].degraded == () and plan.node_verdict.gpus[2].faults == ()
    kept = plan_rules(
        verdict(), {UUIDS[2]: dev}, {UUIDS[2]: rule}, held=frozenset(), streaks={}, recover_after=1
    )
    assert kept.delete == ()  # no streak seen since the start: never enough
    gone = plan_rules(
        verdict(), {UUIDS[2]: dev}, {UUIDS[2]: rule}, held=frozenset(), streaks={UUIDS[2]: 1}, recover_after=1
    )
    assert gone.delete == (rule,)
