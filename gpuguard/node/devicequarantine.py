"""`DeviceQuarantine`: the per-GPU quarantine's state across reconciles (the slices and rules last read, the
rules an operator deleted, the budget's answer, the order check of fresh rules), through its own seam
`DeviceSource` (the API server or a dry run, `devicewriters`).

The budget counts GPUs as well as nodes (docs/design.md): a rule costs 1/G of a node's share (G: the GPUs
the node publishes, recorded on the rule), and the sum of all rules plus the fully quarantined nodes must stay
within --max-quarantined; past it the rule is written with effect None (informational: the API server's
status says what would be evicted) until there is room. Agents that fault at the same instant all see room:
after a rule is made blocking, the quarantine order of rules and fully quarantined nodes
(`deviceorder.rules_past_limit`) is checked at once and again VERIFY_SETTLE seconds later, and a rule of this
node past the limit steps back to effect None.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from fractions import Fraction
from typing import Any, Protocol, TypeVar

import structlog

from gpuguard import validation
from gpuguard.config import NodeSettings
from gpuguard.errors import ConflictError, GpuguardError, NodeUpdateError, PermanentApiError
from gpuguard.model import Fault, GpuQuarantine, Verdict
from gpuguard.node.budget import VERIFY_SETTLE, Budget
from gpuguard.node.deviceorder import rules_past_limit, rules_share
from gpuguard.node.devices import (
    NONE_EFFECT,
    DeviceRule,
    device_effect,
    per_gpu,
    rule_body,
    split,
    taint_value,
)
from gpuguard.node.deviceslices import SliceDevice, slice_devices
from gpuguard.node.view import (
    ANN_BOOT_ID,
    ANN_DEFERRED,
    ANN_FAULTS,
    ANN_REASON,
    TAINT_KEY,
    NodeView,
    join_keys,
    reason_text,
    rfc3339,
)
from gpuguard.policy import cleared_without_reboot
from gpuguard.state import RuleMemory

log = structlog.get_logger("gpuguard.node.devices")
T = TypeVar("T")


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


class RuleMemoryStore(Protocol):
    """Where the rules' memory outlives the process (`state.StateStore`)."""

    def load_rules(self) -> RuleMemory:
        """The memory recorded in this boot (empty when none)."""

    def save_rules(self, rules: RuleMemory) -> None:
        """Record it (written only when changed; never raises)."""


