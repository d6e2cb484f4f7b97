"""Durable fault state: the faults only a reboot clears (Xids, lost GPUs...), kept in a small file so that a
fault seen while the API server was unreachable still ends in a taint after the agent restarts.

The driver delivers an Xid once and never replays it to a restarted process; without this file, an agent
killed between the Xid and its write would forget the fault. The file is keyed by the host's boot ID: after a
reboot the faults' evidence is gone by definition, so a file from another boot is discarded.

The same file keeps the per-GPU quarantine's memory of its DeviceTaintRules (`RuleMemory`): the rules
gpuguard made and the ones an operator deleted, so that a rule deleted by hand is not made again for the same
fault after the agent restarts (the API server keeps no trace of a deleted rule).

Written atomically (temp file, rename), versioned, and tolerant: a corrupt or foreign file is logged and moved
aside; a failed write (a full disk, a read-only remount) gives one warning and is tried again with backoff
(store.retry) until one succeeds, then one line says durability resumed.

No fsync, on purpose: it cost milliseconds in the fault's path (before the taint) and protects nothing here.
A written file is in the kernel's page cache the moment write() returns, and the rename swaps old for new
atomically, so a crash of the agent at any instant (SIGKILL, OOM kill, a container or pod restart, a node
drain) leaves either the old file or the new one, never a fault lost: the kernel still holds it. Only the
kernel's own end (a panic, a power cut) loses unsynced data, and that is a reboot: the boot ID changes and the
file of the old boot is discarded anyway (its faults' evidence is gone with the boot). A torn file after such
a crash is moved aside as corrupt, which is the same outcome. docs/reliability.md has the argument in full.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from gpuguard.core import files
from gpuguard.core.errors import ConfigError
from gpuguard.core.model import Fault
from gpuguard.store import atomic, limits
from gpuguard.store.retry import WriteRetry

log = structlog.get_logger(__name__)

VERSION = 1
KIND = "gpuguard-state"
FILE_NAME = "state.json"
MAX_BYTES = limits.STATE_MAX_BYTES
MAX_RULES = limits.STATE_MAX_RULES
MAX_FAULTS = limits.STATE_MAX_FAULTS


@dataclass(frozen=True)
class RuleMemory:
    """The per-GPU quarantine's memory (`quarantine.gpu.memory`): `known`, the rules gpuguard made or found
    (rule name -> (GPU UUID, fault keys)); `overridden`, the GPUs whose rule an operator deleted (UUID -> the
    fault keys it was deleted for: not made again for those)."""

    known: Mapping[str, tuple[str, frozenset[str]]] = field(default_factory=dict)
    overridden: Mapping[str, frozenset[str]] = field(default_factory=dict)


def read_boot_id(path: str) -> str:
    """The host's boot ID (the same value the kubelet reports as status.nodeInfo.bootID); "" if unreadable."""
    try:
        return files.read_text(path, limit=4 * files.KIB, what="boot ID file").strip()
    except ConfigError:
        return ""


