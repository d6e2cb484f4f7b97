"""Per-GPU quarantine with DRA device taints (KEP-5055): a fault that belongs to one GPU becomes one
`DeviceTaintRule` (resource.k8s.io/v1) for that device only, where the node's GPUs are published in
ResourceSlices (NVIDIA's DRA driver, `gpu.nvidia.com`, pool = the node's name). Every other fault, and every
fault on a node without such slices (device-plugin clusters), stays with the node taint (`node.plan`).

This module is the rules themselves: gpuguard's rules as read (`DeviceRule`, with its fault record and its
share of the budget), the rule gpuguard writes (`rule_body`: a deterministic name, the node taint's record)
and the seam to the API server (`DeviceSource`). Which faults go to a rule is `plan`'s, the node's published
devices `slices`', the budget's order of rules `order`'s, and the state across reconciles `quarantine`'s
(docs/design.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

from gpuguard.core import validation
from gpuguard.core.errors import ConfigError
from gpuguard.core.model import Fault
from gpuguard.quarantine.gpu.slices import SliceDevice
from gpuguard.quarantine.record import (
    ANN_DEFERRED,
    ANN_REASON,
    ANN_SINCE,
    DOMAIN,
    TAINT_KEY,
    NodeRef,
    Recorded,
    new_record,
)

# Labels on every rule gpuguard writes: which node's (what `gpuguard status`, the budget and the admission
# policy select by), and who manages it.
LABEL_NODE = f"{DOMAIN}/node"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "gpuguard"
# The GPUs the node publishes, recorded on each rule: the budget's share of one rule is 1/this.
ANN_NODE_GPUS = f"{DOMAIN}/node-gpus"
ANN_UUID = f"{DOMAIN}/uuid"
# Device taint effects (no PreferNoSchedule for devices: DRA has no scoring).
NONE_EFFECT = "None"
_EFFECTS = {"NoSchedule": "NoSchedule", "NoExecute": "NoExecute", "PreferNoSchedule": NONE_EFFECT}

_MAX_NAME = 253
LIST_PAGE = 100
"""Rules per list page: one list of rules others wrote never sits in memory whole."""
RULE_PREFIX = "gpuguard."


def device_effect(node_effect: str) -> str:
    """--taint-effect for a device: NoSchedule and NoExecute as they are; PreferNoSchedule (soft) has no
    device counterpart, so None (informational) rather than a hard block the operator did not ask for."""
    return _EFFECTS.get(node_effect, "NoSchedule")


def rule_name(node: str, device: str) -> str | None:
    """gpuguard.<node>.<device>: a device name is a DNS label, which holds no dot, so the last dot splits the
    name back into node and device and no two (node, device) pairs share a name (the admission policy
    requires exactly this name of a create). Deterministic, so an agent restarted after a crash finds (409)
    the rule it made. None when it would be longer than a name may be, or the device is no DNS label: that
    GPU gets the node taint."""
    name = f"{RULE_PREFIX}{node}.{device}"
    if len(name) > _MAX_NAME or not validation.is_dns_label(device):
        return None
    return name


def earlier_rule_name(node: str, device: str) -> str:
    """The name gpuguard gave rules before the dotted scheme (gpuguard-<node>-<device>, ambiguous): such a
    rule is still recognised as the node's own, to be released; never made or adopted on a 409."""
    return f"gpuguard-{node}-{device}".lower()


