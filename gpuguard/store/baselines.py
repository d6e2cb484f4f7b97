"""The signals' first-good baselines, kept across agent restarts in --state-dir (`signal-baselines.json`).

gpuguard.judge.signals judges `nvlink-down`, `pcie-width` and `pcie-gen` against the first good reading of
each GPU. Kept in the process only, a restarted agent (a DaemonSet rollout, an OOM kill) would take a link
already down, or a PCIe link already narrower, as its first good reading and report the degraded GPU clean.
This file keeps those baselines per GPU UUID (never the rate windows: counters and clock samples start again),
so the next agent judges against the same first reading. The GPUs are known by UUID: a GPU replaced is a new
UUID and a new baseline; a UUID NVML no longer lists is dropped at the next write.

Not keyed by the boot ID, unlike state.json: a link down before a reboot is as likely down after it. To take
a new baseline on purpose (a GPU moved to a narrower slot), delete the file and restart the agent.

Written only when a baseline changes (in practice once, at the first check), durably: a temp file, fsync,
rename, fsync of the directory. The write happens once per GPU life, off the fault's path, so unlike
state.json's it pays for fsync: the file outlives the boot. Read once at start, validated field by field and
bounded; a corrupt or foreign file is moved aside with a log line, and the agent starts without baselines
(as before this file existed), never a crash; a bad entry (a reading no link can have, gpuguard.core.hardware)
is dropped alone, and the writer never writes one. A failed write: one warning, memory only until a write
tried again with backoff (store.retry) succeeds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import structlog

from gpuguard.core import files
from gpuguard.core.errors import ConfigError
from gpuguard.core.hardware import NVLINK_MAX_LINKS, nvlink_links_ok, pcie_gen_ok, pcie_width_ok
from gpuguard.core.model import SignalMemory
from gpuguard.store import atomic, limits
from gpuguard.store.retry import WriteRetry

log = structlog.get_logger(__name__)

KIND = "gpuguard-signal-baselines"
VERSION = 1
FILE_NAME = "signal-baselines.json"


def baselines(memory: SignalMemory, present: Collection[str]) -> SignalMemory:
    """Pure: the baselines in `memory` (not its windows) of the GPUs in `present`, in UUID order; a UUID
    or a reading the file's reader would drop is left out (gpuguard.core.hardware: what a link can report)."""

    kept = {
        u for u in sorted(present)[: limits.BASELINES_MAX_GPUS] if 0 < len(u) <= limits.BASELINES_MAX_UUID
    }

    def keep(u: str) -> bool:
        return u in kept

    return SignalMemory(
        first_links=tuple(sorted((u, v) for u, v in memory.first_links if keep(u) and nvlink_links_ok(v))),
        first_width=tuple(sorted((u, v) for u, v in memory.first_width if keep(u) and pcie_width_ok(v))),
        first_gen=tuple(sorted((u, v) for u, v in memory.first_gen if keep(u) and pcie_gen_ok(v))),
    )


