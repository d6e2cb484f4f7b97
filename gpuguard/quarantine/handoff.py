"""The hand-off of the newest judgement (model.Judgement: the verdict and its streaks) from the agent's
thread to the reconciler's writer thread: latest wins (an old one is never applied after a newer one), one
that cannot change any decision does not wake the writer, and the start-up jitter holds the first request.
The reconciler does the work; this module only says when there is some."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gpuguard.core.model import Judgement, Verdict

# The decision-relevant summary of a judgement (see Handoff.submit).
Signature = tuple[object, ...]


class Handoff:
    """`stop`: set when the agent shuts down (the writer thread's waits end at once)."""

    def __init__(
        self, *, recover_after: int, stop: threading.Event, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._recover_after = recover_after
        self._stop = stop
        self._clock = clock
        self._cond = threading.Condition()
        self._latest: Judgement | None = None
        self._fault_keys: tuple[Verdict, frozenset[str], frozenset[str]] | None = None
        # The last judgement handed over and its summary: a steady agent hands the same object again.
        self._last: tuple[Judgement, Signature] | None = None
        # The summary of the last verdict reconciled without error, and of the one handed over since.
        self._settled: Signature | None = None
        self._pending: Signature | None = None
        self._generation = 0
        self._done_generation = 0
        self._first_verdict_at: float | None = None

    def submit(self, judgement: Judgement, *, quiet: Callable[[], bool]) -> None:
        """Hand over the newest judgement. One whose summary (fault keys, health, the streaks up to
        --recover-after, flapping, GPUs seen, the degraded signals) is that of the last one reconciled, while
        `quiet()` (asked under the lock: the node cached, nothing pending on it) does not wake the writer."""
        last = self._last
        sig = last[1] if last is not None and last[0] is judgement else self._summary(judgement)
        self._last = (judgement, sig)
        with self._cond:
            if self._first_verdict_at is None:
                self._first_verdict_at = self._clock()
            self._latest = judgement
            if sig == self._settled and quiet():
                return
            self._pending = sig
            self._generation += 1
            self._cond.notify_all()

    def _summary(self, judgement: Judgement) -> Signature:
        verdict = judgement.verdict
        keys = self._fault_keys
        if keys is None or keys[0] is not verdict:
            # Once per verdict object: the agent hands over its remembered verdict at every steady check.
            keys = self._fault_keys = (
                verdict,
                frozenset(f.key for f in verdict.faults),
                frozenset(f.key for f in verdict.degraded),
            )
        return (
            keys[1],
            verdict.healthy,
            judgement.streaks.capped(self._recover_after),
            judgement.flapping,
            bool(verdict.gpus),
            keys[2],
        )

    def latest(self) -> Judgement | None:
        with self._cond:
            return self._latest

    def begin(self) -> tuple[int, Signature | None]:
        """A reconcile starts: the generation it covers and the summary it settles when it succeeds."""
        with self._cond:
            return self._generation, self._pending

    def done(self, generation: int, sig: Signature | None, *, settled: bool) -> None:
        with self._cond:
            self._settled = sig if settled else None
            self._done_generation = max(self._done_generation, generation)
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Block until every submitted verdict has been reconciled (tests and one-shot runs)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._done_generation < self._generation:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def wait_work(self) -> bool:
        """The writer thread's wait for a verdict to reconcile; False once the agent stops."""
        with self._cond:
            while self._done_generation >= self._generation and not self._stop.is_set():
                self._cond.wait()
        return not self._stop.is_set()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def hold_start(self, delay: float) -> None:
        """The start-up jitter: the first request waits until `delay` after the first verdict (the agent's
        first check, right after start), so a fleet that starts at once reaches the API server spread out. A
        verdict with a fault ends the wait at once (the taint is never delayed); the checks and /healthz run
        meanwhile, only /readyz waits."""
        if delay <= 0:
            return
        with self._cond:
            while not self._stop.is_set():
                latest, first = self._latest, self._first_verdict_at
                if latest is None or first is None:
                    self._cond.wait()
                    continue
                if latest.verdict.faults:
                    break
                left = first + delay - self._clock()
                if left <= 0:
                    break
                self._cond.wait(left)
