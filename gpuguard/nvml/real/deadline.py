"""Every NVML call with a deadline, off the thread that judges and writes.

A failing GPU can block an NVML call in the driver for good (an ECC or UUID read that never returns), and
Python cannot interrupt a thread inside a C call. So the backend's pass runs on a reading thread of its own
(`Runner`), and the caller waits for it with a deadline that restarts at every mark of the pass (`Pass.at`:
each node-wide call, each GPU's UUID check and each GPU's reading, whose further calls only name
themselves): the deadline is per call, or per GPU's few calls, never per pass, so a node with many GPUs is
never cut short.

A pass is run either now (`run`: the caller hands it over and waits) or by plan (`next`): the reading thread
keeps the plan from pass to pass, sleeping until the next one's time or until the caller's wake-up event is
set, so at each poll it wakes once by itself and the caller once, for the result.

A call past its deadline is a `Hang`: the caller stops waiting and reports it (`gpu-unresponsive` for a
GPU's call, `nvml-unresponsive` for a node-wide one), the thread is given up (it ends at its next mark
once the call returns, logging `nvml.call_returned`), and the next pass runs on a fresh thread that skips
what hangs (the GPU, the index, or, for a node-wide call, the whole pass). So at most one thread is stuck per
GPU plus one node-wide: accounted for in `hangs()`, never leaked without bound.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import structlog
from structlog.typing import FilteringBoundLogger

log = structlog.get_logger(__name__)

# What a call's deadline covers. Every read gpuguard makes in a pass is answered by the driver in
# microseconds to milliseconds (docs/performance.md); 5 s is over a thousand times that, yet well inside
# kubelet's liveness window (3 probes 10 s apart) and the loop's own stall bound. nvmlInit may take seconds
# on a node without persistence mode (the driver brings every GPU up), so it gets its own, longer bound.
CALL_DEADLINE_S = 5.0
INIT_DEADLINE_S = 30.0

NODE: tuple[str, ...] = ("node",)

T = TypeVar("T")


class Abandoned(Exception):
    """The pass was given up at its deadline: its thread stops at the next mark."""


@dataclass(frozen=True)
class Hang:
    """One NVML call that has not returned within its deadline, and is still in flight."""

    call: str
    key: tuple[str, ...]
    """What later passes skip: ("gpu", uuid), ("index", "N") or NODE."""
    uuid: str | None
    index: int | None
    limit: float
    since: float

    @property
    def detail(self) -> str:
        """Stable text (no elapsed time in it): the reason's detail is the same at every check."""
        where = f" (GPU {self.index}, {self.uuid})" if self.uuid else ""
        if not self.uuid and self.index is not None:
            where = f" (GPU {self.index})"
        return f"{self.call} has not returned within {self.limit:g} s{where}"


class Pass:
    """One pass's progress: the reading thread marks each call before it. A mark is a few attribute stores
    and a clock read (the deadline's whole cost on the reading thread); the rest is worked out only when a
    deadline passes."""

    __slots__ = ("_clock", "_limits", "abandoned", "call", "index", "since", "slow", "uuid")

    def __init__(self, clock: Callable[[], float], limits: tuple[float, float]) -> None:
        self._clock = clock
        self._limits = limits
        self.call = "pass"
        self.uuid: str | None = None
        self.index: int | None = None
        self.slow = False
        self.since = clock()
        self.abandoned = False

    def at(self, call: str, uuid: str | None = None, index: int | None = None, slow: bool = False) -> None:
        """The next NVML call, on this GPU (uuid) or index; its deadline starts now (`slow`: nvmlInit's)."""
        if self.abandoned:
            raise Abandoned
        self.call = call
        self.uuid = uuid
        self.index = index
        self.slow = slow
        self.since = self._clock()

    @property
    def limit(self) -> float:
        return self._limits[1] if self.slow else self._limits[0]

    @property
    def key(self) -> tuple[str, ...]:
        if self.uuid is not None:
            return ("gpu", self.uuid)
        return NODE if self.index is None else ("index", str(self.index))


