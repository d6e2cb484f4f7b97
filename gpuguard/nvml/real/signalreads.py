"""One GPU's reading of the health signals, in the pass of its other reads (nvml.real.readings).

Every pass: the signals' fields (read with the recovery action in the GPU's one nvmlDeviceGetFieldValues
call: NVLink and PCIe counters) and nvmlDeviceGetCurrentClocksEventReasons (clock events are counted per
check). Every SLOW_EVERY_S: the PCIe link's width and generation (the maxima once), the fabric
(nvmlDeviceGetGpuFabricInfoV; every pass while it is not completed and successful, so the grace of
fabric-incomplete is timed from the pass that saw it), the NVLink states (one call per link; at once when
the NVLink error counters moved, as a link that goes down raises them). Every INFOROM_EVERY_S:
nvmlDeviceValidateInforom (a checksum of the InfoROM). The values in between are the last ones read.

A read that answers NOT_SUPPORTED is not applicable: None, never asked again for this GPU. Any other error
is a transient one: "<source>:<NAME>" in the reading's transient_errors, no value this pass (the judge keeps
its last judgement) and the read is due again at the next pass. GPU_IS_LOST is raised to the caller, which
reports the GPU lost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pynvml

from gpuguard.core.model import SignalReadings
from gpuguard.nvml.real.common import Device, SignalState, code, error_name, is_lost, not_supported
from gpuguard.nvml.real.deadline import Pass
from gpuguard.nvml.real.fabric import read_fabric
from gpuguard.nvml.real.fields import (
    FI_NVLINK_LINK_COUNT,
    FI_PCIE_REPLAY_COUNTER,
    NVLINK_ERROR_FIELDS,
    Fields,
)

# A link width, a fabric registration or an NVLink that changes is judged `degraded` (or a fabric fault
# that also shows in Xids): seen within this long is soon enough, for a fifth of the calls of a pass.
SLOW_EVERY_S = 30.0
# nvmlDeviceValidateInforom checksums the InfoROM: not a per-poll read.
INFOROM_EVERY_S = 600.0
_FABRIC_OK = (3, "SUCCESS")  # NVML_GPU_FABRIC_STATE_COMPLETED, NVML_SUCCESS
_FABRIC_STATE_NOT_SUPPORTED = 0  # NVML_GPU_FABRIC_STATE_NOT_SUPPORTED

T = TypeVar("T")


class _Reads:
    """One GPU's signal reads in one pass, and their transient errors."""

    def __init__(self, s: SignalState, p: Pass) -> None:
        self.s, self.p = s, p
        self.errors: list[str] = []

    def ask(self, source: str, call: str, fn: Callable[[], T]) -> T | None:
        if source in self.s.unsupported:
            return None
        self.p.call = call
        try:
            return fn()
        except pynvml.NVMLError as exc:
            if is_lost(exc):
                raise
            if not_supported(exc) or code(exc) == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH:
                # A driver that lacks the call or this struct version: as not applicable as NOT_SUPPORTED.
                self.s.unsupported.add(source)
            else:
                self.errors.append(f"{source}:{error_name(exc)}")
            return None


def read_signals(
    d: Device, p: Pass, now: float, fields: Fields, field_error: str
) -> tuple[SignalReadings, list[str]]:
    """This pass's signal readings of one GPU and the transient errors of their reads. `fields`: the GPU's
    field-values call of this pass (`field_error`: the call's own error)."""
    s, h = d.signal_state, d.handle
    r = _Reads(s, p)
    values = _fields(s, r, fields, field_error)
    if FI_NVLINK_LINK_COUNT in values:
        s.nvlink_links = values[FI_NVLINK_LINK_COUNT]
    nvlink_errors = None
    if all(f in values for f in NVLINK_ERROR_FIELDS):
        nvlink_errors = sum(values[f] for f in NVLINK_ERROR_FIELDS)
    clocks = r.ask(
        "clocks",
        "nvmlDeviceGetCurrentClocksEventReasons",
        lambda: int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)),
    )
    if now >= s.fabric_at or (s.fabric is not None and s.fabric[:2] != _FABRIC_OK):
        s.fabric = r.ask("fabric", "nvmlDeviceGetGpuFabricInfoV", lambda: read_fabric(h))
        if s.fabric is not None and s.fabric[0] == _FABRIC_STATE_NOT_SUPPORTED:
            s.fabric = None  # a GPU without a fabric (no NVSwitch) answers so: not applicable
            s.unsupported.add("fabric")
        s.fabric_at = now + SLOW_EVERY_S if s.fabric is not None else now
    if now >= s.pcie_at:
        s.pcie = _pcie(s, r, h)
        s.pcie_at = now + SLOW_EVERY_S if s.pcie is not None else now
    if s.nvlink_links and (now >= s.nvlink_at or nvlink_errors != s.nvlink_errors):
        s.nvlink_active = _links(r, h, s.nvlink_links)
        s.nvlink_at = now + SLOW_EVERY_S if s.nvlink_active is not None else now
    s.nvlink_errors = nvlink_errors
    if now >= s.inforom_at and "inforom" not in s.unsupported:
        s.inforom_valid = _inforom(s, r, h)
        s.inforom_at = now + INFOROM_EVERY_S if s.inforom_valid is not None else now
    replays = values.get(FI_PCIE_REPLAY_COUNTER)
    key = (s.fabric, s.nvlink_active, s.nvlink_links, nvlink_errors, s.pcie, s.pcie_max, replays, clocks)
    if s.last is None or key != s.last_key or s.inforom_valid != s.last.inforom_valid:
        # A new readings object only when a value changed: a steady GPU hands on the last one.
        s.last_key = key
        s.last = SignalReadings(
            fabric_state=s.fabric[0] if s.fabric else None,
            fabric_status=s.fabric[1] if s.fabric else None,
            fabric_health=s.fabric[2] if s.fabric else None,
            nvlink_active=s.nvlink_active if s.nvlink_links else None,
            nvlink_links=s.nvlink_links or None,
            nvlink_errors=nvlink_errors,
            pcie_width=s.pcie[0] if s.pcie else None,
            pcie_max_width=s.pcie_max[0] if s.pcie and s.pcie_max else None,
            pcie_gen=s.pcie[1] if s.pcie else None,
            pcie_max_gen=s.pcie_max[1] if s.pcie and s.pcie_max else None,
            pcie_replays=replays,
            clock_events=clocks,
            inforom_valid=s.inforom_valid,
        )
    return s.last, r.errors


