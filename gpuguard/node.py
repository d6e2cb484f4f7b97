"""The only code that writes to Kubernetes: gpuguard's taint, cordon, annotations and Events on its own node.

Three layers:
- `plan()`: pure. Given the node as last read and the policy's verdict, the change to make, or None when the
  node already matches (the idempotence every restart relies on). All ownership and recovery rules live here.
- `NodeWriter`: a narrow seam with two implementations, `KubeNodeWriter` (the API server) and
  `DryRunNodeWriter` (logs the exact patch, applies it to an in-memory copy, needs no cluster).
- `NodeReconciler`: runs plan + write on its own thread with optimistic concurrency (every patch carries the
  resourceVersion it was planned against; a 409 means re-read and re-plan) and tenacity retries for transient
  failures, so the GPU checks never wait for the API server.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Protocol

import structlog
import tenacity
from urllib3.exceptions import HTTPError

from gpuguard import __version__, kubeapi, validation
from gpuguard.config import NodeSettings
from gpuguard.errors import (
    ConfigError,
    ConflictError,
    NodeUpdateError,
    PermanentApiError,
    TransientApiError,
)
from gpuguard.model import Fault, Verdict
from gpuguard.policy import cleared_without_reboot, primary

log = structlog.get_logger("gpuguard.node")

DOMAIN = "gpuguard.io"
TAINT_KEY = f"{DOMAIN}/gpu-unhealthy"
ANN_REASON = f"{DOMAIN}/reason"
ANN_SINCE = f"{DOMAIN}/since"
ANN_BOOT_ID = f"{DOMAIN}/boot-id"
ANN_CORDONED = f"{DOMAIN}/cordoned"
ANN_FAULTS = f"{DOMAIN}/faults"
ANN_DEFERRED = f"{DOMAIN}/quarantine-deferred"
OUR_ANNOTATIONS = (ANN_REASON, ANN_SINCE, ANN_BOOT_ID, ANN_CORDONED, ANN_FAULTS, ANN_DEFERRED)
# "true": fully quarantined (counts against --max-quarantined); "deferred": the budget was spent, so only a
# PreferNoSchedule taint until there is room.
LABEL_QUARANTINED = f"{DOMAIN}/quarantined"
# The startup gate: GPU nodes may register with this taint (kubelet --register-with-taints); gpuguard
# removes it after its first complete healthy check, or replaces it with the unhealthy taint.
UNVERIFIED_TAINT_KEY = f"{DOMAIN}/unverified"
GPU_NODE_SELECTOR = "nvidia.com/gpu.present=true"
CONDITION_TYPE = "GPUHealthy"
SOFT_EFFECT = "PreferNoSchedule"
USER_AGENT = f"gpuguard/{__version__}"
_MAX_REASON = 1024
_METADATA_ONLY = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
# Seconds after a full quarantine when the quarantine order is checked a second time: by then the writes of
# every agent that faulted in the same burst have landed (the first check runs right after our own write).
VERIFY_SETTLE = 10.0


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
class NodeView:
    """The part of a Node that gpuguard reads and owns, at one resourceVersion."""

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
            gpu_condition=next(
                (
                    str(c.get("status"))
                    for c in (obj.get("status") or {}).get("conditions") or ()
                    if c.get("type") == CONDITION_TYPE
                ),
                None,
            ),
        )

    @property
    def our_taint(self) -> Taint | None:
        return next((t for t in self.taints if t.key == TAINT_KEY), None)

    @property
    def recorded_faults(self) -> frozenset[str]:
        raw = self.annotations.get(ANN_FAULTS, "")
        return frozenset(validation.fault_key(k) for k in raw.split(",") if k)

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
    def unverified(self) -> bool:
        return any(t.key == UNVERIFIED_TAINT_KEY for t in self.taints)


@dataclass(frozen=True)
class Budget:
    """The cluster-wide quarantine budget as read from the API server (this node not counted).
    `gpu_nodes`: counted for a percentage, None for a count (`--max-quarantined 5` needs no total)."""

    quarantined: int
    limit: int
    gpu_nodes: int | None = None

    @property
    def has_room(self) -> bool:
        return self.quarantined < self.limit


def budget_limit(spec: str, gpu_nodes: int) -> int:
    """--max-quarantined as a node count: "5" or "10%" (of GPU nodes, rounded up so that a small pool can
    still quarantine one node). "100%" never defers."""
    if spec.endswith("%"):
        return math.ceil(gpu_nodes * float(spec[:-1]) / 100)
    return int(spec)


def quarantine_rank(order: Iterable[tuple[str, str]], me: tuple[str, str]) -> int:
    """How many other fully quarantined nodes come before `me` in the quarantine order: the earlier
    gpuguard.io/since first, then the node name. Every agent reads the same annotations, so every agent
    computes the same order: when a burst overshoots the budget, exactly the nodes past the limit yield."""
    return sum(1 for k in set(order) if k[1] != me[1] and k < me)


def plan_yield(node: NodeView, *, ahead: int, limit: int, settings: NodeSettings) -> NodeChange | None:
    """A full quarantine that turned out to be past the budget (agents that faulted at the same instant all
    saw room) steps back to the deferred state: soft taint, our cordon lifted, label "deferred". Pure.
    None when the node is not fully quarantined by us (any more)."""
    ours = node.our_taint
    if ours is None or not node.fully_quarantined or ahead < limit:
        return None
    why = (
        f"quarantine budget spent: {ahead} GPU nodes were quarantined before this one, limit {limit} "
        f"(--max-quarantined {settings.max_quarantined})"
    )
    annotations: dict[str, str | None] = {ANN_DEFERRED: why}
    unschedulable = None
    if node.cordoned_by_us and node.unschedulable:
        unschedulable = False
        annotations[ANN_CORDONED] = None
    reason = node.annotations.get(ANN_REASON, "")
    return NodeChange(
        action="yield",
        taints=_with_our_effect(node, ours, SOFT_EFFECT),
        unschedulable=unschedulable,
        annotations=annotations,
        labels={LABEL_QUARANTINED: "deferred"},
        event=EventSpec("Warning", "GPUQuarantineDeferred", f"{reason}; {why}: soft taint only"),
    )


@dataclass(frozen=True)
class EventSpec:
    type: str  # Normal | Warning
    reason: str  # GPUUnhealthy | GPURecovered
    message: str


@dataclass(frozen=True)
class NodeChange:
    """One write to the node. `taints` is the whole new list (the API replaces it whole) or None."""

    action: str  # taint | defer | escalate | yield | add-faults | recover | verified
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


def plan(
    node: NodeView,
    verdict: Verdict,
    *,
    healthy_streak: int,
    settings: NodeSettings,
    now: datetime,
    budget: Budget | None = None,
    flapping: bool = False,
) -> NodeChange | None:
    """The change that brings `node` in line with `verdict`, or None. Pure.

    Ownership: only the taints with key TAINT_KEY (and UNVERIFIED_TAINT_KEY, the startup gate), the
    annotations in OUR_ANNOTATIONS, the label LABEL_QUARANTINED and a cordon that ANN_CORDONED says we placed
    are ever changed or removed; every other taint is carried over exactly as it was read.
    `budget` None means no budget information (dry run without a cluster): quarantine fully.
    `flapping`: faults came back within --flap-window, so recovery waits (see the agent).
    """
    faults = verdict.faults
    recorded = node.recorded_faults
    ours = node.our_taint
    full = budget is None or budget.has_room
    if faults:
        # Compared through fault_key on both sides: a hostile UUID can neither split a key nor make a
        # recorded fault look new at every check.
        keys = {validation.fault_key(f.key) for f in faults}
        new = [f for f in faults if validation.fault_key(f.key) not in recorded]
        if ours is None and new:
            return _quarantine(
                node, faults, new, recorded | keys, settings=settings, now=now, budget=budget, full=full
            )
        if ours is not None and node.deferred and full:
            return _escalate(node, ours, faults, recorded | keys, settings=settings)
        if not new:
            # Already tainted for these faults, or the taint was removed by hand for these very faults.
            return None
        return NodeChange(
            action="add-faults",
            annotations={ANN_FAULTS: _join_keys(recorded | keys), ANN_REASON: _reason_text(faults)},
            event=EventSpec("Warning", "GPUUnhealthy", _reason_text(new)),
        )

    owned = (
        ours is not None
        or any(k in node.annotations for k in OUR_ANNOTATIONS)
        or LABEL_QUARANTINED in node.labels
    )
    if not owned:
        if node.unverified and verdict.gpus:
            # The startup gate: the first complete healthy check clears it.
            return NodeChange(
                action="verified",
                taints=tuple(t for t in node.taints if t.key != UNVERIFIED_TAINT_KEY),
            )
        return None
    if not settings.recover or healthy_streak < settings.recover_after or flapping:
        return None
    if not evidence_gone(node, verdict):
        return None
    return NodeChange(
        action="recover",
        taints=tuple(t for t in node.taints if t.key not in (TAINT_KEY, UNVERIFIED_TAINT_KEY))
        if ours is not None or node.unverified
        else None,
        unschedulable=False if node.cordoned_by_us and node.unschedulable else None,
        annotations=dict.fromkeys((k for k in OUR_ANNOTATIONS if k in node.annotations), None),
        labels={LABEL_QUARANTINED: None} if LABEL_QUARANTINED in node.labels else {},
        event=EventSpec(
            "Normal",
            "GPURecovered",
            "GPUs healthy again and the fault's evidence is gone"
            + (f" (was: {node.annotations.get(ANN_REASON)})" if ANN_REASON in node.annotations else ""),
        ),
    )


def _quarantine(
    node: NodeView,
    faults: tuple[Fault, ...],
    new: list[Fault],
    keys: set[str] | frozenset[str],
    *,
    settings: NodeSettings,
    now: datetime,
    budget: Budget | None,
    full: bool,
) -> NodeChange:
    first = primary(new)
    assert first is not None
    annotations: dict[str, str | None] = {
        ANN_REASON: _reason_text(faults),
        ANN_SINCE: node.annotations.get(ANN_SINCE) or _rfc3339(now),
        ANN_BOOT_ID: node.boot_id,
        ANN_FAULTS: _join_keys(keys),
    }
    unschedulable = None
    if full and settings.cordon and not node.unschedulable:
        unschedulable = True
        annotations[ANN_CORDONED] = "true"
    message = _reason_text(faults)
    if not full:
        assert budget is not None
        of = f" of {budget.gpu_nodes}" if budget.gpu_nodes is not None else ""
        annotations[ANN_DEFERRED] = (
            f"quarantine budget spent: {budget.quarantined}{of} GPU nodes quarantined, "
            f"limit {budget.limit} (--max-quarantined {settings.max_quarantined})"
        )
        message = f"{message}; {annotations[ANN_DEFERRED]}: soft taint only"
    taint = Taint(key=TAINT_KEY, value=first.reason, effect=settings.taint_effect if full else SOFT_EFFECT)
    kept = tuple(t for t in node.taints if t.key != UNVERIFIED_TAINT_KEY)
    return NodeChange(
        action="taint" if full else "defer",
        taints=(*kept, taint),
        unschedulable=unschedulable,
        annotations=annotations,
        labels={LABEL_QUARANTINED: "true" if full else "deferred"},
        event=EventSpec("Warning", "GPUUnhealthy" if full else "GPUQuarantineDeferred", message),
    )


def _escalate(
    node: NodeView,
    ours: Taint,
    faults: tuple[Fault, ...],
    keys: set[str] | frozenset[str],
    *,
    settings: NodeSettings,
) -> NodeChange:
    """A deferred quarantine becomes full once the budget has room again."""
    annotations: dict[str, str | None] = {
        ANN_DEFERRED: None,
        ANN_FAULTS: _join_keys(keys),
        ANN_REASON: _reason_text(faults),
    }
    unschedulable = None
    if settings.cordon and not node.unschedulable:
        unschedulable = True
        annotations[ANN_CORDONED] = "true"
    return NodeChange(
        action="escalate",
        taints=_with_our_effect(node, ours, settings.taint_effect),
        unschedulable=unschedulable,
        annotations=annotations,
        labels={LABEL_QUARANTINED: "true"},
        event=EventSpec("Warning", "GPUUnhealthy", f"quarantine budget has room: {_reason_text(faults)}"),
    )


def _with_our_effect(node: NodeView, ours: Taint, effect: str) -> tuple[Taint, ...]:
    """The node's taints with ours set to `effect`, in place (timeAdded dropped: the API sets it)."""
    changed = replace(ours, effect=effect, time_added=None)
    return tuple(changed if t.key == TAINT_KEY else t for t in node.taints)


