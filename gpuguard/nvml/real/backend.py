"""NvmlBackend: NVML's init and inventory, and the poll (`snapshot()`) that reads every GPU and hands over
the Xids the event path (gpuguard.nvml.real.events) recorded since the last one.

A GPU is known only by its UUID (one NVML cannot identify is reported as unidentified, never under a made-up
name); an init that fails half way is shut down and retried; each GPU's reading says whether its Xids are
watched.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pynvml
import structlog

from gpuguard.model import Snapshot
from gpuguard.nvml.base import Wakeup
from gpuguard.nvml.real.common import Device, error_name, handle_key, is_lost, text
from gpuguard.nvml.real.events import EventPath
from gpuguard.nvml.real.readings import describe, read

log = structlog.get_logger("gpuguard.nvml")


class NvmlBackend:
    """Backend on the real NVML library. Thread-safe: NVML is, and our own state is under a lock."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._initialized = False
        self._driver: str | None = None
        self._count = 0
        self._devices: list[Device] = []
        self._unidentified: list[tuple[int, str]] = []
        self._by_uuid: dict[str, Device] = {}
        self._by_handle: dict[int, Device] = {}
        # The previous pass's snapshot, returned again while nothing it holds changed.
        self._last: Snapshot | None = None
        self._events = EventPath(devices=lambda: self._devices, attribute=self._attribute, clock=clock)

    # -- Backend protocol ---------------------------------------------------------------------------------

    def open(self, wakeup: Wakeup) -> None:
        self._events.wakeup = wakeup
        self._events.prepare()
        self._try_init()

    def snapshot(self) -> Snapshot:
        if not self._initialized:
            err = self._try_init()
            if err is not None:
                return Snapshot(init_error=err)
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as exc:
            # The driver itself stopped answering: report it like an init failure; the next pass asks again.
            log.warning("nvml.device_count_failed", error=error_name(exc))
            return Snapshot(init_error=error_name(exc), driver_version=self._driver)
        self._events.rebuild_if_asked()
        if (
            count != self._count
            or self._unidentified
            or any(d.enumeration_error and not d.lost_at_enumeration for d in self._devices)
        ):
            self._enumerate(count)
        self._events.ensure()
        gpus = tuple(read(d, *self._events.watch_state(d)) for d in self._devices)
        xids = self._events.take_xids()
        unidentified = tuple(self._unidentified)
        last = self._last
        if (
            last is not None
            and not xids
            and not last.xids
            and last.driver_version == self._driver
            and last.unidentified == unidentified
            and len(last.gpus) == len(gpus)
            and all(a is b for a, b in zip(last.gpus, gpus, strict=True))
        ):
            # Every GPU read the same as at the previous pass (the same reading objects) and no Xid came:
            # the same snapshot, so the agent's remembered evaluation applies without comparing fields.
            return last
        self._last = Snapshot(gpus=gpus, xids=xids, driver_version=self._driver, unidentified=unidentified)
        return self._last

    def close(self) -> None:
        stopped = self._events.stop_thread()
        if not self._initialized:
            return
        self._initialized = False
        if not stopped:
            # A thread may still wait on the set: nvml.h defines neither a free nor a shutdown under it, so
            # both are left to the process's exit.
            self._events.abandon_set()
            return
        self._events.free_set()
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("nvml.shutdown_failed", error=error_name(exc))

    # -- init and inventory -------------------------------------------------------------------------------

    def _try_init(self) -> str | None:
        """Initialise NVML; return the NVML error name on failure (a reading, not an exception).

        An init that succeeds but whose next calls fail is undone (nvmlShutdown) and reported the same way,
        so the next pass starts over instead of running without an event set.
        """
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            return error_name(exc)
        try:
            self._driver = text(pynvml.nvmlSystemGetDriverVersion())
            count = int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as exc:
            log.warning("nvml.init_incomplete", error=error_name(exc), retry="next check")
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as shut:
                log.debug("nvml.shutdown_failed", error=error_name(shut))
            return error_name(exc)
        self._initialized = True
        self._enumerate(count)
        self._events.ensure()
        log.info("nvml.initialized", driver=self._driver, gpus=count)
        return None

    def _attribute(self, uuid: str | None, handle: Any) -> Device | None:
        with self._lock:
            return self._by_uuid.get(uuid) if uuid else self._by_handle.get(handle_key(handle))

    def _enumerate(self, count: int) -> None:
        by_index = {d.index: d for d in self._devices}
        devices: list[Device] = []
        unidentified: list[tuple[int, str]] = []
        for i in range(count):
            before = by_index.get(i)
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            except pynvml.NVMLError as exc:
                # The real driver answers GPU_IS_LOST here for a GPU that fell off the bus: a GPU we knew
                # stays (lost is a fault, not an absence); one we never identified is reported as such.
                if before is not None and is_lost(exc):
                    devices.append(
                        replace(before, lost_at_enumeration=True, registered=0, watch_note="gpu lost")
                    )
                else:
                    log.warning("nvml.handle_failed", gpu=i, error=error_name(exc))
                    unidentified.append((i, f"handle:{error_name(exc)}"))
                continue
            try:
                uuid = text(pynvml.nvmlDeviceGetUUID(handle))
            except pynvml.NVMLError as exc:
                if before is not None and handle_key(before.handle) == handle_key(handle):
                    # The same device as before (same handle): keep its identity, read it again next pass.
                    lost = is_lost(exc)
                    devices.append(
                        replace(before, lost_at_enumeration=lost, enumeration_error=error_name(exc))
                    )
                else:
                    log.warning("nvml.uuid_failed", gpu=i, error=error_name(exc))
                    unidentified.append((i, f"uuid:{error_name(exc)}"))
                continue
            known = self._by_uuid.get(uuid)
            if known is not None and handle_key(known.handle) == handle_key(handle):
                devices.append(replace(known, index=i, lost_at_enumeration=False, enumeration_error=None))
            else:
                devices.append(describe(i, handle, uuid))
        for i, error in unidentified:
            if (i, error) not in self._unidentified:
                log.warning("nvml.gpu_unidentified", gpu=i, error=error, xid_watched=False)
        with self._lock:
            self._count = count
            self._devices = devices
            self._unidentified = unidentified
            self._by_uuid = {d.uuid: d for d in devices}
            self._by_handle = {handle_key(d.handle): d for d in devices if d.handle is not None}
