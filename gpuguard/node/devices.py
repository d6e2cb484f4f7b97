"""Per-GPU quarantine with DRA device taints (KEP-5055): a fault that belongs to one GPU becomes one
`DeviceTaintRule` (resource.k8s.io/v1) for that device only, where the node's GPUs are published in
ResourceSlices (NVIDIA's DRA driver, `gpu.nvidia.com`, pool = the node's name). Every other fault, and every
fault on a node without such slices (device-plugin clusters), stays with the node taint (`plan`).

- which faults are one GPU's (`per_gpu`), and the split of a verdict into the GPUs' part and the node's
  (`Split`, `split`), both pure;
- the published devices of the node by the GPU's UUID (`slice_devices`) and gpuguard's rules as read
  (`DeviceRule`), with the rule gpuguard writes (`rule_body`: a deterministic name, the node taint's record);
- `DeviceQuarantine`: the state across reconciles (the slices and rules last read, the rules an operator
  deleted, the budget's answer), through its own seam `DeviceSource` (the API server or a dry run).

The budget counts GPUs as well as nodes (docs/design.md): a rule costs 1/G of a node's share (G: the GPUs
the node publishes, recorded on the rule), and the sum of all rules plus the fully quarantined nodes must stay
within --max-quarantined; past it the rule is written with effect None (informational: the API server's
status says what would be evicted) until there is room. Agents that fault at the same instant all see room:
after a rule is made blocking, the quarantine order of rules and fully quarantined nodes (`rules_past_limit`)
is checked at once and again VERIFY_SETTLE seconds later, and a rule of this node past the limit steps back
to effect None.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from fractions import Fraction
from typing import Any, Protocol, TypeVar

import structlog

from gpuguard import validation
from gpuguard.config import NodeSettings
from gpuguard.errors import ConfigError, ConflictError, NodeUpdateError, PermanentApiError
from gpuguard.model import ECC, RESET_REQUIRED, ROW_REMAP, Fault, GpuQuarantine, Verdict, recovery_reason
from gpuguard.node.budget import VERIFY_SETTLE, Budget
from gpuguard.node.view import (
    ANN_BOOT_ID,
    ANN_DEFERRED,
    ANN_FAULTS,
    ANN_REASON,
    ANN_SINCE,
    DOMAIN,
    TAINT_KEY,
    NodeView,
    join_keys,
    reason_text,
    rfc3339,
)
from gpuguard.policy import cleared_without_reboot, primary

log = structlog.get_logger("gpuguard.node.devices")
T = TypeVar("T")

API = "/apis/resource.k8s.io/v1"
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
_NAME_SAFE = re.compile(r"[^a-z0-9.-]")
_RESET_ACTIONS = frozenset({recovery_reason(1), recovery_reason(4)})  # gpu-reset, drain-and-reset


def per_gpu(fault: Fault) -> bool:
    """A fault that belongs to one GPU: uncorrected ECC, an Xid on that GPU, a failed row remap, the driver
    asking for a reset of that GPU. A lost or missing GPU, NVML that does not start, a GPU that does not
    answer and a recovery action beyond the GPU (node reboot, ...) are the node's: the node taint."""
    if not fault.uuid:
        return False
    r = fault.reason
    return r in (ECC, ROW_REMAP, RESET_REQUIRED) or r.startswith("xid-") or r in _RESET_ACTIONS


def device_effect(node_effect: str) -> str:
    """--taint-effect for a device: NoSchedule and NoExecute as they are; PreferNoSchedule (soft) has no
    device counterpart, so None (informational) rather than a hard block the operator did not ask for."""
    return _EFFECTS.get(node_effect, "NoSchedule")


@dataclass(frozen=True)
class SliceDevice:
    """One device of a ResourceSlice, as the rule selects it."""

    driver: str
    pool: str
    device: str
    uuid: str


