"""No verdict depends on how often the agent looked: the same readings judged at polls at --interval
alone, and with extra checks at random instants (every Xid, even an ignored one, wakes a check at once),
give the same faults, degraded marks and fault episodes at every poll. Readings: a GPU unreadable, and a
node-wide query failing, in sub-interval blips or for one span of any length; HW slowdown or power brake
bits set for a moment."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gpuguard.core.config import PolicySettings
from gpuguard.core.model import GpuReading, SignalReadings, Snapshot, Verdict
from gpuguard.judge.policy import evaluate
from gpuguard.quarantine.repeat.escalation import gpu_faults

INTERVAL = 3.0
POLLS = tuple(i * INTERVAL for i in range(12))
SETTINGS = PolicySettings(interval=INTERVAL)

Span = tuple[float, float]  # [start, start + length)

# Instants on a 10 ms grid: an event check a hair (1e-70 s) after a poll is the poll's own instant, within
# the clock's slack (judge.streaks), not a check of its own.
instants = st.integers(0, 3300).map(lambda i: i / 100)
spans = st.tuples(instants, st.integers(1, 299).map(lambda i: i / 100))  # a blip shorter than --interval
lasting = st.tuples(instants, st.integers(1, 2000).map(lambda i: i / 100))  # any length
# Blips, each shorter than --interval, or one failure of any length. Not blips in a row closer than an
# interval: polls could read those as one failure that checks in the gaps see answering (a run may end
# sooner when a check comes early, never last longer).
failures = st.lists(spans, max_size=3) | st.lists(lasting, max_size=1)


def apart(spans: list[Span]) -> bool:
    ordered = sorted(spans)
    return all(b[0] - (a[0] + a[1]) >= INTERVAL for a, b in itertools.pairwise(ordered))


def within(t: float, spans: list[Span]) -> bool:
    return any(start <= t < start + length for start, length in spans)


def reading(t: float, unreadable: list[Span], count: list[Span], clocks: list[tuple[Span, int]]) -> Snapshot:
    mask = 0
    for span, bit in clocks:
        mask |= bit if within(t, [span]) else 0
    gpu0 = GpuReading(index=0, uuid="GPU-0", signals=SignalReadings(clock_events=mask))
    gpu1 = GpuReading(index=1, uuid="GPU-1")
    if within(t, unreadable):
        gpu1 = replace(gpu1, unreadable=True, ecc_uncorrected=None, transient_errors=("ecc:TIMEOUT",))
    node_error = "nvmlDeviceGetCount:TIMEOUT" if within(t, count) else None
    return Snapshot(gpus=(gpu0, gpu1), node_error=node_error, taken_at=t)


def at_polls(instants: list[float], snapshot_at: Callable[[float], Snapshot]) -> list[tuple[object, ...]]:
    """What each poll's verdict decides: faults, degraded marks, and the episodes' input."""
    v: Verdict | None = None
    out: list[tuple[object, ...]] = []
    for t in sorted(set(instants)):
        v = evaluate(snapshot_at(t), previous=v, settings=SETTINGS)
        if t in POLLS:
            faults = sorted((f.reason, f.uuid or "") for f in v.faults)
            degraded = sorted((f.reason, f.uuid or "") for f in v.degraded)
            out.append((t, faults, degraded, gpu_faults(v)))
    return out


@settings(max_examples=250, deadline=None)
@given(
    bursts=st.lists(st.tuples(instants, st.integers(1, 8)), max_size=6),
    unreadable=failures,
    count=failures,
    clocks=st.lists(st.tuples(spans, st.sampled_from([0x08, 0x80])), max_size=4),
)
def test_extra_checks_at_random_instants_change_no_verdict_at_any_poll(
    bursts: list[tuple[float, int]],
    unreadable: list[Span],
    count: list[Span],
    clocks: list[tuple[Span, int]],
) -> None:
    assume(apart(unreadable) and apart(count))

    def snapshot_at(t: float) -> Snapshot:
        return reading(t, unreadable, count, clocks)

    # An Xid storm: bursts of checks 50 ms apart.
    events = [round(t + 0.05 * k, 2) for t, n in bursts for k in range(n)]
    polled = at_polls(list(POLLS), snapshot_at)
    assert at_polls(list(POLLS) + events, snapshot_at) == polled