class StateStore:
    """`boot_id` "" (the host's boot ID could not be read): no durable state at all, since nothing could tell
    a file of this boot from one of an earlier boot. `backend`: the backend whose faults the file holds; a
    file written by another backend (a mock demo on the same host) is never restored."""

    def __init__(
        self,
        directory: str | Path | None,
        *,
        boot_id: str,
        backend: str = "nvml",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._dir = Path(directory) if directory else None
        self._boot_id = boot_id
        self._backend = backend
        # What the file should hold (the latest saves) and what it holds (None: not written by this process).
        self._faults: tuple[Fault, ...] = ()
        self._rules = RuleMemory()
        # The last kernel-log record judged in this boot (--kernel-log): a restart's replay starts after it.
        self._kernel_seq: int | None = None
        self._written: tuple[tuple[Fault, ...], RuleMemory, int | None] | None = None
        self._retry = WriteRetry(log, "state", directory=str(self._dir), clock=clock)
        self._restored: tuple[Fault, ...] = ()
        self._loaded = False
        # The agent's thread saves faults, the reconciler's thread the rules: one file, written whole.
        self._lock = threading.RLock()
        self._disabled = self._dir is None or not boot_id
        if self._dir is not None and not boot_id:
            log.warning(
                "state.no_boot_id",
                directory=str(self._dir),
                note="the host's boot ID is unreadable: running without durable fault state",
            )

    @property
    def path(self) -> Path | None:
        return self._dir / FILE_NAME if self._dir else None

    def load(self) -> tuple[Fault, ...]:
        """The sticky faults recorded during this boot (empty after a reboot or on any problem). The file is
        read once: the rules' memory (`load_rules`, read first at start) and the faults come from that read,
        and `state.restored` is logged once."""
        with self._lock:
            if not self._loaded:
                self._loaded = True
                self._restored = self._load()
            return self._restored

    def kernel_seq(self) -> int | None:
        """The sequence number of the last kernel-log record judged in this boot (None: none, or no file)."""
        with self._lock:
            self.load()
            return self._kernel_seq

    def load_rules(self) -> RuleMemory:
        """The per-GPU quarantine's memory recorded in this boot (empty after a reboot or on any problem)."""
        with self._lock:
            self.load()
            return self._rules

    def save_rules(self, rules: RuleMemory) -> None:
        """Write the file if the rules' memory changed. Never raises."""
        with self._lock:
            if self._writable():
                self._rules = rules
                self._flush()

    def _load(self) -> tuple[Fault, ...]:
        path = self.path
        if path is None or self._disabled or not path.exists():
            return ()
        try:
            raw = files.read_bytes(path, limit=MAX_BYTES, what="state file")
            doc = json.loads(raw)
            faults = _parse(doc)
        except ConfigError as exc:  # not a regular file, larger than MAX_BYTES, unreadable
            _move_aside(path, str(exc))
            return ()
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            # RecursionError: JSON nested deeper than the interpreter's stack (json.loads raises it).
            _move_aside(path, f"{type(exc).__name__}: {exc}")
            return ()
        if doc.get("boot_id") != self._boot_id:
            log.info("state.previous_boot_discarded", path=str(path), faults=len(faults))
            return ()
        if doc.get("backend", "nvml") != self._backend:
            log.warning(
                "state.other_backend_discarded",
                path=str(path),
                backend=doc.get("backend"),
                faults=len(faults),
            )
            return ()
        self._faults = faults
        self._rules = _parse_rules(doc.get("device_rules"), path)
        seq = doc.get("kernel_seq")
        self._kernel_seq = seq if type(seq) is int and seq >= 0 else None
        self._written = (faults, self._rules, self._kernel_seq)
        if faults:
            log.warning("state.restored", path=str(path), faults=[f.key for f in faults])
        return faults

    def save(self, faults: tuple[Fault, ...], *, kernel_seq: int | None = None) -> None:
        """Write the file if the faults (or the last kernel-log record judged) changed since the last write,
        or a failed write is due again. Never raises."""
        with self._lock:
            if not self._writable():
                return
            self._faults = faults
            if kernel_seq is not None and (self._kernel_seq is None or kernel_seq > self._kernel_seq):
                self._kernel_seq = kernel_seq
            self._flush()

    def _writable(self) -> bool:
        """Under the lock: False when the store is disabled; else the file read first, so a save of one half
        (faults, or the rules' memory) keeps the other."""
        if self._disabled:
            return False
        if not self._loaded:
            self.load_rules()
        return True

    def _flush(self) -> None:
        want = (self._faults, self._rules, self._kernel_seq)
        if want != self._written and self._retry.due() and self._write(*want):
            self._written = want

    def _write(self, faults: tuple[Fault, ...], rules: RuleMemory, kernel_seq: int | None) -> bool:
        """Write within the reader's limits (store.limits): past them the least severe faults go first."""
        assert self._dir is not None
        kept = limits.kept_faults(faults)
        if len(kept) < len(faults):
            log.warning(
                "state.faults_not_kept", kept=len(kept), dropped=len(faults) - len(kept), limit=MAX_FAULTS
            )
        data = self._dump(kept, _within(rules), kernel_seq)
        if len(data) > MAX_BYTES:  # only a rules memory far past any node's: the faults are what matters
            log.warning("state.rules_not_kept", bytes=len(data), limit=MAX_BYTES)
            data = self._dump(kept, RuleMemory(), kernel_seq)
        try:
            # No fsync (see the module's docstring): it runs in a fault's path before the taint.
            atomic.write_atomically(self._dir / FILE_NAME, data, durable=False, temp_stem="state")
        except OSError as exc:
            self._retry.failed(exc)
            return False
        self._retry.succeeded()
        return True

    def _dump(self, faults: tuple[Fault, ...], rules: RuleMemory, kernel_seq: int | None) -> bytes:
        doc = {
            "kind": KIND,
            "version": VERSION,
            "boot_id": self._boot_id,
            "backend": self._backend,
            "kernel_seq": kernel_seq,
            "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "faults": [
                {"reason": f.reason, "detail": f.detail, "uuid": f.uuid, "gpu_index": f.gpu_index}
                for f in faults
            ],
            "device_rules": {
                "known": [
                    {"rule": name, "uuid": uuid, "faults": sorted(keys)}
                    for name, (uuid, keys) in sorted(rules.known.items())
                ],
                "overridden": [
                    {"uuid": uuid, "faults": sorted(keys)} for uuid, keys in sorted(rules.overridden.items())
                ],
            },
        }
        return json.dumps(doc, separators=(",", ":")).encode()


