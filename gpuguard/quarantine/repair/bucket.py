"""The cluster-wide pace of resets as a token bucket that refills by itself (no latch an operator must clear).
Pure: the tokens and the time they were counted in, the answer out; `gpuguard.quarantine.repair.pace` keeps
them in a Lease."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class Bucket:
    """`burst` resets at once at most, refilled at `per_hour` resets an hour."""

    per_hour: float
    burst: int


def take(bucket: Bucket, tokens: float | None, at: datetime | None, now: datetime) -> tuple[bool, float]:
    """Whether a reset may start now, and the tokens left. A bucket never seen (or unreadable) is full; one
    whose time is ahead of `now` refills nothing (a clock step cannot mint tokens)."""
    if tokens is None or at is None or not 0 <= tokens <= bucket.burst:
        tokens, at = float(bucket.burst), now
    elapsed = max(0.0, (now - at).total_seconds())
    tokens = min(float(bucket.burst), tokens + elapsed * bucket.per_hour / 3600)
    if tokens >= 1:
        return True, tokens - 1
    return False, tokens