def plan_condition(
    current: str | None, verdict: Verdict, *, last_keys: frozenset[str] | None, now: datetime
) -> dict[str, str] | None:
    """The GPUHealthy node condition to write, or None when it already says this (updated only on change:
    a status flip, or a different set of faults)."""
    status = "True" if verdict.healthy else "False"
    keys = frozenset(f.key for f in verdict.faults)
    if current == status and (last_keys is None or last_keys == keys):
        return None
    stamp = _rfc3339(now)
    return {
        "type": CONDITION_TYPE,
        "status": status,
        "reason": "GPUsHealthy" if verdict.healthy else "GPUFault",
        "message": (
            f"{len(verdict.gpus)} GPUs healthy (gpuguard)"
            if verdict.healthy
            else _reason_text(verdict.faults)
        ),
        "lastHeartbeatTime": stamp,
        "lastTransitionTime": stamp,
    }


def evidence_gone(node: NodeView, verdict: Verdict | None = None) -> bool:
    """Whether every recorded fault is proven cleared, given that the GPUs now read healthy.

    The healthy reading itself proves some faults gone (policy.cleared_without_reboot: ECC, NVML init, a
    recovery action back to NONE, an Xid a driver-requested GPU reset cleared); everything else (an Xid, a
    lost or missing GPU, a failed row remap) needs a reboot, shown by a bootID that differs from the one
    recorded when the taint was placed. An agent restart changes neither.
    """
    cleared = verdict.reset_cleared if verdict is not None else frozenset()
    if all(cleared_without_reboot(k, cleared) for k in node.recorded_faults):
        return True
    recorded_boot = node.annotations.get(ANN_BOOT_ID, "")
    return bool(recorded_boot) and bool(node.boot_id) and recorded_boot != node.boot_id


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


