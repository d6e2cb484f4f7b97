"""gpuguard's configuration: one frozen dataclass tree, built once at the CLI edge and validated there.

Only gpuguard.cli reads flags and environment variables; everything else receives these objects.
Standard library only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from fractions import Fraction

from gpuguard.core import validation
from gpuguard.core.errors import ConfigError
from gpuguard.core.repairconfig import REPAIR_MODES
from gpuguard.core.signalconfig import SignalConfig
from gpuguard.core.signaltable import SIGNALS, SignalTable
from gpuguard.core.xids import CATALOG

# Default ignored Xids: those NVIDIA's Xid catalog files under the immediate action RESTART_APP or IGNORE,
# plus gpuguard's named overrides (45, 154); see gpuguard/core/xids.py and
# gpuguard/core/data/xid_catalog.json. A bad kernel or a killed process produces these on healthy hardware:
# tainting a node for them would punish the GPU for the workload's bug. 109 (context switch timeout,
# RESET_GPU) is a fault, although NVIDIA's device plugin ignores it.
DEFAULT_IGNORED_XIDS: frozenset[int] = CATALOG.default_ignored()


@dataclass(frozen=True)
class PolicySettings:
    """What makes a GPU unhealthy. Built once from flags/env by gpuguard.core.config."""

    ecc_threshold: int = 0
    """Volatile uncorrected ECC errors tolerated; 0 because any uncorrected error can corrupt results."""
    ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS
    """Xids that are events, not faults (RESTART_APP/IGNORE in NVIDIA's catalog, plus 45 and 154)."""
    expected_gpus: int | None = None
    """GPUs the node must have; None: the count at the first successful NVML init."""
    allow_no_gpu: bool = False
    """Treat an NVML init failure as "no GPUs here" instead of a fault (mixed pools, laptops)."""
    unreadable_after: int = 3
    """How long every query on a GPU must fail (or NVML fail to identify it, or a node-wide query fail)
    before that is a fault, in checks at `interval` (judge.unanswered): one failed pass is a transient NVML
    error, three (from the first failed check to the third at --interval 3, 6 s, however many checks Xids
    woke meanwhile) a GPU that does not answer. `check` uses 1: a preflight has one pass. RESET_REQUIRED and
    GPU_IS_LOST are faults at once."""
    interval: float = 3.0
    """The agent's --interval (the agent sets it from its own): what "N checks" means in seconds. Checks
    come early and often (every Xid wakes one), so no judgement counts them."""
    signals: SignalTable = SIGNALS
    """The health signals with their levels, thresholds and windows (gpuguard/core/data/signals.json), as
    --signals-config changed them for this node (gpuguard.core.signalconfig)."""


TAINT_EFFECTS = validation.TAINT_EFFECTS
GATE_REMOVALS = ("gpuguard", "external")
QUARANTINE_MODES = ("auto", "node", "gpu")
EVICT_MODES = ("none", "gpu-pods")
# Where `watch` keeps faults that only a reboot clears: the DaemonSet's hostPath. Config's own default is none
# (tests, dry runs, the mock backend unless told).
STATE_DIR = "/var/lib/gpuguard"
# The label NVIDIA GPU Feature Discovery sets on GPU nodes; also the DaemonSet's nodeSelector.
GPU_NODE_SELECTOR = "nvidia.com/gpu.present=true"
# The label NVIDIA GPU Feature Discovery sets to the node's GPU count: `check` expects that many where it can
# read its node (gpuguard.runtime.gpucount says why this source).
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
# `gpuguard release --wait`: seconds to wait for the agent to lift the hold. The agent re-reads a node it
# holds anything on every --node-resync (30 s): four re-reads and a slow API server.
RELEASE_WAIT = 120.0


_LIMIT = re.compile(r"^(\d{1,6}|\d{1,3}(\.\d{1,3})?%)$")


@dataclass(frozen=True)
class QuarantineLimit:
    """--max-quarantined, parsed once: a count of GPU nodes, or a percentage of them. The percentage is a
    Fraction, not a float: exact, so 8.8% of 375 nodes is 33 (a float makes it 34)."""

    text: str
    """The flag's text, which messages and Events quote (`str(limit)`)."""
    count: int | None = None
    """A number of GPU nodes; None for a percentage."""
    percent: Fraction | None = None
    """A percentage of the GPU nodes `gpu_node_selector` selects; None for a count."""

    @classmethod
    def parse(cls, text: str) -> QuarantineLimit:
        """A count ("5") or a percentage 0..100% ("10%", at most three decimals); else a ConfigError that
        names the flag."""
        if _LIMIT.fullmatch(text) and not text.endswith("%"):
            return cls(text, count=int(text))
        if _LIMIT.fullmatch(text) and Fraction(text[:-1]) <= 100:
            return cls(text, percent=Fraction(text[:-1]))
        raise ConfigError("--max-quarantined must be a count (e.g. 5) or a percentage 0..100% (e.g. 10%)")

    @property
    def unlimited(self) -> bool:
        """A limit that never defers a quarantine: no budget to read, no list, no watch. Any spelling of 100%
        ("100.0%" too): the parsed value decides, not the text."""
        return self.percent is not None and self.percent >= 100

    def of(self, gpu_nodes: int) -> int:
        """As a node count: the count, or the percentage of `gpu_nodes` rounded up (so that a small pool
        can still quarantine one node)."""
        if self.percent is None:
            return self.count or 0
        return math.ceil(self.percent * gpu_nodes / 100)

    def __str__(self) -> str:
        return self.text


DEFAULT_MAX_QUARANTINED = QuarantineLimit.parse("10%")


@dataclass(frozen=True)
class NodeSettings:
    """What gpuguard does to its own node."""

    name: str | None = None
    """The node the agent runs on (downward API NODE_NAME); None only in a dry run."""
    taint_effect: str = "NoSchedule"
    """NoSchedule keeps new pods off and leaves running ones alone: a sick GPU's pods fail on their own,
    and a false positive must not evict a healthy serving fleet."""
    cordon: bool = True
    """Also set spec.unschedulable, so `kubectl get nodes` shows it and drain tooling sees it."""
    recover: bool = True
    """Remove our own taint once the fault's evidence is gone (a repaired node returns without a human)."""
    recover_after: int = 3
    """Healthy checks at --interval before recovery, measured in time (judge/streaks.py: a run that began
    at t0 is 1 + (now - t0) // interval checks long): one lucky read must not undo a quarantine, and checks
    that events bring early do not count twice."""
    degraded_taint: bool = True
    """A degraded GPU (the second level) also puts a PreferNoSchedule taint gpuguard.io/gpu-degraded
    on its node, so the scheduler prefers other nodes; False: the condition, label and annotation only."""
    accelerated_condition: bool = False
    """Also mirror the quarantine into the node condition AcceleratedHardwareReady, in the EKS node monitoring
    agent's reasons, which EKS node auto-repair and Karpenter's AWS repair act on (False for 10 minutes:
    the node is replaced). Off: on other platforms nothing reads it, and where the EKS agent runs it owns
    the condition (gpuguard then writes none; node/accelerated.py)."""
    dry_run: bool = False
    """Log the exact change instead of writing it."""
    kubeconfig: str | None = None
    """None: in-cluster config, then KUBECONFIG, then ~/.kube/config."""
    api_timeout: float = 10.0
    """Seconds per API request (connect and read), so a hanging API server never stalls the agent."""
    max_quarantined: QuarantineLimit = DEFAULT_MAX_QUARANTINED
    """Cluster-wide budget: GPU nodes gpuguard may fully quarantine at once (a count or a percentage of the
    nodes `gpu_node_selector` selects). A bad driver roll-out that makes every node report an Xid must
    not take the whole fleet out of service; past the budget a node only gets a PreferNoSchedule taint."""
    gpu_node_selector: str = GPU_NODE_SELECTOR
    """The GPU nodes a percentage budget counts, as an equality label selector ("" for every node): the
    same labels as the DaemonSet's nodeSelector, so the budget counts exactly the nodes agents run on."""
    node_resync: float = 30.0
    """Seconds between re-reads of the node while gpuguard holds anything on it (a quarantine, its record,
    the startup gate): the kubelet's new bootID after a reboot and an operator's override are seen within
    this long. A node gpuguard holds nothing on is never re-read (a healthy fleet costs no requests)."""
    budget_recheck: float = 60.0
    """Seconds between budget lists while a quarantine is deferred: one cheap request a minute at most."""
    budget_count_spread: float = 3600.0
    """Seconds over which an agent's first count of the GPU nodes (a percentage budget) falls at random
    after its start: a fleet that starts at once lists the fleet once per agent, so N agents spread N lists
    of N nodes over this long. An hour: 5,000 agents list about 1.4 times a second, near the steady rate
    (one a second fleet-wide); a minute (the old default) put 83 lists of 5,000 nodes a second on the API
    server at every fleet-wide start (docs/performance.md, "The fleet at 5,000 nodes"). Until then the
    budget proves room without the count where it can (always with nothing quarantined), and a fault whose
    room it cannot prove lists in its path, as before the budget was read from a watch."""
    slice_refresh: float = 600.0
    """Seconds: a GPU fault that finds no device in the slices read them again after its node taint, when
    the last read is older than this (a DRA driver that started after the agent). At most one request per
    this long and none on a healthy node, so that a fault's transition keeps costing its three requests
    (docs/design.md)."""
    flap_window: float = 600.0
    """Seconds: a fault that comes back within this long of the previous one keeps the node quarantined
    until the GPUs stay healthy for this long (one write per episode, not one per flip)."""
    gate_taint_key: str = "gpuguard.io/unverified"
    """The startup gate's taint key: GPU nodes register with it (kubelet --register-with-taints, Karpenter's
    startupTaints, a Cluster Autoscaler node group's `startup-taint.cluster-autoscaler.kubernetes.io/...`
    taint) and no workload lands on them before gpuguard's first complete healthy check."""
    gate_removal: str = "gpuguard"
    """Who lifts the gate: "gpuguard" removes it after the first complete healthy check; "external" leaves it
    to a node-readiness controller that removes it (e.g. a `readiness.k8s.io/...` taint) when the GPUHealthy
    condition gpuguard writes turns True."""
    api_qps: float = 5.0
    """Client-side rate limit, requests per second on average (0: none). A fault costs at most 5 requests
    (LIST, patch, condition, Event, the order check's LIST), which the burst covers, so the limit never
    delays a taint; it holds an agent whose loop goes wrong (a conflict storm, a retry bug) to this rate,
    client-go's default; it never delayed a request in the fleet bench (docs/performance.md)."""
    api_burst: int = 20
    """Requests the client may send at once before the rate applies: a transition (5) plus 7 rounds of a
    409 conflict (read and patch again) without waiting."""
    startup_jitter: float = 30.0
    """Seconds: the reconciler's first request (the read of the node, then the start-up writes) waits a
    random 0..this, so a DaemonSet installed or restarted on 5,000 nodes at once reaches the API server at
    about 170 agents a second instead of as one herd: a third of the rate measured clean at 1,000 nodes
    (docs/performance.md). A fault found
    meanwhile ends the wait at once; checks, /healthz and the durable state do not wait, only /readyz.
    Not applied on a host that booted within 10 minutes (a new node: its startup gate waits for the
    agent). 0: no jitter."""
    quarantine: str = "auto"
    """What a fault of one GPU quarantines: "auto" that GPU alone (a DRA DeviceTaintRule) where the node
    publishes its GPUs in ResourceSlices of `dra_driver`, else the node; "node" always the node (as before
    DRA); "gpu" as auto, and a per-GPU fault whose GPU is not published is logged as an error (the node
    taint still stands in: never a fault without a quarantine). One bad GPU of eight costs one GPU."""
    dra_driver: str = "gpu.nvidia.com"
    """The DRA driver whose ResourceSlices publish the node's GPUs (NVIDIA's k8s-dra-driver-gpu); the pool
    is the node's name, the device's `uuid` attribute the GPU's UUID."""
    refusal_backoff: float = 300.0
    """Seconds a request the API server refused (401, 403, 404, 422: RBAC, an admission policy) is not sent
    again: one ERROR line and one request per 5 minutes instead of one per check
    (gpuguard.quarantine.apistate)."""
    retry_max_wait: float = 2.0
    """Cap of the exponential backoff between retries of a transient API failure: a repaired API server
    sees the pending write within this long of coming back."""
    evict: str = "none"
    """"gpu-pods": evict (policy/v1 Eviction, PodDisruptionBudgets hold) the pods whose containers hold a
    faulty GPU (gpuguard.eviction). "none" by default: evicting is a write power over other teams' pods that
    the agent's token did not have before (docs/design.md, "Evicting the pods on a faulty GPU"), so an
    operator turns it on and lists the namespaces it may evict in."""
    evict_grace_period: int | None = None
    """Seconds each evicted pod gets to stop; None: the pod's own terminationGracePeriodSeconds."""
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    """The kubelet's PodResources socket (the DaemonSet mounts its folder read-only when eviction is on)."""
    repair: str = "off"
    """"on" or "dry-run": ask the repair executor to reset a quarantined GPU whose faults a reset remedies
    (the request annotation on this node, docs/design.md "Repair"); "off" by default, as the executor is."""
    repeat_limit: int = 3
    """Fault episodes of one GPU within `repeat_window` that make it a repeat offender, held for repair
    until an operator releases it (0: off). 3: GPUd asks for hardware inspection once an Xid comes back
    after 2 reboots (its --xid-reboot-threshold, default 2); NVSentinel escalates after 5 fatal Xids in
    24 h or 5 remediations in 7 days."""
    repeat_window: float = 604800.0
    """Seconds over which `repeat_limit` counts episodes: 7 days, NVSentinel's window for remediations. A
    GPU that faults once a week is never held."""


@dataclass(frozen=True)
class ServerSettings:
    host: str = ""
    """"": every interface, IPv6 and IPv4 (a dual-stack socket; IPv4 only where the host has no IPv6).
    Kubelet probes the pod IP, whichever family the cluster gives the pod."""
    port: int = 9847
    """gpuguard's port for /healthz, /readyz and /metrics."""


@dataclass(frozen=True)
class Config:
    backend: str = "nvml"
    scenario: str | None = None
    interval: float = 3.0
    """Seconds between polls (ECC, lost GPUs). Xids do not wait for it: they wake the loop at once."""
    state_dir: str | None = None
    """Durable fault state (gpuguard.store.state); None: none (dry runs, tests)."""
    boot_id_file: str = "/proc/sys/kernel/random/boot_id"
    run_for: float | None = None
    """Stop after this many seconds (demos and tests); None: until SIGTERM."""
    nvml_load_timeout: float = 30.0
    """Seconds `watch` waits for libnvidia-ml.so.1 to become loadable before it exits 3. The NVIDIA container
    toolkit injects the library only when a container starts: an agent that started before the driver
    (GPU Operator) must be restarted by kubelet to get it. 30 s rides out nothing else worth waiting for."""
    nvml_call_timeout: float = 5.0
    """Seconds one NVML call may take before its GPU (or the node) is reported unresponsive
    (gpuguard.nvml.real.deadline says why 5)."""
    kernel_log: str | None = None
    """The kernel log read as a second source of Xids (/dev/kmsg; a stand-in file in tests, the demo); None:
    off, the default, since reading it takes a hostPath device and a privilege (docs/security.md)."""
    log_format: str = "auto"
    expected_gpus_label: str = GPU_COUNT_LABEL
    """`check` only: the node label holding the node's GPU count ("": the node is never read)."""
    pci_root: str | None = "/sys/bus/pci/devices"
    """Where the NVIDIA GPUs on the PCI bus are listed (gpu-missing against NVML); tests point it elsewhere,
    None: not compared."""
    signals_config: SignalConfig | None = None
    """--signals-config, parsed: its global part is in policy.signals; its node rules apply once the agent
    has read its node's labels."""
    policy: PolicySettings = field(default_factory=PolicySettings)
    node: NodeSettings = field(default_factory=NodeSettings)
    server: ServerSettings = field(default_factory=ServerSettings)

    def __post_init__(self) -> None:
        validate(self)


MIN_INTERVAL = 0.05

# The GPU nodes' label selector: alternatives separated by ";" (a node that matches any is a GPU node, as the
# DaemonSet's ORed nodeSelectorTerms), each key[=value][,key[=value]] (a bare key: the label exists).
_LABEL_KEY = r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?"
_ALTERNATIVE = rf"{_LABEL_KEY}(={_LABEL_VALUE})?(,{_LABEL_KEY}(={_LABEL_VALUE})?)*"
_SELECTOR = re.compile(rf"^{_ALTERNATIVE}(;{_ALTERNATIVE})*$")
_LABEL_KEY_ONLY = re.compile(rf"^{_LABEL_KEY}$")
_DRIVER = re.compile(r"^(?=.{1,63}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def validate(cfg: Config) -> None:
    """Raise ConfigError (one line, names the flag) for any value that cannot work."""
    if cfg.backend not in ("nvml", "mock"):
        raise ConfigError(f"--backend must be nvml or mock, not {cfg.backend!r}")
    if cfg.scenario is not None and cfg.backend != "mock":
        raise ConfigError("--scenario needs --backend mock")
    if not MIN_INTERVAL <= cfg.interval <= 3600:  # NaN fails this too
        raise ConfigError(f"--interval must be between {MIN_INTERVAL} and 3600 seconds")
    if cfg.run_for is not None and not 0 < cfg.run_for < 1e9:  # "not >": NaN fails too
        raise ConfigError("--run-for must be > 0")
    if not 0 < cfg.nvml_load_timeout <= 3600:  # NaN fails this too
        raise ConfigError("--nvml-load-timeout must be between 0 and 3600 seconds")
    if not 0 < cfg.nvml_call_timeout <= 60:  # NaN fails this too
        raise ConfigError("--nvml-call-timeout must be between 0 and 60 seconds")
    if cfg.kernel_log is not None and not cfg.kernel_log.startswith("/"):
        raise ConfigError(f"--kernel-log must be an absolute path or off, not {cfg.kernel_log!r}")
    if cfg.log_format not in ("auto", "json", "console"):
        raise ConfigError("--log-format must be json or console")
    if cfg.expected_gpus_label and not _LABEL_KEY_ONLY.match(cfg.expected_gpus_label):
        raise ConfigError(f"--expected-gpus-label {cfg.expected_gpus_label!r}: not a label key")
    p = cfg.policy
    if p.ecc_threshold < 0:
        raise ConfigError("--ecc-threshold must be >= 0")
    if p.expected_gpus is not None and p.expected_gpus < 0:
        raise ConfigError("--expected-gpus must be >= 0")
    n = cfg.node
    if n.taint_effect not in TAINT_EFFECTS:
        raise ConfigError(f"--taint-effect must be one of {', '.join(TAINT_EFFECTS)}")
    try:
        validation.taint_key(n.gate_taint_key)
    except ConfigError as exc:
        raise ConfigError(f"--gate-taint-key: {exc}") from None
    if n.gate_taint_key == f"{validation.PREFIX}gpu-unhealthy":
        raise ConfigError(f"--gate-taint-key must not be {n.gate_taint_key}, the fault taint's key")
    if n.gate_removal not in GATE_REMOVALS:
        raise ConfigError(f"--gate-removal must be one of {', '.join(GATE_REMOVALS)}")
    if n.quarantine not in QUARANTINE_MODES:
        raise ConfigError(f"--quarantine must be one of {', '.join(QUARANTINE_MODES)}")
    if not _DRIVER.match(n.dra_driver):
        raise ConfigError(f"--dra-driver {n.dra_driver!r}: expected a DNS subdomain such as gpu.nvidia.com")
    if not 0 < n.budget_recheck <= 86400:
        raise ConfigError("--budget-recheck must be between 0 and 86400 seconds")
    if not 0 <= n.api_qps <= 1000:  # NaN fails this too
        raise ConfigError("--api-qps must be between 0 (no limit) and 1000")
    if not 1 <= n.api_burst <= 1000:
        raise ConfigError("--api-burst must be between 1 and 1000")
    if not 0 <= n.startup_jitter <= 3600:
        raise ConfigError("--startup-jitter must be between 0 and 3600 seconds")
    if not 0 <= n.budget_count_spread <= 86400:
        raise ConfigError("--budget-count-spread must be between 0 and 86400 seconds")
    if not 0 <= n.slice_refresh <= 86400:
        raise ConfigError("--slice-refresh must be between 0 and 86400 seconds")
    if n.recover_after < 1:
        raise ConfigError("--recover-after must be >= 1")
    if not 0 < n.refusal_backoff <= 86400:
        raise ConfigError("--refusal-backoff must be between 0 and 86400 seconds")
    if not 0 < n.node_resync <= 86400:
        raise ConfigError("--node-resync must be between 0 and 86400 seconds")
    if n.gpu_node_selector and not _SELECTOR.match(n.gpu_node_selector):
        raise ConfigError(
            f"--gpu-node-selector {n.gpu_node_selector!r}: expected key[=value][,key[=value]], alternatives "
            "separated by ';' (label syntax)"
        )
    if n.repair not in REPAIR_MODES:
        raise ConfigError(f"--repair must be one of {', '.join(REPAIR_MODES)}")
    if n.evict not in EVICT_MODES:
        raise ConfigError(f"--evict must be one of {', '.join(EVICT_MODES)}")
    if n.evict_grace_period is not None and not 0 <= n.evict_grace_period <= 86400:
        raise ConfigError("--evict-grace-period must be between 0 and 86400 seconds")
    if not 0 <= n.flap_window <= 7 * 86400:  # NaN fails every comparison: rejected too
        raise ConfigError("--flap-window must be between 0 and 604800 seconds")
    if not 0 <= n.repeat_limit <= 32:  # the history keeps 32 episodes per GPU
        raise ConfigError("--repeat-limit must be between 0 (off) and 32")
    if not 0 < n.repeat_window <= 365 * 86400:
        raise ConfigError("--repeat-window must be between 0 and 31536000 seconds")
    if n.name is not None:
        try:
            validation.node_name(n.name)
        except ConfigError as exc:
            raise ConfigError(f"--node: {exc}") from None
    if n.name is None and not n.dry_run:
        raise ConfigError("no node name: pass --node or set NODE_NAME (or use --dry-run)")
    if not 0 <= cfg.server.port <= 65535:
        raise ConfigError("--listen port must be 0..65535")


def parse_xids(text: str, *, flag: str) -> frozenset[int]:
    """'79, 48,109' -> {48, 79, 109}; '' -> {}."""
    codes: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        if not (part.isascii() and part.isdigit()) or len(part) > 6:
            raise ConfigError(f"{flag}: {part!r} is not an Xid code (comma-separated integers)")
        codes.add(int(part))
    return frozenset(codes)


def parse_listen(text: str) -> ServerSettings:
    """'HOST:PORT', ':PORT' (every interface, both families) or '[::1]:PORT'."""
    host, sep, port = text.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or len(port) > 5:
        raise ConfigError(f"--listen {text!r}: expected HOST:PORT, e.g. :9847 or 127.0.0.1:9847")
    return ServerSettings(host=host.strip("[]"), port=int(port))
