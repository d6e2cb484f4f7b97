"""The GPU history's summary on the node, the annotation `gpuguard.io/gpu-history`: what `gpuguard history`
reads from a laptop (the history itself is a file on the node, `gpuguard.store.history`). Pure.

Bounded by the agent, which writes it (`summary`): per GPU its last EPISODES episodes and last RELEASES
releases with their totals, the GPUs held first then the most recently active, and at most MAX_BYTES in all
(GPUs dropped, and counted in "more", until it fits). Bounded again by the admission policy (an agent token
may not write more than MAX_BYTES there) and by the reader (`read`), which trusts nothing the node holds: a
stolen agent token can write its own node's summary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gpuguard.quarantine.record import DOMAIN
from gpuguard.quarantine.repeat.release import bounded_json
from gpuguard.store.history import ENDINGS, MAX_TEXT, MAX_UUID, GpuHistory, History

ANN_HISTORY = f"{DOMAIN}/gpu-history"
MAX_BYTES = 4096
EPISODES = 4
RELEASES = 2
VERSION = 1


@dataclass(frozen=True)
class EpisodeLine:
    reasons: str  # "xid-79+ecc"
    first_seen: int
    ended: str | None
    ended_at: int | None


@dataclass(frozen=True)
class GpuSummary:
    """One GPU as the node shows it: held since (None: not held) and by whom (None: its episodes held it)."""

    held_at: int | None
    held_by: str | None
    episodes: tuple[EpisodeLine, ...]
    episodes_total: int
    releases: tuple[tuple[str, int], ...]
    releases_total: int


@dataclass(frozen=True)
class Summary:
    gpus: dict[str, GpuSummary]
    more: int  # GPUs left out to keep within MAX_BYTES


def summary(history: History) -> str | None:
    """The annotation's value for `history` (None: nothing to show), at most MAX_BYTES."""
    if not history:
        return None
    order = sorted(history, key=lambda u: (history[u].escalated is not None, history[u].active), reverse=True)
    gpus = {uuid: _gpu(history[uuid]) for uuid in order}
    while True:
        text = json.dumps({"v": VERSION, "gpus": gpus, "more": len(order) - len(gpus)}, separators=(",", ":"))
        if len(text.encode("utf-8")) <= MAX_BYTES or not gpus:
            return text
        gpus.pop(next(reversed(gpus)))  # the least recently active, held ones last


def _gpu(h: GpuHistory) -> dict[str, Any]:
    return {
        "held": None if h.escalated is None else [int(h.escalated), h.held_by],
        "episodes": [
            [
                "+".join(e.reasons),
                int(e.first_seen),
                e.ended,
                None if e.ended_at is None else int(e.ended_at),
            ]
            for e in h.episodes[-EPISODES:]
        ],
        "episodes_total": len(h.episodes),
        "releases": [[r.by, int(r.at)] for r in h.releases[-RELEASES:]],
        "releases_total": len(h.releases),
    }


def read(text: str) -> Summary:
    """The summary the annotation holds; ValueError (one line) where it is not one the agent writes."""
    doc = bounded_json(text, MAX_BYTES)
    try:
        if not isinstance(doc, dict) or doc.get("v") != VERSION or not isinstance(doc.get("gpus"), dict):
            raise TypeError("not a summary of this version")
        gpus = {_str(uuid, MAX_UUID): _gpu_of(g) for uuid, g in doc["gpus"].items()}
        return Summary(gpus=gpus, more=_int(doc.get("more", 0)))
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise ValueError(f"not a GPU history summary ({exc})") from None


def _gpu_of(g: Any) -> GpuSummary:
    if not isinstance(g, dict):
        raise TypeError("a GPU is not an object")
    held = g["held"]
    if held is not None and not (isinstance(held, list) and len(held) == 2):
        raise TypeError("held is not [time, by]")
    episodes = tuple(
        EpisodeLine(
            reasons=_str(e[0], 3 * MAX_TEXT + 2),
            first_seen=_int(e[1]),
            ended=_ending(e[2]),
            ended_at=None if e[3] is None else _int(e[3]),
        )
        for e in _list(g["episodes"], EPISODES, 4)
    )
    return GpuSummary(
        held_at=None if held is None else _int(held[0]),
        held_by=None if held is None or held[1] is None else _str(held[1], MAX_TEXT),
        episodes=episodes,
        episodes_total=_int(g["episodes_total"]),
        releases=tuple((_str(r[0], MAX_TEXT), _int(r[1])) for r in _list(g["releases"], RELEASES, 2)),
        releases_total=_int(g["releases_total"]),
    )


def _list(value: Any, most: int, width: int) -> list[list[Any]]:
    if not isinstance(value, list) or len(value) > most:
        raise TypeError(f"expected a list of at most {most}")
    if not all(isinstance(v, list) and len(v) == width for v in value):
        raise TypeError(f"expected lists of {width}")
    return value


def _str(value: Any, most: int) -> str:
    if not isinstance(value, str) or len(value) > most:
        raise TypeError(f"expected a string of at most {most} characters")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 10**11:
        raise TypeError("expected a whole number of seconds")
    return value


def _ending(value: Any) -> str | None:
    if value is not None and value not in ENDINGS:
        raise ValueError(f"unknown ending {str(value)[:20]!r}")
    return value  # type: ignore[no-any-return]