def _fields(s: SignalState, r: _Reads, fields: Fields, field_error: str) -> dict[int, int]:
    """The signal fields that answered; a field's own error other than NOT_SUPPORTED is transient. After the
    first answer only the fields still needed are asked for: the NVLink count is known, a GPU without NVLink
    (its count NOT_SUPPORTED or 0) has no NVLink counters, and a field NOT_SUPPORTED stays so."""
    if "fields" in s.unsupported:
        return {}
    if field_error:
        r.errors.append(f"fields:{field_error}")
        return {}
    values = {}
    for fid, (value, error) in fields.items():
        if value is not None:
            values[fid] = value
        elif error not in ("NOT_SUPPORTED", "FUNCTION_NOT_FOUND") and fid in _SIGNAL_IDS:
            r.errors.append(f"fields:{error}")
    if not s.field_ids and not r.errors:
        keep = [f for f in _SIGNAL_IDS_ORDERED if f in values and f != FI_NVLINK_LINK_COUNT]
        if not values.get(FI_NVLINK_LINK_COUNT):
            keep = [f for f in keep if f not in NVLINK_ERROR_FIELDS]
        s.field_ids = tuple(keep)
        if not keep:
            s.unsupported.add("fields")
    return values


_SIGNAL_IDS_ORDERED = (FI_NVLINK_LINK_COUNT, *NVLINK_ERROR_FIELDS, FI_PCIE_REPLAY_COUNTER)
_SIGNAL_IDS = frozenset(_SIGNAL_IDS_ORDERED)


def _pcie(s: SignalState, r: _Reads, h: Any) -> tuple[int, int] | None:
    """(current width, current generation), and the maxima at the first read; None when a read failed."""
    width = r.ask(
        "pcie", "nvmlDeviceGetCurrPcieLinkWidth", lambda: int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(h))
    )
    if width is None:
        return None
    gen = r.ask(
        "pcie",
        "nvmlDeviceGetCurrPcieLinkGeneration",
        lambda: int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)),
    )
    if gen is None:
        return None
    if s.pcie_max is None:
        top_width = r.ask(
            "pcie", "nvmlDeviceGetMaxPcieLinkWidth", lambda: int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(h))
        )
        top_gen = r.ask(
            "pcie",
            "nvmlDeviceGetMaxPcieLinkGeneration",
            lambda: int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h)),
        )
        if top_width is None or top_gen is None:
            return None
        s.pcie_max = (top_width, top_gen)
    return width, gen


def _inforom(s: SignalState, r: _Reads, h: Any) -> bool | None:
    """True, False (CORRUPTED_INFOROM: the answer, not an error), None (not read)."""
    r.p.call = "nvmlDeviceValidateInforom"
    try:
        pynvml.nvmlDeviceValidateInforom(h)
        return True
    except pynvml.NVMLError as exc:
        if exc.value == pynvml.NVML_ERROR_CORRUPTED_INFOROM:
            return False
        if is_lost(exc):
            raise
        if not_supported(exc):
            s.unsupported.add("inforom")
        else:
            r.errors.append(f"inforom:{error_name(exc)}")
        return None


def _links(r: _Reads, h: Any, count: int) -> frozenset[int] | None:
    """The active links among the GPU's `count`; None when a read failed this pass (a link that answers
    NOT_SUPPORTED is not one the GPU uses)."""
    active = set()
    for link in range(count):
        r.p.call = "nvmlDeviceGetNvLinkState"
        try:
            if pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED:
                active.add(link)
        except pynvml.NVMLError as exc:
            if is_lost(exc):
                raise
            if not not_supported(exc):
                r.errors.append(f"nvlink:{error_name(exc)}")
                return None
    return frozenset(active)
