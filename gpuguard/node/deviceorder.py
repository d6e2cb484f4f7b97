"""The quarantine order of rules and nodes: the budget counts GPUs as well as nodes (docs/design.md). A rule
costs 1/G of a node's share (G: the GPUs its node publishes, recorded on the rule); agents that fault at the
same instant all see room, so after a rule is made blocking the order of every blocking rule and every fully
quarantined node is checked, and a rule of this node past the limit steps back (`devicequarantine`). Pure."""

from __future__ import annotations

from collections.abc import Iterable
from fractions import Fraction

from gpuguard.node.devices import NONE_EFFECT, DeviceRule
from gpuguard.node.view import ANN_SINCE


def rules_past_limit(
    nodes: Iterable[tuple[str, str]], rules: Iterable[DeviceRule], limit: int
) -> dict[str, Fraction]:
    """The quarantine order of rules: every blocking rule of gpuguard (its share) and every fully quarantined
    node (`nodes`: (since, name), a whole node each), the earlier gpuguard.io/since first, then the name.
    Returns the rules past `limit` with what comes before each. Pure; every agent reads the same rules and
    nodes, so every agent computes the same order, and the earliest keep their place. Only rules are ever
    named: a node past the limit is the node budget's to step back (budget.plan_yield), never a rule's. A
    rule of a fully quarantined node is not in the order at all: the node's taint covers its GPUs, so the
    node counts once."""
    nodes = set(nodes)
    covered = {name for _, name in nodes}
    entries: list[tuple[str, str, Fraction, bool]] = [
        (since, name, Fraction(1), False) for since, name in nodes
    ]
    entries += [
        (r.annotations.get(ANN_SINCE, ""), r.name, r.share, True)
        for r in rules
        if not r.deferred and r.effect != NONE_EFFECT and r.pool not in covered
    ]
    past: dict[str, Fraction] = {}
    used = Fraction(0)
    for _, name, share, is_rule in sorted(entries, key=lambda e: (e[0], e[1])):
        if is_rule and used + share > limit:
            past[name] = used
        used += share
    return past


def rules_share(rules: Iterable[DeviceRule], *, covered: Iterable[str] = ()) -> Fraction:
    """What the non-deferred rules cost the budget: the sum of their shares, but nothing for a rule of a node
    in `covered` (fully quarantined: the node already counts as a whole, its GPUs with it). Exact."""
    nodes = set(covered)
    return sum((r.share for r in rules if not r.deferred and r.pool not in nodes), Fraction(0))
