"""The sticky faults' recovery rules (gpuguard/judge/recovery.py): an unresponsive NVML call is a sticky
fault that clears only when the calls answer again, and never takes the GPU's other sticky faults with it."""

from __future__ import annotations

import pytest

from gpuguard.core.model import GPU_UNRESPONSIVE, NVML_UNRESPONSIVE, Fault, GpuReading, Snapshot
from gpuguard.core.xidevent import XID_SOURCE_KERNEL, KernelLine, XidEvent
from gpuguard.judge.recovery import split_xids, unresponsive_rule

ECC = Fault("ecc", "2 uncorrected", uuid="GPU-0", gpu_index=0)
HUNG_GPU = Fault(
    GPU_UNRESPONSIVE, "nvmlDeviceGetMemoryErrorCounter has not returned", uuid="GPU-0", gpu_index=0
)
HUNG_NVML = Fault(NVML_UNRESPONSIVE, "nvmlDeviceGetCount has not returned")
GPU0 = GpuReading(index=0, uuid="GPU-0")
GPU1 = GpuReading(index=1, uuid="GPU-1")


@pytest.mark.parametrize(
    ("sticky", "snapshot", "kept"),
    [
        ([ECC, HUNG_NVML], Snapshot(gpus=(GPU0,)), [ECC]),
        ([ECC, HUNG_GPU], Snapshot(gpus=(GPU0,)), [ECC]),
        ([HUNG_NVML], Snapshot(gpus=(GPU0,)), []),
        ([HUNG_NVML], Snapshot(init_error="DRIVER_NOT_LOADED"), [HUNG_NVML]),
        ([HUNG_GPU], Snapshot(gpus=(GpuReading(index=0, uuid="GPU-0", unreadable=True),)), [HUNG_GPU]),
        ([HUNG_GPU], Snapshot(gpus=(GPU1,)), [HUNG_GPU]),
        ([ECC], Snapshot(gpus=(GPU0,)), [ECC]),
    ],
    ids=[
        "a whole pass answered: NVML's cleared, the ECC fault kept",
        "the GPU answered: its unresponsive fault cleared, its ECC fault kept",
        "a whole pass answered",
        "NVML not initialised: no pass answered",
        "the GPU unreadable: it did not answer",
        "the GPU not read at all",
        "nothing unresponsive: left as it is",
    ],
)
def test_an_unresponsive_fault_clears_only_when_its_calls_answer_and_alone(
    sticky: list[Fault], snapshot: Snapshot, kept: list[Fault]
) -> None:
    assert unresponsive_rule(sticky, snapshot) == kept


@pytest.mark.parametrize(
    ("severity", "fatal"), [("Fatal", True), ("Non-fatal", False), (None, True), ("no line", True)]
)
def test_an_nvswitch_sxid_is_a_fault_unless_its_line_says_non_fatal_whatever_xids_are_ignored(
    severity: str | None, fatal: bool
) -> None:
    """An SXid has its own severity, not the Xid catalog's: a "Non-fatal" one is an event; one whose line
    says none, or that has no line, is a fault. --ignored-xids is about GPUs' Xids, not a switch's."""
    line = None if severity == "no line" else KernelLine(seq=1, at=0.0, pci="0000:c1:00", severity=severity)
    x = XidEvent(None, None, 20034, source=XID_SOURCE_KERNEL, kernel=line, sxid=True)
    faults, events = split_xids([x], frozenset({20034}), set())
    assert (faults, events) == (((x,), ()) if fatal else ((), (x,)))
