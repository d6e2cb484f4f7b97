"""The node's second level, `degraded`: GPUs are shown and scheduled around softly, never cordoned
and never counted by the quarantine budget. A pure plan of the marks gpuguard keeps for them on its Node:

- the annotation ANN_DEGRADED: the degraded signals' keys (JSON list of "<reason>/<uuid or node>", sorted,
  bounded), gpuguard's record that the other marks are its own;
- the label LABEL_DEGRADED=true (for selectors; the budget counts only `gpuguard.io/quarantined`);
- by default (--no-degraded-taint turns it off) a PreferNoSchedule taint DEGRADED_TAINT_KEY without a value
  (as the fault taint: `record.TAINT_KEY`'s comment says why);
- the node condition GPUDegraded (`plan_degraded_condition`), and the Events GPUDegraded / GPUDegradedCleared.

The marks go once the verdict has been free of degraded signals for --recover-after checks. Ownership as for
the fault taint: without gpuguard's record (the annotation) a taint or label with these keys is someone
else's and is never removed; a taint removed by hand is not put back for the same signals, only for new ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from gpuguard.core import validation
from gpuguard.core.errors import ConfigError
from gpuguard.core.model import Fault, plural
from gpuguard.quarantine.node.view import (
    DEGRADED_CONDITION_TYPE,
    SOFT_EFFECT,
    EventSpec,
    NodeChange,
    NodeView,
    Taint,
)
from gpuguard.quarantine.record import DEGRADED_TAINT_KEY, DOMAIN, rfc3339

LABEL_DEGRADED = f"{DOMAIN}/degraded"
ANN_DEGRADED = f"{DOMAIN}/degraded-signals"
DEGRADED_CONDITION = DEGRADED_CONDITION_TYPE
# Bounds on what is written and on what is believed when read back: a node with hundreds of signals (or an
# annotation another writer filled) never makes a large write or a large condition.
MAX_DEGRADED_KEYS = 64
# The NodeChange actions of this module (the reconciler writes them after the fault's own).
DEGRADED_ACTIONS = ("degrade", "degrade-clear")
_MAX_MESSAGE = 4096


@dataclass(frozen=True)
class DegradedRecord:
    """gpuguard's record of the degraded marks on a node, as read (validated: trust nothing read back)."""

    present: bool = False
    keys: frozenset[str] = frozenset()

    @classmethod
    def read(cls, annotations: Mapping[str, str]) -> DegradedRecord:
        raw = annotations.get(ANN_DEGRADED)
        if raw is None:
            return cls()
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if not isinstance(doc, list):
            return cls(present=True)  # ours, but unreadable: rewritten at the next degraded verdict
        keys = [validation.fault_key(k) for k in doc if isinstance(k, str) and k]
        return cls(present=True, keys=frozenset(keys[:MAX_DEGRADED_KEYS]))

    @property
    def first_reason(self) -> str | None:
        """The alphabetically first recorded reason (what `gpuguard status` shows, and the taint's value in
        earlier versions); None when nothing is recorded."""
        return min((k.split("/", 1)[0] for k in self.keys), default=None)


def degraded_keys(degraded: Iterable[Fault]) -> frozenset[str]:
    """The keys as recorded: each through fault_key (a hostile UUID cannot split or grow one), at most
    MAX_DEGRADED_KEYS of them (the first in sorted order)."""
    keys = sorted({validation.fault_key(f.key) for f in degraded})
    return frozenset(keys[:MAX_DEGRADED_KEYS])


def degraded_taint(node: NodeView) -> Taint | None:
    return next((t for t in node.taints if t.key == DEGRADED_TAINT_KEY), None)


def plan_degraded(
    node: NodeView, degraded: tuple[Fault, ...], *, clean_streak: int, recover_after: int, taint: bool
) -> NodeChange | None:
    """The one write that brings the node's degraded marks in line, or None. Pure.

    `degraded`: the signals the node carries itself (on a DRA node, per-GPU signals go to effect-None
    DeviceTaintRules instead); `clean_streak`: consecutive checks without any degraded signal; `taint`: place
    the PreferNoSchedule taint (False: the label, annotation and condition only)."""
    record = DegradedRecord.read(node.annotations)
    if degraded:
        return _mark(node, record, degraded, taint=taint)
    if not record.present or clean_streak < recover_after:
        return None
    return _clear(node, record)


