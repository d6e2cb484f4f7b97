"""gpuguard.judge.xidfaults: an Xid as a fault, whichever source reported it; the detail names the GPU (or
the NVSwitch, or the PCI address NVML could not place), the MIG instances and what the kernel's line said."""

from __future__ import annotations

from gpuguard.core.model import Fault, KernelLine, XidEvent
from gpuguard.judge.xidfaults import describe_xid, xid_fault

LINE = KernelLine(seq=7, at=5.0, pci="0000:3b:00", pid=1234, process="python3", text="Ch 00000008")


def test_an_nvml_xid_is_a_fault_of_its_gpu_named_by_index_and_uuid() -> None:
    assert xid_fault(XidEvent(1, "GPU-a", 79)) == Fault(
        "xid-79", "GPU has fallen off the bus (GPU 1, GPU-a)", uuid="GPU-a", gpu_index=1
    )


def test_a_mig_xid_names_its_gpu_and_compute_instance() -> None:
    x = XidEvent(0, "GPU-a", 79, gpu_instance=2, compute_instance=0)
    assert xid_fault(x).detail == (
        "GPU has fallen off the bus (GPU 0, GPU-a, MIG GPU instance 2, compute instance 0)"
    )
    only_gi = XidEvent(0, "GPU-a", 79, gpu_instance=0)
    assert xid_fault(only_gi).detail == "GPU has fallen off the bus (GPU 0, GPU-a, MIG GPU instance 0)"


def test_a_kernel_log_xid_says_what_the_drivers_line_said() -> None:
    x = XidEvent(1, "GPU-a", 79, source="kmsg", kernel=LINE)
    assert xid_fault(x).detail == (
        "GPU has fallen off the bus (GPU 1, GPU-a, kernel log: pid 1234, process python3, Ch 00000008)"
    )


def test_a_kernel_line_that_says_nothing_more_is_named_alone() -> None:
    bare = KernelLine(seq=1, at=0.0, pci="0000:3b:00")
    x = XidEvent(1, "GPU-a", 79, source="kmsg", kernel=bare)
    assert xid_fault(x).detail == "GPU has fallen off the bus (GPU 1, GPU-a, kernel log)"


def test_a_kernel_line_of_pid_0_names_it() -> None:
    line = KernelLine(seq=1, at=0.0, pci="0000:3b:00", pid=0)
    assert "kernel log: pid 0)" in xid_fault(XidEvent(1, "GPU-a", 79, kernel=line)).detail


def test_an_xid_nvml_could_not_place_is_the_nodes_naming_the_pci_address() -> None:
    x = XidEvent(None, None, 79, source="kmsg", kernel=KernelLine(seq=1, at=0.0, pci="0000:3b:00"))
    assert xid_fault(x) == Fault(
        "xid-79", "GPU has fallen off the bus (GPU at PCI 0000:3b:00 not identified by NVML, kernel log)"
    )
    assert xid_fault(XidEvent(None, None, 79)).detail == (
        "GPU has fallen off the bus (GPU not identified by NVML)"
    )


def test_an_sxid_is_the_nodes_naming_the_nvswitch_and_its_severity() -> None:
    line = KernelLine(seq=1, at=0.0, pci="0000:05:00", text="link training failed", severity="Fatal")
    x = XidEvent(None, None, 12028, source="kmsg", kernel=line, sxid=True)
    assert xid_fault(x) == Fault(
        "sxid-12028",
        "NVSwitch SXid 12028 (NVSwitch at PCI 0000:05:00, kernel log: Fatal, link training failed)",
    )
    assert xid_fault(XidEvent(None, None, 12028, sxid=True)).detail == "NVSwitch SXid 12028 (NVSwitch)"


def test_an_sxid_that_names_a_gpu_is_still_the_nodes() -> None:
    f = xid_fault(XidEvent(3, "GPU-a", 20034, sxid=True))
    assert (f.reason, f.uuid, f.gpu_index) == ("sxid-20034", None, None)


def test_an_xid_is_described_as_the_catalog_describes_it() -> None:
    assert describe_xid(79) == "GPU has fallen off the bus"
    assert describe_xid(999).startswith("unknown Xid")
