"""The agent's side of a repair, pure: which GPU to ask the executor to reset (the request annotation on its
own node), and which GPUs the executor's record holds out of service meanwhile (a `repair-held` fault, so
the agent's own quarantine of that GPU stays until the executor proved the reset).

A GPU is asked for only when every fault it has is one a reset remedies (`core/remedies.py`, data) and its
quarantine is in place: its own DeviceTaintRule blocking, or gpuguard's node taint (not deferred) where the
GPU has no rule. One request per node at a time, kept while the executor is on it; a GPU the record
holds in this boot (a reboot asked for, a failed proof) is not asked for again: the executor climbs its
ladder on its own, and the next GPU's turn comes."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import replace
from datetime import datetime, timedelta

from gpuguard.core.model import REPAIR_HELD, Fault, GpuQuarantine, GpuVerdict, Verdict
from gpuguard.core.remedies import REMEDIES
from gpuguard.quarantine.node.view import NodeChange, NodeView
from gpuguard.quarantine.repair.values import (
    ANN_REQUEST,
    ANN_STATE,
    REQUEST_TTL_S,
    UNDER_WAY,
    Request,
    parse_record,
    parse_request,
)


def remedied_by_reset(g: GpuVerdict) -> bool:
    """Every fault of the GPU (none of them the repair's own hold) is one a reset remedies."""
    faults = [f for f in g.faults if f.reason != REPAIR_HELD]
    field = g.recovery_action is not None
    return bool(faults) and all(REMEDIES.remedies(f.reason, recovery_field=field) for f in faults)


def in_place(node: NodeView, verdict: Verdict, rules: Iterable[GpuQuarantine]) -> set[str]:
    """The GPUs whose quarantine is in place: their own rule blocking (not deferred), or every GPU while
    gpuguard's node taint is on (not deferred)."""
    held = {q.uuid for q in rules if not q.deferred}
    if node.our_taint is not None and not node.deferred:
        held |= {g.uuid for g in verdict.gpus}
    return held


def hold(node: NodeView, verdict: Verdict) -> Verdict:
    """The verdict with a `repair-held` fault on each GPU the executor's record holds in this boot."""
    held = parse_record(node.annotations.get(ANN_STATE)).held(node.boot_id)
    if not held:
        return verdict
    gpus = tuple(
        replace(g, faults=(*g.faults, Fault(REPAIR_HELD, "held by the repair executor", g.uuid, g.index)))
        if g.uuid in held
        else g
        for g in verdict.gpus
    )
    return replace(verdict, gpus=gpus)


def ask(
    node: NodeView,
    verdict: Verdict,
    *,
    in_place: Collection[str],
    now: datetime,
) -> NodeChange | None:
    """The write that brings the request annotation in line with the verdict, or None. `in_place`: the UUIDs
    whose quarantine is in place (the reconciler knows: rules blocking, or the node taint)."""
    current, _why = parse_request(node.annotations.get(ANN_REQUEST), node=node.name, now=now)
    record = parse_record(node.annotations.get(ANN_STATE))
    held = record.held(node.boot_id)
    entry = record.get(current.uuid) if current is not None else None
    if entry is not None and entry.phase in UNDER_WAY and entry.boot == node.boot_id:
        return None  # the executor is on it: the request stays as it is
    wanted = [g for g in verdict.gpus if g.uuid in in_place and g.uuid not in held and remedied_by_reset(g)]
    if not wanted:
        return _set(node, None) if ANN_REQUEST in node.annotations else None
    uuid = (
        current.uuid
        if current is not None and any(g.uuid == current.uuid for g in wanted)
        else wanted[0].uuid
    )
    if (
        current is not None
        and current.uuid == uuid
        and current.deadline - now > timedelta(seconds=REQUEST_TTL_S / 2)
    ):
        return None
    request = Request(uuid, node.name, now + timedelta(seconds=REQUEST_TTL_S))
    return _set(node, request.value())


def _set(node: NodeView, value: str | None) -> NodeChange | None:
    if node.annotations.get(ANN_REQUEST) == value:
        return None
    return NodeChange(action="repair-request", annotations={ANN_REQUEST: value})
