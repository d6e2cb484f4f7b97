"""`gpuguard uninstall`: take off the nodes everything gpuguard put there, for a clean uninstall.

It removes only what gpuguard placed (RULE, the sentence README and docs/operations.md print): its
taints, labels and annotations under ``gpuguard.io/``, the ``GPUHealthy`` and ``GPUDegraded`` node
conditions, the cordon it made, and its DeviceTaintRules, which hold single GPUs out (the per-GPU
quarantine) or show a degraded one. A mark an operator placed with gpuguard's key stays, as the agent itself
leaves it: a ``gpuguard.io/gpu-unhealthy`` taint on a node without gpuguard's record of it (the annotations
``gpuguard.io/faults`` or ``gpuguard.io/since``), a ``gpuguard.io/needs-repair`` label without
``gpuguard.io/needs-repair-placed``, a cordon without ``gpuguard.io/cordoned=true``.

Removing the DaemonSet leaves all of them in place, on purpose: a node that was held out for a bad GPU stays
held out until someone decides. Run this after the agents are gone (they would put the marks back). Writes are
merge patches with the resourceVersion read (a 409 re-reads and plans again) and touch nothing else; the
conditions go with a strategic-merge delete on nodes/status.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity

from gpuguard.core.errors import ConflictError, GpuguardError
from gpuguard.core.model import plural
from gpuguard.kube import client as kubeclient
from gpuguard.kube import nodes
from gpuguard.quarantine.gpu.writers import KubeDeviceSource
from gpuguard.quarantine.node.view import (
    ANN_CORDONED,
    ANN_REPAIR_PLACED,
    CONDITION_TYPE,
    DEGRADED_CONDITION_TYPE,
    LABEL_NEEDS_REPAIR,
)
from gpuguard.quarantine.record import ANN_FAULTS, ANN_SINCE, DOMAIN, TAINT_KEY

PREFIX = f"{DOMAIN}/"
RULE = (
    "gpuguard uninstall removes only what gpuguard placed: an operator's gpuguard.io/gpu-unhealthy taint "
    "(on a node without gpuguard's annotations gpuguard.io/faults and gpuguard.io/since), an operator's "
    "gpuguard.io/needs-repair label (without gpuguard.io/needs-repair-placed) and an operator's cordon "
    "(without gpuguard.io/cordoned) stay"
)
_ATTEMPTS = 5
T = TypeVar("T")


class _Conflict(Exception):
    """The node changed between read and write (409): read and plan again."""


@dataclass(frozen=True)
class Cleanup:
    """What gpuguard left on one node, as a merge patch for the node and whether the condition is there."""

    node: str
    resource_version: str
    taints: tuple[str, ...]
    labels: tuple[str, ...]
    annotations: tuple[str, ...]
    uncordon: bool
    condition: bool
    kept_taints: tuple[Mapping[str, Any], ...] = ()
    # The second level's condition (a degraded GPU), removed like GPUHealthy.
    degraded_condition: bool = False
    # An operator's marks under gpuguard's keys, left in place ("taint gpuguard.io/gpu-unhealthy=rma-123").
    kept: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (
            self.taints
            or self.labels
            or self.annotations
            or self.uncordon
            or self.condition
            or self.degraded_condition
        )

    def describe(self) -> str:
        parts = [f"taint {k}" for k in self.taints]
        parts += [f"label {k}" for k in self.labels]
        parts += [f"annotation {k}" for k in self.annotations]
        parts += ["the cordon gpuguard made"] * self.uncordon
        parts += [f"condition {CONDITION_TYPE}"] * self.condition
        parts += [f"condition {DEGRADED_CONDITION_TYPE}"] * self.degraded_condition
        return ", ".join(parts) if parts else "nothing of gpuguard's"

    def patch(self) -> dict[str, Any] | None:
        meta: dict[str, Any] = {"resourceVersion": self.resource_version}
        if self.labels:
            meta["labels"] = dict.fromkeys(self.labels)
        if self.annotations:
            meta["annotations"] = dict.fromkeys(self.annotations)
        spec: dict[str, Any] = {}
        if self.taints:
            spec["taints"] = [dict(t) for t in self.kept_taints]
        if self.uncordon:
            spec["unschedulable"] = False
        if len(meta) == 1 and not spec:
            return None
        return {"metadata": meta, **({"spec": spec} if spec else {})}


def plan_cleanup(obj: Mapping[str, Any]) -> Cleanup:
    """Pure: what to take off this Node object (as the API returns it)."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    taints = list(spec.get("taints") or [])
    annotations = meta.get("annotations") or {}
    labels = meta.get("labels") or {}
    conditions = (obj.get("status") or {}).get("conditions") or []
    recorded = ANN_FAULTS in annotations or ANN_SINCE in annotations

    def ours(taint: Mapping[str, Any]) -> bool:
        key = str(taint.get("key", ""))
        return key.startswith(PREFIX) and (key != TAINT_KEY or recorded)

    operators_label = LABEL_NEEDS_REPAIR in labels and ANN_REPAIR_PLACED not in annotations
    kept = [
        f"taint {_taint_text(t)}" for t in taints if str(t.get("key", "")).startswith(PREFIX) and not ours(t)
    ]
    kept += [f"label {LABEL_NEEDS_REPAIR}"] * operators_label
    return Cleanup(
        node=str(meta.get("name", "")),
        resource_version=str(meta.get("resourceVersion", "")),
        taints=tuple(sorted({str(t.get("key")) for t in taints if ours(t)})),
        labels=tuple(
            sorted(
                k
                for k in labels
                if k.startswith(PREFIX) and not (k == LABEL_NEEDS_REPAIR and operators_label)
            )
        ),
        annotations=tuple(sorted(k for k in annotations if k.startswith(PREFIX))),
        uncordon=bool(spec.get("unschedulable")) and annotations.get(ANN_CORDONED) == "true",
        condition=any(c.get("type") == CONDITION_TYPE for c in conditions),
        kept_taints=tuple(t for t in taints if not ours(t)),
        degraded_condition=any(c.get("type") == DEGRADED_CONDITION_TYPE for c in conditions),
        kept=tuple(kept),
    )


