"""One GPU's polled reading: uncorrected ECC, remapped rows, the recovery action, presence; and the
description read once when a GPU is first seen (name, PCI bus id, whether ECC applies)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pynvml

from gpuguard.core.model import GpuReading, SignalReadings
from gpuguard.nvml.real.common import (
    FI_GPU_RECOVERY_ACTION,
    Device,
    error_name,
    is_lost,
    not_supported,
    text,
)
from gpuguard.nvml.real.deadline import Hang, Pass
from gpuguard.nvml.real.fields import SIGNAL_FIELDS, Fields, read_fields
from gpuguard.nvml.real.signalreads import read_signals


def describe(index: int, handle: Any, uuid: str, p: Pass) -> Device:
    p.at("nvmlDeviceGetName", uuid, index)
    name = _optional(lambda: text(pynvml.nvmlDeviceGetName(handle)), "")
    p.at("nvmlDeviceGetPciInfo", uuid, index)
    pci = _optional(lambda: text(pynvml.nvmlDeviceGetPciInfo(handle).busId), "")
    ecc_supported = True
    try:
        p.at("nvmlDeviceGetEccMode", uuid, index)
        current, _pending = pynvml.nvmlDeviceGetEccMode(handle)
        ecc_supported = bool(current)  # ECC disabled: counters are not applicable
    except pynvml.NVMLError as exc:
        if not_supported(exc):
            ecc_supported = False
    return Device(index, handle, uuid, name, pci, ecc_supported)


def unresponsive(d: Device, hang: Hang, watch: tuple[bool, str]) -> GpuReading:
    """The reading of a GPU with a call in flight past its deadline: the last values, and what hangs."""
    base = last_reading(d, watch)
    return base if base.unresponsive == hang.detail else replace(base, unresponsive=hang.detail)


def last_reading(d: Device, watch: tuple[bool, str]) -> GpuReading:
    """The last pass's reading of this GPU (none yet: nothing known), with the watch state of now."""
    if d.last_reading is None:
        return _unread(d, *watch)
    reading = d.last_reading[1]
    if (reading.xid_watched, reading.xid_watch_note) == watch:
        return reading
    return replace(reading, xid_watched=watch[0], xid_watch_note=watch[1])


# NOT_SUPPORTED for the recovery field is asked again this often (a driver update can bring it, and Xid 154,
# the driver announcing an action, asks again at once).
RECOVERY_PROBE_S = 600.0


def read(d: Device, watched: bool, watch_note: str, p: Pass, now: float) -> GpuReading:
    """This pass's reading of one GPU: every query asked again. The GpuReading object is the one of the
    previous pass when every value is the same (a steady GPU allocates nothing, and the snapshot and the
    remembered evaluation compare by identity first).

    One deadline covers the GPU's whole reading (a few calls of microseconds each): it starts at the GPU,
    and each call only names itself (`p.call`), so a hang is still the exact call on the exact GPU, for a
    store per call instead of a clock read (the idle CPU goal, docs/performance.md)."""
    if d.lost_at_enumeration:
        return _reading(d, watched, watch_note, _LOST_VALUES)
    if d.enumeration_error:
        failed: _Values = (None, None, None, None, (d.enumeration_error,), True, None, _NO_SIGNALS)
        return _reading(d, watched, watch_note, failed)
    p.at("nvmlDeviceGetTotalEccErrors", d.uuid, d.index)
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
        if is_lost(exc):
            return _reading(d, watched, watch_note, _LOST_VALUES)
        if not_supported(exc):
            d.ecc_supported = False  # ECC mode answered, the counter does not: not applicable
        else:
            errors.append(f"ecc:{error_name(exc)}")
    try:
        if d.remap_supported:
            p.call = "nvmlDeviceGetRemappedRows"
            _corr, _unc, pending, failure = pynvml.nvmlDeviceGetRemappedRows(d.handle)
            remap_failure, remap_pending = bool(failure), bool(pending)
            answered += 1
    except pynvml.NVMLError as exc:
        if is_lost(exc):
            return _reading(d, watched, watch_note, _LOST_VALUES)
        if not_supported(exc):
            d.remap_supported = False  # pre-Ampere, some vGPU and MIG set-ups: not applicable
        else:
            errors.append(f"remap:{error_name(exc)}")
    # One field-values call: the recovery action (while supported, or probed again) and the signals' fields.
    ask_recovery = d.recovery_supported or now >= d.recovery_probe_at
    ask_signals = "fields" not in d.signal_state.unsupported
    fields: Fields = {}
    field_error = ""
    if ask_recovery or ask_signals:
        ids = (d.signal_state.field_ids or SIGNAL_FIELDS) if ask_signals else ()
        try:
            p.call = "nvmlDeviceGetFieldValues"
            fields = read_fields(d.handle, (FI_GPU_RECOVERY_ACTION, *ids) if ask_recovery else ids)
        except pynvml.NVMLError as exc:
            if is_lost(exc):
                return _reading(d, watched, watch_note, _LOST_VALUES)
            if not_supported(exc):
                d.signal_state.unsupported.add("fields")
                fields = {FI_GPU_RECOVERY_ACTION: (None, "NOT_SUPPORTED")}
            else:
                field_error = error_name(exc)
    if ask_recovery:
        action, error = fields.get(FI_GPU_RECOVERY_ACTION, (None, field_error))
        d.recovery_supported = error != "NOT_SUPPORTED"
        if not d.recovery_supported:
            d.recovery_probe_at = now + RECOVERY_PROBE_S
        elif error:
            errors.append(f"recovery:{error}")
        else:
            answered += 1
    if not answered and not errors:
        # Nothing else is polled on this GPU: probe it so a lost or broken GPU still shows.
        try:
            p.call = "nvmlDeviceGetUUID"
            pynvml.nvmlDeviceGetUUID(d.handle)
            answered += 1
        except pynvml.NVMLError as exc:
            if is_lost(exc):
                return _reading(d, watched, watch_note, _LOST_VALUES)
            errors.append(f"probe:{error_name(exc)}")
    retired: tuple[int, bool] | None = None
    if d.retired_supported:
        try:
            retired = _retired_pages(d, p)
            answered += 1
        except pynvml.NVMLError as exc:
            if is_lost(exc):
                return _reading(d, watched, watch_note, _LOST_VALUES)
            if not_supported(exc):
                d.retired_supported = False  # Ampere and newer remap rows instead: not applicable
            else:
                errors.append(f"retired:{error_name(exc)}")
    try:
        signals, signal_errors = read_signals(d, p, now, fields, field_error)
    except pynvml.NVMLError:  # GPU_IS_LOST: the only error read_signals raises
        return _reading(d, watched, watch_note, _LOST_VALUES)
    errors.extend(signal_errors)
    unreadable = not answered and bool(errors)
    values = (ecc, remap_failure, remap_pending, action, tuple(errors), unreadable, retired, signals)
    return _reading(d, watched, watch_note, values)


