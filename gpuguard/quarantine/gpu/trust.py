"""What the per-GPU quarantine trusts of the DeviceTaintRules it reads ("trust nothing another agent wrote"):
a stolen agent token, or an operator's tool, can write rules under gpuguard's labels. Only a rule provably
gpuguard's own for its node and device (`DeviceRule.own`) is taken over, released or counted:

- `trusted_rules`: the node's own rules among those listed under its label;
- `adopt`: a create whose 409 takes over the existing rule only when it is this node's rule for this device;
- `countable`: the rules the GPU budget counts (blocking, one per (pool, device)); `gpu.order` caps each
  node at one node's worth.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import structlog

from gpuguard.core.errors import ConflictError
from gpuguard.quarantine.gpu.rules import NONE_EFFECT, RULE_PREFIX, DeviceRule
from gpuguard.quarantine.gpu.slices import SliceDevice

log = structlog.get_logger(__name__)


class RuleWriter(Protocol):
    """The part of `rules.DeviceSource` a create needs."""

    def create(self, body: Mapping[str, Any]) -> DeviceRule:
        """Create; ConflictError when a rule of that name exists."""

    def get(self, name: str) -> DeviceRule | None:
        """The rule of that name; None when there is none."""


def trusted_rules(
    node: str, listed: Iterable[DeviceRule], *, logged: set[str]
) -> tuple[dict[str, DeviceRule], set[str]]:
    """The rules of `listed` that are `node`'s own, by name, and the names of the others. Each other one is
    logged once (`logged`: the names already logged, as returned last time) and left alone."""
    rules: dict[str, DeviceRule] = {}
    untrusted: set[str] = set()
    for r in listed:
        if r.own(node):
            rules[r.name] = r
            continue
        untrusted.add(r.name)
        if r.name not in logged:
            log.warning(
                "device.rule_untrusted",
                node=node,
                rule=r.name,
                pool=r.pool,
                device=r.device,
                note="not gpuguard's rule for this node: ignored",
            )
    return rules, untrusted


def adopt(source: RuleWriter, node: str, dev: SliceDevice, body: Mapping[str, Any]) -> DeviceRule | None:
    """Create the rule. On a 409 the rule of that name is taken over only when it is provably this node's
    rule for this very device (node, pool, driver, device, labels, name: `DeviceRule.selects`), as one made
    before a restart is. Any other one (squatted, changed by someone else) is left alone and None returned,
    with a line that names it: the caller puts the node taint in its place."""
    name = str(body["metadata"]["name"])
    try:
        return source.create(body)
    except ConflictError:
        found = source.get(name)
    if found is not None and found.selects(dev):
        log.info("device.rule_adopted", node=node, rule=name, device=dev.device, uuid=dev.uuid)
        return found
    log.error(
        "device.rule_conflict",
        node=node,
        rule=name,
        device=dev.device,
        uuid=dev.uuid,
        found_pool=found.pool if found is not None else None,
        found_device=found.device if found is not None else None,
        note="a rule of that name exists and is not this node's for this device: node taint",
    )
    return None


def countable(rules: Iterable[DeviceRule]) -> list[DeviceRule]:
    """The rules the GPU budget counts: blocking (neither deferred nor effect None: a rule that blocks
    nothing takes no room), each its own pool's (`DeviceRule.own`), and one per (pool, device), the first
    by name. What a rule costs, and the cap of one node's worth per node, is `gpu.order`'s."""
    seen: set[tuple[str, str]] = set()
    out = []
    for r in sorted(rules, key=lambda r: (not r.name.startswith(RULE_PREFIX), r.name)):
        if r.deferred or r.effect == NONE_EFFECT or not r.own(r.pool) or (r.pool, r.device) in seen:
            continue
        seen.add((r.pool, r.device))
        out.append(r)
    return out
