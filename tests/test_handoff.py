"""The hand-off from the agent's thread to the writer's (gpuguard/quarantine/handoff.py): a judgement that can
change a decision wakes the writer and one that cannot does not, the writer's waits end when there is work or
the agent stops, and the start-up jitter holds the first request until its delay has passed on the clock
(at once for a fault)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gpuguard.core.model import Fault, GpuVerdict, Judgement, Streaks, Verdict
from gpuguard.quarantine.handoff import Handoff
from harness.clock import Clock

GPU = GpuVerdict(index=0, uuid="GPU-0")
HEALTHY = Verdict(gpus=(GPU,))
ECC = Fault("ecc", "3 uncorrected", uuid="GPU-0", gpu_index=0)
XID = Fault("xid-79", "fell off the bus", uuid="GPU-0", gpu_index=0)
NVLINK = Fault("nvlink-down", "link 0 inactive", uuid="GPU-0", gpu_index=0)
PCIE = Fault("pcie-width", "x8 of x16", uuid="GPU-0", gpu_index=0)


def cached() -> bool:
    """The node cached and nothing pending on it."""
    return True


def faulty(*faults: Fault) -> Verdict:
    return Verdict(gpus=(GpuVerdict(index=0, uuid="GPU-0", faults=faults),))


def degraded(*signals: Fault) -> Verdict:
    return Verdict(gpus=(GpuVerdict(index=0, uuid="GPU-0", degraded=signals),))


def reconciled(h: Handoff, *, settled: bool = True) -> None:
    """The writer's reconcile of the latest judgement, as NodeReconciler.reconcile_now brackets it."""
    generation, sig = h.begin()
    h.done(generation, sig, settled=settled)


def wakes(h: Handoff, judgement: Judgement, quiet: Callable[[], bool] = cached) -> bool:
    before = h.begin()[0]
    h.submit(judgement, quiet=quiet)
    return h.begin()[0] == before + 1


def in_thread(target: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(target()), daemon=True)
    t.start()
    return t, out


def test_a_fresh_handoff_has_no_work_and_is_idle() -> None:
    h = Handoff(recover_after=3, stop=threading.Event())
    assert h.begin() == (0, None) and h.latest() is None
    assert h.wait_idle(0) is True


def test_each_judgement_that_can_change_a_decision_wakes_the_writer_once() -> None:
    h = Handoff(recover_after=3, stop=threading.Event())
    cases = [
        (Judgement(HEALTHY, Streaks(healthy=1)), True),  # the first
        (Judgement(HEALTHY, Streaks(healthy=1)), False),  # the same again, the node quiet
        (Judgement(Verdict(gpus=(GPU,)), Streaks(healthy=1)), False),  # an equal verdict, another object
        (Judgement(HEALTHY, Streaks(healthy=2)), True),  # a streak still short of --recover-after
        (Judgement(HEALTHY, Streaks(healthy=3)), True),  # reaching it
        (Judgement(HEALTHY, Streaks(healthy=4)), False),  # past it: nothing left to decide
        (Judgement(faulty(ECC)), True),
        (Judgement(faulty(XID)), True),  # another fault in place of the first, the node still unhealthy
        (Judgement(faulty(XID), flapping=True), True),
        (Judgement(degraded(NVLINK)), True),
        (Judgement(degraded(NVLINK, PCIE)), True),  # another degraded signal
        (Judgement(Verdict()), True),  # no GPU seen
    ]
    for judgement, wake in cases:
        assert wakes(h, judgement) is wake, judgement
        assert h.latest() is judgement  # latest wins, woken or not
        reconciled(h)


def test_a_judgement_the_writer_could_not_settle_wakes_it_again() -> None:
    h = Handoff(recover_after=3, stop=threading.Event())
    same = Judgement(faulty(ECC))
    assert wakes(h, same)
    reconciled(h, settled=False)  # a write failed
    assert wakes(h, same)
    reconciled(h)
    assert not wakes(h, same)
    assert wakes(h, same, quiet=lambda: False)  # the node not cached, or something pending on it


def test_wait_idle_returns_once_the_writer_is_done_and_false_at_its_timeout() -> None:
    h = Handoff(recover_after=3, stop=threading.Event())
    h.submit(Judgement(HEALTHY), quiet=cached)
    assert h.wait_idle(0.05) is False
    generation, sig = h.begin()
    timer = threading.Timer(0.1, lambda: h.done(generation, sig, settled=True))
    timer.start()
    assert h.wait_idle(1.0) is True  # within a second: woken by done, not at the timeout
    timer.join()
    # A long timeout is no longer wait: done wakes the waiter at once.
    h.submit(Judgement(Verdict(gpus=(GpuVerdict(index=0, uuid="GPU-0", faults=(ECC,)),))), quiet=cached)
    generation, sig = h.begin()
    timer = threading.Timer(0.1, lambda: h.done(generation, sig, settled=True))
    timer.start()
    started = time.monotonic()
    assert h.wait_idle(30.0) is True
    assert time.monotonic() - started < 15.0
    timer.join()


def test_the_writers_wait_ends_with_work_and_says_false_once_the_agent_stops() -> None:
    stop = threading.Event()
    h = Handoff(recover_after=3, stop=stop)
    waiter, out = in_thread(h.wait_work)
    waiter.join(0.2)
    assert waiter.is_alive()  # nothing to do: it waits
    h.submit(Judgement(HEALTHY), quiet=cached)
    waiter.join(5)
    assert out == [True]
    reconciled(h)
    waiter, out = in_thread(h.wait_work)
    stop.set()
    h.wake()
    waiter.join(5)
    assert out == [False]
    h.submit(Judgement(faulty(ECC)), quiet=cached)
    assert h.wait_work() is False  # work, but the agent stops


def test_the_start_jitter_holds_the_first_request_until_its_delay_has_passed_on_the_clock() -> None:
    stop, clock = threading.Event(), Clock(100.0)
    h = Handoff(recover_after=3, stop=stop, clock=clock)
    holder, _ = in_thread(lambda: h.hold_start(30.0))
    holder.join(0.2)
    assert holder.is_alive()  # no verdict yet
    h.submit(Judgement(HEALTHY), quiet=cached)  # the first, at 100
    holder.join(0.2)
    assert holder.is_alive()
    clock.t = 129.0
    h.submit(Judgement(HEALTHY, Streaks(healthy=1)), quiet=cached)  # a later verdict does not move the start
    h.wake()
    holder.join(0.2)
    assert holder.is_alive()  # a second to go
    clock.t = 130.0
    h.wake()
    holder.join(5)
    assert not holder.is_alive()


def test_the_start_jitter_never_holds_a_fault_and_a_delay_of_0_holds_nothing() -> None:
    h = Handoff(recover_after=3, stop=threading.Event(), clock=Clock(100.0))
    h.hold_start(0.0)  # returns at once, with no verdict at all
    holder, _ = in_thread(lambda: h.hold_start(30.0))
    h.submit(Judgement(faulty(ECC)), quiet=cached)
    holder.join(5)
    assert not holder.is_alive()


def test_a_delay_of_one_second_still_holds_the_start() -> None:
    stop = threading.Event()
    h = Handoff(recover_after=3, stop=stop, clock=Clock(100.0))
    holder, _ = in_thread(lambda: h.hold_start(1.0))
    holder.join(0.2)
    assert holder.is_alive()
    stop.set()  # the agent stops: the wait ends
    h.wake()
    holder.join(5)
    assert not holder.is_alive()
