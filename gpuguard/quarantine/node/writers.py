"""The writers: `KubeNodeWriter` (the API server, through `gpuguard.kube.client`, which raises gpuguard's
errors itself) and `DryRunNodeWriter` (logs the exact patch, applies it to an in-memory copy, needs no
cluster). `make_writer` is the one place that knows which one a setting asks for. Both are also the budget's
`BudgetSource`: the API server lists the fleet (the fallback of `budgetwatch.WatchedBudget`, which keeps the
budget in memory); a dry run has no fleet (every quarantine is full)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, Protocol

import structlog

from gpuguard.core import validation
from gpuguard.core.config import GPU_NODE_SELECTOR, NodeSettings, QuarantineLimit
from gpuguard.core.errors import ConfigError, GpuguardError, PermanentApiError
from gpuguard.core.metrics import Metrics, counted
from gpuguard.kube import client as kubeclient
from gpuguard.kube import events, kubeconfig, nodes
from gpuguard.quarantine.budget import Budget
from gpuguard.quarantine.node.budget import OtherNodes, count_budget
from gpuguard.quarantine.node.degraded import LABEL_DEGRADED, DegradedRecord, degraded_taint
from gpuguard.quarantine.node.view import (
    ACCELERATED_CONDITION_TYPE,
    DEGRADED_CONDITION_TYPE,
    LABEL_QUARANTINED,
    EventSpec,
    NodeChange,
    NodeView,
    Taint,
    apply_change,
)
from gpuguard.quarantine.record import ANN_REASON, ANN_SINCE

log = structlog.get_logger(__name__)

DRY_RUN_NODE = "dry-run"


class NodeWriter(Protocol):
    """One node's reads and writes (the budget's fleet-wide reads are `budget.BudgetSource`)."""

    def read(self, *, reserve_write: bool = False) -> NodeView:
        """The node now. `reserve_write`: the read is the basis of a write that follows at once (the
        reconciler's read-modify-write): a client-side rate limit takes that write's token with the read,
        so the write never waits between them."""

    def patch(self, node: NodeView, change: NodeChange) -> NodeView:
        """Apply `change` planned against `node`; ConflictError if the node has moved on."""

    def record_event(self, node: NodeView, event: EventSpec) -> None: ...

    def set_condition(self, node: NodeView, condition: Mapping[str, str]) -> NodeView:
        """Patch nodes/status; returns the node as the server now has it (a new resourceVersion)."""


class DryRunNodeWriter:
    """Writes nothing and keeps the result in memory; the exact patch it would send is logged once, in the
    transition's own line (`node.dry_run`, by the reconciler's report), not here a second time.

    Starts from the real node when one can be read (so a dry run on a live cluster shows the real
    decisions), else from an empty node named after --node (or "dry-run").
    """

    def __init__(self, initial: NodeView) -> None:
        self._node = initial

    def read(self, *, reserve_write: bool = False) -> NodeView:
        return self._node

    def patch(self, node: NodeView, change: NodeChange) -> NodeView:
        _checked_patch(node, change)
        self._node = apply_change(self._node, change)
        return self._node

    def record_event(self, node: NodeView, event: EventSpec) -> None:
        log.info("node.dry_run_event", node=node.name, type=event.type, reason=event.reason)

    def budget(self, spec: QuarantineLimit, *, exclude: str) -> Budget | None:
        return None

    def quarantine_order(self) -> list[tuple[str, str]]:
        return []

    def changes(self) -> int:
        return 0

    def set_condition(self, node: NodeView, condition: Mapping[str, str]) -> NodeView:
        _checked_condition(node, condition)
        log.info("node.dry_run_condition", node=node.name, condition=dict(condition))
        if condition["type"] == DEGRADED_CONDITION_TYPE:
            self._node = replace(self._node, degraded_condition=condition["status"])
        elif condition["type"] == ACCELERATED_CONDITION_TYPE:
            self._node = replace(self._node, accelerated_condition=dict(condition))
        else:
            self._node = replace(
                self._node, gpu_condition=condition["status"], gpu_condition_message=condition["message"]
            )
        return self._node


class KubeNodeWriter:
    """The API server, through `gpuguard.kube.client` (whose client raises transient/permanent/conflict errors
    itself). Counts each request in gpuguard_api_requests_total{verb,code}."""

    def __init__(
        self,
        name: str,
        *,
        api: kubeclient.Client,
        timeout: float = 10.0,
        event_namespace: str = events.NODE_NAMESPACE,
        metrics: Metrics | None = None,
        gpu_node_selector: str = GPU_NODE_SELECTOR,
        others: OtherNodes | None = None,
    ) -> None:
        self._name = name
        self._gpu_nodes = gpu_node_selector
        self._api = api
        self._timeout = timeout
        self._event_namespace = event_namespace
        self._metrics = metrics
        self._others = others or OtherNodes()
        self._write_reserved = False

    @property
    def api(self) -> kubeclient.Client:
        return self._api

    @property
    def others(self) -> OtherNodes:
        """How other nodes' claims are validated (and each ignored one logged once)."""
        return self._others

    def read(self, *, reserve_write: bool = False) -> NodeView:
        # A read that reserves its write pays that write's token now (a rate-limited 409 loop would
        # otherwise wait between its read and its write, and a busy writer's change land in between every
        # time); the reservation lasts until the next write or the next read.
        self._write_reserved = False
        with self._counted("get"):
            doc = nodes.read(
                self._api, self._name, timeout=self._timeout, tokens=2.0 if reserve_write else 1.0
            )
        self._write_reserved = reserve_write
        return NodeView.from_api(doc)

    def _write_tokens(self) -> float:
        """The rate limiter's tokens for a write to the node: none when the read before it reserved one."""
        reserved, self._write_reserved = self._write_reserved, False
        return 0.0 if reserved else 1.0

    def patch(self, node: NodeView, change: NodeChange) -> NodeView:
        body = _checked_patch(node, change)
        with self._counted("patch"):
            doc = nodes.patch(self._api, self._name, body, timeout=self._timeout, tokens=self._write_tokens())
        return NodeView.from_api(doc)

    def record_event(self, node: NodeView, event: EventSpec) -> None:
        body = events.body(
            events.node_ref(node.name, node.uid),
            namespace=self._event_namespace,
            name=f"{node.name}.{time.time_ns():x}",
            type=event.type,
            reason=event.reason,
            message=event.message,
            host=node.name,
            now=datetime.now(UTC),
        )
        with self._counted("create"):
            events.post(self._api, body, timeout=self._timeout)

    def budget(self, spec: QuarantineLimit, *, exclude: str) -> Budget | None:
        """One list (`budgetwatch.WatchedBudget`'s fallback while its watch is not synced): for a count, the
        quarantined nodes (by label: a few items); for a percentage, every GPU node's metadata
        (PartialObjectMetadataList: no specs, no statuses): the total, and the quarantined by label."""
        if spec.count is not None:
            quarantined = sum(1 for _, name in self.quarantine_order() if name != exclude)
            return Budget(quarantined=quarantined, limit=spec.count)
        items = self._list_metadata("list GPU nodes", self._gpu_nodes)
        return count_budget(items, spec, exclude=exclude, quarantined=self._others.quarantined(items))

    def quarantine_order(self) -> list[tuple[str, str]]:
        """Metadata of the fully quarantined GPU nodes only (label selector): a few items, not the fleet.
        Only the GPU nodes the budget counts: a quarantined node outside them is not in this budget. Each
        node's claim validated first (`OtherNodes`): a malformed or forged one does not count."""
        selector = nodes.within(f"{LABEL_QUARANTINED}=true", self._gpu_nodes)
        return self._others.quarantined(self._list_metadata("list quarantined nodes", selector))

    def changes(self) -> int:
        """Constant: every read here is a request, so nothing is read again unasked."""
        return 0

    def _list_metadata(self, what: str, selector: str) -> list[dict[str, Any]]:
        """Nodes by label selector, metadata only (PartialObjectMetadataList: no specs, no statuses)."""
        with self._counted("list"):
            return nodes.select(self._api, selector, what=what, metadata_only=True, timeout=self._timeout)

    def set_condition(self, node: NodeView, condition: Mapping[str, str]) -> NodeView:
        _checked_condition(node, condition)
        with self._counted("patch"):
            doc = nodes.patch_status(
                self._api, self._name, [dict(condition)], timeout=self._timeout, tokens=self._write_tokens()
            )
        return NodeView.from_api(doc)

    def _counted(self, verb: str) -> AbstractContextManager[None]:
        return counted(self._metrics, verb)


