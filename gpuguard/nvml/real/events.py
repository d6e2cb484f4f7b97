"""The event path: one NVML event set, every GPU registered for Xid, uncorrected (double-bit) ECC and
recovery-action events, one thread waiting on it that records Xids and wakes the agent at once on any event
(the check that follows reads the ECC counter and the recovery action the event announced).

An event set that cannot be created, or a registration that fails, is retried with backoff (after UNKNOWN the
set is freed and a fresh one made, as nvml.h asks); a wait that fails with anything but TIMEOUT rebuilds the
event path and re-reads every GPU at once.
"""

from __future__ import annotations

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

# Bounded so that close() is prompt (the event thread checks its stop flag between waits).
EVENT_WAIT_MS = 1000

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
        self.stop_thread()
        self.free_set()
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

    def stop_thread(self) -> None:
        self._thread_stop.set()
        if self._thread is not None:
            self._thread.join(timeout=EVENT_WAIT_MS / 1000 + 1)
            self._thread = None

    def free_set(self) -> None:
        if self._event_set is not None:
            try:
                pynvml.nvmlEventSetFree(self._event_set)
            except pynvml.NVMLError as exc:
                log.debug("nvml.event_set_free_failed", error=error_name(exc))
            self._event_set = None

    def _event_loop(self, event_set: Any, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                data = pynvml.nvmlEventSetWait_v2(event_set, EVENT_WAIT_MS)
            except pynvml.NVMLError as exc:
                if code(exc) == pynvml.NVML_ERROR_TIMEOUT:
                    self._wait_ok.set()
                    continue
                if stop.is_set():
                    return
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
