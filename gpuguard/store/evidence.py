"""The evidence kept at detection, in `<state-dir>/evidence.json`: for each fault and degraded mark as it was
first judged, one record of what made it (the verdict's reasons, the GPU's readings, the kernel's lines, the
action, the pods on the GPU, the budget, the agent's version and settings digest), so that "why was my node
taken?" and an RMA ticket have the moment itself, not a log that rotated (docs/design.md, "Evidence at
detection").

A record is a JSON mapping the caller builds; this module bounds it: strings cut to EVIDENCE_MAX_TEXT, lists
and mappings to EVIDENCE_MAX_ITEMS entries, nesting to EVIDENCE_MAX_DEPTH, EVIDENCE_MAX_VALUES values in
all, and then its largest sections dropped (named in `trimmed`) until it serialises within
EVIDENCE_MAX_RECORD_BYTES. At most EVIDENCE_MAX_RECORDS are kept, the oldest dropped. Written whole by one
rename (store/atomic.py), durably: a record is written once per fault, and must outlive a power cut. Read
back tolerantly: a file that does not parse is moved aside (`evidence.corrupt`), a record that is not a
mapping or is past the bound is skipped; the agent never fails for this file; a failed write is a warning.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from gpuguard.core import files
from gpuguard.core.errors import ConfigError
from gpuguard.store import atomic, limits

log = structlog.get_logger(__name__)

KIND = "gpuguard-evidence"
VERSION = 1
FILE_NAME = "evidence.json"
# The sections dropped first when a record is too large, then any other but its identity.
_DROP_FIRST = ("kernel", "xids", "pods", "readings", "verdict")
_IDENTITY = frozenset({"at", "boot_id", "node", "kind", "key", "reason", "uuid", "gpu", "trimmed"})


def bounded(record: Mapping[str, Any]) -> dict[str, Any]:
    """`record` within the limits: cut, then its largest sections dropped until it fits."""
    out: dict[str, Any] = _cut(record, 0)
    order = [k for k in _DROP_FIRST if k in out]
    order += sorted((k for k in out if k not in _IDENTITY and k not in order), key=lambda k: -_size(out[k]))
    while _size(out) > limits.EVIDENCE_MAX_RECORD_BYTES and order:
        key = order.pop(0)
        del out[key]
        out["trimmed"] = [*out.get("trimmed", []), key]
    return out


def _cut(value: Any, depth: int, room: list[int] | None = None) -> Any:
    """`value` cut to the limits; `room`: the values left to copy (EVIDENCE_MAX_VALUES in all), so that a
    record built of shared references is never walked further than it could be kept."""
    room = [limits.EVIDENCE_MAX_VALUES] if room is None else room
    room[0] -= 1
    if room[0] < 0:
        return None
    if isinstance(value, str):
        return value[: limits.EVIDENCE_MAX_TEXT]
    if value is None or isinstance(value, bool | int | float):
        return value
    if depth >= limits.EVIDENCE_MAX_DEPTH:
        return None
    if isinstance(value, Mapping):
        items = list(value.items())[: limits.EVIDENCE_MAX_ITEMS]
        return {str(k)[: limits.EVIDENCE_MAX_TEXT]: _cut(v, depth + 1, room) for k, v in items}
    if isinstance(value, list | tuple):
        return [_cut(v, depth + 1, room) for v in value[: limits.EVIDENCE_MAX_ITEMS]]
    return str(value)[: limits.EVIDENCE_MAX_TEXT]


def _size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode())


def read(path: Path) -> tuple[dict[str, Any], ...]:
    """The records of an evidence file, oldest first; () when there is none. Raises ConfigError (one line)
    when the file cannot be read or is not an evidence file; skips a record it would not have written."""
    try:
        text = files.read_text(path, limit=limits.EVIDENCE_MAX_BYTES, what="evidence file", error=ConfigError)
    except ConfigError:
        if not path.exists():
            return ()
        raise
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"evidence file {path}: not JSON ({exc.msg})") from None
    if not isinstance(doc, dict) or doc.get("kind") != KIND or not isinstance(doc.get("records"), list):
        raise ConfigError(f"evidence file {path}: not a {KIND} file")
    kept = [r for r in doc["records"] if isinstance(r, dict) and _size(r) <= limits.EVIDENCE_MAX_RECORD_BYTES]
    return tuple(kept[-limits.EVIDENCE_MAX_RECORDS :])


class EvidenceStore:
    """The node's evidence file: records added one at a time, the newest EVIDENCE_MAX_RECORDS kept."""

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / FILE_NAME
        self._records: list[dict[str, Any]] | None = None

    def load(self) -> tuple[dict[str, Any], ...]:
        """What the file holds (a corrupt one moved aside, then none)."""
        if self._records is None:
            try:
                self._records = list(read(self.path))
            except ConfigError as exc:
                aside = atomic.move_aside(self.path, tag="corrupt")
                log.warning("evidence.corrupt", path=str(self.path), moved_to=str(aside), error=str(exc))
                self._records = []
        return tuple(self._records)

    def add(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Keep one record (bounded; the oldest dropped past the count) and write the file; the record as
        kept. A failed write is a warning (`evidence.write_failed`): the record stays in memory."""
        kept = bounded(record)
        records = [*self.load(), kept][-limits.EVIDENCE_MAX_RECORDS :]
        self._records = records
        data = json.dumps({"kind": KIND, "version": VERSION, "records": records}, separators=(",", ":"))
        try:
            atomic.write_atomically(self.path, data.encode(), durable=True)
        except OSError as exc:
            log.warning("evidence.write_failed", path=str(self.path), error=str(exc))
        return kept
