"""Domain types shared by the backends, the policy and the node writer.

Standard library only: nothing here may import pynvml or kubernetes, so the pure parts of gpuguard
(policy, node planning) can be tested without either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Taint values (and the first word of every reason string) are label values: these are the fixed ones,
# Xid faults are "xid-<code>".
ECC = "ecc"
GPU_LOST = "gpu-lost"
GPU_MISSING = "gpu-missing"
ROW_REMAP = "row-remap"
NVML_INIT = "nvml-init"


def xid_reason(code: int) -> str:
    return f"xid-{code}"


@dataclass(frozen=True)
class GpuReading:
    """What a backend read from one GPU in one pass. Readings only: no judgement."""

    index: int
    uuid: str
    name: str = ""
    pci_bus_id: str = ""
    # Volatile uncorrected ECC total; None when it could not be read this pass (see ecc_supported).
    ecc_uncorrected: int | None = 0
    # False on GPUs without ECC (consumer cards) or with ECC disabled: "not applicable", not a fault.
    ecc_supported: bool = True
    # Row remapping (Ampere and newer); None where the GPU does not support it.
    remap_failure: bool | None = None
    remap_pending: bool | None = None
    # NVML_ERROR_GPU_IS_LOST (or the device is otherwise unreachable for good).
    lost: bool = False
    # Queries that failed transiently this pass (NVML_ERROR_UNKNOWN, _TIMEOUT, ...): retried, not a fault.
    transient_errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class XidEvent:
    """One critical Xid, delivered once by the driver (never replayed to a restarted process)."""

    gpu_index: int
    uuid: str
    code: int


@dataclass(frozen=True)
class Snapshot:
    """One pass over the node's GPUs: the readings plus the Xids delivered since the previous pass."""

    gpus: tuple[GpuReading, ...] = ()
    xids: tuple[XidEvent, ...] = ()
    # NVML could not be initialised (name of the NVML error, e.g. "DRIVER_NOT_LOADED").
    init_error: str | None = None
    driver_version: str | None = None


@dataclass(frozen=True)
class Fault:
    """One reason a GPU (or the node) is unhealthy.

    `reason` is the taint value it maps to; `key` identifies the fault across checks and restarts (it is
    what the node annotation `gpuguard.io/faults` records), so that a taint removed by hand is not re-added
    for the same fault, only for a new one.
    """

    reason: str
    detail: str
    uuid: str | None = None
    gpu_index: int | None = None

    @property
    def key(self) -> str:
        return f"{self.reason}/{self.uuid or 'node'}"

    @property
    def message(self) -> str:
        return f"{self.reason}: {self.detail}"


@dataclass(frozen=True)
class GpuVerdict:
    index: int
    uuid: str
    name: str = ""
    present: bool = True
    faults: tuple[Fault, ...] = ()
    ecc_uncorrected: int | None = None

    @property
    def healthy(self) -> bool:
        return not self.faults


@dataclass(frozen=True)
class Verdict:
    """The policy's judgement of one snapshot, plus the memory it carries to the next evaluation."""

    gpus: tuple[GpuVerdict, ...] = ()
    node_faults: tuple[Fault, ...] = ()
    # Xids seen in this snapshot that the policy ignores (logged, counted, not faults).
    ignored_xids: tuple[XidEvent, ...] = ()
    # Xids seen in this snapshot that are faults.
    fatal_xids: tuple[XidEvent, ...] = ()
    # Devices seen since the first successful NVML init, in first-seen order: (index, uuid, name).
    known: tuple[tuple[int, str, str], ...] = ()
    expected_gpus: int | None = None
    # Faults that stay until the process ends (an Xid, a lost GPU): the driver does not repeat them.
    sticky: tuple[Fault, ...] = field(default=())

    @property
    def faults(self) -> tuple[Fault, ...]:
        return self.node_faults + tuple(f for g in self.gpus for f in g.faults)

    @property
    def healthy(self) -> bool:
        return not self.faults
