"""The reading thread's planned pass (nvml.real.deadline.Runner.next): each pass's result handed over in
order and none lost, an event's pass at once, a slow pass as it ends, a hung one at its deadline, and a wait
shorter than the plan's period reads nothing."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest

from gpuguard.nvml.real.deadline import Hang, Pass, Runner


def _job(took: float = 0.0) -> Any:
    count = [0]

    def job(p: Pass) -> int:
        p.at("nvmlDeviceGetCount")
        time.sleep(took)
        count[0] += 1
        return count[0]

    return job


def _polls(runner: Runner, job: Any, early: threading.Event, n: int, interval: float) -> list[Any]:
    out = []
    for _ in range(n):
        out.append(runner.next(job, at=time.monotonic() + interval, early=early))
    return out


def test_results_the_caller_was_too_slow_to_take_come_in_order_none_lost() -> None:
    """A caller busy for longer than the plan's period (a slow check) finds several passes done: each is
    handed over, oldest first (a pass's Xids are in its result only)."""
    runner, job, early = Runner(), _job(), threading.Event()
    try:
        first = runner.next(job, at=time.monotonic() + 0.05, early=early)
        time.sleep(0.28)  # about five of the plan's periods
        later: list[int] = [runner.next(job, at=time.monotonic() + 0.05, early=early) for _ in range(4)]  # type: ignore[misc]
    finally:
        runner.stop()
    assert first == 1
    assert later == sorted(later) and len(set(later)) == 4 and later[0] == 2, later


def test_an_early_pass_is_handed_over_at_once_not_at_the_callers_look() -> None:
    runner, job, early = Runner(), _job(), threading.Event()
    try:
        assert runner.next(job, at=time.monotonic() + 0.05, early=early) == 1
        threading.Timer(0.1, early.set).start()
        t0 = time.monotonic()
        got = runner.next(job, at=time.monotonic() + 30.0, early=early)
        took = time.monotonic() - t0
    finally:
        runner.stop()
    assert got == 2
    assert took < 1.0, f"an early pass took {took:.2f} s to come back"


def test_a_pass_slower_than_the_look_comes_back_when_done_not_at_its_deadline() -> None:
    """A pass of 0.15 s is handed over as it ends, never held until the call deadline (5 s)."""
    runner, job, early = Runner(), _job(took=0.15), threading.Event()
    try:
        t0 = time.monotonic()
        results = _polls(runner, job, early, 3, 0.05)
        took = time.monotonic() - t0
    finally:
        runner.stop()
    assert results == [1, 2, 3]
    assert took < 2.0, f"three slow passes took {took:.2f} s"


def test_a_planned_pass_that_hangs_is_reported_at_its_deadline() -> None:
    release = threading.Event()

    def job(p: Pass) -> int:
        p.at("nvmlDeviceGetTotalEccErrors", "GPU-1", 1)
        release.wait(10)
        return 1

    runner, early = Runner(deadline=0.3), threading.Event()
    try:
        t0 = time.monotonic()
        got = runner.next(job, at=time.monotonic() + 0.05, early=early)
        took = time.monotonic() - t0
    finally:
        release.set()
        runner.stop()
    assert isinstance(got, Hang) and got.uuid == "GPU-1" and got.call == "nvmlDeviceGetTotalEccErrors"
    assert 0.3 <= took < 1.5, took


def test_a_wait_that_ends_before_the_plans_time_reads_nothing() -> None:
    runner, job, early = Runner(), _job(), threading.Event()
    try:
        assert runner.next(job, at=time.monotonic() + 0.2, early=early) == 1
        assert runner.next(job, at=time.monotonic() + 0.01, early=early) is None
    finally:
        runner.stop()


def test_idle_polls_hand_the_reading_thread_no_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan is kept from poll to poll: the reading thread runs each pass by itself and nothing is handed
    to it per poll (a job handed over per poll woke both threads twice more). Checked against the one-off
    `run`, which does hand a job over."""
    puts: list[Any] = []

    class Counting(queue.SimpleQueue[Any]):
        def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
            puts.append(item)
            super().put(item, block, timeout)

    monkeypatch.setattr(queue, "SimpleQueue", Counting)  # the module deadline uses
    runner, job, early = Runner(), _job(), threading.Event()
    try:
        results = [runner.next(job, at=time.monotonic() + 0.02, early=early) for _ in range(6)]
        jobs = [item for item in puts if isinstance(item, tuple) and len(item) == 4]
        assert runner.run(job) == 7
        one_off = [item for item in puts if isinstance(item, tuple) and len(item) == 4]
    finally:
        runner.stop()
    assert results == [1, 2, 3, 4, 5, 6]
    assert jobs == [] and len(one_off) == 1
