"""The one nvmlDeviceGetFieldValues call per GPU and pass: the driver's recovery action and the cheap
counters of issue 29's signals (NVLink link count and CRC / replay / recovery error totals, the PCIe replay
counter)."""

from __future__ import annotations

from typing import Any

import pynvml

from gpuguard.nvml.real.common import ERROR_NAMES

# nvml.h field ids (older nvidia-ml-py releases may lack the names; the numbers are the ABI).
FI_NVLINK_CRC_TOTAL = 38  # NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL
FI_NVLINK_REPLAY_TOTAL = 52  # NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL
FI_NVLINK_RECOVERY_TOTAL = 59  # NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL
FI_NVLINK_LINK_COUNT = 91  # NVML_FI_DEV_NVLINK_LINK_COUNT
FI_PCIE_REPLAY_COUNTER = 94  # NVML_FI_DEV_PCIE_REPLAY_COUNTER
SIGNAL_FIELDS = (
    FI_NVLINK_LINK_COUNT,
    FI_NVLINK_CRC_TOTAL,
    FI_NVLINK_REPLAY_TOTAL,
    FI_NVLINK_RECOVERY_TOTAL,
    FI_PCIE_REPLAY_COUNTER,
)
NVLINK_ERROR_FIELDS = (FI_NVLINK_CRC_TOTAL, FI_NVLINK_REPLAY_TOTAL, FI_NVLINK_RECOVERY_TOTAL)

# nvmlValueType_t: 0 double, 1 uint, 2 ulong, 3 ulonglong, 4 slonglong, 5 sint. Only the member the type
# names is read (each read of a ctypes union member costs as much as the call's wrapper).
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}
# The ctypes fields are read past pynvml's Python-level __getattribute__ (which only decodes bytes).
_field = object.__getattribute__


Fields = dict[int, tuple[int | None, str]]


def read_fields(handle: Any, ids: tuple[int, ...]) -> Fields:
    """One nvmlDeviceGetFieldValues call: each field id -> (its value, "") or (None, its own NVML error
    name: NOT_SUPPORTED where the GPU lacks it). The call itself failing raises pynvml.NVMLError, as every
    other read does."""
    out: Fields = {}
    for fv in pynvml.nvmlDeviceGetFieldValues(handle, list(ids)):
        ret = int(_field(fv, "nvmlReturn"))
        fid = int(_field(fv, "fieldId"))
        if ret != pynvml.NVML_SUCCESS:
            out[fid] = (None, ERROR_NAMES.get(ret, f"NVML error {ret}"))
            continue
        member = _VALUE_MEMBERS.get(int(_field(fv, "valueType")), "uiVal")
        out[fid] = (int(getattr(_field(fv, "value"), member)), "")
    return out