def _hang_log(hang: Hang) -> FilteringBoundLogger:
    """The lines about one hung call (it hung, it returned) name the call and its GPU's index and UUID."""
    return cast(FilteringBoundLogger, log.bind(call=hang.call, gpu=hang.index, uuid=hang.uuid))


_LOOK = object()  # put on a reading thread's queue: a plan was set, look at it


@dataclass(eq=False)
class _Plan:
    """A pass the reading thread runs by itself at `due`, or at once when `early` is set, and again `period`
    after each start: an idle poll wakes the reading thread once (its time) and the waiting caller once (the
    result), with no hand-over in between (each one costs a thread wake-up, and CPython's GIL one more)."""

    job: Callable[[Pass], Any]
    due: float
    period: float
    early: threading.Event
    # A Pass alone: it began early (the caller's deadline runs from now); (Pass, result): it is done.
    out: queue.SimpleQueue[Any]
    current: Pass | None = None


class _Reader:
    """One reading thread: the one-off jobs it is handed, or the plan it keeps."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.plan: _Plan | None = None
        self.thread: threading.Thread | None = None


class Runner:
    """Runs passes on a reading thread; the caller waits with a deadline per call."""

    def __init__(
        self,
        *,
        deadline: float = CALL_DEADLINE_S,
        init_deadline: float = INIT_DEADLINE_S,
        clock: Callable[[], float] = time.monotonic,
        discarded: Callable[[Any], None] = lambda result: None,
    ) -> None:
        self._limits = (deadline, max(deadline, init_deadline))
        # Called with the result of a pass that finished just as its deadline gave it up (nothing is lost).
        self._discarded = discarded
        self._clock = clock
        self._lock = threading.Lock()
        self._reader: _Reader | None = None
        self._hangs: dict[tuple[str, ...], Hang] = {}

    @property
    def longest(self) -> float:
        """The longest a pass's caller can wait on one call."""
        return self._limits[1]

    def hangs(self) -> tuple[Hang, ...]:
        with self._lock:
            return tuple(self._hangs.values())

    def hung(self, key: tuple[str, ...]) -> Hang | None:
        with self._lock:
            return self._hangs.get(key)

    def run(self, job: Callable[[Pass], T]) -> T | Hang:
        """job(pass) on the reading thread now: its result, or the Hang that ended the wait."""
        p = Pass(self._clock, self._limits)
        box: list[Any] = []
        # Held until the pass is done: a bare lock is the cheapest hand-back CPython has (an Event is a
        # Condition, a lock and a list underneath).
        done = threading.Lock()
        done.acquire()
        with self._lock:
            reader = self._started()
            plan, reader.plan = reader.plan, None
            reader.jobs.put((job, p, box, done))
        if plan is not None:
            plan.early.set()  # the thread waits for its plan's time: end that wait (the plan is off)
        hang = None
        while hang is None and not done.acquire(timeout=max(0.0, p.since + p.limit - self._clock())):
            hang = self._give_up(p, lambda: bool(box))
        if hang is not None:
            return self._hung(hang)
        if isinstance(box[0], BaseException):
            raise box[0]
        result: T = box[0]
        return result

    def next(self, job: Callable[[Pass], T], *, at: float, early: threading.Event) -> T | Hang | None:
        """The result of job(pass) planned for `at`, or begun sooner once `early` is set (and `early` cleared
        as it begins): the reading thread runs it by itself, and again `at - now` after each start, so the
        next call finds the thread already waiting for its time. The Hang that ended the wait; None when
        `at` came before the plan's time (a wait shorter than the period: nothing was read)."""
        with self._lock:
            reader = self._started()
            plan = reader.plan
            if plan is None or plan.job != job or plan.early is not early:
                plan = _Plan(
                    job, due=at, period=max(0.0, at - self._clock()), early=early, out=queue.SimpleQueue()
                )
                reader.plan = plan
                reader.jobs.put(_LOOK)
        while True:
            with self._lock:
                p = plan.current
            if p is not None:
                until = p.since + p.limit
            elif plan.due > at:
                until = at
            else:
                until = max(plan.due, self._clock()) + self._limits[0]
            try:
                item = plan.out.get(timeout=max(0.0, until - self._clock()))
            except queue.Empty:
                if p is None:
                    if plan.due > at and self._clock() >= at:
                        return None
                    continue  # not begun yet (a thread late to run): no call is in flight
                hang = self._give_up(p, lambda p=p: plan.current is not p)  # type: ignore[misc]
                if hang is not None:
                    return self._hung(hang)
                continue
            if isinstance(item, Pass):
                continue  # begun early: the deadline runs from its start
            result = item[1]
            if isinstance(result, BaseException):
                raise result
            out: T = result
            return out

    def stop(self) -> None:
        """End the reading thread (not one given up: it ends when its call returns)."""
        with self._lock:
            reader, self._reader = self._reader, None
        if reader is None:
            return
        plan, reader.plan = reader.plan, None
        reader.jobs.put(None)
        if plan is not None:
            plan.early.set()
        if reader.thread is not None:
            reader.thread.join(1.0)

    def _started(self) -> _Reader:
        """The current reading thread's reader (a new thread if there is none). Under self._lock."""
        if self._reader is None:
            reader = _Reader()
            thread = threading.Thread(
                target=self._work, args=(reader,), name="gpuguard-nvml-read", daemon=True
            )
            reader.thread = thread
            self._reader = reader
            thread.start()
        return self._reader

    def _hung(self, hang: Hang) -> Hang:
        _hang_log(hang).warning(
            "nvml.call_hung",
            deadline_s=hang.limit,
            stuck_threads=len(self.hangs()),
            action="reported as unresponsive; skipped until it returns",
        )
        return hang

    def _give_up(self, p: Pass, finished: Callable[[], bool]) -> Hang | None:
        """The Hang if the call in flight is past its deadline (None: done, or a later call's time runs)."""
        with self._lock:
            if finished() or self._clock() < p.since + p.limit:
                return None
            p.abandoned = True
            self._reader = None  # this thread is given up: the next pass gets a fresh one
            hang = Hang(call=p.call, key=p.key, uuid=p.uuid, index=p.index, limit=p.limit, since=p.since)
            self._hangs[p.key] = hang
            return hang

    def _work(self, reader: _Reader) -> None:
        while True:
            plan = reader.plan
            if plan is not None:
                if not self._planned(reader, plan):
                    return
                continue
            item = reader.jobs.get()
            if item is None:
                return
            if item is _LOOK:
                continue
            job, p, box, done = item
            result = self._call(job, p)
            with self._lock:
                if not p.abandoned:
                    box.append(result)
                    done.release()
                    continue
                hang = self._hangs.pop(p.key, None)
            self._returned(result, hang)
            return

    def _planned(self, reader: _Reader, plan: _Plan) -> bool:
        """Wait for the plan's time (or `early`), run its pass, hand the result over. False: the thread is
        given up (its pass passed a deadline) and ends."""
        began_early = plan.early.wait(max(0.0, plan.due - self._clock()))
        if reader.plan is not plan:
            return True  # the plan was taken off meanwhile: a one-off job or a new plan is waiting
        plan.early.clear()
        p = Pass(self._clock, self._limits)
        start = p.since
        with self._lock:
            plan.current = p
        if began_early:
            plan.out.put(p)
        result = self._call(plan.job, p)
        with self._lock:
            if not p.abandoned:
                plan.current = None
                plan.due = start + plan.period
                plan.out.put((p, result))
                return True
            hang = self._hangs.pop(p.key, None)
        self._returned(result, hang)
        return False

    @staticmethod
    def _call(job: Callable[[Pass], Any], p: Pass) -> Any:
        try:
            return job(p)
        except Abandoned:
            return None
        except Exception as exc:  # handed to the caller, which logs it
            return exc

    def _returned(self, result: Any, hang: Hang | None) -> None:
        """A given-up thread's pass came back: its result is not lost, and the call is logged as returned."""
        if result is not None and not isinstance(result, BaseException):
            self._discarded(result)
        if hang is not None:
            _hang_log(hang).info("nvml.call_returned", after_s=round(self._clock() - hang.since, 3))
