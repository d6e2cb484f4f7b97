"""Reads that fail, measured in time (pure): a GPU every query of which fails (`gpu-unreadable`), a GPU NVML
counts but cannot identify (`gpu-unreadable` on the node) and a node-wide query that fails (`nvml-init`).

One failed read is a transient NVML error, not a fault. A failure is kept as the moment it was first read
(the check's `taken_at`) and told in checks at --interval as judge.streaks tells a run: it is a fault once
it has lasted `unreadable_after` checks (3: from the first failed check to the third at --interval 3, 6 s),
however many checks Xids woke in between. A check that reads it answering again ends it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

from gpuguard.judge.streaks import checks

K = TypeVar("K")


def failing_since(failing: Iterable[K], previous: Mapping[K, float], now: float) -> dict[K, float]:
    """When each failure read at `now` began: the previous check's time for one still failing, else now."""
    return {k: previous.get(k, now) for k in failing}


def how_long(since: float, now: float, interval: float) -> str:
    """The failure's length as its fault says it: 'for 6.0 s, 3 checks at --interval 3', or 'in this check'
    for one read once (`check`, whose single pass is enough)."""
    n = checks(since, now, interval)
    if now <= since:
        return "in this check"
    return f"for {now - since:.1f} s, {n} {'check' if n == 1 else 'checks'} at --interval {interval:g}"