def slice_devices(items: Iterable[Mapping[str, Any]], *, driver: str, node: str) -> dict[str, SliceDevice]:
    """The node's published devices by GPU UUID: the slices of `driver` whose pool is the node's name (as
    NVIDIA's DRA driver publishes them), each device's `uuid` attribute (or `<driver>/uuid`). A device
    without a UUID, or two with the same one, is left out: a rule must name exactly the faulty GPU."""
    found: dict[str, SliceDevice] = {}
    twice: set[str] = set()
    for item in items:
        spec = item.get("spec") or {}
        pool = str((spec.get("pool") or {}).get("name") or "")
        if spec.get("driver") != driver or pool != node:
            continue
        for dev in spec.get("devices") or []:
            attrs = dev.get("attributes") or {}
            attr = attrs.get("uuid") or attrs.get(f"{driver}/uuid") or {}
            uuid = attr.get("string") if isinstance(attr, Mapping) else None
            name = dev.get("name")
            if not isinstance(uuid, str) or not uuid or not isinstance(name, str):
                continue
            if uuid in found:
                twice.add(uuid)
            found[uuid] = SliceDevice(driver=driver, pool=pool, device=name, uuid=uuid)
    for uuid in twice:
        log.warning("device.uuid_ambiguous", node=node, uuid=uuid, note="published twice: node taint")
        del found[uuid]
    return found


def rule_name(node: str, device: str) -> str:
    """Deterministic: gpuguard-<node>-<device> (a DNS subdomain), with a hash when that is too long, so an
    agent restarted after a crash finds (409) the rule it made, and never makes a second one."""
    name = _NAME_SAFE.sub("-", f"gpuguard-{node}-{device}".lower()).strip("-.")
    if len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(f"{node}/{device}".encode()).hexdigest()[:16]
    return f"{name[: _MAX_NAME - 17].rstrip('-.')}-{digest}"


@dataclass(frozen=True)
class DeviceRule:
    """A DeviceTaintRule of gpuguard's as read (metadata and the parts gpuguard owns)."""

    name: str
    pool: str
    device: str
    effect: str
    taint_value: str = ""
    uid: str = ""
    resource_version: str = ""
    annotations: Mapping[str, str] = field(default_factory=dict)

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
        )

    @property
    def uuid(self) -> str:
        return self.annotations.get(ANN_UUID, "")

    @property
    def faults(self) -> frozenset[str]:
        raw = self.annotations.get(ANN_FAULTS, "")
        return frozenset(validation.fault_key(k) for k in raw.split(",") if k)

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


def rules_past_limit(
    nodes: Iterable[tuple[str, str]], rules: Iterable[DeviceRule], limit: int
) -> dict[str, Fraction]:
    """The quarantine order of rules: every blocking rule of gpuguard (its share) and every fully quarantined
    node (`nodes`: (since, name), a whole node each), the earlier gpuguard.io/since first, then the name.
    Returns the rules past `limit` with what comes before each. Pure; every agent reads the same rules and
    nodes, so every agent computes the same order, and the earliest keep their place. Only rules are ever
    named: a node past the limit is the node budget's to step back (budget.plan_yield), never a rule's."""
    entries: list[tuple[str, str, Fraction, bool]] = [
        (since, name, Fraction(1), False) for since, name in set(nodes)
    ]
    entries += [
        (r.annotations.get(ANN_SINCE, ""), r.name, r.share, True)
        for r in rules
        if not r.deferred and r.effect != NONE_EFFECT
    ]
    past: dict[str, Fraction] = {}
    used = Fraction(0)
    for _, name, share, is_rule in sorted(entries, key=lambda e: (e[0], e[1])):
        if is_rule and used + share > limit:
            past[name] = used
        used += share
    return past


def rule_body(
    node: NodeView,
    dev: SliceDevice,
    faults: Iterable[Fault],
    *,
    node_gpus: int,
    effect: str,
    since: str,
    deferred: bool = False,
) -> dict[str, Any]:
    """The DeviceTaintRule for one faulty GPU: its device only, gpuguard's taint key, the reason of its
    most severe fault as value, and the node taint's record (faults, reason, since, boot-id)."""
    faults = tuple(faults)
    annotations = {
        ANN_FAULTS: join_keys({validation.fault_key(f.key) for f in faults}),
        ANN_REASON: reason_text(faults),
        ANN_SINCE: since,
        ANN_BOOT_ID: node.boot_id,
        ANN_UUID: validation.clean_text(dev.uuid, max_bytes=128),
        ANN_NODE_GPUS: str(node_gpus),
    }
    if deferred:
        annotations[ANN_DEFERRED] = "budget spent"
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": rule_name(node.name, dev.device),
            "labels": {LABEL_NODE: node.name, LABEL_MANAGED_BY: MANAGED_BY},
            "annotations": annotations,
        },
        "spec": {
            "deviceSelector": {"driver": dev.driver, "pool": dev.pool, "device": dev.device},
            "taint": {"key": TAINT_KEY, "value": _taint_value(faults), "effect": effect},
        },
    }


