"""What the repair executor reads of one GPU through NVML: where it is (its index, by UUID), whether any
process uses it (the idle proof), and what a reset must leave (the proof: the same UUID at that index,
the recovery action NONE, no remap or page retirement pending). Each read is a whole nvmlInit..nvmlShutdown
of its own: after a reset the driver hands out new handles, and an executor that keeps none needs no
re-init logic. Errors are pynvml's, named (`NvmlReadError`), never judged here."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

import pynvml

from gpuguard.nvml.base import GpuAfterReset
from gpuguard.nvml.real.common import FI_GPU_RECOVERY_ACTION, error_name
from gpuguard.nvml.real.fields import read_fields

T = TypeVar("T")


class NvmlReadError(Exception):
    """An NVML call of the repair's reads failed; the message names the call and NVML's error."""


@contextmanager
def _session() -> Iterator[None]:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlReadError(f"nvmlInit: {error_name(exc)}") from exc
    try:
        yield
    finally:
        with suppress(pynvml.NVMLError):  # the reads answered; a failed shutdown changes none of them
            pynvml.nvmlShutdown()


def _call(what: str, fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        raise NvmlReadError(f"{what}: {error_name(exc)}") from exc


def _optional(fn: Callable[..., T], *args: Any) -> T | None:
    """A read that a GPU may not support: None for NOT_SUPPORTED, any other error raised."""
    try:
        return fn(*args)
    except pynvml.NVMLError_NotSupported:
        return None


class RepairReads:
    """The executor's NVML reads (gpuguard.quarantine.repair.executor.GpuReads)."""

    def index_of(self, uuid: str) -> int | None:
        """The GPU's index now, None where NVML lists no GPU of that UUID."""
        with _session():
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            except pynvml.NVMLError_NotFound:
                return None
            except pynvml.NVMLError as exc:
                raise NvmlReadError(f"nvmlDeviceGetHandleByUUID: {error_name(exc)}") from exc
            return int(_call("nvmlDeviceGetIndex", pynvml.nvmlDeviceGetIndex, handle))

    def processes(self, index: int) -> tuple[int, ...]:
        """The pids of the compute processes NVML lists on the GPU."""
        with _session():
            handle = _call("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, index)
            procs = _call(
                "nvmlDeviceGetComputeRunningProcesses", pynvml.nvmlDeviceGetComputeRunningProcesses, handle
            )
            return tuple(sorted(int(p.pid) for p in procs))

    def after_reset(self, index: int) -> GpuAfterReset:
        with _session():
            handle = _call("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, index)
            uuid = _call("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, handle)
            action, _error = _call(
                "nvmlDeviceGetFieldValues", read_fields, handle, (FI_GPU_RECOVERY_ACTION,)
            )[FI_GPU_RECOVERY_ACTION]
            rows = _optional(pynvml.nvmlDeviceGetRemappedRows, handle)
            retired = _optional(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        return GpuAfterReset(
            uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
            recovery_action=action,
            remap_pending=None if rows is None else bool(rows[2]),
            retired_pending=None if retired is None else bool(retired),
        )