def _mark(
    node: NodeView, record: DegradedRecord, degraded: tuple[Fault, ...], *, taint: bool
) -> NodeChange | None:
    keys = degraded_keys(degraded)
    new = keys != record.keys or not record.present
    annotations: dict[str, str | None] = {}
    labels: dict[str, str | None] = {}
    if new:
        annotations[ANN_DEGRADED] = json.dumps(sorted(keys), separators=(",", ":"))
    if node.labels.get(LABEL_DEGRADED) != "true":
        labels[LABEL_DEGRADED] = "true"
    current = degraded_taint(node)
    ours = current is not None and _ours(current, record)
    wanted = Taint(key=DEGRADED_TAINT_KEY, effect=SOFT_EFFECT)
    taints: tuple[Taint, ...] | None = None
    if taint and ((new and current is None) or ours) and _differs(current, wanted):
        # Placed for new signals, kept up to date while present; removed by hand for the same signals, it
        # stays off (an operator's override). Someone else's taint with this key is left exactly as it is.
        taints = (*(t for t in node.taints if t.key != DEGRADED_TAINT_KEY), wanted)
    elif not taint and ours:
        taints = tuple(t for t in node.taints if t.key != DEGRADED_TAINT_KEY)
    if not annotations and not labels and taints is None:
        return None
    return NodeChange(
        action="degrade",
        taints=taints,
        annotations=annotations,
        labels=labels,
        event=EventSpec("Warning", "GPUDegraded", degraded_text(degraded)) if new else None,
    )


def _clear(node: NodeView, record: DegradedRecord) -> NodeChange:
    current = degraded_taint(node)
    ours = current is not None and _ours(current, record)
    return NodeChange(
        action="degrade-clear",
        taints=tuple(t for t in node.taints if t.key != DEGRADED_TAINT_KEY) if ours else None,
        annotations={ANN_DEGRADED: None},
        labels={LABEL_DEGRADED: None} if LABEL_DEGRADED in node.labels else {},
        event=EventSpec(
            "Normal",
            "GPUDegradedCleared",
            "no degraded GPU signal for the recovery window"
            + (f" (was: {', '.join(sorted(record.keys))})" if record.keys else ""),
        ),
    )


def _differs(current: Taint | None, wanted: Taint) -> bool:
    return current is None or (current.value, current.effect) != (wanted.value, wanted.effect)


def _ours(current: Taint, record: DegradedRecord) -> bool:
    """The taint with our key is the one gpuguard wrote for the recorded signals: PreferNoSchedule without a
    value, or with the value earlier versions gave the recorded keys (`_earlier_value`; rewritten without
    it in one patch). An operator's taint with the same key (another effect or value, placed before
    gpuguard's record or after ours was removed by hand) is theirs: never rewritten, never removed."""
    if not record.present or current.effect != SOFT_EFFECT:
        return False
    return not current.value or current.value == _earlier_value(record)


def _earlier_value(record: DegradedRecord) -> str:
    """The value earlier versions gave the taint: the record's first reason, or "degraded" where there is
    none or it is not a valid label value."""
    try:
        return validation.taint_value(record.first_reason or "degraded")
    except ConfigError:
        return "degraded"


def degraded_text(degraded: Iterable[Fault]) -> str:
    """'nvlink-down on GPU 0 (GPU-1234): link 3 inactive; pcie-width on the node: ...', bounded."""
    parts = []
    for f in sorted(degraded, key=lambda f: (f.reason, f.uuid or "")):
        where = "the node" if f.uuid is None else f"GPU {f.gpu_index} ({f.uuid})"
        parts.append(f"{f.reason} on {where}: {f.detail}" if f.detail else f"{f.reason} on {where}")
    return validation.clean_text("; ".join(parts), max_bytes=_MAX_MESSAGE)


def plan_degraded_condition(
    current: str | None,
    degraded: tuple[Fault, ...],
    *,
    last_keys: frozenset[str] | None,
    clean_streak: int,
    recover_after: int,
    now: datetime,
) -> dict[str, str] | None:
    """The GPUDegraded condition to write, or None: True with the reasons and GPU UUIDs while degraded
    (rewritten when the signals change, and once after a restart); False once clean for the recovery
    window, only on a node that has the condition (a node never degraded costs no request)."""
    stamp = rfc3339(now)
    if degraded:
        keys = degraded_keys(degraded)
        # `last_keys` None: this run has not written it yet; the condition on the node is a previous
        # run's, whose signals may have changed since: written once (a request at a degraded node's start).
        if current == "True" and last_keys == keys:
            return None
        gpus = len({f.uuid for f in degraded if f.uuid})
        return {
            "type": DEGRADED_CONDITION,
            "status": "True",
            "reason": "GPUDegraded",
            "message": validation.clean_text(
                f"{plural(gpus, 'GPU')} degraded (gpuguard): {degraded_text(degraded)}",
                max_bytes=_MAX_MESSAGE,
            ),
            "lastHeartbeatTime": stamp,
            "lastTransitionTime": stamp,
        }
    if current != "True" or clean_streak < recover_after:
        return None
    return {
        "type": DEGRADED_CONDITION,
        "status": "False",
        "reason": "GPUsNotDegraded",
        "message": "no degraded GPU signal (gpuguard)",
        "lastHeartbeatTime": stamp,
        "lastTransitionTime": stamp,
    }
