"""Domain types shared by the backends, the policy and the node writer.

Standard library only: nothing here may import pynvml or kubernetes, so the pure parts of gpuguard
(policy, node planning) can be tested without either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property

# The Xid types live in their own module (the kernel log added a second source); the model names them.
from gpuguard.core.xidevent import (
    SXID_PREFIX,
    XID_SOURCE_KERNEL,
    XID_SOURCE_NVML,
    KernelLine,
    XidEvent,
    sxid_reason,
    xid_reason,
)

__all__ = [
    "SXID_PREFIX",
    "XID_SOURCE_KERNEL",
    "XID_SOURCE_NVML",
    "KernelLine",
    "XidEvent",
    "sxid_reason",
    "xid_reason",
]

# Taint values (and the first word of every reason string) are label values: these are the fixed ones,
# Xid faults are "xid-<code>".
ECC = "ecc"
GPU_LOST = "gpu-lost"
GPU_MISSING = "gpu-missing"
ROW_REMAP = "row-remap"
NVML_INIT = "nvml-init"
# NVML answers NVML_ERROR_RESET_REQUIRED for the GPU.
RESET_REQUIRED = "reset-required"
# Every query on a GPU failed for a few checks at --interval, or NVML counts a GPU it cannot identify.
GPU_UNREADABLE = "gpu-unreadable"
# An NVML call on the GPU, or a node-wide one, has not returned within its deadline (nvml.real.deadline).
GPU_UNRESPONSIVE = "gpu-unresponsive"
NVML_UNRESPONSIVE = "nvml-unresponsive"
# Dynamic page retirement (pre-Ampere GPUs): pages pending retirement, or as many retired as NVIDIA's limit.
RETIRED_PAGES = "retired-pages"
# A GPU whose faults recurred past --repeat-limit within --repeat-window (quarantine.escalation): held for
# repair until an operator releases it, whatever it reads.
REPEAT_OFFENDER = "repeat-offender"
# A GPU the repair executor holds out of service while it resets and proves it, or after its proof failed
# (quarantine.repair.asking): gone from the verdict when the executor's record lets it go, which is its proof.
REPAIR_HELD = "repair-held"
# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (nvmlDeviceGpuRecoveryAction_t): value -> the name in the reason.
RECOVERY_ACTIONS = {
    0: "none",
    1: "gpu-reset",
    2: "node-reboot",
    3: "drain-p2p",
    4: "drain-and-reset",
    5: "recover-imex-domain",
    6: "bus-reset",
    7: "system-reboot",
}
RECOVERY_PREFIX = "recovery-"


def plural(count: int, noun: str) -> str:
    """`1 GPU`, `2 GPUs`: a count with its noun as an operator reads it in a log line or a condition."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def recovery_reason(action: int) -> str:
    """'recovery-gpu-reset', 'recovery-node-reboot', ...; an action newer than this table: 'recovery-9'."""
    return RECOVERY_PREFIX + RECOVERY_ACTIONS.get(action, str(action))


