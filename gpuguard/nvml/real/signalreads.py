"""One GPU's reading of issue 29's signals, in the pass of its other reads (nvml.real.readings).

Per GPU and pass: one nvmlDeviceGetFieldValues call (NVLink and PCIe counters), nvmlDeviceGetGpuFabricInfoV,
the current PCIe link width and generation, nvmlDeviceGetCurrentClocksEventReasons. Less often: the NVLink
states (one call per link) when the NVLink error counters moved or every NVLINK_EVERY_S, the PCIe maxima once,
nvmlDeviceValidateInforom (a checksum of the InfoROM) every INFOROM_EVERY_S. A read that answers
NOT_SUPPORTED is not applicable: None, never asked again for this GPU. Any other error is a transient one:
"<source>:<NAME>" in the reading's transient_errors and no value this pass (the judge keeps its last
judgement). GPU_IS_LOST is raised to the caller, which reports the GPU lost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pynvml

from gpuguard.model import SignalReadings
from gpuguard.nvml.real.common import Device, error_name, is_lost, not_supported
from gpuguard.nvml.real.deadline import Pass
from gpuguard.nvml.real.fabric import read_fabric
from gpuguard.nvml.real.fields import (
    FI_NVLINK_LINK_COUNT,
    FI_PCIE_REPLAY_COUNTER,
    NVLINK_ERROR_FIELDS,
    read_fields,
)

# An NVLink that goes down raises its recovery and replay counters, which are read every pass: the states
# (18 calls on an HGX GPU) are read again at once then, and otherwise this often.
NVLINK_EVERY_S = 30.0
# nvmlDeviceValidateInforom checksums the InfoROM: not a per-poll read.
INFOROM_EVERY_S = 600.0

T = TypeVar("T")


class _Reads:
    """The errors of one GPU's signal reads in one pass."""

    def __init__(self, d: Device, p: Pass) -> None:
        self.d, self.p = d, p
        self.errors: list[str] = []

    def ask(self, source: str, call: str, fn: Callable[[], T]) -> T | None:
        if source in self.d.signals_unsupported:
            return None
        self.p.call = call
        try:
            return fn()
        except pynvml.NVMLError as exc:
            if is_lost(exc):
                raise
            if not_supported(exc):
                self.d.signals_unsupported.add(source)
            else:
                self.errors.append(f"{source}:{error_name(exc)}")
            return None


def read_signals(d: Device, p: Pass, now: float) -> tuple[SignalReadings, list[str]]:
    """This pass's signal readings of one GPU and the transient errors of their reads."""
    r = _Reads(d, p)
    h = d.handle
    fields = r.ask("fields", "nvmlDeviceGetFieldValues", lambda: read_fields(h))
    values: dict[int, int] = {}
    if fields is not None:
        values, field_error = fields
        if field_error:
            r.errors.append(f"fields:{field_error}")
    if FI_NVLINK_LINK_COUNT in values:
        d.nvlink_links = values[FI_NVLINK_LINK_COUNT]
    nvlink_errors = None
    if all(f in values for f in NVLINK_ERROR_FIELDS):
        nvlink_errors = sum(values[f] for f in NVLINK_ERROR_FIELDS)
    fabric = r.ask("fabric", "nvmlDeviceGetGpuFabricInfoV", lambda: read_fabric(h))
    width = r.ask(
        "pcie", "nvmlDeviceGetCurrPcieLinkWidth", lambda: int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(h))
    )
    gen = None
    if width is not None:
        gen = r.ask(
            "pcie",
            "nvmlDeviceGetCurrPcieLinkGeneration",
            lambda: _int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)),
        )
        if d.pcie_max is None and gen is not None:
            max_width = r.ask(
                "pcie", "nvmlDeviceGetMaxPcieLinkWidth", lambda: _int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(h))
            )
            max_gen = r.ask(
                "pcie",
                "nvmlDeviceGetMaxPcieLinkGeneration",
                lambda: _int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h)),
            )
            if max_width is not None and max_gen is not None:
                d.pcie_max = (max_width, max_gen)
    clocks = r.ask(
        "clocks",
        "nvmlDeviceGetCurrentClocksEventReasons",
        lambda: _int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)),
    )
    if now >= d.inforom_at and "inforom" not in d.signals_unsupported:
        d.inforom_valid = _inforom(r, h)
        d.inforom_at = now + INFOROM_EVERY_S if d.inforom_valid is not None else now
    if d.nvlink_links and (now >= d.nvlink_at or nvlink_errors != d.nvlink_errors):
        active = _links(r, h, d.nvlink_links)
        d.nvlink_active = active
        d.nvlink_at = now + NVLINK_EVERY_S if active is not None else now
    d.nvlink_errors = nvlink_errors
    readings = SignalReadings(
        fabric_state=fabric[0] if fabric else None,
        fabric_status=fabric[1] if fabric else None,
        fabric_health=fabric[2] if fabric else None,
        nvlink_active=d.nvlink_active if d.nvlink_links else None,
        nvlink_links=d.nvlink_links or None,
        nvlink_errors=nvlink_errors,
        pcie_width=width,
        pcie_max_width=d.pcie_max[0] if d.pcie_max else None,
        pcie_gen=gen,
        pcie_max_gen=d.pcie_max[1] if d.pcie_max else None,
        pcie_replays=values.get(FI_PCIE_REPLAY_COUNTER),
        clock_events=clocks,
        inforom_valid=d.inforom_valid,
    )
    return readings, r.errors


def _int(value: Any) -> int:
    return int(value)


def _inforom(r: _Reads, h: Any) -> bool | None:
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
            r.d.signals_unsupported.add("inforom")
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
