"""The event path: one NVML event set, every GPU registered for Xid, uncorrected (double-bit) ECC and
recovery-action events, one thread waiting on it that records Xids and wakes the agent at once on any event
(the check that follows reads the ECC counter and the recovery action the event announced).

An event set that cannot be created, or a registration that fails, is retried with backoff (after UNKNOWN the
set is freed and a fresh one made, as nvml.h asks); a wait that fails with anything but TIMEOUT rebuilds the
event path and re-reads every GPU at once.

An idle node must cost next to nothing, so the wait blocks for minutes, not a second. It still ends at once
when the path is stopped: nvml.h documents that nvmlEventSetWait_v2 returns TIMEOUT when "interrupt arrived",
so stop_thread() sends WAKE_SIGNAL to the waiting thread (signal.pthread_kill; a no-op handler is installed
for it, which only the main thread can do). nvml.h does not say that nvmlEventSetFree or nvmlShutdown wakes a
waiter, so neither is relied on, and neither is called while a thread may still wait on the set.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pynvml
import structlog

from gpuguard.model import XidEvent
from gpuguard.nvml.base import Wakeup
from gpuguard.nvml.real.common import (
    EVENT_DOUBLE_BIT_ECC,
    EVENT_RECOVERY_ACTION,
    EVENT_XID,
    NO_INSTANCE,
    Device,
    backoff,
    code,
    error_name,
    handle_key,
    not_supported,
    text,
)

log = structlog.get_logger("gpuguard.nvml")

# How long one wait blocks: long when WAKE_SIGNAL can end it (6 wake-ups an hour on an idle node instead of
# 3,600 at 1 s); without the signal (the backend opened off the main thread, or the signal has someone else's
# handler) bounded, so that stop_thread() is still prompt: it waits up to STOP_TIMEOUT_S for the thread.
LONG_WAIT_MS = 600_000
SHORT_WAIT_MS = 1000
STOP_TIMEOUT_S = SHORT_WAIT_MS / 1000 + 1
WAKE_SIGNAL = signal.SIGUSR2
# A wait that blocked at least this long before it failed counts as a good one (the rebuild's backoff
# starts over), as a TIMEOUT did when every wait lasted a second.
GOOD_WAIT_S = 1.0


def _on_wake_signal(signum: int, frame: object) -> None:
    """Nothing: the signal's only job is to interrupt the event thread's wait."""


def install_wake_signal() -> bool:
    """A no-op handler for WAKE_SIGNAL, so that pthread_kill interrupts a wait instead of killing the process
    (the default) or being dropped (SIG_IGN). False where that is not possible: off the main thread, or the
    signal already has another handler (which we leave alone)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(WAKE_SIGNAL)
    if current is _on_wake_signal:
        return True
    if current is not signal.SIG_DFL:
        return False
    signal.signal(WAKE_SIGNAL, _on_wake_signal)
    return True


Attribute = Callable[[str | None, Any], Device | None]
"""The GPU an event names, by its UUID (None: not readable) or else its handle; None when not known."""


