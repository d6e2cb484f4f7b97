"""nvmlDeviceGetGpuFabricInfoV: whether Fabric Manager registered the GPU (NVSwitch systems, HGX).

The struct is nvml.h's nvmlGpuFabricInfo_v2_t, declared here rather than taken from pynvml: v2 is what
drivers since R535 answer, and older nvidia-ml-py releases do not define it. A library without the call
answers NOT_SUPPORTED, as NVML does on GPUs without a fabric.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml

from gpuguard.nvml.real.common import ERROR_NAMES

_UUID_LEN = 16  # NVML_GPU_FABRIC_UUID_LEN


class FabricInfoV2(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_ubyte * _UUID_LEN),
        ("status", ctypes.c_int),  # nvmlReturn_t
        ("cliqueId", ctypes.c_uint),
        ("state", ctypes.c_uint),  # nvmlGpuFabricState_t
        ("healthMask", ctypes.c_uint),
    ]


# nvml.h NVML_STRUCT_VERSION(GpuFabricInfo, 2): the struct's size | 2 << 24.
FABRIC_INFO_V2 = ctypes.sizeof(FabricInfoV2) | (2 << 24)


def read_fabric(handle: Any) -> tuple[int, str, int]:
    """(state NVML_GPU_FABRIC_STATE_*, the registration's status name, the health mask). Raises
    pynvml.NVMLError (NOT_SUPPORTED where the GPU has no fabric, or the library lacks the call)."""
    call = getattr(pynvml, "nvmlDeviceGetGpuFabricInfoV", None)
    if call is None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    info = FabricInfoV2(version=FABRIC_INFO_V2)
    call(handle, ctypes.byref(info))
    status = "SUCCESS" if info.status == 0 else ERROR_NAMES.get(info.status, f"NVML error {info.status}")
    return int(info.state), status, int(info.healthMask)