# (ecc_uncorrected, remap_failure, remap_pending, recovery_action, transient_errors, unreadable, retired,
# signals); a lost GPU answers nothing: only its identity and the fact that it is lost.
_Values = tuple[
    int | None,
    bool | None,
    bool | None,
    int | None,
    tuple[str, ...],
    bool,
    tuple[int, bool] | None,
    SignalReadings,
]
_NO_SIGNALS = SignalReadings()
_LOST_VALUES: _Values = (None, None, None, None, (), False, None, _NO_SIGNALS)


def _reading(d: Device, watched: bool, watch_note: str, values: _Values) -> GpuReading:
    """The GpuReading of these values: the previous pass's object when nothing differs, else a new one."""
    lost = values is _LOST_VALUES
    key = (d.index, d.ecc_supported, watched, watch_note, lost, values)
    last = d.last_reading
    if last is not None and last[0] == key:
        return last[1]
    ecc, remap_failure, remap_pending, action, errors, unreadable, retired, signals = values
    reading = replace(
        _unread(d, watched, watch_note),
        ecc_uncorrected=ecc,
        remap_failure=remap_failure,
        remap_pending=remap_pending,
        recovery_action=action,
        transient_errors=errors,
        unreadable=unreadable,
        lost=lost,
        retired_pages=retired[0] if retired else None,
        retired_pending=retired[1] if retired else None,
        signals=signals,
    )
    d.last_reading = (key, reading)
    return reading


def _unread(d: Device, watched: bool, watch_note: str) -> GpuReading:
    """The GPU as described when first seen, with its watch state, and nothing read (ECC unknown): a reading
    is this with the values of a pass."""
    return GpuReading(
        index=d.index,
        uuid=d.uuid,
        name=d.name,
        pci_bus_id=d.pci_bus_id,
        ecc_supported=d.ecc_supported,
        ecc_uncorrected=None,
        xid_watched=watched,
        xid_watch_note=watch_note,
    )


def _retired_pages(d: Device, p: Pass) -> tuple[int, bool]:
    """(pages retired, whether some are pending retirement): dynamic page retirement, pre-Ampere GPUs."""
    p.call = "nvmlDeviceGetRetiredPagesPendingStatus"
    pending = bool(pynvml.nvmlDeviceGetRetiredPagesPendingStatus(d.handle))
    p.call = "nvmlDeviceGetRetiredPages"
    count = sum(len(pynvml.nvmlDeviceGetRetiredPages(d.handle, cause)) for cause in (0, 1))  # SBE, DBE
    return count, pending


def _optional(fn: Any, default: str) -> str:
    try:
        return str(fn())
    except pynvml.NVMLError:
        return default