@dataclass(frozen=True)
class SignalReadings:
    """The health signals as one pass read them from one GPU. Readings only, judged by gpuguard.judge.signals.
    Every field None where it does not apply (NVML answers NOT_SUPPORTED) or was not read this pass."""

    # nvmlDeviceGetGpuFabricInfoV: NVML_GPU_FABRIC_STATE_* (1 not started, 2 in progress, 3 completed), the
    # registration's own status (an NVML return name, "SUCCESS"), and the raw health mask.
    fabric_state: int | None = None
    fabric_status: str | None = None
    fabric_health: int | None = None
    # nvmlDeviceGetNvLinkState of every link NVML_FI_DEV_NVLINK_LINK_COUNT reports: the active links.
    nvlink_active: frozenset[int] | None = None
    nvlink_links: int | None = None
    # NVLink CRC flit + replay + recovery error totals (NVML_FI_DEV_NVLINK_*_ERROR_COUNT_TOTAL), summed.
    nvlink_errors: int | None = None
    pcie_width: int | None = None
    pcie_max_width: int | None = None
    # Shown, not judged by default: an idle GPU lowers its link generation to save power.
    pcie_gen: int | None = None
    pcie_max_gen: int | None = None
    # NVML_FI_DEV_PCIE_REPLAY_COUNTER.
    pcie_replays: int | None = None
    # nvmlDeviceGetCurrentClocksEventReasons: the raw bit mask (nvmlClocksEventReason*).
    clock_events: int | None = None
    # nvmlDeviceValidateInforom: False where NVML answers CORRUPTED_INFOROM.
    inforom_valid: bool | None = None


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
    # Queries that failed this pass ("ecc:UNKNOWN", "remap:RESET_REQUIRED", ...): retried; the policy makes
    # RESET_REQUIRED a fault at once and an unreadable GPU one after a few checks.
    transient_errors: tuple[str, ...] = ()
    # No query on the GPU answered this pass.
    unreadable: bool = False
    # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION; None where the driver does not support it (or it was unreadable).
    recovery_action: int | None = None
    # Whether the backend is registered for this GPU's Xid events right now, and if not, why.
    xid_watched: bool = True
    xid_watch_note: str = ""
    # Dynamic page retirement (pre-Ampere): pages retired (SBE + DBE) and whether some are pending; None where
    # the GPU does not retire pages (Ampere and newer remap rows instead).
    retired_pages: int | None = None
    retired_pending: bool | None = None
    # An NVML call on this GPU has not returned within its deadline (what, which deadline); the other values
    # are the last ones read.
    unresponsive: str | None = None
    # The health signals (fabric, NVLink, PCIe, clock events, InfoROM).
    signals: SignalReadings = SignalReadings()


@dataclass(frozen=True)
class Snapshot:
    """One pass over the node's GPUs: the readings plus the Xids delivered since the previous pass."""

    gpus: tuple[GpuReading, ...] = ()
    xids: tuple[XidEvent, ...] = ()
    # NVML could not be initialised (name of the NVML error, e.g. "DRIVER_NOT_LOADED").
    init_error: str | None = None
    driver_version: str | None = None
    # GPUs NVML counts but could not identify this pass (no handle or no UUID): (index, NVML error).
    # They never enter the inventory under a made-up name; persistently unidentified, they are a fault.
    unidentified: tuple[tuple[int, str], ...] = ()
    # A node-wide NVML call (init, the device count) has not returned within its deadline; the readings are
    # the last ones.
    unresponsive: str | None = None
    # NVML calls past their deadline and still in flight (one stuck thread each), for /healthz and metrics.
    stuck_calls: tuple[str, ...] = ()
    # A node-wide query that failed this pass ("nvmlDeviceGetCount:UNKNOWN"): the readings are the last ones;
    # retried, and a fault only when it fails check after check (Verdict.node_error_streak).
    node_error: str | None = None
    # NVIDIA display/3D controllers on the PCI bus (sysfs) that NVML does not list: their PCI addresses.
    bus_only: tuple[str, ...] = ()
    # The last kernel-log sequence number read into this snapshot, judged or found a duplicate (None: none):
    # kept per boot in the state file so that a restart's replay does not judge it again.
    kernel_seq: int | None = field(default=None, compare=False)
    # When the pass was judged, in seconds: the time base of the signals' windows. The agent stamps its own
    # monotonic clock on every snapshot it judges; the mock stamps its scenario time. Not compared: the same
    # readings at another time are the same snapshot.
    taken_at: float = field(default=0.0, compare=False)
    # When the host booted, on the same clock (None: not known): the fabric's grace runs from it.
    booted_at: float | None = field(default=None, compare=False)


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
    xid_watched: bool = True
    xid_watch_note: str = ""
    recovery_action: int | None = None
    # Shown, not judged: a row remap waiting for a GPU reset (None: no row remapping here).
    remap_pending: bool | None = None
    retired_pages: int | None = None
    # The PCIe link as last read, (generation, width): shown, not judged by default (an idle GPU lowers its
    # generation to save power); None where not read.
    pcie_link: tuple[int, int] | None = None
    # The second level: signals that make this GPU `degraded` (shown, scheduled around softly with a
    # PreferNoSchedule taint or an effect-None DeviceTaintRule, never cordoned, never counted by the budget).
    # `reason` is the signal's name (e.g. `nvlink-down`); a GPU may be degraded and faulty at once.
    degraded: tuple[Fault, ...] = ()

    @property
    def healthy(self) -> bool:
        return not self.faults