def _taint_value(faults: tuple[Fault, ...]) -> str:
    first = primary(faults)
    value = first.reason if first is not None else "unhealthy"
    try:
        return validation.taint_value(value)
    except ConfigError:  # a reason that is not a label value: a fixed one
        return "unhealthy"


@dataclass(frozen=True)
class Split:
    """A verdict split by quarantine: the GPUs' faults that rules carry, and the verdict left for the node."""

    node_verdict: Verdict
    by_gpu: Mapping[str, tuple[Fault, ...]]


def split(verdict: Verdict, devices: Mapping[str, SliceDevice], *, mode: str, held: frozenset[str]) -> Split:
    """Pure. With mode "node" everything stays with the node. Otherwise a per-GPU fault whose GPU is
    published (`devices`) goes to that GPU's rule, unless the rule could not be written (`held`: UUIDs whose
    rule the API server refused), where the node taint stands in: never a fault without a quarantine."""
    if mode == "node":
        return Split(node_verdict=verdict, by_gpu={})
    by_gpu: dict[str, tuple[Fault, ...]] = {}
    gpus = []
    for g in verdict.gpus:
        moved = tuple(f for f in g.faults if per_gpu(f) and g.uuid in devices and g.uuid not in held)
        if moved:
            by_gpu[g.uuid] = moved
        gpus.append(replace(g, faults=tuple(f for f in g.faults if f not in moved)) if moved else g)
    return Split(node_verdict=replace(verdict, gpus=tuple(gpus)), by_gpu=by_gpu)


class DeviceSource(Protocol):
    """The API server's ResourceSlices and DeviceTaintRules for one node (`devicewriters`)."""

    def slices(self) -> list[dict[str, Any]] | None:
        """The node's ResourceSlices of the driver; None where the API server does not serve them."""

    def rules(self) -> list[DeviceRule]:
        """gpuguard's rules for this node (label selector)."""

    def all_rules(self) -> list[DeviceRule]:
        """gpuguard's rules of every node: the budget's count."""

    def create(self, body: Mapping[str, Any]) -> DeviceRule:
        """Create; ConflictError when a rule of that name exists."""

    def patch(self, rule: DeviceRule, body: Mapping[str, Any]) -> DeviceRule:
        """Merge patch with the rule's resourceVersion; ConflictError when it moved on."""

    def delete(self, rule: DeviceRule) -> None:
        """Delete with the rule's uid and resourceVersion as preconditions."""


