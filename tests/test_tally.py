"""The tally beside each verdict (gpuguard.judge.tally): a steady node's checks hand the writer the very same
Judgement object once nothing it carries can change a decision, and the tally never tells the writer anything
that recomputing the runs, the flaps and the streaks at every check would not."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.core.model import Fault, GpuVerdict, Judgement, Verdict
from gpuguard.judge.flaps import Flaps, flapping, held, observe_verdict
from gpuguard.judge.streaks import Runs, advance, streaks
from gpuguard.judge.tally import Tally, tally
from tests.test_streaks import ECC
from tests.test_streaks import gpus as node

INTERVAL, WINDOW, RECOVER = 3.0, 60.0, 5
SLOW = Fault("clock-hw-slowdown", "HW slowdown", uuid="GPU-0", gpu_index=0)


def step(previous: Tally, verdict: Verdict, at: float, recover_after: int | None = RECOVER) -> Tally:
    return tally(
        previous,
        verdict,
        judged_at=at,
        now=at,
        interval=INTERVAL,
        flap_window=WINDOW,
        recover_after=recover_after,
    )


def test_a_steady_node_past_recover_after_hands_over_the_same_judgement_object() -> None:
    healthy = node()
    t = Tally()
    for i in range(RECOVER):
        t = step(t, healthy, i * INTERVAL)
    assert t.settled
    again = step(t, healthy, 100 * INTERVAL)
    assert again is t
    assert again.judgement is t.judgement


def test_a_steady_node_short_of_recover_after_is_not_settled() -> None:
    healthy = node()
    t = Tally()
    for i in range(RECOVER - 1):
        t = step(t, healthy, i * INTERVAL)
    assert not t.settled
    assert t.judgement is not None and t.judgement.streaks.healthy == RECOVER - 1


def test_without_recover_after_every_check_hands_over_a_new_judgement() -> None:
    healthy = node()
    t = step(Tally(), healthy, 0.0, None)
    for i in range(1, 20):
        before = t.judgement
        t = step(t, healthy, i * INTERVAL, None)
        assert not t.settled and t.judgement is not before


def test_a_new_verdict_ends_the_settled_tally() -> None:
    healthy = node()
    t = Tally()
    for i in range(RECOVER):
        t = step(t, healthy, i * INTERVAL)
    sick = step(t, node(sick=ECC), RECOVER * INTERVAL)
    assert not sick.settled
    assert sick.judgement is not None and sick.judgement.streaks.healthy == 0


def test_a_faulty_steady_node_never_settles() -> None:
    sick = node(sick=ECC)
    t = Tally()
    for i in range(50):
        t = step(t, sick, i * INTERVAL)
    assert not t.settled


def test_a_flap_in_the_window_keeps_the_tally_unsettled_until_it_has_aged_out() -> None:
    healthy, degraded = node(), node(degraded=SLOW)
    t = Tally()
    at = 0.0
    for v in (healthy, degraded, healthy, degraded, healthy):
        t = step(t, v, at)
        at += INTERVAL
    settled_at = None
    for _ in range(60):
        t = step(t, healthy, at)
        if t.settled and settled_at is None:
            settled_at = at
        at += INTERVAL
    # The last degraded episode began at 3 intervals: the flap is forgotten a whole window after it.
    assert settled_at is not None and settled_at > 3 * INTERVAL + WINDOW


def reference(steps: list[tuple[Verdict, float]]) -> list[Judgement]:
    """What every check handed over before the tally: runs, flaps and streaks recomputed at each check."""
    runs, flaps, out = Runs(), Flaps(), []
    for verdict, at in steps:
        runs = advance(runs, verdict, at)
        flaps = observe_verdict(flaps, verdict, at, WINDOW)
        counted = held(streaks(runs, at, INTERVAL), flaps, at, WINDOW)
        out.append(Judgement(verdict, counted, flapping(flaps.faults, at, WINDOW)))
    return out


POOL = (node(), node(sick=ECC), node(degraded=SLOW), node(sick=ECC, degraded=SLOW))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(range(len(POOL))),
            st.booleans(),  # a new object for an equal verdict (the agent re-evaluated)
            st.floats(min_value=0.01, max_value=40.0),
        ),
        min_size=1,
        max_size=60,
    )
)
def test_the_tally_tells_the_writer_what_recomputing_every_check_would(
    draws: list[tuple[int, bool, float]],
) -> None:
    steps: list[tuple[Verdict, float]] = []
    at, last = 0.0, None
    for which, fresh, dt in draws:
        verdict = POOL[which]
        if fresh:
            verdict = node(**_faults(verdict))
        elif last is not None and last == verdict:
            verdict = last  # the agent's remembered evaluation: the very object again
        steps.append((verdict, at))
        last = verdict
        at += dt
    t = Tally()
    for (verdict, at), want in zip(steps, reference(steps), strict=True):
        t = step(t, verdict, at)
        assert t.judgement is not None
        got = t.judgement
        assert got.verdict is verdict
        assert got.flapping == want.flapping
        assert got.streaks.capped(RECOVER) == want.streaks.capped(RECOVER)


def _faults(v: Verdict) -> dict[str, Fault]:
    out: dict[str, Fault] = {}
    for g in v.gpus:
        if g.faults:
            out["sick"] = g.faults[0]
        if g.degraded:
            out["degraded"] = g.degraded[0]
    return out


def first_settled(steps: list[tuple[Verdict, float]], window: float = WINDOW) -> tuple[float, Tally] | None:
    t = Tally()
    for verdict, at in steps:
        t = tally(
            t, verdict, judged_at=at, now=at, interval=INTERVAL, flap_window=window, recover_after=RECOVER
        )
        if t.settled:
            return at, t
    return None


def test_after_a_fault_the_tally_settles_only_once_the_healthy_streak_reaches_recover_after() -> None:
    """The clean streak (no degraded signal) and every GPU's own ran on through the node's fault: it is the
    shortest streak, the node's healthy one, that must reach --recover-after (a window short enough that the
    fault's flap is forgotten at once)."""
    healthy = node()
    down = replace(healthy, node_faults=(Fault("nvml-init", "NVML initialization failed: UNKNOWN"),))
    steps = [(down, 0.0)] + [(healthy, i * INTERVAL) for i in range(1, 20)]
    got = first_settled(steps, window=1.0)
    assert got is not None
    at, t = got
    assert t.judgement is not None and t.judgement.streaks.healthy == RECOVER
    assert t.judgement.streaks.clean > RECOVER and at == RECOVER * INTERVAL


def test_a_gpus_degraded_flap_in_the_window_keeps_the_tally_unsettled_though_the_nodes_has_aged_out() -> None:
    """GPU 1 degraded from 0 s, GPU 0 as well from 51 s, both clear at 57 s: the node's degraded episode
    (at 0 s) ages out a window later, GPU 0's (at 51 s) only a window after 51 s."""
    slow1 = Fault("clock-hw-slowdown", "HW slowdown", uuid="GPU-1", gpu_index=1)
    one = Verdict(gpus=tuple(GpuVerdict(index=i, uuid=f"GPU-{i}", degraded=(slow1,) * i) for i in (0, 1)))
    both = Verdict(
        gpus=(
            GpuVerdict(index=0, uuid="GPU-0", degraded=(SLOW,)),
            GpuVerdict(index=1, uuid="GPU-1", degraded=(slow1,)),
        )
    )
    healthy = node()
    steps = [(one, i * INTERVAL) for i in range(17)] + [(both, 51.0), (both, 54.0)]
    steps += [(healthy, 57.0 + i * INTERVAL) for i in range(40)]
    got = first_settled(steps)
    assert got is not None and got[0] > 51.0 + WINDOW