def _checked_patch(node: NodeView, change: NodeChange) -> dict[str, Any]:
    """The patch body, validated before anything is sent (label-value syntax, our keys only, sizes). A
    refusal is a permanent error: logged once, the same change not retried for 5 minutes."""
    body = change.patch(node.resource_version)
    try:
        validation.check_node_patch(body)
    except ConfigError as exc:
        raise PermanentApiError(f"patch node {node.name}: refused before sending: {exc}") from exc
    return body


def _checked_condition(node: NodeView, condition: Mapping[str, str]) -> None:
    try:
        validation.check_condition(condition)
    except ConfigError as exc:
        raise PermanentApiError(f"patch node {node.name} status: refused before sending: {exc}") from exc


def make_writer(
    settings: NodeSettings, connect: Callable[[], kubeclient.Client], metrics: Metrics | None = None
) -> KubeNodeWriter | DryRunNodeWriter:
    """The writer the settings ask for: the API server (through the agent's one client, `connect()`, made by
    the composition root), or a dry run."""
    if not settings.dry_run:
        assert settings.name is not None  # validated
        return KubeNodeWriter(
            settings.name,
            api=connect(),
            timeout=settings.api_timeout,
            metrics=metrics,
            gpu_node_selector=settings.gpu_node_selector,
        )
    name = settings.name or DRY_RUN_NODE
    initial = NodeView(name=name, resource_version="1", boot_id="dry-run")
    # A dry run on a live cluster starts from the real node, so it shows the real decisions.
    if settings.name and kubeconfig.named(settings.kubeconfig):
        try:
            real = KubeNodeWriter(settings.name, api=connect(), timeout=3.0)
            initial = real.read()
        except GpuguardError as exc:
            log.warning("node.dry_run_without_cluster", node=name, error=str(exc))
    return DryRunNodeWriter(initial)


