"""Each GPU's fault history, by UUID, kept in `<state-dir>/history.json` across agent restarts and reboots:
its fault episodes (reasons, first seen, in which boot, how each ended), the operators' releases, and
whether it is held as a repeat offender (`quarantine.escalation` decides; this module only keeps it).

Unlike the fault file (`state.py`), this file must outlive a reboot: it is what remembers that a GPU failed in
the previous boot too. So it is written durably: a temp file, fsync, rename over the old one, fsync of the
directory. A crash at any instant (SIGKILL, a kernel panic, a power cut) leaves the old file or the new one.

Bounded, so that a flapping or hostile GPU cannot grow it: at most MAX_EPISODES episodes and MAX_RELEASES
releases per GPU (the oldest dropped), MAX_GPUS GPUs (those with the oldest activity dropped, a held one
last), MAX_REASONS reasons per episode, strings of at most MAX_TEXT characters (a UUID MAX_UUID), and a file
of at most MAX_BYTES (the largest history the bounds allow is about 800 KB: tests/test_history.py computes
it). A corrupt or foreign file is moved aside (`history.json.bad-<time>`) with a log line: the agent runs on
with an empty history, never crashes. A failed write (a full disk) is tried again with backoff (store.retry)
at the next save, so durability resumes when the disk does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from gpuguard.core import files
from gpuguard.core.errors import ConfigError
from gpuguard.store import atomic, limits
from gpuguard.store.retry import WriteRetry

log = structlog.get_logger(__name__)

KIND = "gpuguard-history"
VERSION = 1
FILE_NAME = "history.json"
MAX_BYTES = limits.HISTORY_MAX_BYTES
MAX_EPISODES = limits.HISTORY_MAX_EPISODES
MAX_RELEASES = limits.HISTORY_MAX_RELEASES
MAX_GPUS = limits.HISTORY_MAX_GPUS
MAX_REASONS = limits.HISTORY_MAX_REASONS
MAX_TEXT = limits.HISTORY_MAX_TEXT
MAX_UUID = limits.HISTORY_MAX_UUID
# How an episode ended: the node rebooted, a GPU reset the driver asked for cleared it, a counter went back
# (an ECC count after a driver reload), or an operator released the GPU (`gpuguard release`).
ENDINGS = frozenset({"reboot", "reset", "counter-reset", "operator"})


@dataclass(frozen=True)
class Episode:
    """One quarantine of a GPU, however often its fault blinked within it. `ended` None: still open."""

    reasons: tuple[str, ...]
    first_seen: float
    boot_id: str = ""
    ended: str | None = None
    ended_at: float | None = None
    # Reasons every GPU of the node showed at once (quarantine.repeat.escalation): the node's, not counted.
    shared: tuple[str, ...] = ()


@dataclass(frozen=True)
class Release:
    """An operator's release of a held GPU: who (as the annotation said) and when."""

    by: str
    at: float


@dataclass(frozen=True)
class GpuHistory:
    """`escalated`: when the GPU was found a repeat offender (held until a release); None when not held.
    `held_by`: the operator who placed the hold (`gpuguard hold`), None for one its episodes made."""

    episodes: tuple[Episode, ...] = ()
    releases: tuple[Release, ...] = ()
    escalated: float | None = None
    held_by: str | None = None

    @property
    def open(self) -> Episode | None:
        last = self.episodes[-1] if self.episodes else None
        return last if last is not None and last.ended is None else None

    @property
    def last_release(self) -> float:
        return self.releases[-1].at if self.releases else float("-inf")

    @property
    def active(self) -> float:
        """The time of its latest activity: which GPUs the bound drops first."""
        times = [e.ended_at or e.first_seen for e in self.episodes] + [r.at for r in self.releases]
        return max(times, default=float("-inf"))


History = Mapping[str, GpuHistory]


def bounded(history: History, *, changed: Collection[str] | None = None) -> dict[str, GpuHistory]:
    """The history cut to its bounds: the newest episodes and releases of each GPU, and the GPUs held or most
    recently active. Pure; a GPU's history already within them is kept as it is, and with `changed` only
    those GPUs are looked at (the others are known to be within: this runs in the reconciles that record an
    episode, measured 3 ms for 64 GPUs of 32 episodes when every GPU was looked at)."""
    out = {
        uuid[:MAX_UUID]: h if (changed is not None and uuid not in changed) or _within(h) else _cut(h)
        for uuid, h in history.items()
    }
    if len(out) > MAX_GPUS:
        keep = sorted(out, key=lambda u: (out[u].escalated is not None, out[u].active), reverse=True)
        out = {u: out[u] for u in keep[:MAX_GPUS]}
    return out


def _within(h: GpuHistory) -> bool:
    return (
        len(h.episodes) <= MAX_EPISODES
        and len(h.releases) <= MAX_RELEASES
        and all(
            len(e.reasons) <= MAX_REASONS
            and len(e.boot_id) <= MAX_TEXT
            and all(len(r) <= MAX_TEXT for r in e.reasons)
            for e in h.episodes
        )
        and all(len(r.by) <= MAX_TEXT for r in h.releases)
        and len(h.held_by or "") <= MAX_TEXT
    )


def _cut(h: GpuHistory) -> GpuHistory:
    return GpuHistory(
        episodes=tuple(
            replace(
                e, reasons=tuple(r[:MAX_TEXT] for r in e.reasons[:MAX_REASONS]), boot_id=e.boot_id[:MAX_TEXT]
            )
            for e in h.episodes[-MAX_EPISODES:]
        ),
        releases=tuple(replace(r, by=r.by[:MAX_TEXT]) for r in h.releases[-MAX_RELEASES:]),
        escalated=h.escalated,
        held_by=None if h.held_by is None else h.held_by[:MAX_TEXT],
    )


