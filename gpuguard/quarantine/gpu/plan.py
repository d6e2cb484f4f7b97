"""The per-GPU quarantine's decisions, pure, as `node.plan` is the node's: which faults go to a GPU's rule
and which stay with the node (`split`), whether a rule an operator deleted is made again (`suppressed`: a
held repeat offender's always is), the
change to a rule already held (`update`), when a rule is released (`released`), the step back of a rule past
the budget (`step_back`) and what /healthz shows of the rules (`quarantined`). `quarantine.DeviceQuarantine`
reads, asks the budget and writes what these decide; the fault record's rules are `record.FaultRecord`'s, the
node taint's too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpuguard.core.config import NodeSettings
from gpuguard.core.model import (
    ECC,
    REPAIR_HELD,
    REPEAT_OFFENDER,
    RESET_REQUIRED,
    ROW_REMAP,
    Fault,
    GpuQuarantine,
    Verdict,
    recovery_reason,
)
from gpuguard.quarantine.gpu.rules import NONE_EFFECT, DeviceRule
from gpuguard.quarantine.gpu.slices import SliceDevice
from gpuguard.quarantine.record import ANN_DEFERRED, TAINT_KEY, fault_keys

_RESET_ACTIONS = frozenset({recovery_reason(1), recovery_reason(4)})  # gpu-reset, drain-and-reset


def per_gpu(fault: Fault) -> bool:
    """A fault that belongs to one GPU: uncorrected ECC, an Xid on that GPU, a failed row remap, the driver
    asking for a reset of that GPU. A lost or missing GPU, NVML that does not start, a GPU that does not
    answer and a recovery action beyond the GPU (node reboot, ...) are the node's: the node taint."""
    if not fault.uuid:
        return False
    r = fault.reason
    return (
        r in (ECC, ROW_REMAP, RESET_REQUIRED, REPEAT_OFFENDER, REPAIR_HELD)
        or r.startswith("xid-")
        or r in _RESET_ACTIONS
    )


def wanted(verdict: Verdict) -> set[str]:
    """The GPUs (UUIDs) with a fault of their own: those a rule would hold where they are published."""
    return {g.uuid for g in verdict.gpus if any(per_gpu(f) for f in g.faults)}


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


def suppressed(overridden: Mapping[str, frozenset[str]], uuid: str, faults: Iterable[Fault]) -> bool:
    """An operator deleted this GPU's rule for these very faults (`overridden`: UUID -> the faults its rule
    recorded when it was found gone): it is not made again; a new fault on that GPU makes it again. Never
    for a GPU held as a repeat offender: only a release (gpuguard.io/release, which an agent's token cannot
    write) lifts a hold, so its rule, deleted by anyone, is made again."""
    faults = tuple(faults)
    if any(f.reason == REPEAT_OFFENDER for f in faults):
        return False
    return overridden.get(uuid, frozenset()) >= fault_keys(faults)


def update(
    rule: DeviceRule, faults: tuple[Fault, ...], *, boot_id: str, effect: str, lifted: bool
) -> dict[str, Any] | None:
    """The merge patch that brings a rule already held in line with its GPU's faults, or None when it
    matches: new faults recorded (`FaultRecord.merge`: a record from an earlier boot replaced), and the
    configured `effect` where the rule was deferred and the budget now has room (`lifted`) or blocks
    otherwise than asked (a rule adopted after a restart with another --taint-effect), and a taint with a
    value (earlier versions wrote the fault's reason there) rewritten without one, in the same patch, so
    the GPU is never without the taint. Carries the rule's resourceVersion: a 409 when
    someone changed it."""
    annotations = rule.record.merge(faults, boot_id=boot_id) or {}
    body: dict[str, Any] = {}
    if lifted or rule.taint_value or (not rule.deferred and rule.effect != effect):
        if lifted:
            annotations[ANN_DEFERRED] = None
        blocks = lifted or not rule.deferred
        body["spec"] = {"taint": {"key": TAINT_KEY, "effect": effect if blocks else NONE_EFFECT}}
    if not annotations and not body:
        return None
    body["metadata"] = {"annotations": annotations, "resourceVersion": rule.resource_version}
    return body


def gpu_streak(uuid: str, *, streak: int, gpu_streaks: Mapping[str, int] | None) -> int:
    """The healthy streak a GPU's rule recovers on: its own (`gpu_streaks`, by UUID), never shorter than the
    node's (`streak`, never longer than any GPU's); the node's where none is given."""
    return streak if gpu_streaks is None else max(streak, gpu_streaks.get(uuid, 0))


def released(
    rule: DeviceRule, verdict: Verdict, *, boot_id: str, streak: int, flapping: bool, settings: NodeSettings
) -> bool:
    """Recovery under the node taint's evidence rules: --recover-after healthy checks of the GPU, not
    flapping, and every recorded fault proven gone by the reading or by a reboot (`FaultRecord`)."""
    if not settings.recover or streak < settings.recover_after or flapping:
        return False
    return rule.record.evidence_gone(boot_id, verdict.reset_cleared)


def step_back(rule: DeviceRule, why: str) -> dict[str, Any]:
    """The merge patch that steps a blocking rule past the budget back to the deferred state: effect None
    and gpuguard.io/quarantine-deferred saying `why`, with the rule's resourceVersion."""
    return {
        "metadata": {"annotations": {ANN_DEFERRED: why}, "resourceVersion": rule.resource_version},
        "spec": {"taint": {"key": TAINT_KEY, "effect": NONE_EFFECT}},
    }


def quarantined(rules: Iterable[DeviceRule]) -> tuple[GpuQuarantine, ...]:
    """The GPUs the rules hold out, in device order, as /healthz and the metrics show them."""
    return tuple(
        GpuQuarantine(
            uuid=r.uuid,
            device=r.device,
            rule=r.name,
            reason=r.reason,
            effect=r.effect,
            deferred=r.deferred,
        )
        for r in sorted(rules, key=lambda r: r.device)
    )