def _taint_text(taint: Mapping[str, Any]) -> str:
    value = taint.get("value")
    return f"{taint.get('key')}{'=' + str(value) if value else ''}:{taint.get('effect')}"


def summary(plans: list[Cleanup], rules: list[str], *, dry_run: bool) -> str:
    """The last line: how many nodes had gpuguard's marks, how many rules went, what an operator keeps."""
    marked = sum(1 for p in plans if not p.empty)
    kept = plural(sum(len(p.kept) for p in plans), "operator's mark")
    removed, deleted, left = (
        ("would remove", "would delete", "would keep") if dry_run else ("removed", "deleted", "kept")
    )
    return (
        f"uninstall{' (dry run)' if dry_run else ''}: {removed} gpuguard's marks from {marked} of "
        f"{plural(len(plans), 'node')}, {deleted} {plural(len(rules), 'device taint rule')}, {left} {kept}"
    )


def _request(call: Callable[[], T]) -> T:
    """One request; a 409 is _Conflict, any other failure the client's GpuguardError naming what was tried."""
    try:
        return call()
    except ConflictError as exc:
        raise _Conflict(str(exc)) from exc


def clean_node(api: kubeclient.Client, name: str, *, dry_run: bool = False, timeout: float = 10.0) -> Cleanup:
    """Take gpuguard's marks off one node (or, dry_run, only say which); the plan that was applied."""

    def once() -> Cleanup:
        plan = plan_cleanup(_request(lambda: nodes.read(api, name, timeout=timeout)))
        if dry_run or plan.empty:
            return plan
        body = plan.patch()
        if body is not None:
            _request(lambda: nodes.patch(api, name, body, timeout=timeout))
        gone = [CONDITION_TYPE] * plan.condition + [DEGRADED_CONDITION_TYPE] * plan.degraded_condition
        if gone:
            deleted = [{"type": t, "$patch": "delete"} for t in gone]
            _request(lambda: nodes.patch_status(api, name, deleted, timeout=timeout))
        return plan

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(_Conflict),
        stop=tenacity.stop_after_attempt(_ATTEMPTS),
        wait=tenacity.wait_fixed(0.2),
        reraise=True,
    )
    try:
        return retrying(once)
    except _Conflict as exc:
        raise GpuguardError(f"node {name}: changed under every one of {_ATTEMPTS} attempts: {exc}") from None


def clean_rules(
    api: kubeclient.Client, nodes: tuple[str, ...] | None, *, dry_run: bool = False, timeout: float = 10.0
) -> list[str]:
    """Delete gpuguard's DeviceTaintRules (the per-GPU quarantine) of the named nodes, or of every node
    (None): only rules labelled app.kubernetes.io/managed-by=gpuguard, an administrator's stay. The names,
    "<node>/<device> (<rule>)", deleted (or, dry_run, to be deleted)."""
    source = KubeDeviceSource("", api=api, driver="", timeout=timeout)
    done = []
    for rule in source.all_rules():
        if nodes is not None and rule.pool not in nodes:
            continue
        if not dry_run:
            source.delete(rule)
        done.append(f"{rule.pool}/{rule.device} ({rule.name})")
    return sorted(done)
