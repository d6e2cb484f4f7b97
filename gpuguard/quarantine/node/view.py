"""What gpuguard owns on a Node and how it sees one: the keys, `Taint`, `NodeView` (the node as read, at one
resourceVersion) and `NodeChange` (one write, as a JSON merge patch with its precondition). Pure values."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from gpuguard.quarantine.record import (
    ANN_BOOT_ID,
    ANN_DEFERRED,
    ANN_FAULTS,
    ANN_REASON,
    ANN_SINCE,
    DOMAIN,
    TAINT_KEY,
    Recorded,
)

ANN_CORDONED = f"{DOMAIN}/cordoned"
OUR_ANNOTATIONS = (ANN_REASON, ANN_SINCE, ANN_BOOT_ID, ANN_CORDONED, ANN_FAULTS, ANN_DEFERRED)
# "true": fully quarantined (counts against --max-quarantined); "deferred": the budget was spent, so only a
# PreferNoSchedule taint until there is room.
LABEL_QUARANTINED = f"{DOMAIN}/quarantined"
# The startup gate's default key (--gate-taint-key): GPU nodes may register with this taint (kubelet
# --register-with-taints, an autoscaler's start-up taints); gpuguard removes it after its first complete
# healthy check, or replaces it with the unhealthy taint (--gate-removal gpuguard).
UNVERIFIED_TAINT_KEY = f"{DOMAIN}/unverified"
CONDITION_TYPE = "GPUHealthy"
# The second level's condition (node/degraded.py), read here with the first.
DEGRADED_CONDITION_TYPE = "GPUDegraded"
# The repairers' condition (node/accelerated.py, --accelerated-hardware-condition): gpuguard's or another's.
ACCELERATED_CONDITION_TYPE = "AcceleratedHardwareReady"
# A GPU of the node is held as a repeat offender (quarantine.repair): the label an operator or a node-repair
# controller selects on, whether gpuguard placed it, and the held GPUs (JSON, UUID -> fault episodes).
LABEL_NEEDS_REPAIR = f"{DOMAIN}/needs-repair"
ANN_REPAIR_PLACED = f"{DOMAIN}/needs-repair-placed"
ANN_REPEAT_OFFENDERS = f"{DOMAIN}/repeat-offenders"
SOFT_EFFECT = "PreferNoSchedule"


@dataclass(frozen=True)
class Taint:
    key: str
    effect: str
    value: str | None = None
    time_added: str | None = None

    @classmethod
    def from_api(cls, d: Mapping[str, Any]) -> Taint:
        return cls(
            key=str(d.get("key", "")),
            effect=str(d.get("effect", "")),
            value=d.get("value"),
            time_added=d.get("timeAdded"),
        )

    def to_api(self) -> dict[str, str]:
        out = {"key": self.key, "effect": self.effect}
        if self.value is not None:
            out["value"] = self.value
        if self.time_added is not None:
            out["timeAdded"] = self.time_added
        return out


@dataclass(frozen=True)
class NodeView(Recorded):
    """The part of a Node that gpuguard reads and owns, at one resourceVersion; `record`: gpuguard's fault
    record on it."""

    name: str
    resource_version: str = ""
    uid: str = ""
    taints: tuple[Taint, ...] = ()
    unschedulable: bool = False
    annotations: Mapping[str, str] = field(default_factory=dict)
    boot_id: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    # status.conditions[type=GPUHealthy].status ("True"/"False"), None if absent.
    gpu_condition: str | None = None
    # Its message, None if absent: a restarted agent compares it with the message it would write.
    gpu_condition_message: str | None = None
    # status.conditions[type=GPUDegraded].status, None if absent.
    degraded_condition: str | None = None
    # status.conditions[type=AcceleratedHardwareReady] (status, reason, message, lastTransitionTime), None
    # if absent: whose it is is in its message (node/accelerated.py).
    accelerated_condition: Mapping[str, str] | None = None

    @classmethod
    def from_api(cls, obj: Mapping[str, Any]) -> NodeView:
        meta = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        info = (obj.get("status") or {}).get("nodeInfo") or {}
        return cls(
            name=str(meta.get("name", "")),
            resource_version=str(meta.get("resourceVersion", "")),
            uid=str(meta.get("uid", "")),
            taints=tuple(Taint.from_api(t) for t in spec.get("taints") or ()),
            unschedulable=bool(spec.get("unschedulable", False)),
            annotations=dict(meta.get("annotations") or {}),
            boot_id=str(info.get("bootID", "")),
            labels=dict(meta.get("labels") or {}),
            gpu_condition=_condition(obj, CONDITION_TYPE),
            gpu_condition_message=_condition(obj, CONDITION_TYPE, "message"),
            degraded_condition=_condition(obj, DEGRADED_CONDITION_TYPE),
            accelerated_condition=_whole_condition(obj, ACCELERATED_CONDITION_TYPE),
        )

    @property
    def our_taint(self) -> Taint | None:
        """The gpu-unhealthy taint if gpuguard placed it: the node carries gpuguard's record of it. A taint
        with our key and no record was put there by someone else and is theirs to remove."""
        if ANN_FAULTS not in self.annotations and ANN_SINCE not in self.annotations:
            return None
        return self.unhealthy_taint

    @property
    def unhealthy_taint(self) -> Taint | None:
        """A taint with gpuguard's key, whoever placed it."""
        return next((t for t in self.taints if t.key == TAINT_KEY), None)

    @property
    def recorded_faults(self) -> frozenset[str]:
        return self.record.faults

    @property
    def record_from_earlier_boot(self) -> bool:
        """The recorded faults were seen in an earlier boot than the node's current one."""
        return self.record.from_earlier_boot(self.boot_id)

    @property
    def current_faults(self) -> frozenset[str]:
        """The recorded faults of this boot (`FaultRecord.current`)."""
        return self.record.current(self.boot_id)

    @property
    def overridden(self) -> bool:
        """gpuguard's quarantine label without its taint: someone removed the taint by hand."""
        return LABEL_QUARANTINED in self.labels and self.unhealthy_taint is None

    def holds_gpuguard_state(self, gate_key: str = UNVERIFIED_TAINT_KEY) -> bool:
        """Anything of gpuguard's on the node (annotations, the label, the startup gate): what others may
        change under it (the kubelet's bootID, an operator's override), so it is re-read now and then."""
        return (
            any(k in self.annotations for k in OUR_ANNOTATIONS)
            or LABEL_QUARANTINED in self.labels
            or self.gated(gate_key)
        )

    @property
    def cordoned_by_us(self) -> bool:
        return self.annotations.get(ANN_CORDONED) == "true"

    @property
    def deferred(self) -> bool:
        return self.labels.get(LABEL_QUARANTINED) == "deferred"

    @property
    def fully_quarantined(self) -> bool:
        """Our taint and the label that counts against the budget (not a deferred, soft quarantine)."""
        return self.our_taint is not None and self.labels.get(LABEL_QUARANTINED) == "true"

    @property
    def repeat_offenders(self) -> dict[str, int]:
        """The GPUs the node's annotation lists as held repeat offenders ({} when absent or malformed)."""
        try:
            doc = json.loads(self.annotations.get(ANN_REPEAT_OFFENDERS, "{}"))
        except (ValueError, RecursionError):
            return {}
        if not isinstance(doc, dict):
            return {}
        return {str(k): v for k, v in doc.items() if isinstance(v, int) and not isinstance(v, bool)}

    def gated(self, gate_key: str = UNVERIFIED_TAINT_KEY) -> bool:
        """The node still carries the startup gate's taint (--gate-taint-key)."""
        return any(t.key == gate_key for t in self.taints)