def _within(rules: RuleMemory) -> RuleMemory:
    """The rules memory the reader accepts: entries with texts or key lists past its limits left out."""

    def ok(*texts: str, keys: frozenset[str]) -> bool:
        return len(keys) <= MAX_RULES and all(len(t) <= limits.STATE_MAX_TEXT for t in (*texts, *keys))

    known = [(n, (u, k)) for n, (u, k) in sorted(rules.known.items()) if ok(n, u, keys=k)]
    overridden = [(u, k) for u, k in sorted(rules.overridden.items()) if ok(u, keys=k)]
    return RuleMemory(known=dict(known[:MAX_RULES]), overridden=dict(overridden[:MAX_RULES]))


def _parse(doc: Any) -> tuple[Fault, ...]:
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise ValueError("not a gpuguard state file")
    if doc.get("version") != VERSION:
        raise ValueError(f"unsupported version {doc.get('version')!r}")
    if not isinstance(doc.get("boot_id"), str) or not isinstance(doc.get("backend", ""), str):
        raise TypeError("boot_id and backend must be strings")
    raw = doc.get("faults")
    if not isinstance(raw, list) or len(raw) > MAX_FAULTS:
        raise TypeError(f"faults must be a list of at most {MAX_FAULTS} objects")
    faults = []
    for f in raw:
        if not isinstance(f, dict):
            raise TypeError("each fault must be an object")
        uuid, index = f.get("uuid"), f.get("gpu_index")
        if not isinstance(f["reason"], str) or not isinstance(f["detail"], str):
            raise TypeError("fault reason/detail must be strings")
        if uuid is not None and not isinstance(uuid, str):
            raise TypeError("fault uuid must be a string")
        if index is not None and (not isinstance(index, int) or isinstance(index, bool)):
            raise TypeError("fault gpu_index must be an integer")
        reason, detail = f["reason"][: limits.STATE_MAX_REASON], f["detail"][: limits.STATE_MAX_DETAIL]
        faults.append(Fault(reason=reason, detail=detail, uuid=uuid, gpu_index=index))
    return tuple(faults)


def _parse_rules(part: Any, path: Path) -> RuleMemory:
    """The file's rules memory; a part that is missing (a file of an older gpuguard) or malformed is no
    memory, logged: never a reason to lose the file's faults."""
    if part is None:
        return RuleMemory()
    try:
        known = {_text(r["rule"]): (_text(r["uuid"]), _keys(r["faults"])) for r in _bounded(part["known"])}
        overridden = {_text(r["uuid"]): _keys(r["faults"]) for r in _bounded(part["overridden"])}
    except (TypeError, KeyError, ValueError) as exc:
        log.warning("state.device_rules_ignored", path=str(path), error=f"{type(exc).__name__}: {exc}"[:300])
        return RuleMemory()
    return RuleMemory(known=known, overridden=overridden)


def _bounded(items: Any) -> list[Any]:
    if not isinstance(items, list) or len(items) > MAX_RULES:
        raise ValueError(f"expected a list of at most {MAX_RULES}")
    return items


def _text(value: Any) -> str:
    if not isinstance(value, str) or len(value) > limits.STATE_MAX_TEXT:
        raise TypeError(f"expected a string of at most {limits.STATE_MAX_TEXT} characters")
    return value


def _keys(values: Any) -> frozenset[str]:
    return frozenset(_text(v) for v in _bounded(values))


def _move_aside(path: Path, why: str) -> None:
    aside = atomic.move_aside(path, tag="corrupt")
    log.warning("state.corrupt", path=str(path), moved_to=str(aside), error=why[:300])
