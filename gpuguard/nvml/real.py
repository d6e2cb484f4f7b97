"""The production backend: NVML through NVIDIA's official bindings (`nvidia-ml-py`, module `pynvml`).

The only module that imports pynvml. Xids (and recovery-action changes) arrive as NVML events on a dedicated
thread, which wakes the agent at once; ECC, remapped rows, the recovery action and device presence are polled
by `snapshot()` at the agent's interval.

Every error nvml.h documents for a call made here has an answer (docs/reliability.md, "NVML errors"):
a GPU is known only by its UUID (one NVML cannot identify is reported as unidentified, never under a made-up
name); an init that fails half way is shut down and retried; an event set that cannot be created, or a
registration that fails, is retried with backoff (after UNKNOWN the set is freed and a fresh one made, as
nvml.h asks); a wait that fails with anything but TIMEOUT rebuilds the event path and re-reads every GPU at
once; each GPU's reading says whether its Xids are watched.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
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
# nvml.h constants that older nvidia-ml-py releases (12.535) do not define yet.
FI_GPU_RECOVERY_ACTION = int(getattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", 230))
EVENT_XID = int(pynvml.nvmlEventTypeXidCriticalError)
EVENT_RECOVERY_ACTION = int(getattr(pynvml, "nvmlEventTypeGpuRecoveryAction", 0x8000))
_NO_INSTANCE = 0xFFFFFFFF
# Retries of event-set creation and registration: 1 s, doubling, at most a minute apart.
RETRY_BASE = 1.0
RETRY_MAX = 60.0


def error_name(exc: BaseException) -> str:
    value = getattr(exc, "value", None)
    if isinstance(value, int):
        return _ERROR_NAMES.get(value, f"NVML error {value}")
    return type(exc).__name__


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _is_lost(exc: BaseException) -> bool:
    return bool(_code(exc) == pynvml.NVML_ERROR_GPU_IS_LOST)


def _not_supported(exc: BaseException) -> bool:
    return _code(exc) in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)


def _handle_key(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _backoff(failures: int) -> float:
    return float(min(RETRY_MAX, RETRY_BASE * 2 ** max(0, failures - 1)))


@dataclass
class _Device:
    index: int
    handle: Any
    uuid: str
    name: str = ""
    pci_bus_id: str = ""
    ecc_supported: bool = True
    remap_supported: bool = True
    recovery_supported: bool = True
    lost_at_enumeration: bool = False
    # Why the last enumeration could not describe it (UUID known from before): re-enumerate next pass.
    enumeration_error: str | None = None
    # Event registration: the handle it is registered with (0: none), why not, when to retry.
    registered: int = 0
    watch_note: str = "not registered yet"
    unsupported: bool = False
    register_failures: int = 0
    register_retry_at: float = 0.0


class NvmlBackend:
    """Backend on the real NVML library. Thread-safe: NVML is, and our own state is under a lock."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._initialized = False
        self._driver: str | None = None
        self._count = 0
        self._devices: list[_Device] = []
        self._unidentified: list[tuple[int, str]] = []
        self._by_uuid: dict[str, _Device] = {}
        self._by_handle: dict[int, _Device] = {}
        self._pending: list[XidEvent] = []
        self._wakeup: Wakeup = lambda: None
        # The event path: one set, one thread waiting on it.
        self._event_set: Any = None
        self._thread: threading.Thread | None = None
        self._thread_stop = threading.Event()
        self._rebuild = threading.Event()
        self._rebuild_reason = ""
        self._wait_ok = threading.Event()
        self._set_failures = 0
        self._set_retry_at = 0.0
        self._set_note = "no event set yet"

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
            count = int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as exc:
            # The driver itself stopped answering: report it like an init failure; the next pass asks again.
            log.warning("nvml.device_count_failed", error=error_name(exc))
            return Snapshot(init_error=error_name(exc), driver_version=self._driver)
        if self._rebuild.is_set():
            self._teardown_events(self._rebuild_reason)
        if (
            count != self._count
            or self._unidentified
            or any(d.enumeration_error and not d.lost_at_enumeration for d in self._devices)
        ):
            self._enumerate(count)
        self._ensure_events()
        gpus = tuple(self._read(d) for d in self._devices)
        with self._lock:
            xids = tuple(self._pending)
            self._pending.clear()
        return Snapshot(
            gpus=gpus, xids=xids, driver_version=self._driver, unidentified=tuple(self._unidentified)
        )

    def close(self) -> None:
        self._stop_thread()
        if not self._initialized:
            return
        self._initialized = False
        self._free_set()
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
            self._driver = _text(pynvml.nvmlSystemGetDriverVersion())
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
        self._ensure_events()
        log.info("nvml.initialized", driver=self._driver, gpus=count)
        return None

    def _enumerate(self, count: int) -> None:
        by_index = {d.index: d for d in self._devices}
        devices: list[_Device] = []
        unidentified: list[tuple[int, str]] = []
        for i in range(count):
            before = by_index.get(i)
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            except pynvml.NVMLError as exc:
                # The real driver answers GPU_IS_LOST here for a GPU that fell off the bus: a GPU we knew
                # stays (lost is a fault, not an absence); one we never identified is reported as such.
                if before is not None and _is_lost(exc):
                    devices.append(
                        replace(before, lost_at_enumeration=True, registered=0, watch_note="gpu lost")
                    )
                else:
                    log.warning("nvml.handle_failed", gpu=i, error=error_name(exc))
                    unidentified.append((i, f"handle:{error_name(exc)}"))
                continue
            try:
                uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            except pynvml.NVMLError as exc:
                if before is not None and _handle_key(before.handle) == _handle_key(handle):
                    # The same device as before (same handle): keep its identity, read it again next pass.
                    lost = _is_lost(exc)
                    devices.append(
                        replace(before, lost_at_enumeration=lost, enumeration_error=error_name(exc))
                    )
                else:
                    log.warning("nvml.uuid_failed", gpu=i, error=error_name(exc))
                    unidentified.append((i, f"uuid:{error_name(exc)}"))
                continue
            known = self._by_uuid.get(uuid)
            if known is not None and _handle_key(known.handle) == _handle_key(handle):
                devices.append(replace(known, index=i, lost_at_enumeration=False, enumeration_error=None))
            else:
                devices.append(self._describe(i, handle, uuid))
        for i, error in unidentified:
            if (i, error) not in self._unidentified:
                log.warning("nvml.gpu_unidentified", gpu=i, error=error, xid_watched=False)
        with self._lock:
            self._count = count
            self._devices = devices
            self._unidentified = unidentified
            self._by_uuid = {d.uuid: d for d in devices}
            self._by_handle = {_handle_key(d.handle): d for d in devices if d.handle is not None}

    def _describe(self, index: int, handle: Any, uuid: str) -> _Device:
        name = _optional(lambda: _text(pynvml.nvmlDeviceGetName(handle)), "")
        pci = _optional(lambda: _text(pynvml.nvmlDeviceGetPciInfo(handle).busId), "")
        ecc_supported = True
        try:
            current, _pending = pynvml.nvmlDeviceGetEccMode(handle)
            ecc_supported = bool(current)  # ECC disabled: counters are not applicable
        except pynvml.NVMLError as exc:
            if _not_supported(exc):
                ecc_supported = False
        return _Device(index, handle, uuid, name, pci, ecc_supported)

    # -- the event path -----------------------------------------------------------------------------------

    def _ensure_events(self) -> None:
        """Create the event set (with backoff) and register every GPU that is not registered yet."""
        now = self._clock()
        if self._event_set is None:
            if now < self._set_retry_at:
                return
            try:
                self._event_set = pynvml.nvmlEventSetCreate()
            except pynvml.NVMLError as exc:
                self._set_failures += 1
                self._set_retry_at = now + _backoff(self._set_failures)
                self._set_note = f"event set: {error_name(exc)}"
                log.warning(
                    "nvml.event_set_failed",
                    error=error_name(exc),
                    retry_in=_backoff(self._set_failures),
                    xid_watched=False,
                )
                return
            self._set_note = ""
            for d in self._devices:
                d.registered, d.register_failures, d.register_retry_at = 0, 0, 0.0
            self._start_thread()
        for d in self._devices:
            if d.registered or d.unsupported or d.lost_at_enumeration or d.handle is None:
                continue
            if now < d.register_retry_at:
                continue
            if not self._register(d, now):
                return  # the set was discarded (UNKNOWN): a fresh one on the next pass

    def _register(self, d: _Device, now: float) -> bool:
        """Register one GPU for Xid (and recovery-action) events. False: the set had to be discarded."""
        try:
            supported = int(pynvml.nvmlDeviceGetSupportedEventTypes(d.handle))
            mask = supported & (EVENT_XID | EVENT_RECOVERY_ACTION)
            if not mask & EVENT_XID:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            pynvml.nvmlDeviceRegisterEvents(d.handle, mask, self._event_set)
        except pynvml.NVMLError as exc:
            if _not_supported(exc):
                # Some GPUs, MIG and vGPU configurations: reported, not retried (the answer will not change).
                d.unsupported, d.watch_note = True, "xid events not supported"
                log.warning("nvml.xid_events_unsupported", gpu=d.index, uuid=d.uuid, xid_watched=False)
                return True
            if _code(exc) == pynvml.NVML_ERROR_UNKNOWN:
                # nvml.h: the set is in an undefined state and should be freed.
                self._teardown_events(f"register: {error_name(exc)}")
                self._set_failures += 1
                self._set_retry_at = now + _backoff(self._set_failures)
                return False
            d.register_failures += 1
            d.register_retry_at = now + _backoff(d.register_failures)
            d.watch_note = f"register: {error_name(exc)}"
            log.warning(
                "nvml.xid_register_failed",
                gpu=d.index,
                uuid=d.uuid,
                error=error_name(exc),
                retry_in=_backoff(d.register_failures),
                xid_watched=False,
            )
            return True
        d.registered, d.register_failures, d.watch_note = _handle_key(d.handle), 0, ""
        return True

    def _teardown_events(self, reason: str) -> None:
        """Stop the thread, free the set; every GPU is unwatched until the next pass registers it again."""
        log.warning("nvml.event_path_rebuilt", reason=reason, gpus=len(self._devices), xid_watched=False)
        self._stop_thread()
        self._free_set()
        self._rebuild.clear()
        self._set_note = reason
        if not self._wait_ok.is_set():
            # Failing again before a single good wait: back off instead of spinning on a broken driver.
            self._set_failures += 1
            self._set_retry_at = self._clock() + _backoff(self._set_failures)
        else:
            self._set_failures = 0
        for d in self._devices:
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

    def _stop_thread(self) -> None:
        self._thread_stop.set()
        if self._thread is not None:
            self._thread.join(timeout=EVENT_WAIT_MS / 1000 + 1)
            self._thread = None

    def _free_set(self) -> None:
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
                if _code(exc) == pynvml.NVML_ERROR_TIMEOUT:
                    self._wait_ok.set()
                    continue
                if stop.is_set():
                    return
                # GPU_IS_LOST, UNKNOWN, ...: NVIDIA's device plugin gives up on the set here. We rebuild it
                # and read every GPU now (the wake-up runs a check at once).
                log.warning("nvml.event_wait_failed", error=error_name(exc), action="rebuild, check now")
                self._rebuild_reason = f"wait: {error_name(exc)}"
                self._rebuild.set()
                self._wakeup()
                return
            self._wait_ok.set()
            if int(data.eventType) & EVENT_XID:
                self._on_xid(data)
            self._wakeup()  # an Xid or a recovery-action change: judge now

    def _on_xid(self, data: Any) -> None:
        """Attribute the Xid by the device's UUID (as NVIDIA's device plugin does), the handle as fallback."""
        uuid: str | None = None
        try:
            uuid = _text(pynvml.nvmlDeviceGetUUID(data.device))
        except pynvml.NVMLError as exc:
            log.debug("nvml.xid_uuid_failed", error=error_name(exc))
        gi = getattr(data, "gpuInstanceId", _NO_INSTANCE)
        ci = getattr(data, "computeInstanceId", _NO_INSTANCE)
        with self._lock:
            d = self._by_uuid.get(uuid) if uuid else self._by_handle.get(_handle_key(data.device))
            x = XidEvent(
                gpu_index=d.index if d else None,
                uuid=d.uuid if d else uuid,
                code=int(data.eventData),
                gpu_instance=None if gi == _NO_INSTANCE else int(gi),
                compute_instance=None if ci == _NO_INSTANCE else int(ci),
            )
            self._pending.append(x)
        if d is None:
            log.warning("nvml.xid_unattributed", xid=x.code, uuid=uuid)

    # -- readings -----------------------------------------------------------------------------------------

    def _read(self, d: _Device) -> GpuReading:
        watched = bool(d.registered) and self._event_set is not None and not self._rebuild.is_set()
        base = GpuReading(
            index=d.index,
            uuid=d.uuid,
            name=d.name,
            pci_bus_id=d.pci_bus_id,
            ecc_supported=d.ecc_supported,
            ecc_uncorrected=None,
            xid_watched=watched,
            xid_watch_note=""
            if watched
            else (d.watch_note if self._event_set is not None else self._set_note),
        )
        if d.lost_at_enumeration:
            return _lost(base)
        if d.enumeration_error:
            return replace(base, transient_errors=(f"uuid:{d.enumeration_error}",), unreadable=True)
        ecc: int | None = None
        remap_failure: bool | None = None
        remap_pending: bool | None = None
        action: int | None = None
        errors: list[str] = []
        answered = 0
        try:
            if d.ecc_supported:
                ecc = int(
                    pynvml.nvmlDeviceGetTotalEccErrors(
                        d.handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                    )
                )
                answered += 1
        except pynvml.NVMLError as exc:
            if _is_lost(exc):
                return _lost(base)
            errors.append(f"ecc:{error_name(exc)}")
        try:
            if d.remap_supported:
                _corr, _unc, pending, failure = pynvml.nvmlDeviceGetRemappedRows(d.handle)
                remap_failure, remap_pending = bool(failure), bool(pending)
                answered += 1
        except pynvml.NVMLError as exc:
            if _is_lost(exc):
                return _lost(base)
            if _not_supported(exc):
                d.remap_supported = False  # pre-Ampere, some vGPU and MIG set-ups: not applicable
            else:
                errors.append(f"remap:{error_name(exc)}")
        if d.recovery_supported:
            try:
                action, error = _recovery_action(d.handle)
                if error == "NOT_SUPPORTED":
                    d.recovery_supported = False
                elif error:
                    errors.append(f"recovery:{error}")
                else:
                    answered += 1
            except pynvml.NVMLError as exc:
                if _is_lost(exc):
                    return _lost(base)
                if _not_supported(exc):
                    d.recovery_supported = False
                else:
                    errors.append(f"recovery:{error_name(exc)}")
        if not answered and not errors:
            # Nothing else is polled on this GPU: probe it so a lost or broken GPU still shows.
            try:
                pynvml.nvmlDeviceGetUUID(d.handle)
                answered += 1
            except pynvml.NVMLError as exc:
                if _is_lost(exc):
                    return _lost(base)
                errors.append(f"probe:{error_name(exc)}")
        return replace(
            base,
            ecc_uncorrected=ecc,
            remap_failure=remap_failure,
            remap_pending=remap_pending,
            recovery_action=action,
            transient_errors=tuple(errors),
            unreadable=not answered and bool(errors),
        )


def _recovery_action(handle: Any) -> tuple[int | None, str]:
    """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: (value, "") or (None, the field's own NVML error name)."""
    fv = pynvml.nvmlDeviceGetFieldValues(handle, [FI_GPU_RECOVERY_ACTION])[0]
    if fv.nvmlReturn != pynvml.NVML_SUCCESS:
        name = _ERROR_NAMES.get(int(fv.nvmlReturn), f"NVML error {fv.nvmlReturn}")
        return None, name
    value_type = int(fv.valueType)
    v = fv.value
    # nvmlValueType_t: 0 double, 1 uint, 2 ulong, 3 ulonglong, 4 slonglong, 5 sint, 6 ushort
    raw = {0: v.dVal, 1: v.uiVal, 2: v.ulVal, 3: v.ullVal, 4: v.sllVal, 5: v.siVal}.get(value_type, v.uiVal)
    return int(raw), ""


def _lost(base: GpuReading) -> GpuReading:
    """A lost GPU answers nothing: only its identity and the fact that it is lost."""
    return replace(base, ecc_uncorrected=None, remap_failure=None, remap_pending=None, lost=True)


def _optional(fn: Any, default: str) -> str:
    try:
        return str(fn())
    except pynvml.NVMLError:
        return default
