"""The production backend: NVML through NVIDIA's official bindings (`nvidia-ml-py`, module `pynvml`).

The only package that imports pynvml. Xids, uncorrected (double-bit) ECC errors and recovery-action changes
arrive as NVML events on a dedicated thread (`events`), which wakes the agent at once; ECC, remapped rows,
the recovery action and device presence are also polled (`readings`) by `NvmlBackend.snapshot()`
(`backend`) at the agent's interval, so a GPU or driver without those events is still read.

Every error nvml.h documents for a call made here has an answer (docs/reliability.md, "NVML errors").
"""

from gpuguard.nvml.real.backend import NvmlBackend
from gpuguard.nvml.real.common import (
    EVENT_DOUBLE_BIT_ECC,
    EVENT_RECOVERY_ACTION,
    EVENT_XID,
    FI_GPU_RECOVERY_ACTION,
    error_name,
)

__all__ = [
    "EVENT_DOUBLE_BIT_ECC",
    "EVENT_RECOVERY_ACTION",
    "EVENT_XID",
    "FI_GPU_RECOVERY_ACTION",
    "NvmlBackend",
    "error_name",
]
