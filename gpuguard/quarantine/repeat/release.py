"""An operator's release of a repeat offender, as the annotation `gpuguard.io/release` carries it from
`gpuguard release` (or a node-repair controller) to the agent, which owns the GPU history. Pure.

The agent trusts nothing another writer put there: at most MAX_BYTES, a JSON object of exactly three fields,
`gpu` a GPU UUID (or "*": every held GPU of the node), `by` a short printable name, `at` an RFC 3339 UTC time
not more than SKEW_S in the future. Anything else is refused with a log line (and the annotation removed, so
it is not refused again at every check). The admission policy keeps the agents' own tokens from writing it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gpuguard.quarantine.record import DOMAIN

ANN_RELEASE = f"{DOMAIN}/release"
MAX_BYTES = 512
# Clocks of the releasing machine and the node differ by seconds; a release from further ahead is forged.
SKEW_S = 300.0
MAX_BY = 64
_UUID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}")
_TIME = "%Y-%m-%dT%H:%M:%SZ"
ALL = "*"


@dataclass(frozen=True)
class ReleaseRequest:
    gpu: str
    by: str
    at: float


def parse(text: str, *, now: float) -> ReleaseRequest:
    """The release the annotation asks for; ValueError (a one-line reason) when it is not one."""
    doc = bounded_json(text, MAX_BYTES)
    if not isinstance(doc, dict) or set(doc) != {"gpu", "by", "at"}:
        raise ValueError('not an object of exactly "gpu", "by" and "at"')
    gpu, by, at = doc["gpu"], doc["by"], doc["at"]
    if not isinstance(gpu, str) or not (gpu == ALL or _UUID.fullmatch(gpu)):
        raise ValueError('"gpu" is neither a GPU UUID nor "*"')
    if not isinstance(by, str) or not by or len(by) > MAX_BY or not by.isprintable():
        raise ValueError(f'"by" is not a printable name of 1 to {MAX_BY} characters')
    try:
        when = datetime.strptime(at, _TIME).replace(tzinfo=UTC).timestamp() if isinstance(at, str) else None
    except ValueError:
        when = None
    if when is None:
        raise ValueError('"at" is not a time like 2026-12-05T10:00:00Z')
    if when > now + SKEW_S:
        raise ValueError(f'"at" is more than {SKEW_S:g} s in the future')
    return ReleaseRequest(gpu=gpu, by=by, at=when)


def bounded_json(text: str, max_bytes: int) -> Any:
    """The JSON an annotation another writer may have put there holds; ValueError when it is longer than
    `max_bytes` or no JSON (a nesting too deep included)."""
    if len(text.encode("utf-8")) > max_bytes:
        raise ValueError(f"more than {max_bytes} bytes")
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise ValueError("not JSON") from None


def annotation(gpu: str, *, by: str, at: datetime) -> str:
    """The annotation's value that `parse` accepts (the CLI's side)."""
    return json.dumps({"gpu": gpu, "by": by, "at": at.astimezone(UTC).strftime(_TIME)}, sort_keys=True)