def _merge(current: Mapping[str, str], patch: Mapping[str, str | None]) -> dict[str, str]:
    """A JSON merge patch on a string map: None removes the key."""
    out = dict(current)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def _reason_text(faults: Any) -> str:
    return validation.clean_text("; ".join(f.message for f in faults), max_bytes=_MAX_REASON)


def _join_keys(keys: Any) -> str:
    return ",".join(sorted(keys))


def _rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- writers -----------------------------------------------------------------------------------------------


class NodeWriter(Protocol):
    def read(self) -> NodeView: ...

    def patch(self, node: NodeView, change: NodeChange) -> NodeView:
        """Apply `change` planned against `node`; ConflictError if the node has moved on."""

    def record_event(self, node: NodeView, event: EventSpec) -> None: ...

    def budget(self, spec: str, *, exclude: str) -> Budget | None:
        """The quarantine budget (one list), or None where there is no cluster to ask."""

    def quarantine_order(self) -> list[tuple[str, str]]:
        """(gpuguard.io/since, name) of every node fully quarantined by gpuguard (one small list)."""

    def set_condition(self, node: NodeView, condition: Mapping[str, str]) -> NodeView:
        """Patch nodes/status; returns the node as the server now has it (a new resourceVersion)."""


class DryRunNodeWriter:
    """Writes nothing: logs the exact patch it would send and keeps the result in memory.

    Starts from the real node when one can be read (so a dry run on a live cluster shows the real
    decisions), else from an empty node named after --node (or "dry-run").
    """

    def __init__(self, initial: NodeView) -> None:
        self._node = initial

    def read(self) -> NodeView:
        return self._node

    def patch(self, node: NodeView, change: NodeChange) -> NodeView:
        body = _checked_patch(node, change)
        log.info(
            "node.dry_run",
            node=node.name,
            action=change.action,
            patch=json.dumps(body, sort_keys=True),
        )
        self._node = apply_change(self._node, change)
        return self._node

    def record_event(self, node: NodeView, event: EventSpec) -> None:
        log.info("node.dry_run_event", node=node.name, type=event.type, reason=event.reason)

    def budget(self, spec: str, *, exclude: str) -> Budget | None:
        return None

    def quarantine_order(self) -> list[tuple[str, str]]:
        return []

    def set_condition(self, node: NodeView, condition: Mapping[str, str]) -> NodeView:
        _checked_condition(node, condition)
        log.info("node.dry_run_condition", node=node.name, condition=json.dumps(dict(condition)))
        self._node = replace(self._node, gpu_condition=condition["status"])
        return self._node


