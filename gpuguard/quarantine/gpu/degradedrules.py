"""`DegradedRules`: the effect-None DeviceTaintRules of degraded GPUs (`gpu.degraded` decides) across
reconciles: the rules held, their creates, updates and deletes through the fault quarantine's own seam
(`rules.DeviceSource`), and the GPUs whose rule could not be written (their signals stay with the node's
marks). `quarantine.DeviceQuarantine` hands it the rules its list found and calls `apply` after its own."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from functools import partial
from typing import TypeVar

import structlog

from gpuguard.core.errors import ConflictError, PermanentApiError
from gpuguard.core.model import Fault, Verdict
from gpuguard.quarantine.gpu.degraded import (
    DegradedPlan,
    degraded_rule_body,
    degraded_rule_name,
    degraded_update,
    is_degraded_rule,
    own_degraded,
    plan_rules,
)
from gpuguard.quarantine.gpu.lines import rule_log
from gpuguard.quarantine.gpu.rules import DeviceRule, DeviceSource
from gpuguard.quarantine.gpu.slices import SliceDevice
from gpuguard.quarantine.record import NodeRef, rfc3339

log = structlog.get_logger(__name__)
_INSTEAD = "the node's degraded marks show this GPU instead"
T = TypeVar("T")


class DegradedRules:
    def __init__(
        self,
        source: DeviceSource,
        *,
        recover_after: int,
        dry_run: bool = False,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._source = source
        self._recover_after = recover_after
        self._dry_run = dry_run
        self._now = now
        self._rules: dict[str, DeviceRule] = {}  # by GPU UUID
        self._held: set[str] = set()
        self._logged: set[str] = set()
        # A write met a conflict: the caller reads the rules again at its next reconcile.
        self.stale = False

    def read(self, node: str, listed: Iterable[DeviceRule]) -> list[DeviceRule]:
        """Take the degraded rules out of `listed` (the node's rules under gpuguard's label): those provably
        ours are held, the others logged once and left alone. Returns the rest (the fault rules' to judge)."""
        rest: list[DeviceRule] = []
        rules: dict[str, DeviceRule] = {}
        for r in listed:
            if not is_degraded_rule(r):
                rest.append(r)
            elif own_degraded(r, node) and r.uuid:
                rules[r.uuid] = r
            elif r.name not in self._logged:
                self._logged.add(r.name)
                log.warning("device.degraded_rule_untrusted", node=node, rule=r.name, note="ignored")
        self._rules = rules
        self.stale = False
        return rest

    def apply(
        self,
        node: NodeRef,
        verdict: Verdict,
        devices: Mapping[str, SliceDevice],
        *,
        streaks: Mapping[str, int],
    ) -> Verdict:
        """Write what `plan_rules` asks; return the verdict left for the node's marks."""
        plan = self._plan(verdict, devices, streaks)
        for uuid, degraded in plan.create.items():
            self._create(node, devices[uuid], degraded, node_gpus=len(devices))
        for uuid, degraded in plan.update.items():
            self._update(node, self._rules[uuid], degraded)
        for rule in plan.delete:
            if self._write(node, rule, partial(_deleted, self._source, rule)) is not None:
                self._rules.pop(rule.uuid, None)
                log.info("device.degraded_cleared", node=node.name, rule=rule.name, uuid=rule.uuid)
        if self._held & set(plan.create):
            plan = self._plan(verdict, devices, streaks)  # refused just now: the node shows them
        return plan.node_verdict

    def _plan(
        self, verdict: Verdict, devices: Mapping[str, SliceDevice], streaks: Mapping[str, int]
    ) -> DegradedPlan:
        return plan_rules(
            verdict,
            devices,
            self._rules,
            held=frozenset(self._held),
            streaks=streaks,
            recover_after=self._recover_after,
        )

    def _create(
        self, node: NodeRef, dev: SliceDevice, degraded: tuple[Fault, ...], *, node_gpus: int
    ) -> None:
        if degraded_rule_name(node.name, dev.device) is None:
            self._held.add(dev.uuid)
            log.error("device.degraded_rule_unnamed", node=node.name, device=dev.device, note=_INSTEAD)
            return
        body = degraded_rule_body(node, dev, degraded, node_gpus=node_gpus, since=rfc3339(self._now()))
        try:
            rule: DeviceRule | None = self._source.create(body)
        except ConflictError:
            rule = self._source.get(str(body["metadata"]["name"]))
            if rule is None or not own_degraded(rule, node.name) or rule.device != dev.device:
                log.error("device.degraded_rule_conflict", node=node.name, rule=body["metadata"]["name"])
                rule = None
        except PermanentApiError as exc:
            log.error(
                "device.degraded_rule_rejected", node=node.name, uuid=dev.uuid, error=str(exc), note=_INSTEAD
            )
            rule = None
        if rule is None:
            self._held.add(dev.uuid)
            return
        self._rules[dev.uuid] = rule
        rule_log(node.name, rule, dev).warning(
            "device.degraded", reasons=sorted({f.reason for f in degraded}), dry_run=self._dry_run
        )
        if rule.faults and degraded_update(rule, degraded) is not None:
            self._update(node, rule, degraded)  # adopted after a restart, for other signals

    def _update(self, node: NodeRef, rule: DeviceRule, degraded: tuple[Fault, ...]) -> None:
        body = degraded_update(rule, degraded)
        if body is None:
            return
        updated = self._write(node, rule, lambda: self._source.patch(rule, body))
        if updated is not None:
            self._rules[rule.uuid] = updated

    def _write(self, node: NodeRef, rule: DeviceRule, call: Callable[[], T]) -> T | None:
        """A change to a held rule: its answer, or None when it did not land (a conflict: read again)."""
        try:
            return call()
        except ConflictError:
            self.stale = True
        except PermanentApiError as exc:
            if exc.status == 404:  # deleted by someone: made again while its GPU is degraded
                self._rules.pop(rule.uuid, None)
                log.info("device.degraded_rule_gone", node=node.name, rule=rule.name)
                return None
            log.error("device.degraded_rule_write_rejected", node=node.name, rule=rule.name, error=str(exc))
        return None


def _deleted(source: DeviceSource, rule: DeviceRule) -> bool:
    source.delete(rule)
    return True
