"""Every flag of gpuguard's commands, declared once (gpuguard.cli.flag.Flag: name, variable, type, the
settings field whose default is the flag's, parser, help). The click options are made from these
declarations and the settings are built from them (gpuguard.cli.settings), so a default is written only in
gpuguard.core.config."""

from __future__ import annotations

from collections.abc import Callable

import click

from gpuguard.cli.flag import FINITE, F, Flag
from gpuguard.core.config import (
    DEFAULT_IGNORED_XIDS,
    EVICT_MODES,
    GATE_REMOVALS,
    QUARANTINE_MODES,
    STATE_DIR,
    TAINT_EFFECTS,
    Config,
    NodeSettings,
    PolicySettings,
    QuarantineLimit,
    ServerSettings,
    parse_listen,
)
from gpuguard.core.repairconfig import REPAIR_MODES


def _strip(text: str) -> str:
    return text.strip()


def _or_none(text: str | None) -> str | None:
    return text or None


def _off_or_path(text: str | None) -> str | None:
    text = (text or "").strip()
    return None if text in ("", "off") else text


def _listen_text(server: ServerSettings) -> str:
    return f"{server.host}:{server.port}"


def _declare(*flags: Flag) -> dict[str, Flag]:
    return {f.dest: f for f in flags}


FLAGS = _declare(
    # the GPUs: `watch` and `check`
    Flag(
        "--backend",
        "nvml: the GPUs through NVIDIA's NVML. mock: a scenario file, no GPU needed.",
        (Config, "backend"),
        type=click.Choice(["nvml", "mock"]),
    ),
    Flag("--scenario", "Mock scenario file (YAML). Default: the embedded demo.", (Config, "scenario")),
    Flag(
        "--kernel-log",
        "Read Xids and SXids from the kernel log too: /dev/kmsg (or a file in its record format), replayed "
        "from the boot's start at start; 'off': NVML's events only.",
        (Config, "kernel_log"),
        parse=_off_or_path,
    ),
    Flag(
        "--ecc-threshold",
        "Volatile uncorrected ECC errors tolerated per GPU.",
        (PolicySettings, "ecc_threshold"),
        type=int,
    ),
    Flag(
        "--ignore-xids",
        "Comma-separated Xids that are not faults ('' for none); replaces the default list "
        f"({', '.join(map(str, sorted(DEFAULT_IGNORED_XIDS)))}).",
        default=None,
        empty_env=True,
    ),
    Flag("--fatal-xids", "Comma-separated Xids to remove from the ignored list.", default=""),
    Flag(
        "--expected-gpus",
        "GPUs this node must have. Default: the count at the first successful NVML init.",
        (PolicySettings, "expected_gpus"),
        type=int,
    ),
    Flag(
        "--allow-no-gpu",
        "'No GPU here' (no NVML library, no driver, zero GPUs) is not a fault; a broken driver still is.",
        (PolicySettings, "allow_no_gpu"),
        is_flag=True,
    ),
    Flag(
        "--log-format",
        "Default: console on a terminal, JSON otherwise (in a cluster).",
        (Config, "log_format"),
        type=click.Choice(["json", "console"]),
        default=None,
    ),
    # `watch`
    Flag(
        "--interval",
        "Seconds between polls (>= 0.05). Xids do not wait for it.",
        (Config, "interval"),
        type=FINITE,
    ),
    Flag(
        "--node",
        "This agent's node. Default: env NODE_NAME (the downward API).",
        (NodeSettings, "name"),
        parse=_or_none,
        envvars=("NODE_NAME",),
    ),
    Flag(
        "--kubeconfig",
        "Default: in-cluster config, then KUBECONFIG, then ~/.kube/config.",
        (NodeSettings, "kubeconfig"),
    ),
    Flag(
        "--listen",
        "HOST:PORT for /healthz, /readyz and /metrics (port 0: any free port).",
        (Config, "server"),
        parse=parse_listen,
        text=_listen_text,
    ),
    Flag(
        "--dry-run",
        "Write nothing to the cluster; log the exact change instead. Needs no cluster.",
        (NodeSettings, "dry_run"),
        is_flag=True,
    ),
    Flag(
        "--taint-effect",
        "Effect of gpuguard.io/gpu-unhealthy.",
        (NodeSettings, "taint_effect"),
        type=click.Choice(TAINT_EFFECTS),
    ),
    Flag(
        "--gate-taint-key",
        "The startup gate's taint key: nodes that register with it get no workload before gpuguard's "
        "first complete healthy check (e.g. startup-taint.cluster-autoscaler.kubernetes.io/gpuguard for "
        "Cluster Autoscaler; any key listed in a Karpenter NodePool's startupTaints).",
        (NodeSettings, "gate_taint_key"),
        parse=_strip,
    ),
    Flag(
        "--gate-removal",
        "Who lifts the gate: gpuguard itself, or a node-readiness controller that removes it when the "
        "GPUHealthy condition turns True (gpuguard then only writes the condition).",
        (NodeSettings, "gate_removal"),
        type=click.Choice(GATE_REMOVALS),
    ),
    Flag("--no-cordon", "Taint only; do not cordon.", (NodeSettings, "cordon"), is_flag=True, negate=True),
    Flag(
        "--accelerated-hardware-condition",
        "Also write the node condition AcceleratedHardwareReady (False while the node is quarantined, with "
        "the EKS node monitoring agent's reasons) for EKS node auto-repair and Karpenter; never over one "
        "another writer owns.",
        (NodeSettings, "accelerated_condition"),
        is_flag=True,
    ),
    Flag(
        "--no-degraded-taint",
        "A degraded GPU gets no PreferNoSchedule taint gpuguard.io/gpu-degraded on its node (the GPUDegraded "
        "condition, label and annotation stay).",
        (NodeSettings, "degraded_taint"),
        is_flag=True,
        negate=True,
    ),
    Flag(
        "--recover-after",
        "Healthy checks at --interval before gpuguard removes its own taint, measured in time: (N-1) x "
        "--interval seconds of healthy readings (checks that events bring earlier never shorten it).",
        (NodeSettings, "recover_after"),
        type=int,
    ),
    Flag(
        "--no-recover",
        "Never remove the taint; a human does.",
        (NodeSettings, "recover"),
        is_flag=True,
        negate=True,
    ),
    Flag(
        "--max-quarantined",
        "Cluster-wide budget of GPU nodes gpuguard may fully quarantine: a count or a percentage of "
        "the GPU nodes (--gpu-node-selector). Past it, only a PreferNoSchedule taint.",
        (NodeSettings, "max_quarantined"),
        parse=lambda text: QuarantineLimit.parse(text.strip()),
    ),
    Flag(
        "--gpu-node-selector",
        "Label selector of the GPU nodes a percentage budget counts: the DaemonSet's nodeSelector, "
        "as key=value[,key=value] ('' for every node).",
        (NodeSettings, "gpu_node_selector"),
        parse=_strip,
        empty_env=True,
    ),
    Flag(
        "--quarantine",
        "What a fault of one GPU (ECC, an Xid, a row-remap failure, a GPU reset asked for) quarantines: "
        "auto that GPU alone (a DRA DeviceTaintRule) where the node's GPUs are in ResourceSlices of "
        "--dra-driver, else the node; node always the node; gpu as auto, an unpublished GPU logged as an "
        "error.",
        (NodeSettings, "quarantine"),
        type=click.Choice(QUARANTINE_MODES),
    ),
    Flag(
        "--dra-driver",
        "The DRA driver whose ResourceSlices (pool = the node's name) publish the GPUs, matched by UUID.",
        (NodeSettings, "dra_driver"),
        parse=_strip,
    ),
    Flag(
        "--flap-window",
        "Seconds: a fault that returns within this window keeps the node quarantined until the GPUs "
        "stay healthy for a whole window.",
        (NodeSettings, "flap_window"),
        type=FINITE,
    ),
    Flag(
        "--repeat-limit",
        "Fault episodes of one GPU within --repeat-window that hold it for repair (a repeat offender: not "
        "released by reboots or resets until `gpuguard release`); 0: off.",
        (NodeSettings, "repeat_limit"),
        type=int,
    ),
    Flag(
        "--repeat-window",
        "Seconds over which --repeat-limit counts a GPU's fault episodes (default 7 days).",
        (NodeSettings, "repeat_window"),
        type=FINITE,
    ),
    Flag(
        "--state-dir",
        "Where faults that only a reboot clears are kept across agent restarts ('' to disable; a dry run "
        "keeps none).",
        (Config, "state_dir"),
        parse=_or_none,
        default=STATE_DIR,
        empty_env=True,
    ),
    Flag(
        "--startup-jitter",
        "Seconds: the first request to the API server waits a random 0..this, so agents that start at "
        "once across a fleet do not arrive together (0: none). A fault found meanwhile does not wait.",
        (NodeSettings, "startup_jitter"),
        type=FINITE,
    ),
    Flag(
        "--api-qps",
        "Client-side rate limit: API requests per second on average (0: none).",
        (NodeSettings, "api_qps"),
        type=FINITE,
    ),
    Flag(
        "--api-burst",
        "Client-side rate limit: requests sent at once before --api-qps applies.",
        (NodeSettings, "api_burst"),
        type=int,
    ),
    Flag(
        "--budget-recheck",
        "Seconds between budget lists while a quarantine is deferred.",
        (NodeSettings, "budget_recheck"),
        type=FINITE,
        hidden=True,
    ),
    Flag(
        "--budget-count-spread",
        "Seconds over which the first GPU-node count (a percentage budget) falls after start.",
        (NodeSettings, "budget_count_spread"),
        type=FINITE,
        hidden=True,
    ),
    Flag(
        "--slice-refresh",
        "Seconds: a GPU fault that finds no device re-reads the slices if the last read is older.",
        (NodeSettings, "slice_refresh"),
        type=FINITE,
        hidden=True,
    ),
    Flag(
        "--node-resync",
        "Seconds between re-reads of the node while gpuguard holds anything on it.",
        (NodeSettings, "node_resync"),
        type=FINITE,
        hidden=True,
    ),
    Flag(
        "--refusal-backoff",
        "Seconds a request the API server refused is not sent again (tests shorten it).",
        (NodeSettings, "refusal_backoff"),
        type=FINITE,
        hidden=True,
    ),
    Flag(
        "--boot-id-file",
        "The host's boot ID (tests point it elsewhere to simulate a reboot).",
        (Config, "boot_id_file"),
        hidden=True,
    ),
    Flag("--run-for", "Stop after this many seconds (demos, tests).", (Config, "run_for"), type=FINITE),
    Flag(
        "--nvml-load-timeout",
        "Seconds to wait for a loadable libnvidia-ml.so.1 at start, then exit 3 so kubelet restarts "
        "the container (the container toolkit injects the library at container start).",
        (Config, "nvml_load_timeout"),
        type=FINITE,
    ),
    Flag(
        "--nvml-call-timeout",
        "Seconds one NVML call may take before its GPU (or the node) is reported unresponsive.",
        (Config, "nvml_call_timeout"),
        type=FINITE,
        hidden=True,
    ),
    Flag(
        "--signals-config",
        "A YAML file that changes the health signals' levels (fault, degraded, ignore), thresholds and "
        "windows, globally and per node label selector (docs/design.md, 'Health signals').",
        default=None,
    ),
    Flag(
        "--pci-root",
        "Where sysfs lists the PCI devices (tests point it elsewhere); GPUs on the bus that NVML does not "
        "list are gpu-missing.",
        (Config, "pci_root"),
        hidden=True,
    ),
    # eviction of the pods on a faulty GPU (gpuguard.eviction)
    Flag(
        "--evict",
        "gpu-pods: evict (Eviction API; PodDisruptionBudgets hold) the pods whose containers hold a faulty "
        "GPU, as the kubelet's PodResources API reports them; none: evict nothing.",
        (NodeSettings, "evict"),
        type=click.Choice(EVICT_MODES),
    ),
    Flag(
        "--evict-grace-period",
        "Seconds an evicted pod gets to stop. Default: the pod's terminationGracePeriodSeconds.",
        (NodeSettings, "evict_grace_period"),
        type=int,
    ),
    Flag(
        "--pod-resources-socket",
        "The kubelet's PodResources socket (tests point it at a fake kubelet).",
        (NodeSettings, "pod_resources_socket"),
        hidden=True,
    ),
    Flag(
        "--repair",
        "on or dry-run: ask the repair executor to reset a quarantined GPU whose faults a reset remedies "
        "(the gpuguard.io/repair-request annotation on this node); off: ask for nothing.",
        (NodeSettings, "repair"),
        type=click.Choice(REPAIR_MODES),
    ),
    # `check`
    Flag(
        "--expected-gpus-label",
        "The node label holding how many GPUs the node has (GPU Feature Discovery's; an instance type's "
        "count where the cloud labels one). Empty: never read the node.",
        (Config, "expected_gpus_label"),
        parse=_strip,
    ),
)

# The flags of each command, in the order of their --help (FLAGS is declared in that order).
GPU_FLAGS = (
    "backend",
    "scenario",
    "kernel_log",
    "ecc_threshold",
    "ignore_xids",
    "fatal_xids",
    "expected_gpus",
    "allow_no_gpu",
    "log_format",
    "signals_config",
    "pci_root",
)
# `watch`: every flag but check's own (the last declared).
WATCH_FLAGS = tuple(name for name in FLAGS if name != "expected_gpus_label")


def options(names: tuple[str, ...]) -> Callable[[F], F]:
    """The click options of these flags, in this order in --help."""

    def decorate(f: F) -> F:
        for name in reversed(names):
            f = FLAGS[name].option()(f)
        return f

    return decorate