class KubeNodeWriter:
    """The API server, through `gpuguard.kubeapi`. Translates its errors into transient/permanent/conflict."""

    def __init__(
        self,
        name: str,
        *,
        api: kubeapi.Client,
        timeout: float = 10.0,
        event_namespace: str = "default",
        metrics: Any = None,
    ) -> None:
        self._name = name
        self._api = api
        self._path = kubeapi.path_of("api/v1/nodes", name)
        self._timeout = timeout
        self._event_namespace = event_namespace
        self._metrics = metrics

    def read(self) -> NodeView:
        with _translate(f"read node {self._name}", "get", self._metrics):
            return NodeView.from_api(self._api.request("GET", self._path, timeout=self._timeout))

    def patch(self, node: NodeView, change: NodeChange) -> NodeView:
        body = _checked_patch(node, change)
        with _translate(f"patch node {self._name}", "patch", self._metrics):
            doc = self._api.request(
                "PATCH",
                self._path,
                body=body,
                content_type="application/merge-patch+json",
                timeout=self._timeout,
            )
            return NodeView.from_api(doc)

    def record_event(self, node: NodeView, event: EventSpec) -> None:
        now = datetime.now(UTC)
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{node.name}.{time.time_ns():x}", "namespace": self._event_namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": node.uid},
            "type": event.type,
            "reason": event.reason,
            "message": validation.clean_text(event.message),
            "source": {"component": "gpuguard", "host": node.name},
            "reportingComponent": "gpuguard",
            "reportingInstance": node.name,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        path = kubeapi.path_of("api/v1/namespaces", self._event_namespace, "events")
        with _translate("create event", "create", self._metrics):
            self._api.request("POST", path, body=body, timeout=self._timeout)

    def budget(self, spec: str, *, exclude: str) -> Budget | None:
        """One list, in the fault's hot path: for a count, the quarantined nodes (by label: a few items);
        for a percentage, every GPU node's metadata (PartialObjectMetadataList: no specs, no statuses),
        which gives the total and, from the labels, the quarantined ones."""
        if not spec.endswith("%"):
            quarantined = sum(1 for _, name in self.quarantine_order() if name != exclude)
            return Budget(quarantined=quarantined, limit=int(spec))
        items = self._list_metadata("list GPU nodes", GPU_NODE_SELECTOR)
        names = {i["metadata"]["name"] for i in items}
        quarantined = sum(
            1
            for i in items
            if i["metadata"]["name"] != exclude
            and (i["metadata"].get("labels") or {}).get(LABEL_QUARANTINED) == "true"
        )
        total = len(names) if exclude in names else len(names) + 1
        return Budget(gpu_nodes=total, quarantined=quarantined, limit=budget_limit(spec, total))

    def quarantine_order(self) -> list[tuple[str, str]]:
        """Metadata of the fully quarantined nodes only (label selector): a few items, not the fleet."""
        items = self._list_metadata("list quarantined nodes", f"{LABEL_QUARANTINED}=true")
        return [
            (str((i["metadata"].get("annotations") or {}).get(ANN_SINCE, "")), str(i["metadata"]["name"]))
            for i in items
        ]

    def _list_metadata(self, what: str, selector: str) -> list[dict[str, Any]]:
        """Nodes by label selector, metadata only (PartialObjectMetadataList: no specs, no statuses)."""
        with _translate(what, "list", self._metrics):
            doc = self._api.request(
                "GET",
                "/api/v1/nodes",
                query={"labelSelector": selector},
                accept=_METADATA_ONLY,
                timeout=self._timeout,
            )
        return doc["items"] or []  # an empty metadata list comes as "items": null

    def set_condition(self, node: NodeView, condition: Mapping[str, str]) -> NodeView:
        _checked_condition(node, condition)
        with _translate(f"patch node {self._name} status", "patch", self._metrics):
            doc = self._api.request(
                "PATCH",
                self._path + "/status",
                body={"status": {"conditions": [dict(condition)]}},
                content_type="application/strategic-merge-patch+json",  # conditions merge by type
                timeout=self._timeout,
            )
            return NodeView.from_api(doc)