@dataclass(frozen=True)
class SignalMemory:
    """What gpuguard.judge.signals carries from one check to the next, per GPU UUID: the first good reading's
    active NVLinks and PCIe width, counter samples (time, total) and clock event samples (time, mask) over
    the longest window, when a fabric's grace started (the boot or its first incomplete reading) and, per
    GPU, its incomplete run (seconds incomplete so far, the last reading's time, since when it reads
    COMPLETED: None while incomplete), kept across flaps until it stays COMPLETED a whole grace."""

    first_links: tuple[tuple[str, frozenset[int]], ...] = ()
    first_width: tuple[tuple[str, int], ...] = ()
    first_gen: tuple[tuple[str, int], ...] = ()
    counters: tuple[tuple[str, tuple[tuple[float, int], ...]], ...] = ()
    clock_samples: tuple[tuple[str, tuple[tuple[float, int], ...]], ...] = ()
    fabric_incomplete_since: tuple[tuple[str, float], ...] = ()
    fabric_runs: tuple[tuple[str, tuple[float, float, float | None]], ...] = ()

    @cached_property
    def pending(self) -> bool:
        """Whether time alone can change a judgement (a grace running, events or a counter's rise within a
        window): the agent then judges again although nothing read differently."""
        return bool(self.fabric_incomplete_since or self.fabric_runs or self.clock_samples) or any(
            len(samples) > 1 for _, samples in self.counters
        )


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
    # The recovery-action rule (docs/design.md): Xid fault keys recorded while the driver asked for a GPU
    # reset (they clear when the action reads NONE again), keys recorded while it read NONE, with when
    # (attached if a reset is read up to the next poll, one --interval later), and keys a reset has cleared
    # in this process (the node's evidence).
    reset_clearable: frozenset[str] = frozenset()
    reset_pending: tuple[tuple[str, float], ...] = ()
    reset_cleared: frozenset[str] = frozenset()
    # Since when (the first failing check's taken_at) each GPU (by UUID) has been unreadable, each
    # unidentified index unidentified, and a node-wide query (Snapshot.node_error) failing: judge.unanswered.
    unreadable_since: tuple[tuple[str, float], ...] = ()
    unidentified_since: tuple[tuple[int, float], ...] = ()
    node_error_since: float | None = None
    # Node-wide `degraded` signals, as GpuVerdict.degraded for one GPU.
    node_degraded: tuple[Fault, ...] = ()
    # What the signals' judge remembers between checks (first good readings, counter samples, events).
    signal_memory: SignalMemory = field(default_factory=SignalMemory)

    @cached_property
    def faults(self) -> tuple[Fault, ...]:
        # Computed once per verdict (frozen: it cannot change); the loop asks for it several times a check.
        return self.node_faults + tuple(f for g in self.gpus for f in g.faults)

    @cached_property
    def degraded(self) -> tuple[Fault, ...]:
        # Every `degraded` signal, the node's first. Not faults: `healthy` ignores them.
        return self.node_degraded + tuple(f for g in self.gpus for f in g.degraded)

    @property
    def healthy(self) -> bool:
        return not self.faults

    @cached_property
    def pending(self) -> bool:
        """Whether time alone can change the next judgement (a failure lasting, a window, a grace): the agent
        then judges again although nothing read differently."""
        failing = self.unreadable_since or self.unidentified_since or self.node_error_since is not None
        return bool(failing) or self.signal_memory.pending


