"""What the reconciler says about the node besides the quarantine itself: the GPUHealthy condition (written
only when it changes), the Event of each change (best effort) and one log line per write, naming one fault."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime

import structlog

from gpuguard.core import validation
from gpuguard.core.config import NodeSettings
from gpuguard.core.errors import NodeUpdateError
from gpuguard.core.model import Verdict
from gpuguard.judge.explained import brief
from gpuguard.judge.policy import primary
from gpuguard.quarantine.node.accelerated import owned_by_another, plan_accelerated_condition
from gpuguard.quarantine.node.degraded import (
    DEGRADED_ACTIONS,
    degraded_keys,
    plan_degraded_condition,
)
from gpuguard.quarantine.node.plan import plan_condition
from gpuguard.quarantine.node.view import EventSpec, NodeChange, NodeView
from gpuguard.quarantine.node.writers import NodeWriter
from gpuguard.quarantine.record import DEGRADED_TAINT_KEY, join_keys

log = structlog.get_logger(__name__)

# The line each kind of write logs.
_LINES = {
    "taint": "node.tainted",
    "defer": "node.tainted_soft",
    "escalate": "node.quarantine_escalated",
    "yield": "node.quarantine_yielded",
    "add-faults": "node.fault_added",
    "recover": "node.recovered",
    "verified": "node.verified",
    "override": "node.taint_removed_by_operator",
    "release-cordon": "node.cordon_released",
    "degrade": "node.degraded",
    "degrade-clear": "node.degraded_cleared",
    "repair": "node.repair_marks",
    "repair-request": "repair.requested",
    "unvalue": "node.taint_value_removed",
}


class NodeReport:
    """`set_node`: the reconciler's record of the node as the API server last answered (a condition write
    answers with the node)."""

    def __init__(
        self,
        writer: NodeWriter,
        settings: NodeSettings,
        *,
        now: Callable[[], datetime],
        set_node: Callable[[NodeView], None],
    ) -> None:
        self._writer = writer
        self._settings = settings
        self._now = now
        self._set_node = set_node
        self._condition_keys: frozenset[str] | None = None
        self._override_logged: frozenset[str] = frozenset()
        self._degraded_keys: frozenset[str] | None = None
        self._foreign_logged = False

    def condition(self, node: NodeView, verdict: Verdict, flapping: bool, *, device_tainted: int) -> None:
        """The GPUHealthy condition, written only when it changes (best effort, like Events). Flap damping
        holds it like the quarantine: a healthy reading between faults within --flap-window does not set
        it back to True (one status write per episode, not one per flip). `device_tainted`: the GPUs
        DeviceTaintRules hold out."""
        if flapping and verdict.healthy:
            return
        condition = plan_condition(
            node.gpu_condition,
            verdict,
            last_keys=self._condition_keys,
            now=self._now(),
            device_tainted=device_tainted,
            current_message=node.gpu_condition_message,
        )
        if condition is None:
            self._condition_keys = frozenset(f.key for f in verdict.faults)
            return
        if (error := self._write(node, condition)) is not None:
            log.warning("node.condition_failed", node=node.name, error=error)
            return
        self._condition_keys = frozenset(f.key for f in verdict.faults)
        self._written(
            "node.condition", node=node.name, status=condition["status"], reason=condition["reason"]
        )

    def degraded_condition(self, node: NodeView, verdict: Verdict, *, clean_streak: int) -> None:
        """The GPUDegraded condition (node/degraded.py), written only when it changes, best effort."""
        condition = plan_degraded_condition(
            node.degraded_condition,
            verdict.degraded,
            last_keys=self._degraded_keys,
            clean_streak=clean_streak,
            recover_after=self._settings.recover_after,
            now=self._now(),
        )
        keys = degraded_keys(verdict.degraded)
        if condition is None:
            # The condition says the last signals written until it is rewritten: a clean check that does not
            # clear it yet (the recovery window, a flap held) leaves them, so the same signals back cost
            # nothing.
            if keys:
                self._degraded_keys = keys
            return
        if (error := self._write(node, condition)) is not None:
            log.warning("node.degraded_condition_failed", node=node.name, error=error)
            return
        self._degraded_keys = keys
        self._written("node.degraded_condition", node=node.name, status=condition["status"])

    def accelerated_condition(self, node: NodeView, verdict: Verdict, flapping: bool) -> None:
        """AcceleratedHardwareReady (node/accelerated.py), when --accelerated-hardware-condition is on:
        written only when it changes, best effort, held like GPUHealthy through a flap, and never over
        another writer's (said once)."""
        if not self._settings.accelerated_condition or (flapping and verdict.healthy):
            return
        if owned_by_another(node.accelerated_condition):
            if not self._foreign_logged:
                self._foreign_logged = True
                current = node.accelerated_condition or {}
                log.warning(
                    "node.accelerated_condition_foreign", node=node.name, reason=current.get("reason")
                )
            return
        self._foreign_logged = False
        condition = plan_accelerated_condition(
            node.accelerated_condition, verdict, quarantined=node.fully_quarantined, now=self._now()
        )
        if condition is None:
            return
        if (error := self._write(node, condition)) is not None:
            log.warning("node.accelerated_condition_failed", node=node.name, error=error)
            return
        self._written(
            "node.accelerated_condition",
            node=node.name,
            status=condition["status"],
            reason=condition["reason"],
        )

    def _written(self, event: str, **fields: object) -> None:
        """A condition written; not said in a dry run, whose writer's `node.dry_run_condition` line is the one
        line of that transition (with the whole condition)."""
        if not self._settings.dry_run:
            log.info(event, **fields)

    def _write(self, node: NodeView, condition: Mapping[str, str]) -> str | None:
        """Write one condition, best effort: the node as the API server then has it goes to the reconciler;
        the error where it failed (the caller's keys stay unrecorded: planned again next time)."""
        try:
            self._set_node(self._writer.set_condition(node, condition))
        except NodeUpdateError as exc:
            return str(exc)
        return None

    def event(self, node: NodeView, event: EventSpec, verdict: Verdict | None = None) -> None:
        if verdict is not None and event.reason == "GPUUnhealthy":
            # The rule that fired, where operators look first; only where it fits the Event's bound whole.
            rules = brief((*verdict.node_faults, *(f for g in verdict.gpus for f in g.faults)), event.message)
            message = f"{event.message} [{rules}]"
            if rules and len(message.encode()) <= validation.MAX_EVENT_MESSAGE_BYTES:
                event = replace(event, message=message)
        # Best effort: the taint is what protects the scale-out; a lost Event must not block it.
        try:
            self._writer.record_event(node, event)
        except NodeUpdateError as exc:
            log.warning("node.event_failed", node=node.name, reason=event.reason, error=str(exc))

    def change(self, before: NodeView, change: NodeChange, verdict: Verdict) -> None:
        """One line per write; reason, GPU, UUID and detail are of one fault: for "add-faults" the first of
        those it added, else the fault the taint names. A dry run's line is `node.dry_run` (nothing was
        written), with the line a write would have logged as `transition` and the exact patch."""
        name = _LINES[change.action]
        quiet = ("recover", "verified", "override", "release-cordon", "repair", "repair-request")
        warn = change.action not in quiet
        fields: dict[str, object]
        if change.action == "repair-request":
            fields = {"request": dict(change.annotations)}
        elif change.action in DEGRADED_ACTIONS:
            warn = change.action == "degrade"
            fields = {
                "signals": join_keys(degraded_keys(verdict.degraded)),
                "tainted": change.taints is not None
                and any(t.key == DEGRADED_TAINT_KEY for t in change.taints),
            }
        elif not warn:
            if change.action == "override":
                self._override_logged = frozenset(f.key for f in verdict.faults)
            fields = {"uncordoned": change.unschedulable is False}
        else:
            fields = _fault_fields(before, change, verdict)
        if self._settings.dry_run:
            patch = change.patch(before.resource_version)
            log.info(
                "node.dry_run", node=before.name, action=change.action, transition=name, **fields, patch=patch
            )
        else:
            (log.warning if warn else log.info)(name, node=before.name, **fields, dry_run=False)

    def override(self, node: NodeView, verdict: Verdict) -> None:
        """Our taint gone while faults remain: an operator removed it (said once per set of faults)."""
        keys = frozenset(f.key for f in verdict.faults)
        if keys and node.our_taint is None and keys != self._override_logged:
            self._override_logged = keys
            log.warning(
                "node.taint_removed_by_operator",
                node=node.name,
                faults=join_keys(keys),
                note="not re-added for the same fault; a new fault taints again",
            )


def _fault_fields(before: NodeView, change: NodeChange, verdict: Verdict) -> dict[str, object]:
    """The fault a quarantine's line names (for "add-faults" the first it added) and the node's cordon."""
    faults = verdict.faults
    if change.action == "add-faults":
        faults = tuple(f for f in faults if validation.fault_key(f.key) not in before.current_faults)
    first = primary(faults)
    return {
        "reason": first.reason if first else None,
        "gpu": first.gpu_index if first else None,
        "uuid": first.uuid if first else None,
        "detail": first.message if first else None,
        "faults": len(verdict.faults),
        # The node's cordon after this write (a fault added to a cordoned node: still cordoned).
        "cordoned": before.unschedulable if change.unschedulable is None else change.unschedulable,
        "uncordoned": change.unschedulable is False,
    }