def _checked_patch(node: NodeView, change: NodeChange) -> dict[str, Any]:
    """The patch body, validated before anything is sent (label-value syntax, our keys only, sizes). A
    refusal is a permanent error: logged once, the same change not retried for 5 minutes."""
    body = change.patch(node.resource_version)
    try:
        validation.check_node_patch(body)
    except ConfigError as exc:
        raise PermanentApiError(f"patch node {node.name}: refused before sending: {exc}") from exc
    return body


def _checked_condition(node: NodeView, condition: Mapping[str, str]) -> None:
    try:
        validation.check_condition(condition)
    except ConfigError as exc:
        raise PermanentApiError(f"patch node {node.name} status: refused before sending: {exc}") from exc


class _translate:
    """Context manager: kubeapi/urllib3 errors -> gpuguard.errors, with `raise ... from`; counts each request
    in gpuguard_api_requests_total{verb,code}."""

    def __init__(self, what: str, verb: str = "", metrics: Any = None) -> None:
        self.what = what
        self.verb = verb
        self.metrics = metrics

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: Any, exc: BaseException | None, tb: Any) -> None:
        if self.metrics is not None:
            code = "200" if exc is None else str(getattr(exc, "status", None) or "error")
            self.metrics.api_requests.labels(self.verb, code).inc()
        if exc is None or isinstance(exc, NodeUpdateError):
            return
        if isinstance(exc, kubeapi.ApiError):
            if exc.status == 409:
                raise ConflictError(f"{self.what}: conflict: {exc.message}") from exc
            if exc.status == 429 or exc.status >= 500:
                raise TransientApiError(f"{self.what}: {exc}", retry_after=exc.retry_after) from exc
            raise PermanentApiError(f"{self.what}: {exc}", status=exc.status) from exc
        if isinstance(exc, HTTPError | OSError | TimeoutError | json.JSONDecodeError):
            # An answer that is not JSON (a proxy's error page) is as good as no answer.
            raise TransientApiError(f"{self.what}: {type(exc).__name__}: {exc}") from exc