class DeviceQuarantine:
    """The per-GPU quarantine across reconciles. `apply` runs in the reconciler's thread before the node is
    planned: it writes the rules and returns the verdict left for the node taint.

    Reads: the node's slices and rules at the first call (the agent's first reconcile), then again every
    --node-resync seconds while a rule is held, and at once when a fault names a GPU the node's slices did
    not list. A node without slices at the first read makes no request in a fault's path (its faults get
    the node taint, as on a device-plugin cluster), and a healthy node without rules costs nothing.
    """

    def __init__(
        self,
        source: DeviceSource,
        settings: NodeSettings,
        *,
        budget: Callable[[], Budget | None] | None = None,
        order: Callable[[], Iterable[tuple[str, str]]] | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._source = source
        self._settings = settings
        self._budget = budget
        self._order = order
        self._now = now
        self._clock = clock
        self._devices: dict[str, SliceDevice] = {}
        self._node_gpus = 0
        self._rules: dict[str, DeviceRule] = {}
        self._read_at = -math.inf
        self._slices_at = -math.inf
        self._budget_at = -math.inf
        # Rules gpuguard made or found (name -> fault keys): one that is gone at the next read was deleted by
        # an operator, and is not made again for the same faults (a new fault makes it again).
        self._known: dict[str, frozenset[str]] = {}
        self._overridden: dict[str, frozenset[str]] = {}
        # UUIDs whose rule the API server refused (403, 404 API not served): the node taint stands in.
        self._held: set[str] = set()
        self._read_error = ""
        # Rules made blocking since the last settled order check, whether the check runs at this apply,
        # and the monotonic time of the second check (VERIFY_SETTLE after the last blocking write).
        self._fresh: set[str] = set()
        self._check_now = False
        self._settle_at: float | None = None
        self.quarantined: tuple[GpuQuarantine, ...] = ()

    @property
    def mode(self) -> str:
        return self._settings.quarantine

    @property
    def holds_rules(self) -> bool:
        """Rules are held: the reconciler reads the node (its bootID) every --node-resync seconds, and the
        rules are read again then (an operator's deletion)."""
        return bool(self._rules)

    @property
    def settling(self) -> bool:
        """An order check of a fresh rule is pending: the reconciler must wake for it on an unchanged
        verdict."""
        return self._settle_at is not None

    def apply(self, node: NodeView, verdict: Verdict, *, streak: int, flapping: bool) -> Verdict:
        """Write the rules the verdict asks for; return the verdict left for the node (per-GPU faults out)."""
        if self.mode == "node":
            return verdict
        wanted = {g.uuid for g in verdict.gpus if any(per_gpu(f) for f in g.faults)}
        due = self._clock() - self._read_at >= self._settings.node_resync
        if self._read_at == -math.inf or (due and self._rules):
            self._read(node)
        elif (
            self._devices
            and wanted - set(self._devices) - self._held
            and self._clock() - self._slices_at >= 1.0
        ):
            # A DRA node, and a fault on a GPU its slices did not list: they may have changed since. A node
            # without slices (device-plugin clusters) makes no request here: the fault's path stays as fast.
            self._read(node)
        result = split(verdict, self._devices, mode=self.mode, held=frozenset(self._held))
        if self.mode == "gpu":
            for uuid in wanted - set(result.by_gpu):
                log.error("device.unpublished", node=node.name, uuid=uuid, note="node taint instead")
        by_uuid = {r.uuid: r for r in self._rules.values() if r.uuid}
        for uuid, faults in result.by_gpu.items():
            self._hold(node, self._devices[uuid], faults, by_uuid.get(uuid))
        if self._held & set(result.by_gpu):
            # A rule was refused just now: its faults go back to the node in this very reconcile.
            result = split(verdict, self._devices, mode=self.mode, held=frozenset(self._held))
        faulty = set(result.by_gpu)
        for uuid, rule in by_uuid.items():
            if uuid not in faulty and uuid not in wanted:
                self._release(node, rule, verdict, streak=streak, flapping=flapping)
        for uuid in list(self._overridden):
            if uuid not in wanted:
                del self._overridden[uuid]  # the fault is gone: a new one makes a rule again
        self._verify(node)
        self._publish()
        return result.node_verdict

    def _read(self, node: NodeView) -> None:
        self._slices_at = self._read_at = self._clock()
        try:
            docs = self._source.slices()
            rules = {r.name: r for r in self._source.rules()}
        except PermanentApiError as exc:
            # 403: a ClusterRole from before the per-GPU quarantine. Every fault gets the node taint until a
            # read succeeds (next --node-resync): never no quarantine at all because of the GPUs' one.
            if self._devices or self._read_error != str(exc):
                log.error("device.read_rejected", node=node.name, error=str(exc), note="node taint")
            self._read_error = str(exc)
            self._devices, self._node_gpus = {}, 0
            return
        self._read_error = ""
        self._devices = slice_devices(docs or [], driver=self._settings.dra_driver, node=node.name)
        self._node_gpus = len(self._devices)
        for name, keys in self._known.items():
            if name not in rules:
                log.warning(
                    "device.rule_removed_by_operator", node=node.name, rule=name, faults=join_keys(keys)
                )
                uuid = next((r.uuid for r in self._rules.values() if r.name == name), "")
                self._overridden[uuid] = keys
        self._known = {n: r.faults for n, r in rules.items()}
        self._rules = rules

    def _hold(
        self, node: NodeView, dev: SliceDevice, faults: tuple[Fault, ...], rule: DeviceRule | None
    ) -> None:
        keys = frozenset(validation.fault_key(f.key) for f in faults)
        if rule is None:
            if self._overridden.get(dev.uuid, frozenset()) >= keys:
                return  # an operator deleted the rule for these very faults
            self._create(node, dev, faults)
            return
        from_earlier_boot = rule.annotations.get(ANN_BOOT_ID, "") not in ("", node.boot_id)
        recorded = frozenset() if from_earlier_boot else rule.faults
        body: dict[str, Any] = {}
        annotations: dict[str, str | None] = {}
        if not keys <= recorded:
            annotations[ANN_FAULTS] = join_keys(recorded | keys)
            annotations[ANN_REASON] = reason_text(faults)
            if from_earlier_boot:
                annotations[ANN_BOOT_ID] = node.boot_id
        effect = device_effect(self._settings.taint_effect)
        if rule.deferred and self._room(node, rule):
            annotations[ANN_DEFERRED] = None
            body["spec"] = {"taint": {"key": TAINT_KEY, "value": _taint_value(faults), "effect": effect}}
        if not annotations and not body:
            return
        body["metadata"] = {"annotations": annotations, "resourceVersion": rule.resource_version}
        updated = self._write(node, rule, lambda: self._source.patch(rule, body))
        if updated is None:
            return
        self._rules[updated.name] = updated
        self._known[updated.name] = updated.faults
        if "spec" in body:
            self._blocking(updated)
        log.warning(
            "device.rule_updated",
            node=node.name,
            rule=rule.name,
            device=rule.device,
            uuid=dev.uuid,
            escalated="spec" in body,
            dry_run=self._settings.dry_run,
        )

    def _write(self, node: NodeView, rule: DeviceRule, call: Callable[[], T]) -> T | None:
        """A change to an existing rule: its answer, or None when it did not land. A conflict (someone
        changed the rule) reads the rules again at the next reconcile; a refusal is logged, the rule left."""
        try:
            return call()
        except ConflictError:
            self._read_at = -math.inf
        except PermanentApiError as exc:
            log.error("device.rule_write_rejected", node=node.name, rule=rule.name, error=str(exc))
        return None

    def _create(self, node: NodeView, dev: SliceDevice, faults: tuple[Fault, ...]) -> None:
        try:
            deferred = not self._room(node, None)
        except PermanentApiError as exc:
            self._held.add(dev.uuid)
            log.error(
                "device.budget_unreadable", node=node.name, uuid=dev.uuid, error=str(exc), note="node taint"
            )
            return
        effect = NONE_EFFECT if deferred else device_effect(self._settings.taint_effect)
        body = rule_body(
            node,
            dev,
            faults,
            node_gpus=max(self._node_gpus, 1),
            effect=effect,
            since=rfc3339(self._now()),
            deferred=deferred,
        )
        try:
            rule = self._source.create(body)
        except PermanentApiError as exc:
            # Refused (the admission policy, a server without DeviceTaintRules): the node taint stands in.
            self._held.add(dev.uuid)
            log.error(
                "device.rule_rejected", node=node.name, uuid=dev.uuid, error=str(exc), note="node taint"
            )
            return
        self._rules[rule.name] = rule
        self._known[rule.name] = rule.faults
        if not deferred:
            self._blocking(rule)
        first = faults[0]
        log.warning(
            "device.tainted_soft" if deferred else "device.tainted",
            node=node.name,
            rule=rule.name,
            device=dev.device,
            uuid=dev.uuid,
            gpu=first.gpu_index,
            reason=first.reason,
            detail=first.message,
            effect=effect,
            dry_run=self._settings.dry_run,
        )

    def _release(
        self, node: NodeView, rule: DeviceRule, verdict: Verdict, *, streak: int, flapping: bool
    ) -> None:
        """Recovery under the node taint's evidence rules: --recover-after healthy checks of the node, not
        flapping, and every recorded fault proven gone by the reading or by a reboot (a new bootID)."""
        s = self._settings
        if not s.recover or streak < s.recover_after or flapping:
            return
        gone = all(cleared_without_reboot(k, verdict.reset_cleared) for k in rule.faults)
        rebooted = rule.annotations.get(ANN_BOOT_ID, "") not in ("", node.boot_id) and bool(node.boot_id)
        if not (gone or rebooted):
            return
        if not self._write(node, rule, lambda: _deleted(self._source, rule)):
            return
        self._rules.pop(rule.name, None)
        self._known.pop(rule.name, None)
        log.info(
            "device.recovered",
            node=node.name,
            rule=rule.name,
            device=rule.device,
            uuid=rule.uuid,
            dry_run=s.dry_run,
        )

    def _blocking(self, rule: DeviceRule) -> None:
        """A rule was just made blocking: the quarantine order is checked at the end of this apply and
        again VERIFY_SETTLE seconds later (the other agents' writes of the same burst have landed by then)."""
        if self._budget is None or rule.effect == NONE_EFFECT:
            return
        self._fresh.add(rule.name)
        self._check_now = True

    def _verify(self, node: NodeView) -> None:
        """The order check of fresh rules when it is due: at once after the write, then once more after
        VERIFY_SETTLE (a failed list tries again VERIFY_SETTLE later)."""
        due = self._settle_at is not None and self._clock() >= self._settle_at
        if not self._fresh or not (self._check_now or due):
            if not self._fresh:
                self._settle_at = None
            return
        first = self._check_now
        self._check_now = False
        if self._check_order(node) and not first:
            self._fresh.clear()
            self._settle_at = None
            return
        self._settle_at = self._clock() + VERIFY_SETTLE

    def _check_order(self, node: NodeView) -> bool:
        """Is a fresh rule of this node past the limit in the cluster's quarantine order? Steps it back to
        effect None (deferred). False when the lists failed or a step back did not land (checked again
        later)."""
        assert self._budget is not None
        try:
            budget = self._budget()
            if budget is None:
                return True
            nodes = list(self._order()) if self._order is not None else []
            rules = self._source.all_rules()
        except NodeUpdateError as exc:
            log.warning("device.quarantine_order_failed", node=node.name, error=str(exc))
            return False
        past = rules_past_limit(nodes, rules, budget.limit)
        landed = True
        for name in sorted(self._fresh):
            rule = self._rules.get(name)
            if rule is None or rule.deferred or rule.effect == NONE_EFFECT:
                self._fresh.discard(name)  # recovered, deleted or deferred meanwhile
            elif name in past:
                landed = self._step_back(node, rule, past[name], budget.limit) and landed
        return landed

    def _step_back(self, node: NodeView, rule: DeviceRule, ahead: Fraction, limit: int) -> bool:
        """A blocking rule past the budget (agents that faulted at the same instant all saw room) steps back
        to the deferred state: effect None and gpuguard.io/quarantine-deferred, until a re-check has room."""
        why = (
            f"quarantine budget spent: {float(ahead):g} GPU nodes' worth quarantined before this rule, "
            f"limit {limit} (--max-quarantined {self._settings.max_quarantined})"
        )
        body = {
            "metadata": {"annotations": {ANN_DEFERRED: why}, "resourceVersion": rule.resource_version},
            "spec": {"taint": {"key": TAINT_KEY, "value": rule.taint_value, "effect": NONE_EFFECT}},
        }
        updated = self._write(node, rule, lambda: self._source.patch(rule, body))
        if updated is None:
            return False  # a conflict: the rules are read again, the settle re-check looks again
        self._rules[updated.name] = updated
        self._fresh.discard(updated.name)
        self._budget_at = self._clock()  # the next room re-check waits --budget-recheck
        log.warning(
            "device.rule_yielded",
            node=node.name,
            rule=rule.name,
            device=rule.device,
            uuid=rule.uuid,
            ahead=float(ahead),
            limit=limit,
            note="effect None until there is room",
        )
        return True

    def _room(self, node: NodeView, rule: DeviceRule | None) -> bool:
        """Whether one more GPU fits the budget: the fully quarantined nodes plus every rule's share (this
        one's included), at most --max-quarantined. Re-checked at most every --budget-recheck seconds for a
        deferred rule. No budget source (a dry run): always room."""
        if self._budget is None:
            return True
        if rule is not None and self._clock() - self._budget_at < self._settings.budget_recheck:
            return False
        self._budget_at = self._clock()
        budget = self._budget()
        if budget is None:
            return True
        others = [
            r for r in self._source.all_rules() if not r.deferred and r.name != (rule.name if rule else "")
        ]
        share = Fraction(1, max(self._node_gpus, 1))
        used = Fraction(budget.quarantined) + sum((r.share for r in others), Fraction(0))
        room = used + share <= budget.limit
        if not room:
            log.warning(
                "device.budget_spent",
                node=node.name,
                quarantined=float(used),
                limit=budget.limit,
                note="rule with effect None until there is room",
            )
        return room

    def _publish(self) -> None:
        self.quarantined = tuple(
            GpuQuarantine(
                uuid=r.uuid,
                device=r.device,
                rule=r.name,
                reason=r.annotations.get(ANN_REASON, ""),
                effect=r.effect,
                deferred=r.deferred,
            )
            for r in sorted(self._rules.values(), key=lambda r: r.device)
        )


def _deleted(source: DeviceSource, rule: DeviceRule) -> bool:
    source.delete(rule)
    return True