class EventPath:
    """The event set and its waiting thread. The backend calls ensure() / rebuild_if_asked() / take_xids()
    from its poll and close() at the end; the thread only records Xids and calls the wake-up."""

    def __init__(
        self,
        *,
        devices: Callable[[], list[Device]],
        attribute: Attribute,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._devices = devices
        self._attribute = attribute
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: list[XidEvent] = []
        self.wakeup: Wakeup = lambda: None
        self._event_set: Any = None
        self._thread: threading.Thread | None = None
        self._thread_stop = threading.Event()
        self._rebuild = threading.Event()
        self._rebuild_reason = ""
        self._wait_ok = threading.Event()
        self._set_failures = 0
        self._set_retry_at = 0.0
        self._set_note = "no event set yet"
        self._can_signal = False
        self._wait_ms = SHORT_WAIT_MS

    def prepare(self) -> None:
        """Called from the thread that opens the backend: long waits if WAKE_SIGNAL can end them."""
        self._can_signal = install_wake_signal()
        self._wait_ms = LONG_WAIT_MS if self._can_signal else SHORT_WAIT_MS
        if not self._can_signal:
            log.debug("nvml.event_wait_bounded", timeout_ms=self._wait_ms, why="no wake signal handler")

    def watch_state(self, d: Device) -> tuple[bool, str]:
        """Whether this GPU's Xids are watched now, and if not, why."""
        watched = bool(d.registered) and self._event_set is not None and not self._rebuild.is_set()
        if watched:
            return True, ""
        return False, d.watch_note if self._event_set is not None else self._set_note

    def take_xids(self) -> tuple[XidEvent, ...]:
        """The Xids delivered since the previous call, each once."""
        with self._lock:
            xids = tuple(self._pending)
            self._pending.clear()
        return xids

    def rebuild_if_asked(self) -> None:
        """After a failed wait: tear the path down now (the next ensure() builds it again)."""
        if self._rebuild.is_set():
            self._teardown(self._rebuild_reason)

    def ensure(self) -> None:
        """Create the event set (with backoff) and register every GPU that is not registered yet."""
        now = self._clock()
        if self._event_set is None:
            if now < self._set_retry_at:
                return
            try:
                self._event_set = pynvml.nvmlEventSetCreate()
            except pynvml.NVMLError as exc:
                self._set_failures += 1
                self._set_retry_at = now + backoff(self._set_failures)
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
        for d in self._devices():
            if d.registered or d.unsupported or d.lost_at_enumeration or d.handle is None:
                continue
            if now < d.register_retry_at:
                continue
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
                self._set_failures += 1
                self._set_retry_at = now + backoff(self._set_failures)
                return False
            d.register_failures += 1
            d.register_retry_at = now + backoff(d.register_failures)
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

    def _teardown(self, reason: str) -> None:
        """Stop the thread, free the set; every GPU is unwatched until the next pass registers it again."""
        devices = self._devices()
        log.warning("nvml.event_path_rebuilt", reason=reason, gpus=len(devices), xid_watched=False)
        if self.stop_thread():
            self.free_set()
        else:
            self.abandon_set()
        self._rebuild.clear()
        self._set_note = reason
        if not self._wait_ok.is_set():
            # Failing again before a single good wait: back off instead of spinning on a broken driver.
            self._set_failures += 1
            self._set_retry_at = self._clock() + backoff(self._set_failures)
        else:
            self._set_failures = 0
        for d in devices:
            d.registered, d.watch_note = 0, reason

    def _start_thread(self) -> None:
        self._thread_stop = threading.Event()
        self._wait_ok.clear()
        self._thread = threading.Thread(
            target=self._event_loop,
            args=(self._event_set, self._thread_stop),
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
        """Forget a set a thread may still wait on: freeing it under a waiter is not defined by nvml.h."""
        self._event_set = None

    def free_set(self) -> None:
        if self._event_set is not None:
            try:
                pynvml.nvmlEventSetFree(self._event_set)
            except pynvml.NVMLError as exc:
                log.debug("nvml.event_set_free_failed", error=error_name(exc))
            self._event_set = None

    def _event_loop(self, event_set: Any, stop: threading.Event) -> None:
        while not stop.is_set():
            began = time.monotonic()
            try:
                data = pynvml.nvmlEventSetWait_v2(event_set, self._wait_ms)
            except pynvml.NVMLError as exc:
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
            self._wait_ok.set()
            if int(data.eventType) & EVENT_XID:
                self._on_xid(data)
            self.wakeup()  # an Xid, an uncorrected ECC error or a recovery-action change: judge now

    def _on_xid(self, data: Any) -> None:
        """Attribute the Xid by the device's UUID (as NVIDIA's device plugin does), the handle as fallback."""
        uuid: str | None = None
        try:
            uuid = text(pynvml.nvmlDeviceGetUUID(data.device))
        except pynvml.NVMLError as exc:
            log.debug("nvml.xid_uuid_failed", error=error_name(exc))
        gi = getattr(data, "gpuInstanceId", NO_INSTANCE)
        ci = getattr(data, "computeInstanceId", NO_INSTANCE)
        d = self._attribute(uuid, data.device)
        x = XidEvent(
            gpu_index=d.index if d else None,
            uuid=d.uuid if d else uuid,
            code=int(data.eventData),
            gpu_instance=None if gi == NO_INSTANCE else int(gi),
            compute_instance=None if ci == NO_INSTANCE else int(ci),
        )
        with self._lock:
            self._pending.append(x)
        if d is None:
            log.warning("nvml.xid_unattributed", xid=x.code, uuid=uuid)