@dataclass(frozen=True)
class EventSpec:
    type: str  # Normal | Warning
    reason: str  # GPUUnhealthy | GPURecovered
    message: str


# What a NodeChange does: the planner's (plan.py) and the budget's (budget.py: defer, yield). Plain strings,
# so the dry-run writer logs them as they are; the reconciler names its log line after each.
NodeAction = Literal[
    "taint",
    "defer",
    "escalate",
    "yield",
    "add-faults",
    "recover",
    "verified",
    "override",
    "release-cordon",
    "degrade",
    "degrade-clear",
    "repair",
    "repair-request",
    "unvalue",
]


@dataclass(frozen=True)
class NodeChange:
    """One write to the node. `taints` is the whole new list (the API replaces it whole) or None."""

    action: NodeAction
    taints: tuple[Taint, ...] | None = None
    unschedulable: bool | None = None
    annotations: Mapping[str, str | None] = field(default_factory=dict)
    event: EventSpec | None = None
    labels: Mapping[str, str | None] = field(default_factory=dict)

    def patch(self, resource_version: str) -> dict[str, Any]:
        """A JSON merge patch with the resourceVersion precondition (409 if the node moved on)."""
        meta: dict[str, Any] = {"resourceVersion": resource_version}
        if self.annotations:
            meta["annotations"] = dict(self.annotations)
        if self.labels:
            meta["labels"] = dict(self.labels)
        body: dict[str, Any] = {"metadata": meta}
        spec: dict[str, Any] = {}
        if self.taints is not None:
            spec["taints"] = [t.to_api() for t in self.taints]
        if self.unschedulable is not None:
            spec["unschedulable"] = self.unschedulable
        if spec:
            body["spec"] = spec
        return body


def apply_change(node: NodeView, change: NodeChange, *, resource_version: str | None = None) -> NodeView:
    """What the API server does with the patch (for the dry run and for tests). Pure."""
    return replace(
        node,
        taints=node.taints if change.taints is None else change.taints,
        unschedulable=node.unschedulable if change.unschedulable is None else change.unschedulable,
        annotations=_merge(node.annotations, change.annotations),
        labels=_merge(node.labels, change.labels),
        resource_version=resource_version
        if resource_version is not None
        else str(int(node.resource_version or "0") + 1),
    )


def _condition(obj: Mapping[str, Any], kind: str, field: str = "status") -> str | None:
    conditions = (obj.get("status") or {}).get("conditions") or ()
    return next((str(c.get(field)) for c in conditions if c.get("type") == kind), None)


def _whole_condition(obj: Mapping[str, Any], kind: str) -> dict[str, str] | None:
    conditions = (obj.get("status") or {}).get("conditions") or ()
    found = next((c for c in conditions if c.get("type") == kind), None)
    if found is None:
        return None
    fields = ("status", "reason", "message", "lastTransitionTime")
    return {k: str(found[k]) for k in fields if found.get(k) is not None}


def _merge(current: Mapping[str, str], patch: Mapping[str, str | None]) -> dict[str, str]:
    """A JSON merge patch on a string map: None removes the key."""
    out = dict(current)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def with_our_effect(node: NodeView, ours: Taint, effect: str) -> tuple[Taint, ...]:
    """The node's taints with ours set to `effect`, in place, without a value (timeAdded dropped: the API
    sets it)."""
    changed = replace(ours, effect=effect, value=None, time_added=None)
    return tuple(changed if t.key == TAINT_KEY else t for t in node.taints)