@dataclass(frozen=True)
class Streaks:
    """Checks in a row, counted in one place (gpuguard.judge.streaks: runs measured in time, told in checks
    at --interval): with no fault (the node's `healthy`, each GPU's by UUID in `gpus`) and with no
    degraded signal (`clean`, `gpus_clean`). A quarantine or a degraded mark is lifted once its streak
    reaches --recover-after. `gpus` None: the node's streak stands for every GPU (never longer than any
    GPU's own)."""

    healthy: int = 0
    gpus: Mapping[str, int] | None = None
    clean: int = 0
    gpus_clean: Mapping[str, int] = field(default_factory=dict)

    def capped(self, most: int) -> tuple[object, ...]:
        """What a decision can tell apart: each streak up to `most` (--recover-after)."""
        return (
            min(self.healthy, most),
            tuple(sorted((u, min(n, most)) for u, n in (self.gpus or {}).items())),
            min(self.clean, most),
            tuple(sorted((u, min(n, most)) for u, n in self.gpus_clean.items())),
        )


@dataclass(frozen=True)
class Judgement:
    """The one value that crosses from the agent's thread to the writer's: the verdict, judged once, and what
    the agent knows with it (the streaks, and whether the faults flap within --flap-window)."""

    verdict: Verdict
    streaks: Streaks = field(default_factory=Streaks)
    flapping: bool = False


@dataclass(frozen=True)
class GpuQuarantine:
    """One GPU held out of service by a DRA DeviceTaintRule (the per-GPU quarantine), for /healthz,
    `gpuguard status` and gpuguard_gpus_quarantined."""

    uuid: str
    device: str
    rule: str
    reason: str
    effect: str
    # Past the quarantine budget: the rule has effect None (informational) until there is room.
    deferred: bool


@dataclass(frozen=True)
class ApiHealth:
    """The API server as the agent last met it (/healthz "api"): "ok"; "unreachable" (no answer, a timeout,
    5xx or 429 past its retries); "refused" (a request refused with a 4xx other than 409, within its
    backoff). `since`: when it became so (None: since the start); `error`: the last failure's line."""

    state: str = "ok"
    since: datetime | None = None
    error: str | None = None


@dataclass(frozen=True)
class AgentStatus:
    """Everything /healthz and /readyz report, read atomically (made by the agent, served by the server)."""

    alive: bool
    ready: bool
    node: str | None
    verdict: Verdict | None
    tainted: bool
    cordoned: bool
    dry_run: bool
    last_check: datetime | None
    gpu_quarantines: tuple[GpuQuarantine, ...] = ()
    # Where the API server serves DeviceTaintRules: "resource.k8s.io/v1", "resource.k8s.io/v1beta2", "none"
    # (neither: faults of one GPU get the node taint), "unknown" (not listed yet); None: not looked for
    # (--quarantine node, or a dry run without a cluster).
    device_taint_api: str | None = None
    # NVML calls past their deadline and still in flight (Snapshot.stuck_calls of the last check).
    nvml_stuck_calls: tuple[str, ...] = ()
    # The API server as the reconciler last met it; None: no API server (a dry run).
    api: ApiHealth | None = None


@dataclass(frozen=True)
class PodDevices:
    """One pod's devices as the kubelet's PodResources API reports them (gpuguard.kube.podresources), all its
    containers together: device-plugin devices as (resource name, device ID) (NVIDIA's device plugin: the
    GPU's UUID, `UUID::n` for a shared GPU) and DRA devices as (driver, pool, device)."""

    namespace: str
    name: str
    devices: tuple[tuple[str, str], ...] = ()
    claims: tuple[tuple[str, str, str], ...] = ()
