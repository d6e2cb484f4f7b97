"""The second level, `degraded`, on a DRA node, pure: a `degraded` GPU published in a ResourceSlice gets a
DeviceTaintRule of its own with effect None (the scheduler ignores it; `kubectl get devicetaintrules` and
tools show it), named gpuguard-degraded.<node>.<device>, with the key gpuguard.io/gpu-degraded. It blocks
nothing, so the budget never counts it (`trust.countable` skips effect None) and it never holds the startup
gate. It is deleted once its GPU has been free of degraded signals for --recover-after checks.

Trust as for the fault rules (`trust`): only a rule provably gpuguard's degraded rule for this node and
device (`own_degraded`) is updated, adopted on a 409 or deleted; anything else under gpuguard's labels is
left alone. `degradedrules.DegradedRules` reads and writes what this module decides."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpuguard.core import validation
from gpuguard.core.model import Fault, Verdict
from gpuguard.quarantine.gpu.rules import (
    ANN_NODE_GPUS,
    ANN_UUID,
    NONE_EFFECT,
    DeviceRule,
    rule_document,
)
from gpuguard.quarantine.gpu.slices import SliceDevice
from gpuguard.quarantine.record import (
    ANN_FAULTS,
    ANN_REASON,
    DEGRADED_TAINT_KEY,
    NodeRef,
    fault_keys,
    join_keys,
    new_record,
    reason_text,
)

DEGRADED_RULE_PREFIX = "gpuguard-degraded."
_MAX_NAME = 253


def degraded_rule_name(node: str, device: str) -> str | None:
    """gpuguard-degraded.<node>.<device> (the admission policy requires exactly this name of a create); None
    when too long or the device is no DNS label: the node's marks show that GPU instead."""
    name = f"{DEGRADED_RULE_PREFIX}{node}.{device}"
    if len(name) > _MAX_NAME or not validation.is_dns_label(device):
        return None
    return name


def is_degraded_rule(rule: DeviceRule) -> bool:
    """Under gpuguard's degraded name or key: never one of the fault quarantine's rules."""
    return rule.name.startswith(DEGRADED_RULE_PREFIX) or rule.key == DEGRADED_TAINT_KEY


def own_degraded(rule: DeviceRule, node: str) -> bool:
    """Provably gpuguard's degraded rule for one device of `node`: pool and labels that node's, managed by
    gpuguard, one device of a driver, the degraded key with effect None and the name gpuguard gives it."""
    return (
        rule.managed_for(node)
        and rule.key == DEGRADED_TAINT_KEY
        and rule.effect == NONE_EFFECT
        and rule.name == degraded_rule_name(node, rule.device)
    )


def degraded_rule_body(
    node: NodeRef, dev: SliceDevice, degraded: tuple[Fault, ...], *, node_gpus: int, since: str
) -> dict[str, Any]:
    """The effect-None rule for one degraded GPU: its device only, the signals' keys and text as the fault
    rules record theirs."""
    return rule_document(
        degraded_rule_name(node.name, dev.device),
        node.name,
        dev,
        annotations={
            **new_record(degraded, since=since),
            ANN_UUID: validation.clean_text(dev.uuid, max_bytes=128),
            ANN_NODE_GPUS: str(max(node_gpus, 1)),
        },
        taint={"key": DEGRADED_TAINT_KEY, "effect": NONE_EFFECT},
    )


def degraded_update(rule: DeviceRule, degraded: tuple[Fault, ...]) -> dict[str, Any] | None:
    """The merge patch that brings a held rule in line with its GPU's signals now (their keys and text;
    the taint without a value), or None when it already records them. Carries the rule's resourceVersion."""
    keys = fault_keys(degraded)
    if rule.faults == keys:
        return None
    return {
        "metadata": {
            "annotations": {ANN_FAULTS: join_keys(keys), ANN_REASON: reason_text(degraded)},
            "resourceVersion": rule.resource_version,
        },
        "spec": {"taint": {"key": DEGRADED_TAINT_KEY, "effect": NONE_EFFECT}},
    }


@dataclass(frozen=True)
class DegradedPlan:
    """What to do: the GPUs to give a rule (and their signals), the rules to update or delete, and the
    verdict left for the node's marks (the signals rules carry taken out)."""

    create: Mapping[str, tuple[Fault, ...]]
    update: Mapping[str, tuple[Fault, ...]]
    delete: tuple[DeviceRule, ...]
    node_verdict: Verdict


def plan_rules(
    verdict: Verdict,
    devices: Mapping[str, SliceDevice],
    rules: Mapping[str, DeviceRule],
    *,
    held: frozenset[str],
    streaks: Mapping[str, int],
    recover_after: int,
) -> DegradedPlan:
    """Pure. `rules`: the held rules by GPU UUID; `held`: UUIDs whose rule could not be written (the node's
    marks stand in); `streaks`: each GPU's checks in a row without a degraded signal (absent: none since
    the start, never enough). A rule whose GPU is no longer published is deleted once clean, like any."""
    create: dict[str, tuple[Fault, ...]] = {}
    update: dict[str, tuple[Fault, ...]] = {}
    gpus = []
    for g in verdict.gpus:
        if not g.degraded or g.uuid not in devices or g.uuid in held:
            gpus.append(g)
            continue
        (update if g.uuid in rules else create)[g.uuid] = g.degraded
        gpus.append(replace(g, degraded=()))
    degraded_now = {g.uuid for g in verdict.gpus if g.degraded}
    delete = tuple(
        r
        for uuid, r in sorted(rules.items())
        if uuid not in degraded_now and streaks.get(uuid, 0) >= recover_after
    )
    return DegradedPlan(create, update, delete, replace(verdict, gpus=tuple(gpus)))
