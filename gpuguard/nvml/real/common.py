"""What the NVML backend's modules share: NVML error names and codes, constants nvml.h defines, one GPU's
bookkeeping (`Device`) and the retry backoff."""

from __future__ import annotations

import ctypes
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

import pynvml

from gpuguard.core.model import GpuReading, SignalReadings

# NVML error code -> name without the NVML_ERROR_ prefix, e.g. 15 -> "GPU_IS_LOST".
ERROR_NAMES: dict[int, str] = {
    getattr(pynvml, n): n.removeprefix("NVML_ERROR_")
    for n in dir(pynvml)
    if n.startswith("NVML_ERROR_") and isinstance(getattr(pynvml, n), int)
}
# nvml.h constants that older nvidia-ml-py releases (12.535) do not define yet.
FI_GPU_RECOVERY_ACTION = int(getattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", 230))
EVENT_XID = int(pynvml.nvmlEventTypeXidCriticalError)
# nvml.h: "Event about double bit ECC errors", i.e. an uncorrected ECC error (eventData 0).
EVENT_DOUBLE_BIT_ECC = int(pynvml.nvmlEventTypeDoubleBitEccError)
EVENT_RECOVERY_ACTION = int(getattr(pynvml, "nvmlEventTypeGpuRecoveryAction", 0x8000))
NO_INSTANCE = 0xFFFFFFFF
# The driver announces a recovery action (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION says which).
XID_RECOVERY_ACTION = 154
# Sent to the event thread to end its wait (nvml.h: the wait returns TIMEOUT when "interrupt arrived").
WAKE_SIGNAL = signal.SIGUSR2
# Retries of event-set creation and registration: 1 s, doubling, at most a minute apart.
RETRY_BASE = 1.0
RETRY_MAX = 60.0


def error_name(exc: BaseException) -> str:
    value = getattr(exc, "value", None)
    if isinstance(value, int):
        return ERROR_NAMES.get(value, f"NVML error {value}")
    return type(exc).__name__


def code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def is_lost(exc: BaseException) -> bool:
    return bool(code(exc) == pynvml.NVML_ERROR_GPU_IS_LOST)


def not_supported(exc: BaseException) -> bool:
    return code(exc) in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)


def handle_key(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def backoff(failures: int) -> float:
    return float(min(RETRY_MAX, RETRY_BASE * 2 ** max(0, failures - 1)))


@dataclass
class SignalState:
    """One GPU's signal reads between passes (nvml.real.signalreads): the reads that answered NOT_SUPPORTED
    (never asked again), the values of the reads made less often than every pass and when each is due."""

    unsupported: set[str] = field(default_factory=set)
    # The signal fields still asked for after the first answer (): all of them, none answered yet).
    field_ids: tuple[int, ...] = ()
    nvlink_links: int | None = None
    nvlink_errors: int | None = None
    nvlink_active: frozenset[int] | None = None
    nvlink_at: float = 0.0
    fabric: tuple[int, str, int] | None = None
    fabric_at: float = 0.0
    pcie: tuple[int, int] | None = None
    pcie_max: tuple[int, int] | None = None
    pcie_at: float = 0.0
    inforom_valid: bool | None = None
    inforom_at: float = 0.0
    # The last pass's readings: handed on again while every value is the same (no allocation, and the
    # reading's comparison is by identity first).
    last: SignalReadings | None = None
    last_key: tuple[object, ...] = ()


@dataclass
class Device:
    index: int
    handle: Any
    uuid: str
    name: str = ""
    pci_bus_id: str = ""
    ecc_supported: bool = True
    remap_supported: bool = True
    recovery_supported: bool = True
    retired_supported: bool = True
    # While the recovery field answers NOT_SUPPORTED: when to ask again (on Xid 154 at once).
    recovery_probe_at: float = 0.0
    lost_at_enumeration: bool = False
    # Why the last enumeration could not describe it (UUID known from before): re-enumerate next pass.
    enumeration_error: str | None = None
    # Event registration: the handle it is registered with (0: none), why not, when to retry.
    registered: int = 0
    watch_note: str = "not registered yet"
    unsupported: bool = False
    register_failures: int = 0
    register_retry_at: float = 0.0
    # The health signals: what nvml.real.signalreads read less often than every pass, and when next.
    signal_state: SignalState = field(default_factory=SignalState)
    # The last pass's reading and what it was built from (readings.read reuses it while nothing differs).
    last_reading: tuple[tuple[Any, ...], GpuReading] | None = field(default=None, compare=False, repr=False)


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