def load_api_client(kubeconfig: str | None) -> kubeapi.Client:
    """In-cluster config, then KUBECONFIG, then ~/.kube/config; or the file given. ConfigError otherwise."""
    return kubeapi.load(kubeconfig, user_agent=USER_AGENT)


def quarantined_nodes(api: kubeapi.Client, *, timeout: float = 10.0) -> list[dict[str, Any]]:
    """For `gpuguard status`: every node gpuguard has quarantined (fully or deferred), one list request."""
    with _translate("list quarantined nodes", "list"):
        items = (
            api.request("GET", "/api/v1/nodes", query={"labelSelector": LABEL_QUARANTINED}, timeout=timeout)[
                "items"
            ]
            or []
        )
    rows = []
    for item in items:
        n = NodeView.from_api(item)
        taint = n.our_taint
        rows.append(
            {
                "node": n.name,
                "state": "deferred" if n.deferred else "quarantined",
                "reason": taint.value if taint else None,
                "effect": taint.effect if taint else None,
                "since": n.annotations.get(ANN_SINCE),
                "faults": sorted(n.recorded_faults),
                "detail": n.annotations.get(ANN_REASON),
                "cordoned_by_gpuguard": n.cordoned_by_us and n.unschedulable,
                "unschedulable": n.unschedulable,
            }
        )
    return sorted(rows, key=lambda r: str(r["node"]))


# -- reconciler --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeStatus:
    """What /healthz reports about the node (in a dry run: what gpuguard would have done)."""

    tainted: bool = False
    cordoned: bool = False
    reconciled: bool = False
    deferred: bool = False


