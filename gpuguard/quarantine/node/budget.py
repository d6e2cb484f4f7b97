"""The cluster-wide quarantine budget (--max-quarantined): how many GPU nodes gpuguard may fully quarantine at
once, so that a bad driver roll-out that makes every node report an Xid cannot take the fleet out of service.

- arithmetic: `Budget`, `count_budget` (from the nodes' metadata; the limit is `config.QuarantineLimit`);
- what another node claims, validated before it counts: `quarantine_entry` (pure) and `OtherNodes`, which
  ignores a malformed or forged claim and logs it once;
- the quarantine order (`quarantine_rank`) and the step back of a node past the limit (`plan_yield`);
- `limit`: the pure gate that turns the planner's full quarantine into the deferred one when there is no room;
- `QuarantineBudget`: the budget's state across reconciles (the list of this call, the deferred re-check, the
  second order check after a burst), so the reconciler holds none of it.

The fleet is read through `BudgetSource`, a two-method seam of its own: this module never imports a writer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, replace
from datetime import UTC, datetime
from typing import Any, Protocol

import structlog

from gpuguard.core import validation
from gpuguard.core.config import NodeSettings, QuarantineLimit
from gpuguard.core.errors import NodeUpdateError
from gpuguard.core.model import Verdict, plural
from gpuguard.quarantine.budget import VERIFY_SETTLE, Budget, api_time, since_time
from gpuguard.quarantine.node.plan import record_faults
from gpuguard.quarantine.node.view import (
    ANN_CORDONED,
    LABEL_QUARANTINED,
    SOFT_EFFECT,
    EventSpec,
    NodeChange,
    NodeView,
    with_our_effect,
)
from gpuguard.quarantine.record import ANN_DEFERRED, ANN_REASON, ANN_SINCE, TAINT_KEY

log = structlog.get_logger(__name__)


class BudgetSource(Protocol):
    """Where the budget is read: a watch kept in memory (`budgetwatch.WatchedBudget`), the API server's lists
    (`writers.KubeNodeWriter`, its fallback), or nowhere in a dry run."""

    def budget(self, spec: QuarantineLimit, *, exclude: str) -> Budget | None:
        """The quarantine budget, or None where there is no cluster to ask."""

    def quarantine_order(self) -> list[tuple[str, str]]:
        """(gpuguard.io/since, name) of every node fully quarantined by gpuguard."""

    def changes(self) -> int:
        """A number that moves whenever the fleet's quarantines may have changed, so that a fully quarantined
        node checks the order again (free from memory); a constant where every read is a request."""


def count_budget(
    items: Iterable[Mapping[str, Any]],
    spec: QuarantineLimit,
    *,
    exclude: str,
    quarantined: Iterable[tuple[str, str]],
) -> Budget:
    """A percentage budget from the GPU nodes' metadata: the total (this node counted even if its label is
    missing) and the fully quarantined ones other than this node, as `OtherNodes` let them count."""
    names = {i["metadata"]["name"] for i in items}
    total = len(names) if exclude in names else len(names) + 1
    counted = sum(1 for _, name in set(quarantined) if name != exclude)
    return Budget(gpu_nodes=total, quarantined=counted, limit=spec.of(total))


def quarantine_entry(meta: Mapping[str, Any], *, now: datetime) -> tuple[str, str] | str:
    """(gpuguard.io/since, name) of a node that another agent fully quarantined, as it counts in the budget
    and the quarantine order; or why it does not count. Pure.

    Every agent reads these keys from every other node, and a stolen token can write them on its own node:
    a node counts only with the label "true" and a `since` in gpuguard's own form, not before the node was
    created and not ahead of `now` by more than SINCE_SKEW. Otherwise `since=0000-01-01T00:00:00Z` would rank
    a node first for ever and push real faults past the limit. Deterministic but for `now`, so every agent
    ignores the same claims (near the skew bound for a few seconds at most)."""
    labels = meta.get("labels") or {}
    if labels.get(LABEL_QUARANTINED) != "true":
        return "not labelled quarantined=true"
    since = (meta.get("annotations") or {}).get(ANN_SINCE)
    when = since_time(since, now=now)
    if isinstance(when, str):
        return when
    created = api_time(meta.get("creationTimestamp"))
    if created is not None and when < created:
        return f"{ANN_SINCE} {since} lies before the node was created ({meta.get('creationTimestamp')})"
    return (str(since), str(meta["name"]))


class OtherNodes:
    """Other nodes' claims as the budget may count them: each item through `quarantine_entry`; an ignored
    one is logged once (node.claim_ignored, per node and reason), not at every list."""

    def __init__(self, *, clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self._clock = clock
        self._logged: set[tuple[str, str]] = set()
        # The claims found valid, by the very item they were read from (the watch replaces an item whole on
        # every change, a list makes new ones): a fault's budget check validates only what changed since the
        # last check, not every quarantined node again (hundreds in a large fleet). A valid claim stays valid:
        # only its "not ahead of now" part depends on the clock, and the clock moves forward.
        self._valid: dict[int, tuple[Mapping[str, Any], tuple[str, str]]] = {}

    def quarantined(self, items: Iterable[Mapping[str, Any]]) -> list[tuple[str, str]]:
        now: datetime | None = None
        out = []
        valid: dict[int, tuple[Mapping[str, Any], tuple[str, str]]] = {}
        known = self._valid
        for item in items:
            hit = known.get(id(item))
            if hit is not None and hit[0] is item:  # the item itself (kept alive here), not a reused id
                valid[id(item)] = hit
                out.append(hit[1])
                continue
            meta = item.get("metadata") or {}
            now = now or self._clock()
            entry = quarantine_entry(meta, now=now)
            if isinstance(entry, tuple):
                valid[id(item)] = (item, entry)
                out.append(entry)
                continue
            if LABEL_QUARANTINED not in (meta.get("labels") or {}):
                continue  # an unquarantined node in the fleet list: nothing claimed, nothing to say
            name = validation.clean_text(str(meta.get("name", "")), max_bytes=253)
            if (name, entry) not in self._logged:
                self._logged.add((name, entry))
                log.warning("node.claim_ignored", other_node=name, reason=validation.clean_text(entry))
        self._valid = valid  # only the items of this call: nothing kept for a node that left the list
        return out


def quarantine_rank(order: Iterable[tuple[str, str]], me: tuple[str, str]) -> int:
    """How many other fully quarantined nodes come before `me` in the quarantine order: the earlier
    gpuguard.io/since first, then the node name. Every agent reads the same annotations, so every agent
    computes the same order: when a burst overshoots the budget, exactly the nodes past the limit yield."""
    return sum(1 for k in set(order) if k[1] != me[1] and k < me)


def limit(
    change: NodeChange | None, node: NodeView, verdict: Verdict, budget: Budget | None, settings: NodeSettings
) -> NodeChange | None:
    """The gate: the planner's full quarantine as the budget allows it. Pure. Without room a new quarantine
    becomes the deferred one (soft taint, no cordon, label "deferred") and a deferred node stays deferred
    (only new faults are recorded); `budget` None (no cluster to ask) or with room: the change as planned."""
    if change is None or budget is None or budget.has_room:
        return change
    if change.action == "escalate":
        return record_faults(node, verdict.faults)
    if change.action != "taint":
        return change
    count = (
        f"{budget.quarantined} of {plural(budget.gpu_nodes, 'GPU node')}"
        if budget.gpu_nodes is not None
        else plural(budget.quarantined, "GPU node")
    )
    why = (
        f"quarantine budget spent: {count} quarantined, "
        f"limit {budget.limit} (--max-quarantined {settings.max_quarantined})"
    )
    annotations = {k: v for k, v in change.annotations.items() if k != ANN_CORDONED}
    annotations[ANN_DEFERRED] = why
    taints = tuple(replace(t, effect=SOFT_EFFECT) if t.key == TAINT_KEY else t for t in change.taints or ())
    message = change.event.message if change.event else ""
    return NodeChange(
        action="defer",
        taints=taints,
        unschedulable=None,
        annotations=annotations,
        labels={LABEL_QUARANTINED: "deferred"},
        event=EventSpec("Warning", "GPUQuarantineDeferred", f"{message}; {why}: soft taint only"),
    )


def plan_yield(node: NodeView, *, ahead: int, limit: int, settings: NodeSettings) -> NodeChange | None:
    """A full quarantine that turned out to be past the budget (agents that faulted at the same instant all
    saw room) steps back to the deferred state: soft taint, our cordon lifted, label "deferred". Pure.
    None when the node is not fully quarantined by us (any more)."""
    ours = node.our_taint
    if ours is None or not node.fully_quarantined or ahead < limit:
        return None
    why = (
        f"quarantine budget spent: {plural(ahead, 'GPU node')} {'was' if ahead == 1 else 'were'} quarantined "
        f"before this one, limit {limit} "
        f"(--max-quarantined {settings.max_quarantined})"
    )
    annotations: dict[str, str | None] = {ANN_DEFERRED: why}
    unschedulable = None
    if node.cordoned_by_us and node.unschedulable:
        unschedulable = False
        annotations[ANN_CORDONED] = None
    reason = node.annotations.get(ANN_REASON, "")
    return NodeChange(
        action="yield",
        taints=with_our_effect(node, ours, SOFT_EFFECT),
        unschedulable=unschedulable,
        annotations=annotations,
        labels={LABEL_QUARANTINED: "deferred"},
        event=EventSpec("Warning", "GPUQuarantineDeferred", f"{reason}; {why}: soft taint only"),
    )


class QuarantineBudget:
    """The budget's state across reconciles, for one node's reconciler.

    - one list per reconcile call: a 409 re-plan reuses it (the count has not moved in between);
    - while deferred, at most one list per --budget-recheck to see whether there is room again;
    - after a full quarantine, the quarantine order is checked at once and again VERIFY_SETTLE seconds
      later; a node found past the limit yields (the next plan is the step back);
    - while fully quarantined, again whenever the source's `changes()` moves (a watch kept in memory: each
      check costs no request), so the budget holds exactly once every agent's watch has caught up.
    """

    def __init__(
        self,
        source: BudgetSource,
        settings: NodeSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._source = source
        self._settings = settings
        self._clock = clock
        # The budget listed in the current reconcile call: its 409 re-plans reuse it instead of listing again.
        self._call: tuple[Budget | None] | None = None
        # After a full quarantine: (the budget, monotonic time of the second order check).
        self.settle: tuple[Budget, float] | None = None
        # Set when the order check found this node past the limit: the next plan is the yield.
        self._yield: tuple[int, int] | None = None
        self.checked = -math.inf
        # The source's changes() at the last order check, and whether this node is fully quarantined by us.
        self._seen = source.changes()
        self._holding = False

    @property
    def settling(self) -> bool:
        """An order check is pending: the reconciler must wake for it even on an unchanged verdict."""
        return self.settle is not None or (self._holding and self._source.changes() != self._seen)

    def begin(self, node: NodeView) -> None:
        """A new reconcile call: forget the last call's list; run the second order check when it is due,
        or another one when the fleet's quarantines changed while this node holds a full quarantine."""
        self._call = None
        self._holding = node.fully_quarantined
        if self.settle is not None and self._clock() >= self.settle[1]:
            budget = self.settle[0]
            self.settle = None
            self._check_order(node, budget)
        elif self._holding and self._yield is None and self._source.changes() != self._seen:
            try:
                now = self._source.budget(self._settings.max_quarantined, exclude=node.name)
            except NodeUpdateError as exc:
                log.warning("node.quarantine_order_failed", node=node.name, error=str(exc))
                return
            if now is not None:
                self._check_order(node, now)

    def pending_yield(self, node: NodeView) -> NodeChange | None:
        """The step back the order check asked for, if the node is still fully quarantined by us."""
        if self._yield is None:
            return None
        change = plan_yield(node, ahead=self._yield[0], limit=self._yield[1], settings=self._settings)
        if change is None:
            self._yield = None  # recovered or changed by hand meanwhile: nothing to step back from
        return change

    def gate(self, node: NodeView, change: NodeChange | None, verdict: Verdict) -> NodeChange | None:
        """The planned change as the budget allows it; lists the budget only for a full quarantine."""
        if change is None or change.action not in ("taint", "escalate"):
            return change
        if self._settings.max_quarantined.unlimited:
            return change  # no budget: no list request
        if self._call is not None:
            budget = self._call[0]  # a re-plan after a 409 in this reconcile: the count has not moved
        else:
            now = self._clock()
            if change.action == "escalate" and now - self.checked < self._settings.budget_recheck:
                return None  # deferred: at most one list per minute to see whether the budget has room
            budget = self._source.budget(self._settings.max_quarantined, exclude=node.name)
            self._call = (budget,)
            self.checked = now
        if budget is not None and not budget.has_room and change.action == "taint":
            log.warning("node.quarantine_deferred", node=node.name, **asdict(budget))
        return limit(change, node, verdict, budget, self._settings)

    def written(self, node: NodeView, change: NodeChange) -> bool:
        """After a write landed. True when the order check found this node past the limit: plan again,
        the next plan is the yield."""
        self._holding = node.fully_quarantined
        if change.action == "yield":
            self._yield = self.settle = None
            return False
        if change.action in ("taint", "escalate") and self._call and self._call[0]:
            budget = self._call[0]
            self.settle = (budget, self._clock() + VERIFY_SETTLE)
            return self._check_order(node, budget)
        return False

    def _check_order(self, node: NodeView, budget: Budget) -> bool:
        """After a full quarantine: is this node past the budget in the cluster's quarantine order? Sets
        the yield for the next plan and returns True if so. A failed list keeps the check for later."""
        if not node.fully_quarantined:
            return False
        self._seen = self._source.changes()
        try:
            order = self._source.quarantine_order()
        except NodeUpdateError as exc:
            log.warning("node.quarantine_order_failed", node=node.name, error=str(exc))
            self.settle = (budget, self._clock() + VERIFY_SETTLE)
            return False
        ahead = quarantine_rank(order, (node.annotations.get(ANN_SINCE, ""), node.name))
        if ahead < budget.limit:
            return False
        self._yield = (ahead, budget.limit)
        return True
