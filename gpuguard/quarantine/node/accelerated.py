"""The AcceleratedHardwareReady mirror (--accelerated-hardware-condition, off by default): the node condition
that EKS node auto-repair and Karpenter's AWS repair policy act on (False for 10 minutes: the node is
replaced), written in the EKS node monitoring agent's words. Pure.

- False only while gpuguard's quarantine of the node is in force (its taint and the budget's label "true"):
  the quarantine budget bounds what is handed to repair, a GPU that a DeviceTaintRule holds out leaves the
  node serving, and a taint an operator removed is a decision to keep the node. Otherwise True.
- The reason is stable, the agent's own where it names the same fault (`NvidiaXID79Error`,
  `NvidiaDoubleBitError`, `NvidiaDeviceCountMismatch`, `NvidiaNVLinkError`, `NvidiaFabricError`), else one
  in its style (`REASONS`); the table is docs/operations.md's "AcceleratedHardwareReady".
- Never two writers: the message of gpuguard's condition starts with `MESSAGE_PREFIX`. A condition of the
  type without it is another writer's (the EKS agent's "Monitoring for the Nvidia AcceleratedHardware system
  is active", its "detected XID-79 on the instance ..."): gpuguard then writes none.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from gpuguard.core import model
from gpuguard.core.model import Verdict, plural
from gpuguard.judge.policy import primary
from gpuguard.quarantine.node.view import ACCELERATED_CONDITION_TYPE
from gpuguard.quarantine.record import reason_text, rfc3339

# The EKS agent's reason for a healthy NVIDIA node: a repair policy keyed on reasons reads the same word.
READY_REASON = "NvidiaAcceleratedHardwareIsReady"
MESSAGE_PREFIX = "gpuguard: "
# gpuguard's fault reasons -> the condition's reason. Xids are `NvidiaXID<code>Error` (the agent's own).
REASONS = {
    model.ECC: "NvidiaDoubleBitError",
    model.GPU_MISSING: "NvidiaDeviceCountMismatch",
    model.GPU_LOST: "NvidiaDeviceLost",
    model.ROW_REMAP: "NvidiaRemappingRowsFailed",
    model.RETIRED_PAGES: "NvidiaPageRetirement",
    model.RESET_REQUIRED: "NvidiaResetRequired",
    model.NVML_INIT: "NvidiaNVMLError",
    model.NVML_UNRESPONSIVE: "NvidiaNVMLUnresponsive",
    model.GPU_UNRESPONSIVE: "NvidiaGPUUnresponsive",
    model.GPU_UNREADABLE: "NvidiaGPUUnreadable",
    model.REPEAT_OFFENDER: "NvidiaRepeatOffender",
    "fabric-incomplete": "NvidiaFabricError",
    "fabric-status": "NvidiaFabricError",
    "fabric-degraded": "NvidiaFabricError",
    "nvlink-down": "NvidiaNVLinkError",
    "nvlink-errors": "NvidiaNVLinkError",
}


def condition_reason(fault_reason: str) -> str:
    """The stable reason for one of gpuguard's fault reasons: the table, `xid-79` -> `NvidiaXID79Error`,
    `recovery-gpu-reset` -> `NvidiaRecoveryGpuReset`, any other signal `pcie-width` -> `NvidiaPcieWidth`."""
    if fault_reason in REASONS:
        return REASONS[fault_reason]
    if fault_reason.startswith("xid-") and fault_reason[4:].isdigit():
        return f"NvidiaXID{int(fault_reason[4:])}Error"
    words = fault_reason.removeprefix(model.RECOVERY_PREFIX)
    prefix = "NvidiaRecovery" if words != fault_reason else "Nvidia"
    return prefix + "".join(w[:1].upper() + w[1:] for w in words.split("-") if w.isalnum())


def owned_by_another(current: Mapping[str, str] | None) -> bool:
    """The node's AcceleratedHardwareReady was written by someone else (the EKS agent): leave it alone."""
    return current is not None and not str(current.get("message", "")).startswith(MESSAGE_PREFIX)


def plan_accelerated_condition(
    current: Mapping[str, str] | None,
    verdict: Verdict,
    *,
    quarantined: bool,
    now: datetime,
) -> dict[str, str] | None:
    """The condition to write, or None: another writer owns it, or it already says this (status, reason
    and message as read from the node, so a restarted agent writes nothing new). `quarantined`: gpuguard's
    node quarantine is in force (NodeView.fully_quarantined)."""
    if owned_by_another(current):
        return None
    first = primary(verdict.faults)
    if first is not None and quarantined:
        status, reason = "False", condition_reason(first.reason)
        message = f"{MESSAGE_PREFIX}{reason_text(verdict.faults)}"
    elif first is not None:
        status, reason = "True", READY_REASON
        faults = reason_text(verdict.faults)
        message = f"{MESSAGE_PREFIX}GPU faults, node not quarantined (no repair asked): {faults}"
    else:
        status, reason = "True", READY_REASON
        message = f"{MESSAGE_PREFIX}{plural(len(verdict.gpus), 'GPU')} healthy"
    if current is not None and (current.get("status"), current.get("reason"), current.get("message")) == (
        status,
        reason,
        message,
    ):
        return None
    stamp = rfc3339(now)
    kept = (
        current.get("lastTransitionTime") if current is not None and current.get("status") == status else None
    )
    return {
        "type": ACCELERATED_CONDITION_TYPE,
        "status": status,
        "reason": reason,
        "message": message,
        "lastHeartbeatTime": stamp,
        # Karpenter counts its 10 minutes from here: a reason or message that changes keeps the clock.
        "lastTransitionTime": kept or stamp,
    }
