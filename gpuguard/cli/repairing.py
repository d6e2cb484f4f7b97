"""`gpuguard repair-executor`: the repair executor's command (docs/design.md, "Repair"). Its flags' defaults
are its settings fields' (core/repairconfig.py); the composition root is runtime/repairroot.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from gpuguard.cli.commands import cli
from gpuguard.core.repairconfig import REPAIR_MODES, RepairSettings, validate

_DEFAULTS = {
    f.name: None if f.default is dataclasses.MISSING else f.default
    for f in dataclasses.fields(RepairSettings)
}
# flag -> (settings field, type, help)
_OPTIONS: dict[str, tuple[str, Any, str]] = {
    "--node": ("node", str, "The node this executor serves (default: env NODE_NAME)."),
    "--repair": ("mode", click.Choice(REPAIR_MODES), "on: reset; dry-run: log, write nothing; off."),
    "--reset-command": ("reset_command", str, "The reset; {index} and {uuid} are filled in."),
    "--validate-command": ("validate_command", str, "Run after the reset reads healthy ('' : none)."),
    "--command-timeout": ("command_timeout_s", float, "Seconds a reset or validation command may run."),
    "--window": ("window_s", float, "A fault back within this many seconds climbs the ladder."),
    "--drain-timeout": ("drain_timeout_s", float, "Seconds its pods may take to leave."),
    "--idle-gap": ("idle_gap_s", float, "Seconds between the two idle proofs."),
    "--proof-timeout": ("proof_timeout_s", float, "Seconds the GPU may take to read healthy."),
    "--poll": ("poll_s", float, "Seconds between reads of the node."),
    "--per-hour": ("per_hour", float, "Cluster-wide resets an hour (the pace's refill)."),
    "--burst": ("burst", int, "Cluster-wide resets at once at most."),
    "--namespace": ("namespace", str, "Where the pace's Lease lives."),
    "--reboot-sentinel": ("reboot_sentinel", str, "kured's sentinel file: the node reboot request."),
    "--kubeconfig": ("kubeconfig", str, "Default: in-cluster."),
    "--dra-driver": ("dra_driver", str, "The DRA driver whose ResourceSlices publish the GPUs."),
    "--metrics-port": ("metrics_port", int, "/metrics on this port (0: none)."),
    "--log-format": ("log_format", click.Choice(["auto", "json", "console"]), "auto: JSON off a terminal."),
    "--pod-resources-socket": ("pod_resources_socket", str, "The kubelet's PodResources socket."),
}


def _options(f: Any) -> Any:
    for flag, (name, kind, help_) in reversed(_OPTIONS.items()):
        dest, default = flag[2:].replace("-", "_"), _DEFAULTS.get(name)
        env = ["GPUGUARD_NODE", "NODE_NAME"] if name == "node" else None
        f = click.option(flag, dest, type=kind, default=default, help=help_, envvar=env, show_default=True)(f)
    return f


@cli.command("repair-executor")
@_options
@click.option("--run-for", type=float, default=None, hidden=True)
def repair_executor(run_for: float | None, **kw: Any) -> int:
    """Reset a quarantined GPU this node's agent asked for, prove it, and return it (off by default)."""
    fields = {name: kw[flag[2:].replace("-", "_")] for flag, (name, _k, _h) in _OPTIONS.items()}
    settings = validate(RepairSettings(**{**fields, "node": fields["node"] or ""}))
    from gpuguard.runtime import repairroot  # noqa: PLC0415 - the executor's imports only for its command

    repairroot.run(settings, run_for=run_for)
    return 0
