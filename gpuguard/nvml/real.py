"""The production backend: NVML through NVIDIA's official bindings (`nvidia-ml-py`, module `pynvml`).

The only module that imports pynvml. Xids arrive as NVML events on a dedicated thread, which wakes the agent
at once; ECC, remapped rows and device presence are polled by `snapshot()` at the agent's interval.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, replace
from typing import Any

import pynvml
import structlog

from gpuguard.model import GpuReading, Snapshot, XidEvent
from gpuguard.nvml.base import Wakeup

log = structlog.get_logger("gpuguard.nvml")

# NVML error code -> name without the NVML_ERROR_ prefix, e.g. 15 -> "GPU_IS_LOST".
_ERROR_NAMES: dict[int, str] = {
    getattr(pynvml, n): n.removeprefix("NVML_ERROR_")
    for n in dir(pynvml)
    if n.startswith("NVML_ERROR_") and isinstance(getattr(pynvml, n), int)
}
# Bounded so that close() is prompt (the event thread checks its stop flag between waits).
EVENT_WAIT_MS = 1000


def error_name(exc: BaseException) -> str:
    value = getattr(exc, "value", None)
    if isinstance(value, int):
        return _ERROR_NAMES.get(value, f"NVML error {value}")
    return type(exc).__name__


def _is_lost(exc: BaseException) -> bool:
    return bool(_code(exc) == pynvml.NVML_ERROR_GPU_IS_LOST)


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _handle_key(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


@dataclass
class _Device:
    index: int
    handle: Any
    uuid: str
    name: str
    pci_bus_id: str
    ecc_supported: bool
    remap_supported: bool
    lost_at_enumeration: bool = False
    # Set when the device could not be described (handle or UUID query failed): re-enumerate next pass.
    enumeration_error: str | None = None


class NvmlBackend:
    """Backend on the real NVML library. Thread-safe: NVML is, and our own state is under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._initialized = False
        self._driver: str | None = None
        self._devices: list[_Device] = []
        self._by_handle: dict[int, _Device] = {}
        self._event_set: Any = None
        self._pending: list[XidEvent] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wakeup: Wakeup = lambda: None

    # -- Backend protocol ---------------------------------------------------------------------------------

    def open(self, wakeup: Wakeup) -> None:
        self._wakeup = wakeup
        self._try_init()

    def snapshot(self) -> Snapshot:
        if not self._initialized:
            err = self._try_init()
            if err is not None:
                return Snapshot(init_error=err)
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            # The driver itself stopped answering: report it like an init failure, then re-init.
            log.warning("nvml.device_count_failed", error=error_name(exc))
            return Snapshot(init_error=error_name(exc), driver_version=self._driver)
        if count != len(self._devices) or any(
            d.enumeration_error and not d.lost_at_enumeration for d in self._devices
        ):
            self._enumerate(count)
        gpus = tuple(self._read(d) for d in self._devices)
        with self._lock:
            xids = tuple(self._pending)
            self._pending.clear()
        return Snapshot(gpus=gpus, xids=xids, driver_version=self._driver)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=EVENT_WAIT_MS / 1000 + 1)
            self._thread = None
        if not self._initialized:
            return
        self._initialized = False
        if self._event_set is not None:
            try:
                pynvml.nvmlEventSetFree(self._event_set)
            except pynvml.NVMLError as exc:
                log.debug("nvml.event_set_free_failed", error=error_name(exc))
            self._event_set = None
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("nvml.shutdown_failed", error=error_name(exc))

    # -- internals ----------------------------------------------------------------------------------------

    def _try_init(self) -> str | None:
        """Initialise NVML; return the NVML error name on failure (a reading, not an exception)."""
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            return error_name(exc)
        self._initialized = True
        try:
            self._driver = _text(pynvml.nvmlSystemGetDriverVersion())
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            return error_name(exc)
        try:
            self._event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.warning("nvml.events_unavailable", error=error_name(exc))
            self._event_set = None
        self._enumerate(count)
        log.info("nvml.initialized", driver=self._driver, gpus=count)
        if self._event_set is not None and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._event_loop, name="gpuguard-nvml-xid", daemon=True)
            self._thread.start()
        return None

    def _enumerate(self, count: int) -> None:
        known = {d.index: d for d in self._devices}
        registered = set(self._by_handle)
        devices: list[_Device] = []
        for i in range(count):
            before = known.get(i)
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            except pynvml.NVMLError as exc:
                # The real driver answers GPU_IS_LOST here for a GPU that fell off the bus: keep the
                # device (a lost GPU is a fault, not an absence) under the identity we last knew.
                log.warning("nvml.handle_failed", gpu=i, error=error_name(exc))
                devices.append(_unreachable(i, before, lost=_is_lost(exc), error=error_name(exc)))
                continue
            key = _handle_key(handle)
            devices.append(self._describe(i, handle, before, register=key not in registered))
        with self._lock:
            self._devices = devices
            self._by_handle = {_handle_key(d.handle): d for d in devices if d.handle is not None}

    def _describe(self, index: int, handle: Any, before: _Device | None, *, register: bool) -> _Device:
        try:
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
        except pynvml.NVMLError as exc:
            # A GPU lost before we ever read its UUID keeps the identity we had, or a placeholder.
            log.warning("nvml.uuid_failed", gpu=index, error=error_name(exc))
            return replace(
                _unreachable(index, before, lost=_is_lost(exc), error=error_name(exc)), handle=handle
            )
        name = _optional(lambda: _text(pynvml.nvmlDeviceGetName(handle)), "")
        pci = _optional(lambda: _text(pynvml.nvmlDeviceGetPciInfo(handle).busId), "")
        ecc_supported = True
        try:
            current, _pending = pynvml.nvmlDeviceGetEccMode(handle)
            ecc_supported = bool(current)  # ECC disabled: counters are not applicable
        except pynvml.NVMLError as exc:
            if _code(exc) == pynvml.NVML_ERROR_NOT_SUPPORTED:
                ecc_supported = False
        remap_supported = True
        try:
            pynvml.nvmlDeviceGetRemappedRows(handle)
        except pynvml.NVMLError as exc:
            if _code(exc) == pynvml.NVML_ERROR_NOT_SUPPORTED:
                remap_supported = False
        if register and self._event_set is not None:
            self._register_xid(index, uuid, handle)
        return _Device(index, handle, uuid, name, pci, ecc_supported, remap_supported)

    def _register_xid(self, index: int, uuid: str, handle: Any) -> None:
        try:
            supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle)
            if not supported & pynvml.nvmlEventTypeXidCriticalError:
                log.warning("nvml.xid_events_unsupported", gpu=index, uuid=uuid)
                return
            pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, self._event_set)
        except pynvml.NVMLError as exc:
            log.warning("nvml.xid_register_failed", gpu=index, uuid=uuid, error=error_name(exc))

    def _read(self, d: _Device) -> GpuReading:
        base = GpuReading(
            index=d.index,
            uuid=d.uuid,
            name=d.name,
            pci_bus_id=d.pci_bus_id,
            ecc_supported=d.ecc_supported,
            ecc_uncorrected=None,
        )
        if d.lost_at_enumeration:
            return _lost(base)
        if d.handle is None or d.enumeration_error:
            return replace(base, transient_errors=(f"enumerate:{d.enumeration_error}",))
        ecc: int | None = None
        remap_failure: bool | None = None
        remap_pending: bool | None = None
        errors: list[str] = []
        try:
            if d.ecc_supported:
                ecc = int(
                    pynvml.nvmlDeviceGetTotalEccErrors(
                        d.handle,
                        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                        pynvml.NVML_VOLATILE_ECC,
                    )
                )
        except pynvml.NVMLError as exc:
            if _is_lost(exc):
                return _lost(base)
            errors.append(f"ecc:{error_name(exc)}")
        try:
            if d.remap_supported:
                _corr, _unc, pending, failure = pynvml.nvmlDeviceGetRemappedRows(d.handle)
                remap_failure, remap_pending = bool(failure), bool(pending)
            elif not d.ecc_supported:
                # Nothing else is polled on this GPU: probe it so a lost GPU still shows.
                pynvml.nvmlDeviceGetUUID(d.handle)
        except pynvml.NVMLError as exc:
            if _is_lost(exc):
                return _lost(base)
            errors.append(f"remap:{error_name(exc)}")
        return replace(
            base,
            ecc_uncorrected=ecc,
            remap_failure=remap_failure,
            remap_pending=remap_pending,
            transient_errors=tuple(errors),
        )

    def _event_loop(self) -> None:
        event_set = self._event_set
        while not self._stop.is_set():
            try:
                data = pynvml.nvmlEventSetWait_v2(event_set, EVENT_WAIT_MS)
            except pynvml.NVMLError as exc:
                if _code(exc) == pynvml.NVML_ERROR_TIMEOUT:
                    continue
                # GPU_IS_LOST and friends: let the poll see it now, and do not spin on the error.
                log.warning("nvml.event_wait_failed", error=error_name(exc))
                self._wakeup()
                self._stop.wait(EVENT_WAIT_MS / 1000)
                continue
            if not data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                continue
            with self._lock:
                d = self._by_handle.get(_handle_key(data.device))
                index, uuid = (d.index, d.uuid) if d else (-1, "GPU-unknown")
                self._pending.append(XidEvent(gpu_index=index, uuid=uuid, code=int(data.eventData)))
            self._wakeup()


def _unreachable(index: int, before: _Device | None, *, lost: bool, error: str) -> _Device:
    """A device we cannot describe: it keeps the identity we last knew, or a placeholder."""
    return _Device(
        index=index,
        handle=None,
        uuid=before.uuid if before else f"GPU-unknown-{index}",
        name=before.name if before else "",
        pci_bus_id=before.pci_bus_id if before else "",
        ecc_supported=before.ecc_supported if before else True,
        remap_supported=False,
        lost_at_enumeration=lost,
        enumeration_error=error,
    )


def _lost(base: GpuReading) -> GpuReading:
    """A lost GPU answers nothing: only its identity and the fact that it is lost."""
    return replace(base, ecc_uncorrected=None, remap_failure=None, remap_pending=None, lost=True)


def _optional(fn: Any, default: str) -> str:
    try:
        return str(fn())
    except pynvml.NVMLError:
        return default
