"""The repair marks on the node, pure: while a GPU of the node is held as a repeat offender, the label
`gpuguard.io/needs-repair=true` (an operator or a node-repair controller selects on it) and the annotation
`gpuguard.io/repeat-offenders` (JSON, UUID -> fault episodes, at most MAX_LISTED GPUs); an Event
`GPURepeatOffender` when a GPU is newly held; the release annotation removed once the agent handled it.

Only gpuguard's marks are ever removed: the label goes only if `gpuguard.io/needs-repair-placed` says gpuguard
placed it (an operator's own needs-repair label stays, as an operator's cordon does).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace

from gpuguard.core import validation
from gpuguard.quarantine.node.view import (
    ANN_REPAIR_PLACED,
    ANN_REPEAT_OFFENDERS,
    LABEL_NEEDS_REPAIR,
    EventSpec,
    NodeChange,
    NodeView,
)
from gpuguard.quarantine.repeat.hold import ANN_HOLD
from gpuguard.quarantine.repeat.published import ANN_HISTORY
from gpuguard.quarantine.repeat.release import ANN_RELEASE

MAX_LISTED = 16


def listed(held: Mapping[str, int]) -> str:
    """The annotation's value: the held GPUs (at most MAX_LISTED, by UUID) and their episode counts."""
    return json.dumps(dict(sorted(held.items())[:MAX_LISTED]), sort_keys=True, separators=(",", ":"))


def marks(
    node: NodeView,
    held: Mapping[str, int],
    *,
    handled_release: str | None,
    handled_hold: str | None = None,
    published: tuple[str, str | None] | None = None,
    rides: bool = False,
) -> NodeChange | None:
    """The write that brings the node's repair marks in line with `held` (UUID -> episodes), or None; with
    `published` (an annotation key and its value, None: none) the GPU history's summary too, but only in a
    write that happens anyway (`rides`: the planned change, or a mark): never a request of its own, which
    would add one to every per-GPU fault and recovery."""
    annotations: dict[str, str | None] = {}
    labels: dict[str, str | None] = {}
    event = None
    ann = node.annotations
    if held:
        value = listed(held)
        if ann.get(ANN_REPEAT_OFFENDERS) != value:
            annotations[ANN_REPEAT_OFFENDERS] = value
        new = sorted(set(held) - set(node.repeat_offenders))
        if new:
            counts = ", ".join(f"{u} ({held[u]} fault episodes)" for u in new)
            event = EventSpec(
                "Warning",
                "GPURepeatOffender",
                f"held for repair, not released by reboots or resets: {counts}; `gpuguard release` lifts it",
            )
        if LABEL_NEEDS_REPAIR not in node.labels:
            labels[LABEL_NEEDS_REPAIR] = "true"
            annotations[ANN_REPAIR_PLACED] = "true"
    else:
        if ANN_REPEAT_OFFENDERS in ann:
            annotations[ANN_REPEAT_OFFENDERS] = None
        if ANN_REPAIR_PLACED in ann:
            annotations[ANN_REPAIR_PLACED] = None
            if LABEL_NEEDS_REPAIR in node.labels:
                labels[LABEL_NEEDS_REPAIR] = None
    for key, handled in ((ANN_RELEASE, handled_release), (ANN_HOLD, handled_hold)):
        if handled is not None and ann.get(key) == handled:
            annotations[key] = None
    key, text = published or ("", None)
    if (rides or annotations or labels) and published and ann.get(key) != text and (text or key in ann):
        annotations[key] = text
    if not annotations and not labels:
        return None
    return NodeChange(action="repair", annotations=annotations, labels=labels, event=event)


def with_marks(change: NodeChange | None, mark: NodeChange | None) -> NodeChange | None:
    """The planned change with the repair marks in the same write (their keys are their own); the marks'
    Event, where there is one, says both."""
    if mark is None or change is None:
        return change or mark
    event = change.event
    if mark.event is not None:
        why = f"; {change.event.message}" if change.event is not None else ""
        event = replace(mark.event, message=mark.event.message + why)
    annotations = {**change.annotations, **mark.annotations}
    if _size(annotations) > validation.MAX_ANNOTATION_BYTES:
        # The history's summary waits for a later write rather than have the whole write refused (the
        # quarantine with it): one write may carry at most that many bytes of gpuguard's annotations.
        annotations.pop(ANN_HISTORY, None)
    return replace(change, annotations=annotations, labels={**change.labels, **mark.labels}, event=event)


def _size(annotations: Mapping[str, str | None]) -> int:
    return sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items() if v is not None)