class HistoryStore:
    """The history file in `directory` (None: none kept, the history lives only as long as the process)."""

    def __init__(self, directory: str | Path | None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._dir = Path(directory) if directory else None
        self._disabled = self._dir is None
        self._retry = WriteRetry(log, "history", directory=str(self._dir), clock=clock)

    @property
    def path(self) -> Path | None:
        return self._dir / FILE_NAME if self._dir else None

    def load(self) -> dict[str, GpuHistory]:
        """The history on disk; empty when there is none, or it was corrupt (moved aside, logged)."""
        path = self.path
        if path is None or not path.exists():
            return {}
        try:
            doc = json.loads(files.read_bytes(path, limit=MAX_BYTES, what="history file"))
            history = parse(doc)
        except ConfigError as exc:  # not a regular file, too large, unreadable
            _move_aside(path, str(exc))
            return {}
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            _move_aside(path, f"{type(exc).__name__}: {exc}")
            return {}
        held = sum(1 for h in history.values() if h.escalated is not None)
        log.info("history.loaded", path=str(path), gpus=len(history), held=held)
        return history

    def save(self, history: History) -> bool:
        """Write the whole history durably. False where it is not written (no directory, a failed write, or
        one failed before and its backoff has not passed): the caller saves it again later. Never raises."""
        if self._disabled or not self._retry.due():
            return False
        data = json.dumps(serialize(history), separators=(",", ":")).encode()
        try:
            if len(data) > MAX_BYTES:  # the bounds keep it far below: a guard, not a path
                raise OSError(f"{len(data)} bytes, more than the {MAX_BYTES} allowed")
            self._replace(data)
        except OSError as exc:
            self._retry.failed(exc)
            return False
        self._retry.succeeded()
        return True

    def _replace(self, data: bytes) -> None:
        """The file's new content, durably (the crash test drives this write in a loop)."""
        assert self._dir is not None
        atomic.write_atomically(self._dir / FILE_NAME, data, durable=True, temp_stem="history")


def serialize(history: History) -> dict[str, Any]:
    return {
        "kind": KIND,
        "version": VERSION,
        "gpus": {
            uuid: {
                "episodes": [
                    {
                        "reasons": list(e.reasons),
                        "first_seen": e.first_seen,
                        "boot_id": e.boot_id,
                        "ended": e.ended,
                        "ended_at": e.ended_at,
                        **({"shared": list(e.shared)} if e.shared else {}),
                    }
                    for e in h.episodes
                ],
                "releases": [{"by": r.by, "at": r.at} for r in h.releases],
                "escalated": h.escalated,
                # Only where an operator placed the hold: an older agent reads the file as before.
                **({"held_by": h.held_by} if h.held_by is not None else {}),
            }
            for uuid, h in sorted(bounded(history).items())
        },
    }


def parse(doc: Any) -> dict[str, GpuHistory]:
    """The history a document holds; ValueError/TypeError/KeyError when it is not one of ours."""
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise ValueError("not a gpuguard history file")
    if doc.get("version") != VERSION:
        raise ValueError(f"unsupported version {doc.get('version')!r}")
    gpus = doc["gpus"]
    if not isinstance(gpus, dict) or len(gpus) > MAX_GPUS:
        raise TypeError(f"gpus must be an object of at most {MAX_GPUS} GPUs")
    return {_text(uuid, MAX_UUID): _gpu(h) for uuid, h in gpus.items()}


def _gpu(h: Any) -> GpuHistory:
    if not isinstance(h, dict):
        raise TypeError("each GPU's history must be an object")
    episodes = tuple(
        Episode(
            reasons=tuple(_text(r) for r in _list(e["reasons"], MAX_REASONS)),
            first_seen=_time(e["first_seen"]),
            boot_id=_text(e["boot_id"]),
            ended=_ending(e["ended"]),
            ended_at=None if e["ended_at"] is None else _time(e["ended_at"]),
            shared=tuple(_text(r) for r in _list(e.get("shared", []), MAX_REASONS)),
        )
        for e in _list(h["episodes"], MAX_EPISODES)
    )
    releases = tuple(
        Release(by=_text(r["by"]), at=_time(r["at"])) for r in _list(h["releases"], MAX_RELEASES)
    )
    escalated = None if h["escalated"] is None else _time(h["escalated"])
    held_by = h.get("held_by")
    held_by = None if held_by is None or escalated is None else _text(held_by)
    return GpuHistory(episodes=episodes, releases=releases, escalated=escalated, held_by=held_by)


def _list(value: Any, most: int) -> list[Any]:
    if not isinstance(value, list) or len(value) > most:
        raise TypeError(f"expected a list of at most {most}")
    for item in value:
        if not isinstance(item, (dict, str)):
            raise TypeError("expected objects or strings")
    return value


def _text(value: Any, most: int = MAX_TEXT) -> str:
    if not isinstance(value, str) or len(value) > most:
        raise TypeError(f"expected a string of at most {most} characters")
    return value


def _time(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e11:
        raise TypeError("expected a time in seconds since the epoch")
    return float(value)


def _ending(value: Any) -> str | None:
    if value is not None and value not in ENDINGS:
        raise ValueError(f"unknown ending {value!r}")
    return value  # type: ignore[no-any-return]


def _move_aside(path: Path, why: str) -> None:
    aside = atomic.move_aside(path, tag="bad")
    log.warning("history.corrupt", path=str(path), moved_to=str(aside), error=why[:300])
