"""An Xid as gpuguard reads it, from NVML's event set or from the kernel log: one value, judged alike.

Standard library only, like the model that names these types."""

from __future__ import annotations

from dataclasses import dataclass, field


def xid_reason(code: int) -> str:
    return f"xid-{code}"


XID_SOURCE_NVML = "nvml"
XID_SOURCE_KERNEL = "kmsg"
SXID_PREFIX = "sxid-"


def sxid_reason(code: int) -> str:
    """An NVSwitch's SXid: a fault of the node (a switch is no GPU)."""
    return f"{SXID_PREFIX}{code}"


@dataclass(frozen=True)
class KernelLine:
    """Where the kernel log (/dev/kmsg) names an Xid or SXid: what the driver's line says beyond the code."""

    seq: int
    """The record's sequence number in this boot's kernel log (replay skips what was judged)."""
    at: float
    """The record's timestamp: seconds since boot on the kernel's monotonic clock."""
    pci: str
    """The PCI address the line names, as "0000:3b:00" (domain:bus:device)."""
    pid: int | None = None
    process: str | None = None
    text: str = ""
    """The driver's words after the code, bounded and printable."""
    severity: str | None = None
    """An SXid's "Fatal" or "Non-fatal" (None: an Xid, or not said)."""


@dataclass(frozen=True)
class XidEvent:
    """One critical Xid, delivered once by the driver (never replayed to a restarted process)."""

    gpu_index: int | None
    """None, like uuid, when NVML could not say which GPU (the fault then belongs to the node)."""
    uuid: str | None
    code: int
    # MIG: the GPU / compute instance the Xid is attributed to (None: not MIG, NVML's 0xFFFFFFFF).
    gpu_instance: int | None = None
    compute_instance: int | None = None
    source: str = XID_SOURCE_NVML
    """NVML's event set or the kernel log, judged alike (docs/design.md, "The kernel log")."""
    kernel: KernelLine | None = None
    sxid: bool = False
    """An NVSwitch SXid (kernel log only): a node fault, Fatal ones only."""
    at: float | None = field(default=None, compare=False)
    """When it arrived, on the agent's monotonic clock (None: not noted): how the two sources are matched."""
