"""The repair executor's settings (`gpuguard repair-executor`), frozen and validated once at the edge, each
default with why (docs/design.md, "Repair")."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from gpuguard.core.errors import ConfigError

REPAIR_MODES = ("off", "dry-run", "on")


@dataclass(frozen=True)
class RepairSettings:
    node: str
    """The node this executor serves (downward API NODE_NAME): it acts on no other node's request."""
    mode: str = "off"
    """"on": reset; "dry-run": log what it would do and write nothing; "off" by default: a reset takes a GPU
    away from its pods, and an operator turns that on."""
    reset_command: str = "nvidia-smi --gpu-reset -i {index}"
    """The reset, `{index}` and `{uuid}` filled in: nvidia-smi's, which resets one GPU and refuses while any
    process holds it (nvidia-smi(1), "--gpu-reset")."""
    validate_command: str = ""
    """Run after the reset reads healthy, before the GPU is let go (e.g. `dcgmi diag -r 1 -i {index}`);
    "": gpuguard's own proof only."""
    command_timeout_s: float = 300.0
    """A reset on an 8-GPU HGX board takes seconds; a DCGM level-1 diagnostic about a minute."""
    window_s: float = 86400.0
    """A fault that comes back within this long of the GPU's reset (or its reboot request) climbs the
    ladder instead of trying the same again: a day, the NVIDIA health-validation ladder's "recurring"."""
    drain_timeout_s: float = 900.0
    """How long its pods may take to leave (PodDisruptionBudgets hold) before the reset is given up."""
    idle_gap_s: float = 5.0
    """Between the two idle proofs: a pod the kubelet was still starting shows by then."""
    proof_timeout_s: float = 60.0
    """How long the GPU may take after the reset to read healthy (the driver re-initialises it)."""
    poll_s: float = 10.0
    """How often the node is read for a request: a reset is minutes of work, ten seconds of wait is noise."""
    per_hour: float = 6.0
    """Cluster-wide resets an hour (the Lease's token bucket), refilled by itself."""
    burst: int = 2
    """Cluster-wide resets at once at most: a bad driver roll-out that asks every GPU for a reset resets
    two, then six an hour, while the operators look."""
    namespace: str = "gpuguard"
    """Where the pace's Lease lives (the executor's own namespace)."""
    reboot_sentinel: str = "/var/run/gpuguard-reboot/reboot-required"
    """The reboot request: a file kured watches (its --reboot-sentinel, or --reboot-sentinel-command that
    tests this file beside the OS's /var/run/reboot-required), in a host folder of gpuguard's own: a hostPath
    of the whole /var/run would hand the executor the container runtime's socket."""
    dra_driver: str = "gpu.nvidia.com"
    """The DRA driver whose ResourceSlices publish the GPUs (the agent's --dra-driver): a pod that claims
    the GPU through DRA is found by its device."""
    log_format: str = "auto"
    metrics_port: int = 9848
    """/metrics (gpuguard_repair_steps_total) on this port; 0: none. The agent's is 9847."""
    api_timeout: float = 10.0
    kubeconfig: str | None = None
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"


def validate(s: RepairSettings) -> RepairSettings:
    if not s.node:
        raise ConfigError("the repair executor needs --node (or NODE_NAME)")
    if s.mode not in REPAIR_MODES:
        raise ConfigError(f"--repair must be one of {', '.join(REPAIR_MODES)}")
    for name, text in (("--reset-command", s.reset_command), ("--validate-command", s.validate_command)):
        try:
            argv = shlex.split(text)
            [a.format(index=0, uuid="GPU-x") for a in argv]
        except (ValueError, KeyError, IndexError) as exc:
            raise ConfigError(f"{name}: cannot be parsed ({exc}); placeholders: {{index}}, {{uuid}}") from exc
        if name == "--reset-command" and not argv:
            raise ConfigError("--reset-command must not be empty")
    for name, value in (
        ("--window", s.window_s),
        ("--drain-timeout", s.drain_timeout_s),
        ("--proof-timeout", s.proof_timeout_s),
        ("--poll", s.poll_s),
        ("--per-hour", s.per_hour),
    ):
        if not 0 < value <= 30 * 86400:
            raise ConfigError(f"{name} must be a positive number of at most 30 days")
    if not 0 <= s.metrics_port <= 65535:
        raise ConfigError("--metrics-port must be between 0 and 65535")
    if not 1 <= s.burst <= 100:
        raise ConfigError("--burst must be between 1 and 100")
    return s


def argv(template: str, *, index: int, uuid: str) -> list[str]:
    """A command of the settings with its placeholders filled in."""
    return [a.format(index=index, uuid=uuid) for a in shlex.split(template)]
