"""The pure planner: given the node as last read and the policy's verdict, the one change that brings the node
in line, or None when it already matches (the idempotence every restart relies on). All ownership and
recovery rules live here. It always plans the full quarantine; `gpuguard.quarantine.node.budget` turns that
into the deferred one when the cluster's budget is spent.

Ownership: only the taints with key TAINT_KEY (and the startup gate's, --gate-taint-key, unless another
controller lifts it: --gate-removal external), the annotations in OUR_ANNOTATIONS, the label
LABEL_QUARANTINED and a cordon that ANN_CORDONED says we placed are ever changed or removed; every other
taint is carried over exactly as it was read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime

from gpuguard.core.config import NodeSettings
from gpuguard.core.model import REPEAT_OFFENDER, Fault, Verdict, plural
from gpuguard.quarantine.node.view import (
    ANN_CORDONED,
    CONDITION_TYPE,
    LABEL_QUARANTINED,
    OUR_ANNOTATIONS,
    EventSpec,
    NodeChange,
    NodeView,
    Taint,
    with_our_effect,
)
from gpuguard.quarantine.record import (
    ANN_BOOT_ID,
    ANN_DEFERRED,
    ANN_FAULTS,
    ANN_REASON,
    ANN_SINCE,
    TAINT_KEY,
    fault_keys,
    join_keys,
    reason_text,
    rfc3339,
)


def plan(
    node: NodeView,
    verdict: Verdict,
    *,
    healthy_streak: int,
    settings: NodeSettings,
    now: datetime,
    flapping: bool = False,
    gate_held: bool = False,
) -> NodeChange | None:
    """The change that brings `node` in line with `verdict`, or None. Pure.

    `gate_held`: a GPU of this node is known faulty but its DeviceTaintRule blocks nothing (deferred by the
    budget, effect None): the startup gate stays, as for a deferred node quarantine (a never-verified node
    with a known fault is never schedulable).

    A fault plans the full quarantine ("taint", or "escalate" of a deferred one); the budget's gate may
    turn it into the deferred one. `flapping`: faults came back within --flap-window, so recovery waits.
    Faults are compared with the record of the node's current boot only (`NodeView.current_faults`).
    """
    faults = verdict.faults
    ours = node.our_taint
    if faults:
        # Compared through fault_key on both sides: a hostile UUID can neither split a key nor make a
        # recorded fault look new at every check.
        recorded = node.current_faults
        keys = fault_keys(faults)
        new = node.record.new(faults, boot_id=node.boot_id)
        if ours is None and not new:
            # A repeat offender's hold is lifted only by a release (gpuguard.io/release, which an agent's
            # token cannot write), never by removing the taint: it is put back, not taken for an override.
            new = [f for f in faults if f.reason == REPEAT_OFFENDER]
        if ours is None and new:
            return _quarantine(node, faults, recorded | keys, settings=settings, now=now)
        if ours is not None and node.deferred:
            return _escalate(node, ours, faults, recorded | keys, settings=settings)
        return _unvalued(node, ours, record_faults(node, faults) or _tidy(node))

    # Ours: what gpuguard recorded, never a bare taint with our key (an operator's, kept as it is).
    owned = any(k in node.annotations for k in OUR_ANNOTATIONS) or LABEL_QUARANTINED in node.labels
    if not owned:
        if lifts_gate(node, settings) and verdict.gpus and not gate_held:
            # The startup gate: the first complete healthy check clears it. With --gate-removal external a
            # node-readiness controller lifts it from the GPUHealthy condition the reconciler writes.
            return NodeChange(
                action="verified",
                taints=tuple(t for t in node.taints if t.key != settings.gate_taint_key),
            )
        return None
    if (
        not settings.recover
        or healthy_streak < settings.recover_after
        or flapping
        or not evidence_gone(node, verdict)
    ):
        return _unvalued(node, ours, _tidy(node))
    gate = lifts_gate(node, settings) and not gate_held
    removed = ({settings.gate_taint_key} if gate else set()) | ({TAINT_KEY} if ours is not None else set())
    return NodeChange(
        action="recover",
        taints=tuple(t for t in node.taints if t.key not in removed) if ours is not None or gate else None,
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


def _unvalued(node: NodeView, ours: Taint | None, change: NodeChange | None) -> NodeChange | None:
    """Our taint with a value (an earlier gpuguard wrote the fault's reason there) loses it in `change`, or in
    a write of its own ("unvalue"): the taint list is replaced whole in one patch under the node's
    resourceVersion, so the node is never without the taint. Its timeAdded stays: a NoExecute taint's
    tolerationSeconds keep counting from the quarantine's start."""
    if ours is None or not ours.value or (change is not None and change.taints is not None):
        return change
    taints = tuple(replace(t, value=None) if t.key == TAINT_KEY else t for t in node.taints)
    return replace(change or NodeChange(action="unvalue"), taints=taints)


def lifts_gate(node: NodeView, settings: NodeSettings) -> bool:
    """The node carries the startup gate's taint and gpuguard is the one that lifts it."""
    return settings.gate_removal == "gpuguard" and node.gated(settings.gate_taint_key)


def record_faults(node: NodeView, faults: tuple[Fault, ...]) -> NodeChange | None:
    """Faults on a node that is already tainted for others (or whose taint was removed by hand for these
    very faults): the new ones are added to the record (`FaultRecord.merge`), no second taint. None when
    nothing is new."""
    record = node.record
    new = record.new(faults, boot_id=node.boot_id)
    annotations = record.merge(faults, boot_id=node.boot_id)
    if annotations is None:
        return None
    return NodeChange(
        action="add-faults",
        annotations=annotations,
        event=EventSpec("Warning", "GPUUnhealthy", reason_text(new)),
    )


def _tidy(node: NodeView) -> NodeChange | None:
    """What others changed under gpuguard, taken into its record (or None):
    - the taint removed by hand (an override): the label goes, so the node no longer counts against the
      budget; the fault record stays, so the same fault does not taint again (a new one does);
    - our cordon lifted by someone: the claim goes, so a cordon placed later (maintenance) is never lifted
      by gpuguard's recovery."""
    annotations: dict[str, str | None] = {}
    labels: dict[str, str | None] = {}
    event = None
    if node.overridden:
        labels[LABEL_QUARANTINED] = None
        if ANN_DEFERRED in node.annotations:
            annotations[ANN_DEFERRED] = None
        event = EventSpec(
            "Normal",
            "GPUQuarantineOverridden",
            f"{TAINT_KEY} removed by hand: the node no longer counts against the quarantine budget; "
            "the same fault does not taint it again, a new one does",
        )
    if node.cordoned_by_us and not node.unschedulable:
        annotations[ANN_CORDONED] = None
    if not annotations and not labels:
        return None
    return NodeChange(
        action="override" if labels else "release-cordon",
        annotations=annotations,
        labels=labels,
        event=event,
    )


def _quarantine(
    node: NodeView,
    faults: tuple[Fault, ...],
    keys: Iterable[str],
    *,
    settings: NodeSettings,
    now: datetime,
) -> NodeChange:
    annotations: dict[str, str | None] = {
        ANN_REASON: reason_text(faults),
        ANN_SINCE: node.annotations.get(ANN_SINCE) or rfc3339(now),
        ANN_BOOT_ID: node.boot_id,
        ANN_FAULTS: join_keys(keys),
    }
    unschedulable = None
    if settings.cordon and not node.unschedulable:
        unschedulable = True
        annotations[ANN_CORDONED] = "true"
    taint = Taint(key=TAINT_KEY, effect=settings.taint_effect)
    # The startup gate stays until the node is verified healthy (recovery removes it): whatever the budget
    # decides, a never-verified node with a known fault is never schedulable. A taint with our key that
    # gpuguard has no record of (an operator's) is taken over: the record now says why it is there.
    kept = tuple(t for t in node.taints if t.key != TAINT_KEY)
    return NodeChange(
        action="taint",
        taints=(*kept, taint),
        unschedulable=unschedulable,
        annotations=annotations,
        labels={LABEL_QUARANTINED: "true"},
        event=EventSpec("Warning", "GPUUnhealthy", reason_text(faults)),
    )


def _escalate(
    node: NodeView,
    ours: Taint,
    faults: tuple[Fault, ...],
    keys: Iterable[str],
    *,
    settings: NodeSettings,
) -> NodeChange:
    """A deferred quarantine becomes full once the budget has room again."""
    annotations: dict[str, str | None] = {
        ANN_DEFERRED: None,
        ANN_FAULTS: join_keys(keys),
        ANN_REASON: reason_text(faults),
    }
    if node.record_from_earlier_boot:
        annotations[ANN_BOOT_ID] = node.boot_id
    unschedulable = None
    if settings.cordon and not node.unschedulable:
        unschedulable = True
        annotations[ANN_CORDONED] = "true"
    return NodeChange(
        action="escalate",
        taints=with_our_effect(node, ours, settings.taint_effect),
        unschedulable=unschedulable,
        annotations=annotations,
        labels={LABEL_QUARANTINED: "true"},
        event=EventSpec("Warning", "GPUUnhealthy", f"quarantine budget has room: {reason_text(faults)}"),
    )


def plan_condition(
    current: str | None,
    verdict: Verdict,
    *,
    last_keys: frozenset[str] | None,
    now: datetime,
    device_tainted: int = 0,
    current_message: str | None = None,
) -> dict[str, str] | None:
    """The GPUHealthy node condition to write, or None when it already says this (updated only on change:
    a status flip, or a different set of faults). Unhealthy, the message starts with how many GPUs are out
    and how many of them DeviceTaintRules hold (`device_tainted`; the rest of the node stays in service)."""
    status = "True" if verdict.healthy else "False"
    keys = frozenset(f.key for f in verdict.faults)
    message = (
        f"{plural(len(verdict.gpus), 'GPU')} healthy (gpuguard)"
        if verdict.healthy
        else _out(verdict, device_tainted)
    )
    # A restarted agent (`last_keys` None) leaves a matching True alone, and a False whose message (read from
    # the node: `current_message`) already names this run's faults; another False it writes once: the
    # previous run's message names that run's faults, not necessarily this one's.
    restarted_same = last_keys is None and (verdict.healthy or current_message == message)
    if current == status and (last_keys == keys or restarted_same):
        return None
    stamp = rfc3339(now)
    return {
        "type": CONDITION_TYPE,
        "status": status,
        "reason": "GPUsHealthy" if verdict.healthy else _reason(verdict),
        "message": message,
        "lastHeartbeatTime": stamp,
        "lastTransitionTime": stamp,
    }


def _reason(verdict: Verdict) -> str:
    held = any(f.reason == REPEAT_OFFENDER for f in verdict.faults)
    return "GPURepeatOffender" if held else "GPUFault"


def _out(verdict: Verdict, device_tainted: int) -> str:
    bad = sum(1 for g in verdict.gpus if not g.healthy)
    held = f", {device_tainted} held out by device taints" if device_tainted else ""
    if not verdict.gpus:  # NVML down, or no GPU seen: no count to give
        return reason_text(verdict.faults) + (f" ({held.removeprefix(', ')})" if held else "")
    return reason_text(verdict.faults) + f" ({bad} of {plural(len(verdict.gpus), 'GPU')} unhealthy{held})"


def evidence_gone(node: NodeView, verdict: Verdict | None = None) -> bool:
    """Whether every fault the node records is proven cleared, given that the GPUs now read healthy: by the
    reading, or by a reboot (`FaultRecord.evidence_gone`)."""
    cleared = verdict.reset_cleared if verdict is not None else frozenset()
    return node.record.evidence_gone(node.boot_id, cleared)
