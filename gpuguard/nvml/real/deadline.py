"""Every NVML call with a deadline, off the thread that judges and writes.

A failing GPU can block an NVML call in the driver for good (an ECC or UUID read that never returns), and
Python cannot interrupt a thread inside a C call. So the backend's pass runs on a reading thread of its own
(`Runner`), and the caller waits for it with a deadline that restarts at every call the pass marks
(`Pass.at`): the deadline is per call, not per pass, so a node with many GPUs is never cut short.

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
from typing import Any, TypeVar

import structlog

log = structlog.get_logger("gpuguard.nvml")

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


_Job = tuple[Callable[["Pass"], Any], "Pass", list[Any], threading.Lock] | None


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
        self._jobs: queue.SimpleQueue[_Job] | None = None
        self._thread: threading.Thread | None = None
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
        """job(pass) on the reading thread: its result, or the Hang that ended the wait."""
        p = Pass(self._clock, self._limits)
        box: list[Any] = []
        # Held until the pass is done: a bare lock is the cheapest hand-back CPython has (an Event is a
        # Condition, a lock and a list underneath).
        done = threading.Lock()
        done.acquire()
        with self._lock:
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(
                    target=self._work, args=(self._jobs,), name="gpuguard-nvml-read", daemon=True
                )
                self._thread.start()
            self._jobs.put((job, p, box, done))
        hang = None
        while hang is None and not done.acquire(timeout=max(0.0, p.since + p.limit - self._clock())):
            hang = self._give_up(p, box)
        if hang is not None:
            log.warning(
                "nvml.call_hung",
                call=hang.call,
                gpu=hang.index,
                uuid=hang.uuid,
                deadline_s=hang.limit,
                stuck_threads=len(self.hangs()),
                action="reported as unresponsive; skipped until it returns",
            )
            return hang
        if isinstance(box[0], BaseException):
            raise box[0]
        result: T = box[0]
        return result

    def stop(self) -> None:
        """End the reading thread (not one given up: it ends when its call returns)."""
        with self._lock:
            jobs, thread, self._jobs, self._thread = self._jobs, self._thread, None, None
        if jobs is not None and thread is not None:
            jobs.put(None)
            thread.join(1.0)

    def _give_up(self, p: Pass, box: list[Any]) -> Hang | None:
        """The Hang if the call in flight is past its deadline (None: done, or a later call's time runs)."""
        with self._lock:
            if box or self._clock() < p.since + p.limit:
                return None
            p.abandoned = True
            self._jobs = self._thread = None  # this thread is given up: the next pass gets a fresh one
            hang = Hang(call=p.call, key=p.key, uuid=p.uuid, index=p.index, limit=p.limit, since=p.since)
            self._hangs[p.key] = hang
            return hang

    def _work(self, jobs: queue.SimpleQueue[_Job]) -> None:
        while True:
            item = jobs.get()
            if item is None:
                return
            job, p, box, done = item
            try:
                result: Any = job(p)
            except Abandoned:
                result = None
            except Exception as exc:  # handed to the caller, which logs it
                result = exc
            with self._lock:
                if not p.abandoned:
                    box.append(result)
                    done.release()
                    continue
                hang = self._hangs.pop(p.key, None)
            if result is not None and not isinstance(result, BaseException):
                self._discarded(result)
            if hang is not None:
                log.info(
                    "nvml.call_returned",
                    call=hang.call,
                    gpu=hang.index,
                    uuid=hang.uuid,
                    after_s=round(self._clock() - hang.since, 3),
                )
            return