@dataclass(frozen=True)
class DeviceRule(Recorded):
    """A DeviceTaintRule of gpuguard's as read (metadata and the parts gpuguard owns); its `record` is the
    node taint's."""

    name: str
    pool: str
    device: str
    effect: str
    taint_value: str = ""
    uid: str = ""
    resource_version: str = ""
    annotations: Mapping[str, str] = field(default_factory=dict)
    # metadata.creationTimestamp: set by the API server, so a rule's since can be checked against it.
    created: str = ""
    driver: str = ""
    key: str = TAINT_KEY
    labels: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_api(cls, doc: Mapping[str, Any]) -> DeviceRule:
        meta = doc.get("metadata") or {}
        spec = doc.get("spec") or {}
        sel = spec.get("deviceSelector") or {}
        return cls(
            name=str(meta.get("name", "")),
            pool=str(sel.get("pool") or ""),
            device=str(sel.get("device") or ""),
            effect=str((spec.get("taint") or {}).get("effect") or ""),
            taint_value=str((spec.get("taint") or {}).get("value") or ""),
            uid=str(meta.get("uid", "")),
            resource_version=str(meta.get("resourceVersion", "")),
            annotations=dict(meta.get("annotations") or {}),
            created=str(meta.get("creationTimestamp") or ""),
            driver=str(sel.get("driver") or ""),
            key=str((spec.get("taint") or {}).get("key") or ""),
            labels={str(k): str(v) for k, v in (meta.get("labels") or {}).items()},
        )

    def own(self, node: str) -> bool:
        """Provably gpuguard's rule for one device of `node`: `managed_for` that node, gpuguard's taint key,
        and the name gpuguard gives that (node, device) (or gave it before the dotted names). Anything else
        under gpuguard's labels was written by someone else: it is neither adopted, released nor counted."""
        return (
            self.managed_for(node)
            and self.key == TAINT_KEY
            and self.name in (rule_name(node, self.device), earlier_rule_name(node, self.device))
        )

    def managed_for(self, node: str) -> bool:
        """What every rule gpuguard writes for one device of `node` is, whichever its key: pool and
        gpuguard.io/node label both that node, managed by gpuguard, a driver and one device selected."""
        return (
            bool(node)
            and self.pool == node
            and self.labels.get(LABEL_NODE) == node
            and self.labels.get(LABEL_MANAGED_BY) == MANAGED_BY
            and bool(self.driver)
            and bool(self.device)
        )

    def selects(self, dev: SliceDevice) -> bool:
        """Owned by the device's node and selecting exactly that device of its driver (a 409's rule)."""
        return self.own(dev.pool) and (self.driver, self.device) == (dev.driver, dev.device)

    @property
    def uuid(self) -> str:
        return self.annotations.get(ANN_UUID, "")

    @property
    def faults(self) -> frozenset[str]:
        return self.record.faults

    @property
    def reason(self) -> str:
        """The record's reason, safe to show (/healthz, `gpuguard status`), whatever the annotation holds."""
        return validation.clean_text(self.annotations.get(ANN_REASON, ""))

    def from_earlier_boot(self, boot_id: str) -> bool:
        """The rule's record was written in an earlier boot than the node's current one (`boot_id`)."""
        return self.record.from_earlier_boot(boot_id)

    @property
    def deferred(self) -> bool:
        return ANN_DEFERRED in self.annotations

    @property
    def share(self) -> Fraction:
        """This rule's part of a node in the budget: 1/G, G the node's GPUs as recorded (at least 1, at
        most 1024: a record that is missing or absurd counts as a whole node rather than escape the limit)."""
        raw = self.annotations.get(ANN_NODE_GPUS, "")
        gpus = int(raw) if raw.isascii() and raw.isdigit() and 0 < len(raw) <= 4 else 1
        return Fraction(1, gpus if 1 <= gpus <= 1024 else 1)


# What of another agent's rule the budget reads (gpu.watch keeps only this): its claim of a share, of a
# place in the order, of being deferred, and its GPU. A value longer than gpuguard writes is cut.
_BUDGET_ANNOTATIONS = (ANN_NODE_GPUS, ANN_SINCE, ANN_DEFERRED, ANN_UUID)
_MAX_KEPT_VALUE = 256


