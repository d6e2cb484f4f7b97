"""The budget's side of the per-GPU quarantine (docs/design.md, "The budget counts GPUs as well as nodes"):
whether one more GPU fits (`RuleBudget.room`), and the order check of the rules this node made blocking
(`blocking`, `verify`), which steps a rule past the limit back to effect None. The rules, their writes and
their memory stay `gpu.quarantine`'s; this module reads the fleet (the node budget, the fully quarantined
nodes, every rule of gpuguard) and asks for the step back through a callback.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from fractions import Fraction
from typing import Any

import structlog

from gpuguard.core.config import NodeSettings
from gpuguard.core.errors import NodeUpdateError
from gpuguard.quarantine.budget import VERIFY_SETTLE, Budget
from gpuguard.quarantine.gpu.lines import rule_log
from gpuguard.quarantine.gpu.order import rules_past_limit, rules_share
from gpuguard.quarantine.gpu.plan import step_back
from gpuguard.quarantine.gpu.rules import NONE_EFFECT, DeviceRule
from gpuguard.quarantine.record import NodeRef

log = structlog.get_logger(__name__)

# A change to one rule: the rule as the API server answered, or None when it did not land.
Patch = Callable[[DeviceRule, Mapping[str, Any]], DeviceRule | None]


class RuleBudget:
    """`budget`: the node budget (fully quarantined nodes, the limit); `order`: (since, name) of the fully
    quarantined nodes; `all_rules`: every rule of gpuguard. `budget` None (a dry run): always room, no order
    check."""

    def __init__(
        self,
        settings: NodeSettings,
        *,
        all_rules: Callable[[], list[DeviceRule]],
        budget: Callable[[], Budget | None] | None = None,
        order: Callable[[], Iterable[tuple[str, str]]] | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._all_rules = all_rules
        self._budget = budget
        self._order = order
        self._now = now
        self._clock = clock
        self._budget_at = -math.inf
        # Rules made blocking since the last settled order check, whether the check runs at this apply,
        # and the monotonic time of the second check (VERIFY_SETTLE after the last blocking write).
        self._fresh: set[str] = set()
        self._check_now = False
        self._settle_at: float | None = None

    @property
    def settling(self) -> bool:
        """An order check of a fresh rule is pending."""
        return self._settle_at is not None

    def blocking(self, rule: DeviceRule) -> None:
        """A rule was just made blocking: the quarantine order is checked at the end of this apply and
        again VERIFY_SETTLE seconds later (the other agents' writes of the same burst have landed by then)."""
        if self._budget is None or rule.effect == NONE_EFFECT:
            return
        self._fresh.add(rule.name)
        self._check_now = True

    def verify(self, node: NodeRef, rules: Mapping[str, DeviceRule], patch: Patch) -> list[DeviceRule]:
        """The order check of fresh rules when it is due: at once after the write, then once more after
        VERIFY_SETTLE (a failed list tries again VERIFY_SETTLE later). `rules`: this node's rules as last
        read; returns the rules it stepped back, as the API server answered."""
        due = self._settle_at is not None and self._clock() >= self._settle_at
        if not self._fresh or not (self._check_now or due):
            if not self._fresh:
                self._settle_at = None
            return []
        first = self._check_now
        self._check_now = False
        landed, changed = self._check_order(node, rules, patch)
        if landed and not first:
            self._fresh.clear()
            self._settle_at = None
            return changed
        self._settle_at = self._clock() + VERIFY_SETTLE
        return changed

    def _check_order(
        self, node: NodeRef, rules: Mapping[str, DeviceRule], patch: Patch
    ) -> tuple[bool, list[DeviceRule]]:
        """Is a fresh rule of this node past the limit in the cluster's quarantine order? Steps it back to
        effect None (deferred). False when the lists failed or a step back did not land (checked again
        later)."""
        assert self._budget is not None
        try:
            budget = self._budget()
            if budget is None:
                return True, []
            nodes = list(self._order()) if self._order is not None else []
            # This node's rules as its own writes answered, not as the fleet's watch last delivered them (its
            # new rule may not be there yet, a deleted one still): every rule of its pool is its own writes'.
            others = [r for r in self._all_rules() if r.pool != node.name]
            everyone = others + list(rules.values())
        except NodeUpdateError as exc:
            log.warning("device.quarantine_order_failed", node=node.name, error=str(exc))
            return False, []
        past = rules_past_limit(nodes, everyone, budget.limit, now=self._now())
        landed = True
        changed = []
        for name in sorted(self._fresh):
            rule = rules.get(name)
            if rule is None or rule.deferred or rule.effect == NONE_EFFECT:
                self._fresh.discard(name)  # recovered, deleted or deferred meanwhile
            elif name in past:
                updated = self._step_back(node, rule, past[name], budget.limit, patch)
                if updated is None:
                    landed = False
                else:
                    changed.append(updated)
        return landed, changed

    def _step_back(
        self, node: NodeRef, rule: DeviceRule, ahead: Fraction, limit: int, patch: Patch
    ) -> DeviceRule | None:
        """A blocking rule past the budget (agents that faulted at the same instant all saw room) steps back
        to the deferred state: effect None and gpuguard.io/quarantine-deferred, until a re-check has room."""
        worth = "GPU node's worth" if ahead == 1 else "GPU nodes' worth"
        why = (
            f"quarantine budget spent: {float(ahead):g} {worth} quarantined before this rule, "
            f"limit {limit} (--max-quarantined {self._settings.max_quarantined})"
        )
        updated = patch(rule, step_back(rule, why))
        if updated is None:
            return None  # a conflict: the rules are read again, the settle re-check looks again
        self._fresh.discard(updated.name)
        self._budget_at = self._clock()  # the next room re-check waits --budget-recheck
        rule_log(node.name, rule).warning(
            "device.rule_yielded", ahead=float(ahead), limit=limit, note="effect None until there is room"
        )
        return updated

    def room(self, node: NodeRef, rule: DeviceRule | None, *, node_gpus: int) -> bool:
        """Whether one more GPU fits the budget: the fully quarantined nodes plus every rule's share (this
        one's included), at most --max-quarantined. Re-checked at most every --budget-recheck seconds for a
        deferred rule. `node_gpus`: the GPUs this node publishes (a rule's share is 1/that). No budget
        source (a dry run): always room."""
        if self._budget is None:
            return True
        if rule is not None and self._clock() - self._budget_at < self._settings.budget_recheck:
            return False
        self._budget_at = self._clock()
        budget = self._budget()
        if budget is None:
            return True
        others = [r for r in self._all_rules() if r.name != (rule.name if rule else "")]
        # The fully quarantined nodes' rules count nothing more (the node counts once): asked only where both
        # exist, so a fleet without node quarantines adds no read here.
        covered: list[str] = []
        if budget.quarantined and others and self._order is not None:
            covered = [name for _, name in self._order()]
        # This GPU's share, within the one node's worth its node may take at most.
        mine = rules_share([r for r in others if r.pool == node.name])
        share = min(Fraction(1, max(node_gpus, 1)), 1 - mine)
        used = Fraction(budget.quarantined) + rules_share(others, covered=covered)
        room = used + share <= budget.limit
        if not room:
            log.warning(
                "device.budget_spent",
                node=node.name,
                quarantined=float(used),
                limit=budget.limit,
                note="rule with effect None until there is room",
            )
        return room