class NodeReconciler:
    """Applies the latest verdict to the node on its own thread, so the GPU checks never wait for the API.

    The node is read once at start and then kept from the answers to our own writes: a healthy node costs
    no API request at all. Every write carries the resourceVersion it was planned against; a 409 re-reads
    and re-plans, so another controller's concurrent taints and labels are never lost.
    """

    def __init__(
        self,
        writer: NodeWriter,
        settings: NodeSettings,
        *,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        retry_deadline: float = 60.0,
        max_conflicts: int = 20,
        metrics: Any = None,
    ) -> None:
        self._writer = writer
        self._metrics = metrics
        self._condition_keys: frozenset[str] | None = None
        self._settings = settings
        self._now = now
        self._retry_deadline = retry_deadline
        self._max_conflicts = max_conflicts
        self._cond = threading.Condition()
        self._latest: tuple[Verdict, int, bool] | None = None
        # The decision-relevant summary of the last verdict reconciled without error (see submit()).
        self._settled: tuple[object, ...] | None = None
        self._pending_sig: tuple[object, ...] | None = None
        self._blocked = False
        # The budget listed in the current reconcile call: its 409 re-plans reuse it instead of listing again.
        self._call_budget: tuple[Budget | None] | None = None
        # After a full quarantine under a budget: (the budget, monotonic time of the second order check).
        self._settle: tuple[Budget, float] | None = None
        # Set when the order check found this node past the limit: the next plan is the yield.
        self._yield: tuple[int, int] | None = None
        self._budget_checked = -math.inf
        self._generation = 0
        self._done_generation = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._node: NodeView | None = None
        self._status = NodeStatus()
        self._api_down = False
        self._rejected: tuple[str, float] | None = None
        self._override_logged: frozenset[str] = frozenset()
        self._attempt: NodeChange | None = None
        self.writes = 0

    @property
    def status(self) -> NodeStatus:
        return self._status

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpuguard-node", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 1.5) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, verdict: Verdict, healthy_streak: int, *, flapping: bool = False) -> None:
        """Hand over the newest verdict (latest wins: an old one is never applied after a newer one).

        A verdict that cannot change any decision (same faults, a streak past --recover-after, the node
        cached and not deferred) does not wake the writer thread: an idle agent costs next to nothing."""
        sig = (
            frozenset(f.key for f in verdict.faults),
            verdict.healthy,
            min(healthy_streak, self._settings.recover_after),
            flapping,
            bool(verdict.gpus),
        )
        with self._cond:
            self._latest = (verdict, healthy_streak, flapping)
            node = self._node
            if sig == self._settled and node is not None and not node.deferred and self._settle is None:
                return
            self._pending_sig = sig
            self._generation += 1
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """For tests and one-shot runs: block until every submitted verdict has been reconciled."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._done_generation < self._generation:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def reconcile_now(self) -> None:
        """One synchronous reconcile of the latest verdict (the thread's body; also for tests)."""
        with self._cond:
            generation = self._generation
            sig = self._pending_sig
        settled = False
        self._blocked = False
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(TransientApiError),
            wait=self._wait,
            stop=tenacity.stop_after_delay(self._retry_deadline) | _StopOn(self._stop),
            sleep=self._sleep,
            before_sleep=self._before_sleep,
            reraise=True,
        )
        try:
            retrying(self._reconcile_once)
            settled = not self._blocked
            if self._api_down:
                self._api_down = False
                log.info("api.available", node=self._settings.name)
        except TransientApiError as exc:
            log.warning("node.write_deferred", node=self._settings.name, error=str(exc))
        except PermanentApiError as exc:
            self._reject(str(exc))
        finally:
            with self._cond:
                self._settled = sig if settled else None
                self._done_generation = max(self._done_generation, generation)
                self._cond.notify_all()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                while self._done_generation >= self._generation and not self._stop.is_set():
                    self._cond.wait()
            if self._stop.is_set():
                return
            try:
                self.reconcile_now()
            except Exception:
                # A bug must not kill the writer thread for good: log it, and the next verdict retries.
                log.exception("node.reconcile_failed", node=self._settings.name)

    def _reconcile_once(self) -> None:
        with self._cond:
            latest = self._latest
        if latest is None:
            return
        verdict, streak, flapping = latest
        self._call_budget = None
        node = self._node if self._node is not None else self._read()
        if self._settle is not None and time.monotonic() >= self._settle[1]:
            budget = self._settle[0]
            self._settle = None
            self._check_order(node, budget)
        for attempt in range(self._max_conflicts):
            change = self._plan(node, verdict, streak, flapping)
            if change is None:
                self._log_override(node, verdict)
                self._set_node(node)
                self._update_condition(node, verdict)
                return
            if (
                self._rejected is not None
                and self._rejected[0] == _signature(change)
                and (time.monotonic() < self._rejected[1])
            ):
                self._blocked = True  # refused recently: do not hammer it, but do not settle either
                return
            self._attempt = change
            try:
                node = self._writer.patch(node, change)
            except ConflictError:
                log.info("node.conflict", node=node.name, resource_version=node.resource_version)
                # A little jitter: two writers that re-read in lockstep would keep colliding.
                self._sleep(random.uniform(0, 0.005 * (attempt + 1)))  # noqa: S311 - jitter, not crypto
                node = self._read()
                continue
            except TransientApiError:
                self._node = None  # the write may or may not have landed: read again next time
                raise
            self.writes += 1
            self._rejected = None
            self._set_node(node)
            self._log_change(node, change, verdict)
            self._update_condition(node, verdict)
            if change.event is not None:
                self._record_event(node, change.event)
            if change.action == "yield":
                self._yield = self._settle = None
            elif change.action in ("taint", "escalate") and self._call_budget and self._call_budget[0]:
                budget = self._call_budget[0]
                self._settle = (budget, time.monotonic() + VERIFY_SETTLE)
                if self._check_order(node, budget):
                    continue  # the next plan is the yield
            return
        raise TransientApiError(f"node {node.name}: still conflicting after {self._max_conflicts} tries")

    def _check_order(self, node: NodeView, budget: Budget) -> bool:
        """After a full quarantine: is this node past the budget in the cluster's quarantine order? Sets
        the yield for the next plan and returns True if so. A failed list keeps the check for later."""
        if not node.fully_quarantined:
            return False
        try:
            order = self._writer.quarantine_order()
        except NodeUpdateError as exc:
            log.warning("node.quarantine_order_failed", node=node.name, error=str(exc))
            self._settle = (budget, time.monotonic() + VERIFY_SETTLE)
            return False
        ahead = quarantine_rank(order, (node.annotations.get(ANN_SINCE, ""), node.name))
        if ahead < budget.limit:
            return False
        self._yield = (ahead, budget.limit)
        return True

    def _plan(self, node: NodeView, verdict: Verdict, streak: int, flapping: bool) -> NodeChange | None:
        if self._yield is not None:
            change = plan_yield(node, ahead=self._yield[0], limit=self._yield[1], settings=self._settings)
            if change is not None:
                return change
            self._yield = None  # recovered or changed by hand meanwhile: nothing to step back from
        kw: dict[str, Any] = {
            "healthy_streak": streak,
            "settings": self._settings,
            "now": self._now(),
            "flapping": flapping,
        }
        change = plan(node, verdict, **kw)
        if change is None or change.action not in ("taint", "escalate"):
            return change
        if self._settings.max_quarantined == "100%":
            return change  # no budget: no list request
        if self._call_budget is not None:
            budget = self._call_budget[0]  # a re-plan after a 409 in this reconcile: the count has not moved
        else:
            now = time.monotonic()
            if change.action == "escalate" and now - self._budget_checked < self._settings.budget_recheck:
                return None  # deferred: at most one list per minute to see whether the budget has room
            budget = self._writer.budget(self._settings.max_quarantined, exclude=node.name)
            self._call_budget = (budget,)
            self._budget_checked = now
        if budget is not None and not budget.has_room and change.action == "taint":
            log.warning(
                "node.quarantine_deferred",
                node=node.name,
                quarantined=budget.quarantined,
                limit=budget.limit,
                gpu_nodes=budget.gpu_nodes,
            )
        return plan(node, verdict, budget=budget, **kw)

    def _read(self) -> NodeView:
        try:
            node = self._writer.read()
        except TransientApiError:
            self._node = None
            raise
        self._set_node(node)
        return node

    def _set_node(self, node: NodeView) -> None:
        self._node = node
        self._status = NodeStatus(
            tainted=node.our_taint is not None,
            cordoned=node.unschedulable,
            reconciled=True,
            deferred=node.deferred,
        )

    def _update_condition(self, node: NodeView, verdict: Verdict) -> None:
        """The GPUHealthy condition, written only when it changes (best effort, like Events)."""
        condition = plan_condition(
            node.gpu_condition, verdict, last_keys=self._condition_keys, now=self._now()
        )
        if condition is None:
            self._condition_keys = frozenset(f.key for f in verdict.faults)
            return
        try:
            updated = self._writer.set_condition(node, condition)
        except NodeUpdateError as exc:
            log.warning("node.condition_failed", node=node.name, error=str(exc))
            return
        self._condition_keys = frozenset(f.key for f in verdict.faults)
        self._set_node(updated)
        log.info("node.condition", node=node.name, status=condition["status"], reason=condition["reason"])

    def _record_event(self, node: NodeView, event: EventSpec) -> None:
        # Best effort: the taint is what protects the scale-out; a lost Event must not block it.
        try:
            self._writer.record_event(node, event)
        except NodeUpdateError as exc:
            log.warning("node.event_failed", node=node.name, reason=event.reason, error=str(exc))

    def _log_change(self, node: NodeView, change: NodeChange, verdict: Verdict) -> None:
        faults = verdict.faults
        first = primary(faults)
        name = {
            "taint": "node.tainted",
            "defer": "node.tainted_soft",
            "escalate": "node.quarantine_escalated",
            "yield": "node.quarantine_yielded",
            "add-faults": "node.fault_added",
            "recover": "node.recovered",
            "verified": "node.verified",
        }
        log.warning(
            name[change.action],
            node=node.name,
            reason=first.reason if first else None,
            gpu=first.gpu_index if first else None,
            uuid=first.uuid if first else None,
            detail=change.event.message if change.event else None,
            cordoned=bool(change.unschedulable),
            uncordoned=change.unschedulable is False,
            dry_run=self._settings.dry_run,
        ) if change.action not in ("recover", "verified") else log.info(
            name[change.action],
            node=node.name,
            uncordoned=change.unschedulable is False,
            dry_run=self._settings.dry_run,
        )

    def _log_override(self, node: NodeView, verdict: Verdict) -> None:
        keys = frozenset(f.key for f in verdict.faults)
        if keys and node.our_taint is None and keys != self._override_logged:
            self._override_logged = keys
            log.warning(
                "node.taint_removed_by_operator",
                node=node.name,
                faults=_join_keys(keys),
                note="not re-added for the same fault; a new fault taints again",
            )

    def _reject(self, message: str) -> None:
        log.error("node.write_rejected", node=self._settings.name, error=message, retry_in_s=300)
        if self._attempt is not None:
            self._rejected = (_signature(self._attempt), time.monotonic() + 300)

    def _wait(self, state: tenacity.RetryCallState) -> float:
        base = tenacity.wait_exponential_jitter(
            multiplier=0.1, jitter=0.1, max=self._settings.retry_max_wait
        )(state)
        exc = state.outcome.exception() if state.outcome else None
        retry_after = getattr(exc, "retry_after", None)
        if retry_after:
            return max(base, min(float(retry_after), 30.0))
        return base

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _before_sleep(self, state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        if self._metrics is not None:
            self._metrics.api_retries.inc()
        if not self._api_down:
            self._api_down = True
            log.warning("api.unavailable", node=self._settings.name, error=str(exc))
        log.debug("api.retry", attempt=state.attempt_number, error=str(exc))


class _StopOn(tenacity.stop.stop_base):
    """Stop retrying once the agent shuts down."""

    def __init__(self, event: threading.Event) -> None:
        self._event = event

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self._event.is_set()


def _signature(change: NodeChange) -> str:
    return json.dumps(change.patch(""), sort_keys=True)