class BaselineStore:
    """The baselines' file in `directory`. `backend`: whose GPUs the file holds; a file of another backend
    (a mock demo on the same host) is not loaded."""

    def __init__(
        self, directory: str | Path, *, backend: str = "nvml", clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._dir = Path(directory)
        self._backend = backend
        self._saved = SignalMemory()
        self._seen: tuple[SignalMemory, frozenset[str]] | None = None
        self._retry = WriteRetry(log, "baselines", directory=str(self._dir), clock=clock)

    @property
    def path(self) -> Path:
        return self._dir / FILE_NAME

    def load(self) -> SignalMemory:
        """The baselines of the file (none if absent, corrupt, foreign or of another backend)."""
        path = self.path
        if not path.exists():
            return SignalMemory()
        try:
            doc = json.loads(
                files.read_bytes(path, limit=limits.BASELINES_MAX_BYTES, what="signal baselines file")
            )
            loaded = _parse(doc)
        except ConfigError as exc:  # not a regular file, larger than its limit, unreadable
            _move_aside(path, str(exc))
            return SignalMemory()
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            _move_aside(path, f"{type(exc).__name__}: {exc}")
            return SignalMemory()
        if doc.get("backend") != self._backend:
            log.warning("baselines.other_backend_discarded", path=str(path), backend=doc.get("backend"))
            return SignalMemory()
        self._saved = loaded
        log.info("baselines.restored", path=str(path), gpus=_count(loaded))
        return loaded

    def save(self, memory: SignalMemory, present: Collection[str]) -> None:
        """Write the baselines of the GPUs NVML lists (`present`) if they changed. Never raises. Nothing
        listed (NVML not up): nothing written, so a failed start drops no GPU's baseline."""
        if not present or not self._retry.due():
            return
        key = (memory, frozenset(present))
        if self._seen is not None and self._seen[0] is memory and self._seen[1] == key[1]:
            return  # the same memory object as at the last check: nothing new
        kept = baselines(memory, key[1])
        if kept == self._saved:
            self._seen = key
            return
        try:
            atomic.write_atomically(self.path, _dump(kept, self._backend), durable=True)
        except OSError as exc:
            self._retry.failed(exc)  # _seen not set: the same memory is written again when the retry is due
            return
        self._retry.succeeded()
        self._seen = key
        self._saved = kept
        log.info("baselines.saved", path=str(self.path), gpus=_count(kept))


def _count(m: SignalMemory) -> int:
    return len({u for part in (m.first_links, m.first_width, m.first_gen) for u, _ in part})


def _dump(m: SignalMemory, backend: str) -> bytes:
    links, width, gen = dict(m.first_links), dict(m.first_width), dict(m.first_gen)
    gpus = [
        {
            "uuid": u,
            "links": sorted(links[u]) if u in links else None,
            "width": width.get(u),
            "gen": gen.get(u),
        }
        for u in sorted(set(links) | set(width) | set(gen))
    ]
    doc = {
        "kind": KIND,
        "version": VERSION,
        "backend": backend,
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gpus": gpus,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def _parse(doc: Any) -> SignalMemory:
    """Trust nothing: every field checked for type and range, every list bounded."""
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise ValueError("not a gpuguard signal baselines file")
    if doc.get("version") != VERSION:
        raise ValueError(f"unsupported version {doc.get('version')!r}")
    if not isinstance(doc.get("backend"), str):
        raise TypeError("backend must be a string")
    gpus = doc["gpus"]
    if not isinstance(gpus, list) or len(gpus) > limits.BASELINES_MAX_GPUS:
        raise TypeError(f"gpus must be a list of at most {limits.BASELINES_MAX_GPUS} objects")
    links: dict[str, frozenset[int]] = {}
    width: dict[str, int] = {}
    gen: dict[str, int] = {}
    dropped: list[str] = []
    seen: set[str] = set()
    for g in gpus:
        # A bad entry is dropped alone (logged): the other GPUs' baselines stay.
        uuid = g.get("uuid") if isinstance(g, dict) else None
        if not isinstance(uuid, str) or not 0 < len(uuid) <= limits.BASELINES_MAX_UUID or uuid in seen:
            dropped.append(
                f"a GPU entry without a unique UUID of 1 to {limits.BASELINES_MAX_UUID} characters"
            )
            continue
        seen.add(uuid)
        raw = {name: g.get(name) for name in ("links", "width", "gen")}
        found_links, found_width, found_gen = _links(raw["links"]), _width(raw["width"]), _gen(raw["gen"])
        for name, found in (("links", found_links), ("width", found_width), ("gen", found_gen)):
            if raw[name] is not None and found is None:
                dropped.append(f"{uuid} {name} {str(raw[name])[:40]}")
        if found_links is not None:
            links[uuid] = found_links
        if found_width is not None:
            width[uuid] = found_width
        if found_gen is not None:
            gen[uuid] = found_gen
    if dropped:
        log.warning("baselines.entries_dropped", entries=dropped[:20], count=len(dropped))
    return SignalMemory(
        first_links=tuple(sorted(links.items())),
        first_width=tuple(sorted(width.items())),
        first_gen=tuple(sorted(gen.items())),
    )


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _links(value: Any) -> frozenset[int] | None:
    if value is None or not isinstance(value, list) or len(value) > NVLINK_MAX_LINKS:
        return None
    links = [_int(v) for v in value]
    numbers = frozenset(v for v in links if v is not None)
    return numbers if None not in links and nvlink_links_ok(numbers) else None


def _width(value: Any) -> int | None:
    width = _int(value)
    return width if width is not None and pcie_width_ok(width) else None


def _gen(value: Any) -> int | None:
    gen = _int(value)
    return gen if gen is not None and pcie_gen_ok(gen) else None


def _move_aside(path: Path, why: str) -> None:
    aside = atomic.move_aside(path, tag="corrupt")
    log.warning("baselines.corrupt", path=str(path), moved_to=str(aside), error=why[:300])
