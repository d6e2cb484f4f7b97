"""gpuguard.core.xidevent: an Xid as gpuguard reads it, from NVML's event set or the kernel log, one value
judged alike: its reason, its source's name, and an identity that leaves out when it arrived."""

from __future__ import annotations

from gpuguard.core import xidevent
from gpuguard.core.xidevent import KernelLine, XidEvent, sxid_reason, xid_reason


def test_an_xid_and_an_sxid_have_their_reasons() -> None:
    assert (xid_reason(79), sxid_reason(12028)) == ("xid-79", "sxid-12028")


def test_an_xid_is_nvmls_unless_the_kernel_log_reported_it() -> None:
    """The two names the `xid.duplicate` line and the evidence show as `source`."""
    assert XidEvent(0, "GPU-a", 79).source == xidevent.XID_SOURCE_NVML == "nvml"
    assert xidevent.XID_SOURCE_KERNEL == "kmsg"


def test_the_same_xid_arriving_at_another_time_is_the_same_value() -> None:
    line = KernelLine(seq=1, at=5.0, pci="0000:3b:00")
    first = XidEvent(0, "GPU-a", 79, source="kmsg", kernel=line, at=100.0)
    later = XidEvent(0, "GPU-a", 79, source="kmsg", kernel=line, at=101.5)
    assert first == later and hash(first) == hash(later)
    assert first != XidEvent(0, "GPU-a", 79, at=100.0)  # from NVML: another source
