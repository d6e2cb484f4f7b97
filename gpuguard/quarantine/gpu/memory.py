"""The per-GPU quarantine's memory of its rules, which the API server cannot keep (a rule that is gone leaves
no record there): the rules gpuguard made, by name, with their GPU and faults, and the GPUs whose rule an
operator deleted, with the faults it recorded. Kept in the agent's durable state at every change, so that a
restarted agent knows them too (docs/design.md, "An operator's deletion")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import structlog

from gpuguard.core.model import Fault
from gpuguard.quarantine.gpu.plan import suppressed
from gpuguard.quarantine.gpu.rules import DeviceRule
from gpuguard.quarantine.record import join_keys
from gpuguard.store.state import RuleMemory

log = structlog.get_logger(__name__)


class RuleMemoryStore(Protocol):
    """Where the rules' memory outlives the process (`state.StateStore`)."""

    def load_rules(self) -> RuleMemory:
        """The memory recorded in this boot (empty when none)."""

    def save_rules(self, rules: RuleMemory) -> None:
        """Record it (written only when changed; never raises)."""


class Remembered:
    """`known`: the rules gpuguard made or found (name -> (UUID, fault keys)); one that is gone at the next
    read was deleted by an operator, and is not made again for the same faults (`overridden`, UUID -> fault
    keys; a new fault makes it again). `store` None: in memory only (a dry run, no --state-dir)."""

    def __init__(self, store: RuleMemoryStore | None) -> None:
        self._store = store
        remembered = store.load_rules() if store is not None else RuleMemory()
        self.known: dict[str, tuple[str, frozenset[str]]] = dict(remembered.known)
        self.overridden: dict[str, frozenset[str]] = dict(remembered.overridden)

    def save(self) -> None:
        """Into the durable memory (written only when it changed). A rule is remembered after its create
        answered, and forgotten before its delete is sent: a crash between the two never turns a rule into
        one "deleted by an operator" (that would leave a fault without a quarantine); the worst case, a rule
        deleted by hand during that crash, is made again (docs/reliability.md)."""
        if self._store is not None:
            self._store.save_rules(RuleMemory(known=dict(self.known), overridden=dict(self.overridden)))

    def holds(self, rule: DeviceRule) -> None:
        """A rule made, adopted or changed, as the API server answered."""
        self.known[rule.name] = (rule.uuid, rule.faults)
        self.save()

    def forget(self, rule: DeviceRule) -> None:
        """Before the rule's delete is sent (see `save`)."""
        self.known.pop(rule.name, None)
        self.save()

    def suppressed(self, uuid: str, faults: Iterable[Fault]) -> bool:
        """An operator deleted this GPU's rule for these very faults."""
        return suppressed(self.overridden, uuid, faults)

    def read(self, node: str, rules: Mapping[str, DeviceRule], untrusted: set[str]) -> set[str]:
        """After a read of the node's rules (`rules`, its own; `untrusted`, the names of the others): a rule
        remembered and gone was deleted by an operator; one remembered and now untrusted (ours once, changed
        by someone else since) is returned by UUID, for the node taint to stand in."""
        held: set[str] = set()
        for name, (uuid, keys) in self.known.items():
            if name in untrusted:
                held.add(uuid)
            elif name not in rules:
                log.warning(
                    "device.rule_removed_by_operator", node=node, rule=name, uuid=uuid, faults=join_keys(keys)
                )
                self.overridden[uuid] = keys
        self.known = {n: (r.uuid, r.faults) for n, r in rules.items()}
        self.save()
        return held

    def faults_gone(self, wanted: Iterable[str]) -> None:
        """The GPUs whose fault is gone (not in `wanted`): a new fault on them makes a rule again."""
        gone = set(self.overridden) - set(wanted)
        for uuid in gone:
            del self.overridden[uuid]
        self.save()