def trim_rule(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a DeviceTaintRule as read that `DeviceRule.from_api` needs for the budget, bounded (a
    few hundred bytes whatever the rule holds): every agent keeps every rule in memory, and a rule is
    cluster-scoped, under no ResourceQuota."""
    meta = doc.get("metadata") or {}
    spec = doc.get("spec") or {}
    sel = spec.get("deviceSelector") or {}
    taint = spec.get("taint") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}

    def short(value: object) -> str:
        return str(value)[:_MAX_KEPT_VALUE]

    return {
        "metadata": {
            **{
                k: short(meta[k])
                for k in ("name", "uid", "resourceVersion", "creationTimestamp")
                if k in meta
            },
            "labels": {k: short(labels[k]) for k in (LABEL_NODE, LABEL_MANAGED_BY) if k in labels},
            "annotations": {k: short(annotations[k]) for k in _BUDGET_ANNOTATIONS if k in annotations},
        },
        "spec": {
            "deviceSelector": {k: short(sel[k]) for k in ("driver", "pool", "device") if k in sel},
            "taint": {k: short(taint[k]) for k in ("key", "value", "effect") if k in taint},
        },
    }


def rule_body(
    node: NodeRef,
    dev: SliceDevice,
    faults: Iterable[Fault],
    *,
    node_gpus: int,
    effect: str,
    since: str,
    deferred: bool = False,
) -> dict[str, Any]:
    """The DeviceTaintRule for one faulty GPU: its device only, gpuguard's taint key without a value (as the
    node taint: `record.TAINT_KEY`'s comment says why), and the node taint's record (faults, reason, since,
    boot-id)."""
    faults = tuple(faults)
    annotations = {
        **new_record(faults, since=since, boot_id=node.boot_id),
        ANN_UUID: validation.clean_text(dev.uuid, max_bytes=128),
        ANN_NODE_GPUS: str(node_gpus),
    }
    if deferred:
        annotations[ANN_DEFERRED] = "budget spent"
    return rule_document(
        rule_name(node.name, dev.device),
        node.name,
        dev,
        annotations=annotations,
        taint={"key": TAINT_KEY, "effect": effect},
    )


def rule_document(
    name: str | None,
    node: str,
    dev: SliceDevice,
    *,
    annotations: Mapping[str, str],
    taint: Mapping[str, str],
) -> dict[str, Any]:
    """A DeviceTaintRule gpuguard writes, of either kind: `name` (ConfigError when None: no valid name),
    under the node's and gpuguard's labels, selecting `dev` alone, with `taint`."""
    if name is None:
        raise ConfigError(f"device {dev.device!r} of node {node}: no valid rule name")
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": name,
            "labels": {LABEL_NODE: node, LABEL_MANAGED_BY: MANAGED_BY},
            "annotations": dict(annotations),
        },
        "spec": {
            "deviceSelector": {"driver": dev.driver, "pool": dev.pool, "device": dev.device},
            "taint": dict(taint),
        },
    }


class DeviceSource(Protocol):
    """The API server's ResourceSlices and DeviceTaintRules for one node (`gpu.writers`)."""

    def slices(self) -> list[dict[str, Any]] | None:
        """The node's ResourceSlices of the driver; None where the API server does not serve them."""

    def rules(self) -> list[DeviceRule]:
        """gpuguard's rules for this node (label selector)."""

    def all_rules(self) -> list[DeviceRule]:
        """gpuguard's rules of every node: the budget's count."""

    def create(self, body: Mapping[str, Any]) -> DeviceRule:
        """Create; ConflictError when a rule of that name exists."""

    def get(self, name: str) -> DeviceRule | None:
        """The rule of that name, whoever wrote it; None when there is none."""

    def patch(self, rule: DeviceRule, body: Mapping[str, Any]) -> DeviceRule:
        """Merge patch with the rule's resourceVersion; ConflictError when it moved on."""

    def delete(self, rule: DeviceRule) -> None:
        """Delete with the rule's uid and resourceVersion as preconditions."""
