"""The one nvmlDeviceGetFieldValues call per GPU and pass: the driver's recovery action and the cheap
counters of the health signals (NVLink link count and CRC / replay / recovery error totals, the PCIe replay
counter)."""

from __future__ import annotations

import math
import struct
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

# nvml.h nvmlFieldValue_t, read from the array's bytes in one unpack rather than field by field through ctypes
# (a fifth of the cost): fieldId, scopeId, timestamp, latencyUsec, valueType, nvmlReturn, value (an 8-byte
# union). tests/test_nvml_conformance.py holds the layout to nvml.h's.
LAYOUT = struct.Struct("=IIqqii8s")
# nvmlValueType_t -> how its member of the union reads: 0 double, 1 uint, 2 ulong, 3 ulonglong, 4 slonglong,
# 5 sint, 6 ushort.
VALUE_FORMATS = {0: "=d", 1: "=I", 2: "=Q", 3: "=Q", 4: "=q", 5: "=i", 6: "=H"}
_VALUE = {t: struct.Struct(fmt) for t, fmt in VALUE_FORMATS.items()}
_UINT = _VALUE[1]

Fields = dict[int, tuple[int | None, str]]


def read_fields(handle: Any, ids: tuple[int, ...]) -> Fields:
    """One nvmlDeviceGetFieldValues call: each field id -> (its value, "") or (None, its own NVML error
    name: NOT_SUPPORTED where the GPU lacks it). The call itself failing raises pynvml.NVMLError, as every
    other read does."""
    out: Fields = {}
    for fid, _scope, _ts, _latency, kind, ret, raw in LAYOUT.iter_unpack(
        bytes(pynvml.nvmlDeviceGetFieldValues(handle, list(ids)))
    ):
        if ret != 0:  # NVML_SUCCESS
            out[fid] = (None, ERROR_NAMES.get(ret, f"NVML error {ret}"))
            continue
        value = _VALUE.get(kind, _UINT).unpack_from(raw)[0]
        if not (isinstance(value, int) or math.isfinite(value)) or value < 0:
            # Every field read is a count, a counter or an enum: a NaN, an infinity or a negative value is
            # this field's error (int(NaN) raised out of the pass, and every pass of the node failed).
            out[fid] = (None, "INVALID_VALUE")
            continue
        out[fid] = (int(value), "")
    return out
