"""The AcceleratedHardwareReady mirror (node/accelerated.py) read the way Karpenter's AWS repair policy reads
it: a condition of that type with status False whose lastTransitionTime is 10 minutes old gets the node
replaced (karpenter-provider-aws `DefaultRepairPolicies`: {AcceleratedHardwareReady, False, 10m}), and
EKS node auto-repair's overrides key on its reason (`NvidiaXID79Error`)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gpuguard.core import validation
from gpuguard.core.config import PolicySettings
from gpuguard.core.model import GpuReading, Snapshot, Verdict, XidEvent
from gpuguard.judge.policy import evaluate
from gpuguard.quarantine.node.accelerated import (
    READY_REASON,
    condition_reason,
    owned_by_another,
    plan_accelerated_condition,
)

NOW = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)
# karpenter-provider-aws, pkg/cloudprovider: the one policy for this type.
KARPENTER_POLICY = ("AcceleratedHardwareReady", "False", timedelta(minutes=10))
EKS_READY = {
    "status": "True",
    "reason": "NvidiaAcceleratedHardwareIsReady",
    "message": "Monitoring for the Nvidia AcceleratedHardware system is active",
    "lastTransitionTime": "2026-12-01T00:00:00Z",
}


def verdict(*, ecc: int = 0, xid: int | None = None) -> Verdict:
    gpus = (GpuReading(index=0, uuid="GPU-0", ecc_uncorrected=ecc), GpuReading(index=1, uuid="GPU-1"))
    xids = (XidEvent(1, "GPU-1", xid),) if xid is not None else ()
    return evaluate(Snapshot(gpus=gpus, xids=xids), previous=None, settings=PolicySettings())


def karpenter_repairs(conditions: list[dict[str, str]], now: datetime) -> bool:
    """Karpenter's node health check over one policy: the condition's type and status match and it has
    held for the toleration since its lastTransitionTime."""
    kind, status, toleration = KARPENTER_POLICY
    for c in conditions:
        if c["type"] == kind and c["status"] == status:
            since = datetime.strptime(c["lastTransitionTime"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
            return now - since >= toleration
    return False


def test_a_quarantined_node_is_false_with_the_eks_reason_and_karpenter_replaces_it_after_10_minutes() -> None:
    c = plan_accelerated_condition(None, verdict(xid=79), quarantined=True, now=NOW)
    assert c is not None
    assert validation.check_condition(c) is c
    assert (c["type"], c["status"], c["reason"]) == ("AcceleratedHardwareReady", "False", "NvidiaXID79Error")
    assert c["message"].startswith("gpuguard: xid-79")
    assert not karpenter_repairs([c], NOW + timedelta(minutes=9))
    assert karpenter_repairs([c], NOW + timedelta(minutes=10))


def test_a_fault_that_is_not_a_node_quarantine_asks_no_repair() -> None:
    """The budget spent (a deferred quarantine), a GPU a DeviceTaintRule holds out, a taint an operator
    removed: the node is not gpuguard's quarantine, so it is not handed to repair either."""
    c = plan_accelerated_condition(None, verdict(ecc=2), quarantined=False, now=NOW)
    assert c is not None and (c["status"], c["reason"]) == ("True", READY_REASON)
    assert "no repair asked" in c["message"]
    assert not karpenter_repairs([c], NOW + timedelta(hours=1))


def test_a_healthy_node_is_true_and_a_restarted_agent_writes_nothing_new() -> None:
    c = plan_accelerated_condition(None, verdict(), quarantined=False, now=NOW)
    assert c is not None and (c["status"], c["reason"], c["message"]) == (
        "True",
        READY_REASON,
        "gpuguard: 2 GPUs healthy",
    )
    assert plan_accelerated_condition(c, verdict(), quarantined=False, now=NOW + timedelta(hours=1)) is None


def test_a_healthy_nodes_reason_is_the_eks_agents_own_word_for_a_ready_node() -> None:
    """A repair policy keyed on the reason reads the same word from gpuguard as from the EKS agent."""
    c = plan_accelerated_condition(None, verdict(), quarantined=False, now=NOW)
    assert c is not None and c["reason"] == EKS_READY["reason"] == "NvidiaAcceleratedHardwareIsReady"


def test_a_new_fault_changes_the_reason_but_keeps_the_transition_time_karpenter_counts_from() -> None:
    first = plan_accelerated_condition(None, verdict(ecc=2), quarantined=True, now=NOW)
    assert first is not None and first["reason"] == "NvidiaDoubleBitError"
    later = NOW + timedelta(minutes=6)
    second = plan_accelerated_condition(first, verdict(ecc=2, xid=79), quarantined=True, now=later)
    assert second is not None and second["message"] != first["message"]
    assert second["lastTransitionTime"] == first["lastTransitionTime"]
    assert karpenter_repairs([second], NOW + timedelta(minutes=10))


def test_a_condition_another_writer_owns_is_left_alone_whatever_gpuguard_sees() -> None:
    eks_fault = {**EKS_READY, "status": "False", "reason": "NvidiaXID79Error"}
    eks_fault["message"] = "detected XID-79 on the instance, review kernel logs for additional information."
    for theirs in (EKS_READY, eks_fault):
        assert owned_by_another(theirs)
        for v in (verdict(), verdict(xid=79)):
            assert plan_accelerated_condition(theirs, v, quarantined=True, now=NOW) is None
    assert not owned_by_another(None)


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("xid-79", "NvidiaXID79Error"),
        ("xid-48", "NvidiaXID48Error"),
        ("xid-8", "NvidiaXID8Error"),
        ("xid-154", "NvidiaXID154Error"),
        ("ecc", "NvidiaDoubleBitError"),
        ("gpu-missing", "NvidiaDeviceCountMismatch"),
        ("gpu-lost", "NvidiaDeviceLost"),
        ("row-remap", "NvidiaRemappingRowsFailed"),
        ("fabric-incomplete", "NvidiaFabricError"),
        ("nvlink-down", "NvidiaNVLinkError"),
        ("nvml-init", "NvidiaNVMLError"),
        ("repeat-offender", "NvidiaRepeatOffender"),
        ("recovery-node-reboot", "NvidiaRecoveryNodeReboot"),
        ("pcie-width", "NvidiaPcieWidth"),
        ("retired-pages", "NvidiaPageRetirement"),
        ("reset-required", "NvidiaResetRequired"),
        ("nvml-unresponsive", "NvidiaNVMLUnresponsive"),
        ("gpu-unresponsive", "NvidiaGPUUnresponsive"),
        ("gpu-unreadable", "NvidiaGPUUnreadable"),
        ("fabric-status", "NvidiaFabricError"),
        ("fabric-degraded", "NvidiaFabricError"),
        ("nvlink-errors", "NvidiaNVLinkError"),
        ("sxid-12", "NvidiaSxid12"),
        ("xid-", "NvidiaXid"),
        ("clock_hw-slowdown", "NvidiaSlowdown"),
    ],
)
def test_each_fault_has_a_stable_reason_in_the_eks_agents_style(fault: str, reason: str) -> None:
    assert condition_reason(fault) == reason
    validation.check_condition({"type": "AcceleratedHardwareReady", "status": "False", "reason": reason})
