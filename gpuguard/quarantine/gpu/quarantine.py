"""`DeviceQuarantine`: the per-GPU quarantine's state across reconciles (the slices and rules last read,
their writes, the memory of the rules an operator deleted, the slices' refresh after a fault that found no
device), through its own seam `DeviceSource` (the API server or a dry run, `gpu.writers`). The budget's
side (room for one more GPU, the order check of fresh rules) is `gpu.budget.RuleBudget`'s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

import structlog

from gpuguard.core.config import NodeSettings
from gpuguard.core.errors import ConflictError, GpuguardError, PermanentApiError
from gpuguard.core.model import Fault, GpuQuarantine, Verdict
from gpuguard.quarantine.budget import Budget
from gpuguard.quarantine.gpu import plan as gpu_plan
from gpuguard.quarantine.gpu.budget import RuleBudget
from gpuguard.quarantine.gpu.degradedrules import DegradedRules
from gpuguard.quarantine.gpu.lines import rule_log
from gpuguard.quarantine.gpu.memory import Remembered, RuleMemoryStore
from gpuguard.quarantine.gpu.rules import (
    NONE_EFFECT,
    DeviceRule,
    DeviceSource,
    device_effect,
    rule_body,
    rule_name,
)
from gpuguard.quarantine.gpu.slices import SliceDevice, slice_devices
from gpuguard.quarantine.gpu.trust import adopt, trusted_rules
from gpuguard.quarantine.record import (
    NodeRef,
    rfc3339,
)

log = structlog.get_logger(__name__)
# What an operator reads in the error lines: what happens to the fault (it never goes unquarantined).
_INSTEAD = "this GPU's fault gets the node taint instead of a DeviceTaintRule"
_READ_REFUSED = "the API server refused reading ResourceSlices or DeviceTaintRules (RBAC?): " + _INSTEAD
_UNPUBLISHED = "the GPU is in no ResourceSlice of --dra-driver: " + _INSTEAD
T = TypeVar("T")


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
        all_rules: Callable[[], list[DeviceRule]] | None = None,
    ) -> None:
        """memory: where the rules gpuguard made and those an operator deleted outlive the process (the
        agent's `state.StateStore`); None: in memory only (a dry run, no --state-dir). all_rules: every
        gpuguard rule for the budget (the agent's `gpu.watch.WatchedRules`, from memory); None: the
        source's list."""
        self._source = source
        self._settings = settings
        self._budgets = RuleBudget(
            settings,
            all_rules=all_rules or source.all_rules,
            budget=budget,
            order=order,
            now=now,
            clock=clock,
        )
        self._now = now
        self._clock = clock
        self._devices: dict[str, SliceDevice] = {}
        self._node_gpus = 0
        # Called whenever a read finds GPUs of this node in the slices (rules may be made from now on): the
        # agent's gpu.watch.WatchedRules starts its watch then. A node without them never watches rules.
        self.on_devices: Callable[[], None] | None = None
        self._rules: dict[str, DeviceRule] = {}
        self._read_at = -math.inf
        # The rules made and those an operator deleted, kept in `memory` at every change.
        self._memory = Remembered(memory)
        # UUIDs whose rule the API server refused (403, 404 API not served): the node taint stands in.
        self._held: set[str] = set()
        # Faulty GPUs the slices did not list: to read the slices for after the node write, and read for.
        self._refresh_for: set[str] = set()
        self._slices_at = -math.inf
        self._refreshed_for: set[str] = set()
        # Rules under this node's label that are not provably its own (`_trusted`): logged once each.
        self._untrusted: set[str] = set()
        self._node_name = settings.name or ""
        self._read_error = ""
        self.quarantined: tuple[GpuQuarantine, ...] = ()
        # The second level: the effect-None rules of degraded GPUs, from the same reads.
        self.degraded = DegradedRules(
            source, recover_after=settings.recover_after, dry_run=settings.dry_run, now=now
        )

    @property
    def mode(self) -> str:
        return self._settings.quarantine

    @property
    def published(self) -> dict[str, tuple[str, str, str]]:
        """The node's GPUs as its ResourceSlices publish them: (driver, pool, device) by UUID, each GPU's with
        or without a rule (the evictor matches pods' DRA claims with them)."""
        return {uuid: (d.driver, d.pool, d.device) for uuid, d in self._devices.items()}

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
        return self._budgets.settling

    def apply(
        self,
        node: NodeRef,
        verdict: Verdict,
        *,
        streak: int,
        flapping: bool,
        gpu_streaks: Mapping[str, int] | None = None,
        degraded_streaks: Mapping[str, int] | None = None,
    ) -> Verdict:
        """Write the rules the verdict asks for; return the verdict left for the node (per-GPU faults out).
        A rule recovers on its GPU's own healthy streak (`gpu_streaks`, by UUID), or the node's (`streak`,
        never longer than any GPU's) where none is given. A degraded GPU's effect-None rule goes once its
        `degraded_streaks` (checks without a degraded signal, by UUID) reach --recover-after."""
        if self.mode == "node":
            return verdict
        wanted = gpu_plan.wanted(verdict)
        due = self._clock() - self._read_at >= self._settings.node_resync
        # Degraded rules alone (effect None) cost no periodic read: nothing they hold depends on the bootID.
        if self._read_at == -math.inf or (due and self._rules) or self.degraded.stale:
            self._read(node)
        # A fault on a GPU the slices did not list: the node taint now, and the slices read again after this
        # reconcile's node write (`refresh`), once per fault and at most every --slice-refresh seconds: a
        # DRA driver that started after the agent, or a GPU published since. Never a request before the
        # taint, none on a healthy node, and a fault's transition keeps its three requests.
        missing = wanted - set(self._devices) - self._held
        self._refreshed_for &= missing
        stale = self._clock() - self._slices_at >= self._settings.slice_refresh
        self._refresh_for = (missing - self._refreshed_for) if stale else set()
        self._node_name = node.name
        result = gpu_plan.split(verdict, self._devices, mode=self.mode, held=frozenset(self._held))
        if self.mode == "gpu":
            for uuid in wanted - set(result.by_gpu):
                log.error("device.unpublished", node=node.name, uuid=uuid, note=_UNPUBLISHED)
        by_uuid = {r.uuid: r for r in self._rules.values() if r.uuid}
        for uuid, faults in result.by_gpu.items():
            self._hold(node, self._devices[uuid], faults, by_uuid.get(uuid))
        if self._held & set(result.by_gpu):
            # A rule was refused just now: its faults go back to the node in this very reconcile.
            result = gpu_plan.split(verdict, self._devices, mode=self.mode, held=frozenset(self._held))
        faulty = set(result.by_gpu)
        for uuid, rule in by_uuid.items():
            if uuid not in faulty and uuid not in wanted:
                own = gpu_plan.gpu_streak(uuid, streak=streak, gpu_streaks=gpu_streaks)
                self._release(node, rule, verdict, streak=own, flapping=flapping)
        self._memory.faults_gone(wanted)

        def patch(rule: DeviceRule, body: Mapping[str, Any]) -> DeviceRule | None:
            return self._write(node, rule, lambda: self._source.patch(rule, body))

        for stepped in self._budgets.verify(node, self._rules, patch):
            self._rules[stepped.name] = stepped
        self._publish()
        return self.degraded.apply(node, result.node_verdict, self._devices, streaks=degraded_streaks or {})

    def _read(self, node: NodeRef) -> None:
        self._slices_at = self._read_at = self._clock()
        try:
            docs = self._source.slices()
            listed = self.degraded.read(node.name, self._source.rules())
        except PermanentApiError as exc:
            # 403: a ClusterRole from before the per-GPU quarantine. Every fault gets the node taint until a
            # read succeeds (next --node-resync): never no quarantine at all because of the GPUs' one.
            if self._devices or self._read_error != str(exc):
                log.error("device.read_rejected", node=node.name, error=str(exc), note=_READ_REFUSED)
            self._read_error = str(exc)
            self._devices, self._node_gpus = {}, 0
            return
        self._read_error = ""
        self._devices = slice_devices(docs or [], driver=self._settings.dra_driver, node=node.name)
        self._node_gpus = len(self._devices)
        self._found_devices()
        rules, self._untrusted = trusted_rules(node.name, listed, logged=self._untrusted)
        self._held |= self._memory.read(node.name, rules, self._untrusted)
        self._rules = rules

    def refresh(self) -> None:
        """After the reconcile's node write (the reconciler calls it): where a fault found no device, read the
        node's slices again, so that the next fault on a GPU published since gets its rule. A failed read
        is a warning (the node taint stands; the next new fault tries again)."""
        if not self._refresh_for:
            return
        self._refreshed_for |= self._refresh_for
        self._refresh_for = set()
        self._slices_at = self._clock()
        try:
            docs = self._source.slices()
        except PermanentApiError as exc:
            if self._read_error != str(exc):  # the same refusal as the first read's: said already
                log.error("device.read_rejected", node=self._node_name, error=str(exc), note=_READ_REFUSED)
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
        self._found_devices()

    def _found_devices(self) -> None:
        if self._devices and self.on_devices is not None:
            self.on_devices()

    def _hold(
        self, node: NodeRef, dev: SliceDevice, faults: tuple[Fault, ...], rule: DeviceRule | None
    ) -> None:
        if rule is None:
            if not self._memory.suppressed(dev.uuid, faults):
                self._create(node, dev, faults)
            return
        # A deferred rule asks the budget for room (at most every --budget-recheck seconds).
        lifted = rule.deferred and self._budgets.room(node, rule, node_gpus=self._node_gpus)
        body = gpu_plan.update(
            rule,
            faults,
            boot_id=node.boot_id,
            effect=device_effect(self._settings.taint_effect),
            lifted=lifted,
        )
        if body is None:
            return
        updated = self._write(node, rule, lambda: self._source.patch(rule, body))
        if updated is None:
            return
        self._rules[updated.name] = updated
        self._memory.holds(updated)
        if "spec" in body:
            self._budgets.blocking(updated)
        # The rule was found by its GPU's UUID: rule.uuid is dev.uuid.
        rule_log(node.name, rule).warning(
            "device.rule_updated", escalated="spec" in body, dry_run=self._settings.dry_run
        )

    def _write(self, node: NodeRef, rule: DeviceRule, call: Callable[[], T]) -> T | None:
        """A change to an existing rule: its answer, or None when it did not land. A conflict (someone
        changed the rule) reads the rules again at the next reconcile; a refusal is logged, the rule left."""
        try:
            return call()
        except ConflictError:
            self._read_at = -math.inf
        except PermanentApiError as exc:
            log.error("device.rule_write_rejected", node=node.name, rule=rule.name, error=str(exc))
        return None

    def _create(self, node: NodeRef, dev: SliceDevice, faults: tuple[Fault, ...]) -> None:
        try:
            deferred = not self._budgets.room(node, None, node_gpus=self._node_gpus)
        except PermanentApiError as exc:
            self._held.add(dev.uuid)
            log.error(
                "device.budget_unreadable", node=node.name, uuid=dev.uuid, error=str(exc), note=_INSTEAD
            )
            return
        effect = NONE_EFFECT if deferred else device_effect(self._settings.taint_effect)
        if rule_name(node.name, dev.device) is None:
            self._held.add(dev.uuid)
            log.error(
                "device.rule_unnamed",
                node=node.name,
                device=dev.device,
                uuid=dev.uuid,
                note="no valid rule name (too long, or the device is no DNS label): node taint",
            )
            return
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
            rule = adopt(self._source, node.name, dev, body)
        except PermanentApiError as exc:
            # Refused (the admission policy, a server without DeviceTaintRules): the node taint stands in.
            self._held.add(dev.uuid)
            log.error("device.rule_rejected", node=node.name, uuid=dev.uuid, error=str(exc), note=_INSTEAD)
            return
        if rule is None:
            self._held.add(dev.uuid)
            return
        self._rules[rule.name] = rule
        self._memory.holds(rule)
        if rule.effect != effect:
            # Adopted on a 409 (ours from before a restart) blocking otherwise than asked: set it right now.
            self._hold(node, dev, faults, rule)
            return
        if not deferred:
            self._budgets.blocking(rule)
        first = faults[0]
        rule_log(node.name, rule, dev).warning(
            "device.tainted_soft" if deferred else "device.tainted",
            gpu=first.gpu_index,
            reason=first.reason,
            detail=first.message,
            effect=effect,
            dry_run=self._settings.dry_run,
        )

    def _release(
        self, node: NodeRef, rule: DeviceRule, verdict: Verdict, *, streak: int, flapping: bool
    ) -> None:
        """The rule deleted when `plan.released` says its GPU recovered."""
        s = self._settings
        if not gpu_plan.released(
            rule, verdict, boot_id=node.boot_id, streak=streak, flapping=flapping, settings=s
        ):
            return
        self._memory.forget(rule)  # before the delete: see Remembered.save
        if not self._write(node, rule, lambda: _deleted(self._source, rule)):
            return
        self._rules.pop(rule.name, None)
        rule_log(node.name, rule).info("device.recovered", dry_run=s.dry_run)

    def _publish(self) -> None:
        self.quarantined = gpu_plan.quarantined(self._rules.values())


def _deleted(source: DeviceSource, rule: DeviceRule) -> bool:
    source.delete(rule)
    return True
