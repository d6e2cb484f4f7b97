"""The event path: one NVML event set, every GPU registered for Xid, uncorrected (double-bit) ECC and
recovery-action events, one thread waiting on it that records Xids and wakes the agent at once on any event.

Set creation and registration failures are retried with backoff (after UNKNOWN the set is freed and a fresh
one made, as nvml.h asks); a wait that fails with anything but TIMEOUT rebuilds the path and re-reads every
GPU at once. The thread has a heartbeat: each wait returns within the heartbeat (30 s), and one not back
within two is stuck (hung in the driver): every GPU reads `xid_watched` false, it is logged and listed as a
stuck call, and the path is rebuilt on a new thread. A watchdog (nvml.real.watchdog) watches the heartbeat
and the retries' due times and wakes the agent for them: neither waits for `--interval`.

stop_thread() ends a wait with WAKE_SIGNAL (nvml.h: TIMEOUT when "interrupt arrived"); nvmlEventSetFree and
nvmlShutdown never wake a waiter here, nor are they called while one may still wait on the set. A thread that
stops drains its set first (nvml.real.xidevents): an event queued there is in no newer set; a thread given up
(hung in a call) drains and frees its set itself when the call returns, and wakes the agent to judge it."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pynvml
import structlog

from gpuguard.core.model import XidEvent
from gpuguard.nvml.base import Wakeup
from gpuguard.nvml.real.common import (
    EVENT_DOUBLE_BIT_ECC,
    EVENT_RECOVERY_ACTION,
    EVENT_XID,
    WAKE_SIGNAL,
    Device,
    backoff,
    code,
    error_name,
    handle_key,
    install_wake_signal,
    not_supported,
)
from gpuguard.nvml.real.deadline import Pass
from gpuguard.nvml.real.watchdog import Watchdog
from gpuguard.nvml.real.xidevents import Attribute, drain, xid_of

log = structlog.get_logger(__name__)

# A wait blocks for the heartbeat (30 s: 120 wake-ups an hour idle) where WAKE_SIGNAL can end it, else (no
# handler of ours) at most SHORT_WAIT_MS, so that stop_thread() still ends it within STOP_TIMEOUT_S.
HEARTBEAT_S = 30.0
SHORT_WAIT_MS = 1000
STOP_TIMEOUT_S = SHORT_WAIT_MS / 1000 + 1
# A wait that blocked at least this long before it failed counts as a good one (the backoff starts over).
GOOD_WAIT_S = 1.0


class EventPath:
    """The event set and its waiting thread. The backend calls ensure() / rebuild_if_asked() / take_xids()
    from its poll and close() at the end; the thread only records Xids and calls the wake-up."""

    def __init__(
        self,
        *,
        devices: Callable[[], list[Device]],
        attribute: Attribute,
        clock: Callable[[], float] = time.monotonic,
        hung: Callable[[], set[int]] = set,
        heartbeat: float = HEARTBEAT_S,
    ) -> None:
        self._devices = devices
        self._attribute = attribute
        # Handles of GPUs with an NVML call past its deadline: nothing here calls into them.
        self._hung = hung
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: list[XidEvent] = []
        self.wakeup: Wakeup = lambda: None
        self._event_set: Any = None
        self._thread: threading.Thread | None = None
        self._thread_stop = threading.Event()
        self._thread_orphaned = threading.Event()  # set: the thread frees its own set when it ends
        self._rebuild = threading.Event()
        self._rebuild_reason = ""
        self._wait_ok = threading.Event()
        self._set_failures = 0
        self._set_retry_at = 0.0
        self._set_note = "no event set yet"
        self._can_signal = False
        self._heartbeat = heartbeat
        self._wait_ms = min(SHORT_WAIT_MS, int(heartbeat * 1000))
        self._stuck_s = 2 * self._wait_ms / 1000
        # The heartbeat: when the event thread last began or ended a wait. A wait older than two wait bounds
        # is stuck (`_stuck` says so); the watchdog looks at it, and at the retries, off the agent's interval.
        self._beat = clock()
        self._stuck = ""
        self._abandoned: threading.Thread | None = None
        self._quiet_until = 0.0
        self.watchdog = Watchdog(due=self._due, check=self.check, clock=clock)

    def prepare(self) -> None:
        """Called from the thread that opens the backend: long waits if WAKE_SIGNAL can end them."""
        self._can_signal = install_wake_signal()
        self._wait_ms = int(self._heartbeat * 1000)
        if not self._can_signal:
            self._wait_ms = min(self._wait_ms, SHORT_WAIT_MS)
            log.debug("nvml.event_wait_bounded", timeout_ms=self._wait_ms, why="no wake signal handler")
        self._stuck_s = 2 * self._wait_ms / 1000
        self.watchdog.start()

    def _due(self) -> float:
        """When the watchdog must look next: the heartbeat's expiry, or the earliest retry."""
        now = self._clock()
        times = [now + 3600.0]
        if self._thread is not None:
            times.append(self._beat + self._stuck_s)
        times += self._retry_times()
        return max(min(times), self._quiet_until)

    def _retry_times(self) -> list[float]:
        if self._event_set is None:
            return [self._set_retry_at] if self._set_failures else []
        hung = self._hung()
        return [
            d.register_retry_at
            for d in self._devices()
            if d.register_failures and not d.registered and handle_key(d.handle) not in hung
        ]

    def check(self) -> None:
        """A dead or stuck event thread: unwatched, logged, rebuilt by the pass the wake-up starts; a retry
        that is due: the wake-up runs the pass that makes it."""
        now = self._clock()
        act = False
        thread = self._thread
        if thread is not None and not self._rebuild.is_set() and not self._thread_stop.is_set():
            if not thread.is_alive():
                log.warning("nvml.event_thread_died", action="rebuild", xid_watched=False)
                self._rebuild_reason = "event thread died"
                self._rebuild.set()
                act = True
            elif now - self._beat > self._stuck_s:
                if not self._stuck:
                    self._stuck = f"nvmlEventSetWait has not returned within {self._stuck_s:g} s"
                    waited = round(now - self._beat, 1)
                    log.warning("nvml.event_thread_stuck", waited_s=waited, xid_watched=False)
                    act = True
                if self._abandoned is None or not self._abandoned.is_alive():
                    # At most one thread given up at a time: two stuck threads are the bound.
                    self._rebuild_reason = "event thread stuck"
                    self._rebuild.set()
                    act = True
        # While stuck, look again a heartbeat later, not at once: the wake-ups are for changes only.
        self._quiet_until = now + (self._stuck_s if self._stuck else 0.5)
        if act or any(t <= now for t in self._retry_times()):
            self.wakeup()

    def stuck_calls(self) -> list[str]:
        """The event threads stuck in a wait (the current one, one given up earlier)."""
        out = [self._stuck] if self._stuck else []
        if self._abandoned is not None and self._abandoned.is_alive():
            out.append("nvmlEventSetWait (an event thread given up) has not returned")
        return out

    def all_watched(self) -> bool:  # watch_state is (True, "") for every registered GPU
        return self._event_set is not None and not self._rebuild.is_set() and not self._stuck

    def watch_state(self, d: Device) -> tuple[bool, str]:
        """Whether this GPU's Xids are watched now, and if not, why."""
        if d.registered and self.all_watched():
            return True, ""
        if self._stuck:
            return False, self._stuck
        return False, d.watch_note if self._event_set is not None else self._set_note

    def put_back(self, xids: tuple[XidEvent, ...]) -> None:  # taken by a pass given up: not lost
        with self._lock:
            self._pending[:0] = xids

    def take_xids(self, *, keep: bool = False) -> tuple[XidEvent, ...]:
        """The Xids delivered since the previous call, each once (`keep`: a look, left for the next call)."""
        with self._lock:
            xids = tuple(self._pending)
            if not keep:
                self._pending.clear()
        return xids

    def rebuild_if_asked(self) -> None:
        """After a failed wait: tear the path down now (the next ensure() builds it again)."""
        if self._rebuild.is_set():
            self._teardown(self._rebuild_reason)

    def ensure(self, p: Pass) -> None:
        """Create the event set (with backoff) and register every GPU that is not registered yet."""
        now = self._clock()
        if self._event_set is None:
            if now < self._set_retry_at:
                return
            try:
                p.at("nvmlEventSetCreate")
                self._event_set = pynvml.nvmlEventSetCreate()
            except pynvml.NVMLError as exc:
                self._back_off(now)
                self._set_note = f"event set: {error_name(exc)}"
                log.warning(
                    "nvml.event_set_failed",
                    error=error_name(exc),
                    retry_in=backoff(self._set_failures),
                    xid_watched=False,
                )
                return
            self._set_note = ""
            for d in self._devices():
                d.registered, d.register_failures, d.register_retry_at = 0, 0, 0.0
            self._start_thread()
        hung = self._hung()
        for d in self._devices():
            if d.registered or d.unsupported or d.lost_at_enumeration or d.handle is None:
                continue
            if now < d.register_retry_at or handle_key(d.handle) in hung:
                continue
            p.at("nvmlDeviceRegisterEvents", uuid=d.uuid, index=d.index)
            if not self._register(d, now):
                return  # the set was discarded (UNKNOWN): a fresh one on the next pass

    def _register(self, d: Device, now: float) -> bool:
        """Register one GPU for Xid events, and for uncorrected ECC and recovery-action events where the GPU
        has them (ECC off or unsupported: none; drivers before R565: no recovery action). False: the set
        had to be discarded."""
        try:
            supported = int(pynvml.nvmlDeviceGetSupportedEventTypes(d.handle))
            mask = supported & (EVENT_XID | EVENT_DOUBLE_BIT_ECC | EVENT_RECOVERY_ACTION)
            if not mask & EVENT_XID:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            pynvml.nvmlDeviceRegisterEvents(d.handle, mask, self._event_set)
        except pynvml.NVMLError as exc:
            if not_supported(exc):
                # Some GPUs, MIG and vGPU configurations: reported, not retried (the answer will not change).
                d.unsupported, d.watch_note = True, "xid events not supported"
                log.warning("nvml.xid_events_unsupported", gpu=d.index, uuid=d.uuid, xid_watched=False)
                return True
            if code(exc) == pynvml.NVML_ERROR_UNKNOWN:
                # nvml.h: the set is in an undefined state and should be freed.
                self._teardown(f"register: {error_name(exc)}")
                self._back_off(now)
                return False
            d.register_failures += 1
            d.register_retry_at = now + backoff(d.register_failures)
            self.watchdog.poke()
            d.watch_note = f"register: {error_name(exc)}"
            log.warning(
                "nvml.xid_register_failed",
                gpu=d.index,
                uuid=d.uuid,
                error=error_name(exc),
                retry_in=backoff(d.register_failures),
                xid_watched=False,
            )
            return True
        d.registered, d.register_failures, d.watch_note = handle_key(d.handle), 0, ""
        return True

    def _back_off(self, now: float) -> None:
        """One more failure of the set: the next try after the backoff (the watchdog wakes the agent then)."""
        self._set_failures += 1
        self._set_retry_at = now + backoff(self._set_failures)
        self.watchdog.poke()

    def _teardown(self, reason: str) -> None:
        """Stop the thread, free the set; every GPU is unwatched until the next pass registers it again."""
        devices = self._devices()
        log.warning("nvml.event_path_rebuilt", reason=reason, gpus=len(devices), xid_watched=False)
        if self._stuck:
            # Stuck in the driver: no signal ends it. Given up (it ends at its next return), never waited for.
            self._thread_stop.set()
            self._abandoned, self._thread, self._stuck = self._thread, None, ""
            self.abandon_set()  # drained and freed by that thread when its call returns
        elif self.stop_thread():
            self.free_set()
        else:
            self.abandon_set()
        self._rebuild.clear()
        self._set_note = reason
        if not self._wait_ok.is_set():
            # Failing again before a single good wait: back off instead of spinning on a broken driver.
            self._back_off(self._clock())
        else:
            self._set_failures = 0
        for d in devices:
            d.registered, d.watch_note = 0, reason

    def _start_thread(self) -> None:
        self._thread_stop, self._thread_orphaned = threading.Event(), threading.Event()
        self._wait_ok.clear()
        self._beat = self._clock()
        self.watchdog.poke()  # a heartbeat to watch from now
        self._thread = threading.Thread(
            target=self._event_loop,
            args=(self._event_set, self._thread_stop, self._thread_orphaned),
            name="gpuguard-nvml-xid",
            daemon=True,
        )
        self._thread.start()

    def stop_thread(self) -> bool:
        """Stop the waiting thread: signal it until its wait returns (a signal that lands just before the wait
        begins is missed, so it is sent again every 50 ms). False if it did not stop within STOP_TIMEOUT_S."""
        self._thread_stop.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while thread.is_alive():
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("nvml.event_thread_stuck", waited_s=STOP_TIMEOUT_S, action="set left to the exit")
                return False
            if self._can_signal and thread.ident is not None:
                with contextlib.suppress(OSError):  # it ended meanwhile
                    signal.pthread_kill(thread.ident, WAKE_SIGNAL)
                thread.join(min(0.05, left))
            else:
                thread.join(left)
        return True

    def abandon_set(self) -> None:
        """Forget a set a thread may still wait on (freeing it under a waiter is not defined by nvml.h): that
        thread drains and frees it when it ends."""
        self._thread_orphaned.set()
        self._event_set = None

    def free_set(self) -> None:
        if self._event_set is not None:
            try:
                pynvml.nvmlEventSetFree(self._event_set)
            except pynvml.NVMLError as exc:
                log.debug("nvml.event_set_free_failed", error=error_name(exc))
            self._event_set = None

    def _event_loop(self, event_set: Any, stop: threading.Event, orphaned: threading.Event) -> None:
        self._wait_on(event_set, stop)
        if stop.is_set() and drain(event_set, self._on_xid):
            self.wakeup()  # events delivered to this set only (before the next set was registered): judge now
        if orphaned.is_set():
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlEventSetFree(event_set)  # given up: nobody else frees it

    def _wait_on(self, event_set: Any, stop: threading.Event) -> None:
        while not stop.is_set():
            began = time.monotonic()
            self._beat = self._clock()
            try:
                data = pynvml.nvmlEventSetWait_v2(event_set, self._wait_ms)
            except pynvml.NVMLError as exc:
                if stop.is_set():
                    return
                self._alive_again()
                if code(exc) == pynvml.NVML_ERROR_TIMEOUT:  # the timeout, or WAKE_SIGNAL (stop is set then)
                    self._wait_ok.set()
                    continue
                if stop.is_set():
                    return
                if time.monotonic() - began >= GOOD_WAIT_S:
                    self._wait_ok.set()
                # GPU_IS_LOST, UNKNOWN, ...: NVIDIA's device plugin gives up on the set here. We rebuild it
                # and read every GPU now (the wake-up runs a check at once).
                log.warning("nvml.event_wait_failed", error=error_name(exc), action="rebuild, check now")
                self._rebuild_reason = f"wait: {error_name(exc)}"
                self._rebuild.set()
                self.wakeup()
                return
            if stop.is_set():  # given up meanwhile: this event is in this set only (no heartbeat of ours now)
                if int(data.eventType) & EVENT_XID:
                    self._on_xid(data)
                self.wakeup()
                return
            self._alive_again()
            self._wait_ok.set()
            if int(data.eventType) & EVENT_XID:
                self._on_xid(data)
            self.wakeup()  # an Xid, an uncorrected ECC error or a recovery-action change: judge now

    def _alive_again(self) -> None:
        """The heartbeat; a thread that was called stuck and came back is watching again (say so now)."""
        self._beat = self._clock()
        if self._stuck:
            self._stuck = ""
            log.info("nvml.event_thread_returned", xid_watched=True)
            self.wakeup()

    def _on_xid(self, data: Any) -> None:
        x = xid_of(data, hung=self._hung(), attribute=self._attribute)
        with self._lock:
            self._pending.append(x)
