"""An Xid as a fault, whichever source reported it (NVML's event set, the kernel log): its reason and the
detail an operator reads on the node."""

from __future__ import annotations

from gpuguard.core.model import Fault, XidEvent, sxid_reason, xid_reason
from gpuguard.core.xids import CATALOG


def describe_xid(code: int) -> str:
    return CATALOG.describe(code)


def xid_fault(x: XidEvent) -> Fault:
    """The fault an Xid is, from either source: an SXid (an NVSwitch's) is the node's."""
    if x.sxid:
        return Fault(sxid_reason(x.code), _xid_detail(x))
    return Fault(xid_reason(x.code), _xid_detail(x), uuid=x.uuid, gpu_index=x.gpu_index)


def _xid_detail(x: XidEvent) -> str:
    k = x.kernel
    if x.sxid:
        parts = [f"NVSwitch at PCI {k.pci}" if k else "NVSwitch"]
    elif x.uuid is not None:
        parts = [f"GPU {x.gpu_index}, {x.uuid}"]
    else:
        parts = [f"GPU at PCI {k.pci} not identified by NVML" if k else "GPU not identified by NVML"]
    if x.gpu_instance is not None:
        parts.append(f"MIG GPU instance {x.gpu_instance}")
    if x.compute_instance is not None:
        parts.append(f"compute instance {x.compute_instance}")
    if k is not None:
        said = ", ".join(
            s
            for s in (
                k.severity,
                f"pid {k.pid}" if k.pid is not None else None,
                f"process {k.process}" if k.process else None,
                k.text,
            )
            if s
        )
        parts.append(f"kernel log: {said}" if said else "kernel log")
    what = f"NVSwitch SXid {x.code}" if x.sxid else describe_xid(x.code)
    return f"{what} ({', '.join(parts)})"