class DeviceQuarantine:
    """The per-GPU quarantine across reconciles. `apply` runs in the reconciler's thread before the node is
    planned: it writes the rules and returns the verdict left for the node taint.

    Reads: the node's slices and rules at the first call (the agent's first reconcile), then again every
    --node-resync seconds while a rule is held. A fault on a GPU the slices do not list gets the node taint
    with no request before it, and the slices are read again after that write (`refresh`); a healthy node
    without rules costs nothing.
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
        memory: RuleMemoryStore | None = None,
    ) -> None:
        """memory: where the rules gpuguard made and those an operator deleted outlive the process (the
        agent's `state.StateStore`); None: in memory only (a dry run, no --state-dir)."""
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
        self._budget_at = -math.inf
        # Rules gpuguard made or found (name -> (UUID, fault keys)): one that is gone at the next read was
        # deleted by an operator, and is not made again for the same faults (a new fault makes it again).
        # Kept in `memory` at every change, so that a restarted agent knows them too (docs/reliability.md).
        self._memory = memory
        remembered = memory.load_rules() if memory is not None else RuleMemory()
        self._known: dict[str, tuple[str, frozenset[str]]] = dict(remembered.known)
        self._overridden: dict[str, frozenset[str]] = dict(remembered.overridden)
        # UUIDs whose rule the API server refused (403, 404 API not served): the node taint stands in.
        self._held: set[str] = set()
        # Faulty GPUs the slices did not list: to read the slices for after the node write, and read for.
        self._refresh_for: set[str] = set()
        self._refreshed_for: set[str] = set()
        self._node_name = settings.name or ""
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
    def gate_held(self) -> bool:
        """A rule of this node blocks nothing (deferred by the budget, effect None) while its GPU is faulty:
        the startup gate must stay (docs/design.md, the startup gate), as for a deferred node quarantine."""
        return any(r.deferred or r.effect == NONE_EFFECT for r in self._rules.values())

    @property
    def settling(self) -> bool:
        """An order check of a fresh rule is pending: the reconciler must wake for it on an unchanged
        verdict."""
        return self._settle_at is not None

    def apply(
        self,
        node: NodeView,
        verdict: Verdict,
        *,
        streak: int,
        flapping: bool,
        gpu_streaks: Mapping[str, int] | None = None,
    ) -> Verdict:
        """Write the rules the verdict asks for; return the verdict left for the node (per-GPU faults out).
        A rule recovers on its GPU's own healthy streak (`gpu_streaks`, by UUID), or the node's (`streak`,
        never longer than any GPU's) where none is given."""
        if self.mode == "node":
            return verdict
        wanted = {g.uuid for g in verdict.gpus if any(per_gpu(f) for f in g.faults)}
        due = self._clock() - self._read_at >= self._settings.node_resync
        if self._read_at == -math.inf or (due and self._rules):
            self._read(node)
        # A fault on a GPU the slices did not list: the node taint now, and the slices read again after this
        # reconcile's node write (`refresh`), once per fault: a DRA driver that started after the agent, or
        # a GPU published since. Never a request before the taint, and none on a healthy node.
        missing = wanted - set(self._devices) - self._held
        self._refreshed_for &= missing
        self._refresh_for = missing - self._refreshed_for
        self._node_name = node.name
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
                own = streak if gpu_streaks is None else max(streak, gpu_streaks.get(uuid, 0))
                self._release(node, rule, verdict, streak=own, flapping=flapping)
        for uuid in list(self._overridden):
            if uuid not in wanted:
                del self._overridden[uuid]  # the fault is gone: a new one makes a rule again
        self._remember()
        self._verify(node)
        self._publish()
        return result.node_verdict

    def _read(self, node: NodeView) -> None:
        self._read_at = self._clock()
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
        for name, (uuid, keys) in self._known.items():
            if name not in rules:
                log.warning(
                    "device.rule_removed_by_operator",
                    node=node.name,
                    rule=name,
                    uuid=uuid,
                    faults=join_keys(keys),
                )
                self._overridden[uuid] = keys
        self._known = {n: (r.uuid, r.faults) for n, r in rules.items()}
        self._rules = rules
        self._remember()

    def refresh(self) -> None:
        """After the reconcile's node write (the reconciler calls it): where a fault found no device, read the
        node's slices again, so that the next fault on a GPU published since gets its rule. A failed read
        is a warning (the node taint stands; the next new fault tries again)."""
        if not self._refresh_for:
            return
        self._refreshed_for |= self._refresh_for
        self._refresh_for = set()
        try:
            docs = self._source.slices()
        except PermanentApiError as exc:
            if self._read_error != str(exc):  # the same refusal as the first read's: said already
                log.error("device.read_rejected", node=self._node_name, error=str(exc), note="node taint")
            self._read_error = str(exc)
            return
        except GpuguardError as exc:
            log.warning("device.slices_refresh_failed", node=self._node_name, error=str(exc))
            return
        self._read_error = ""
        devices = slice_devices(docs or [], driver=self._settings.dra_driver, node=self._node_name)
        if len(devices) != len(self._devices):
            log.info(
                "device.slices_changed", node=self._node_name, gpus=len(devices), before=len(self._devices)
            )
        self._devices, self._node_gpus = devices, len(devices)

    def _remember(self) -> None:
        """The rules made and those deleted by an operator, into the durable memory (written only when they
        changed). A rule is remembered after its create answered, and forgotten before its delete is sent:
        a crash between the two never turns a rule into one "deleted by an operator" (that would leave a
        fault without a quarantine); the worst case, a rule deleted by hand during that crash, is made again
        (docs/reliability.md)."""
        if self._memory is not None:
            self._memory.save_rules(RuleMemory(known=dict(self._known), overridden=dict(self._overridden)))

    def _hold(
        self, node: NodeView, dev: SliceDevice, faults: tuple[Fault, ...], rule: DeviceRule | None
    ) -> None:
        keys = frozenset(validation.fault_key(f.key) for f in faults)
        if rule is None:
            if self._overridden.get(dev.uuid, frozenset()) >= keys:
                return  # an operator deleted the rule for these very faults
            self._create(node, dev, faults)
            return
        from_earlier_boot = rule.from_earlier_boot(node.boot_id)
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
            body["spec"] = {"taint": {"key": TAINT_KEY, "value": taint_value(faults), "effect": effect}}
        if not annotations and not body:
            return
        body["metadata"] = {"annotations": annotations, "resourceVersion": rule.resource_version}
        updated = self._write(node, rule, lambda: self._source.patch(rule, body))
        if updated is None:
            return
        self._rules[updated.name] = updated
        self._known[updated.name] = (updated.uuid, updated.faults)
        self._remember()
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
        self._known[rule.name] = (rule.uuid, rule.faults)
        self._remember()
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
        """Recovery under the node taint's evidence rules: --recover-after healthy checks of the GPU, not
        flapping, and every recorded fault proven gone by the reading or by a reboot (a new bootID)."""
        s = self._settings
        if not s.recover or streak < s.recover_after or flapping:
            return
        gone = all(cleared_without_reboot(k, verdict.reset_cleared) for k in rule.faults)
        rebooted = rule.from_earlier_boot(node.boot_id)
        if not (gone or rebooted):
            return
        self._known.pop(rule.name, None)  # before the delete: see _remember
        self._remember()
        if not self._write(node, rule, lambda: _deleted(self._source, rule)):
            return
        self._rules.pop(rule.name, None)
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
        past = rules_past_limit(nodes, rules, budget.limit, now=self._now())
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
        others = [r for r in self._source.all_rules() if r.name != (rule.name if rule else "")]
        # The fully quarantined nodes' rules count nothing more (the node counts once): asked only where both
        # exist, so a fleet without node quarantines adds no read here.
        covered: list[str] = []
        if budget.quarantined and others and self._order is not None:
            covered = [name for _, name in self._order()]
        share = Fraction(1, max(self._node_gpus, 1))
        used = Fraction(budget.quarantined) + rules_share(others, covered=covered)
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
                reason=r.reason,
                effect=r.effect,
                deferred=r.deferred,
            )
            for r in sorted(self._rules.values(), key=lambda r: r.device)
        )


def _deleted(source: DeviceSource, rule: DeviceRule) -> bool:
    source.delete(rule)
    return True