def quarantined_nodes(api: kubeclient.Client, *, timeout: float = 10.0) -> list[dict[str, Any]]:
    """For `gpuguard status`: every node gpuguard has quarantined (fully or deferred), one list request."""
    rows = []
    for item in nodes.select(api, LABEL_QUARANTINED, what="list quarantined nodes", timeout=timeout):
        n = NodeView.from_api(item)
        taint = n.our_taint
        # "overridden": the taint was removed by hand and the agent has not caught up yet.
        state = "deferred" if n.deferred else "quarantined" if taint is not None else "overridden"
        rows.append(
            _status_row(
                n,
                state,
                taint,
                reason=n.record.primary_reason,
                since=n.annotations.get(ANN_SINCE),
                faults=sorted(n.recorded_faults),
                detail=n.annotations.get(ANN_REASON),
                cordoned_by_gpuguard=n.cordoned_by_us and n.unschedulable,
                degraded=sorted(DegradedRecord.read(n.annotations).keys),
            )
        )
    return sorted(rows, key=lambda r: str(r["node"]))


def degraded_nodes(api: kubeclient.Client, *, skip: set[str], timeout: float = 10.0) -> list[dict[str, Any]]:
    """For `gpuguard status`: the nodes gpuguard marks degraded (label gpuguard.io/degraded) that are not
    quarantined too (`skip`: those already listed), one list request. Rows as `quarantined_nodes`'s."""
    rows = []
    for item in nodes.select(api, LABEL_DEGRADED, what="list degraded nodes", timeout=timeout):
        n = NodeView.from_api(item)
        record = DegradedRecord.read(n.annotations)
        if n.name not in skip and record.present:
            rows.append(
                _status_row(
                    n, "degraded", degraded_taint(n), reason=record.first_reason, degraded=sorted(record.keys)
                )
            )
    return sorted(rows, key=lambda r: str(r["node"]))


def _status_row(
    n: NodeView,
    state: str,
    taint: Taint | None,
    *,
    reason: str | None,
    degraded: list[str],
    since: str | None = None,
    faults: list[str] | None = None,
    detail: str | None = None,
    cordoned_by_gpuguard: bool = False,
) -> dict[str, Any]:
    """One node's row of `gpuguard status` (`gpu.writers.quarantined_gpus` gives its GPUs' rows); `reason`:
    the record's, the taints carry none."""
    return {
        "node": n.name,
        "state": state,
        "reason": reason,
        "effect": taint.effect if taint else None,
        "since": since,
        "faults": faults or [],
        "detail": detail,
        "cordoned_by_gpuguard": cordoned_by_gpuguard,
        "unschedulable": n.unschedulable,
        "degraded": degraded,
        # GPUs held for repair as repeat offenders: UUID -> fault episodes.
        "repeat_offenders": n.repeat_offenders,
    }
