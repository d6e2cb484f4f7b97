"""The quarantine order of rules and nodes: the budget counts GPUs as well as nodes (docs/design.md). A rule
costs 1/G of a node's share (G: the GPUs its node publishes, recorded on the rule); agents that fault at the
same instant all see room, so after a rule is made blocking the order of every blocking rule and every fully
quarantined node is checked, and a rule of this node past the limit steps back (`gpu.quarantine`). Pure."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from fractions import Fraction

from gpuguard.quarantine.budget import SINCE_SKEW, api_time, since_time
from gpuguard.quarantine.gpu.rules import DeviceRule
from gpuguard.quarantine.gpu.trust import countable
from gpuguard.quarantine.record import ANN_SINCE


def rule_since(rule: DeviceRule, *, now: datetime) -> str | None:
    """The rule's gpuguard.io/since as it may rank in the order, or None when the claim is not valid. As a
    node's claim (`budget.quarantine_entry`): gpuguard's form, not ahead of `now` by more than SINCE_SKEW,
    and, where the API server's creationTimestamp is known, within SINCE_SKEW of it (gpuguard writes since
    in the create itself, so an honest one is the creation time give or take the request and the clocks'
    skew; an agent's stolen token could otherwise rank its own rule first with an early since)."""
    since = rule.annotations.get(ANN_SINCE)
    when = since_time(since, now=now)
    if isinstance(when, str) or since is None:
        return None
    created = api_time(rule.created)
    if created is not None and abs(when - created) > SINCE_SKEW:
        return None
    return since


def rules_past_limit(
    nodes: Iterable[tuple[str, str]], rules: Iterable[DeviceRule], limit: int, *, now: datetime
) -> dict[str, Fraction]:
    """The quarantine order of rules: every blocking rule of gpuguard (its share) and every fully quarantined
    node (`nodes`: (since, name), a whole node each), the earlier gpuguard.io/since first, then the name.
    Returns the rules past `limit` with what comes before each. Pure; every agent reads the same rules and
    nodes, so every agent computes the same order, and the earliest keep their place. Only rules are ever
    named: a node past the limit is the node budget's to step back (budget.plan_yield), never a rule's. A
    rule of a fully quarantined node is not in the order at all: the node's taint covers its GPUs, so the
    node counts once. Only countable rules (`gpu.trust.countable`) are in it, each node's at most one
    node's worth together. A rule whose since is not valid (`rule_since`) still counts its share, after
    every valid claim: it can neither escape the limit nor push an honest rule past it."""
    nodes = set(nodes)
    covered = {name for _, name in nodes}
    entries: list[tuple[bool, str, str, Fraction, str]] = [
        (False, since, name, Fraction(1), "") for since, name in nodes
    ]
    for r in countable(rules):
        if r.pool in covered:
            continue
        since = rule_since(r, now=now)
        entries.append((since is None, since or "", r.name, r.share, r.pool))
    past: dict[str, Fraction] = {}
    used = Fraction(0)
    pools: dict[str, Fraction] = {}
    for _, _, name, claimed, pool in sorted(entries, key=lambda e: (e[0], e[1], e[2])):
        share = claimed
        if pool:
            # One node's worth per node at most, however many rules (or what GPU count) its pool claims.
            share = min(claimed, 1 - pools.get(pool, Fraction(0)))
            pools[pool] = pools.get(pool, Fraction(0)) + share
            if share and used + share > limit:
                past[name] = used
        used += share
    return past


def rules_share(rules: Iterable[DeviceRule], *, covered: Iterable[str] = ()) -> Fraction:
    """What the countable rules (`gpu.trust.countable`: blocking, gpuguard's own) cost the budget: the sum
    of their shares, at most one node's worth per node, and nothing for a rule of a node in `covered`
    (fully quarantined: the node already counts as a whole, its GPUs with it). Exact."""
    nodes = set(covered)
    pools: dict[str, Fraction] = {}
    for r in countable(rules):
        if r.pool not in nodes:
            pools[r.pool] = pools.get(r.pool, Fraction(0)) + r.share
    return sum((min(used, Fraction(1)) for used in pools.values()), Fraction(0))
