"""Command line: `gpuguard watch` (the daemon), `gpuguard check` (one pass, a preflight), `gpuguard version`.

The only module that reads flags and the environment. Every flag can also come from env
`GPUGUARD_<FLAG_NAME>` (e.g. GPUGUARD_INTERVAL); --node also from NODE_NAME (the downward API).
Exit codes: 0 ok/healthy, 1 unhealthy (check), 2 usage or configuration error: one line, no traceback.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from types import FrameType
from typing import Any, TypeVar

import click

from gpuguard import __version__
from gpuguard.config import (
    DEFAULT_IGNORED_XIDS,
    Config,
    NodeSettings,
    PolicySettings,
    ServerSettings,
    parse_listen,
    parse_xids,
)
from gpuguard.errors import ConfigError, GpuguardError
from gpuguard.model import GPU_MISSING, Fault
from gpuguard.nvml.base import Backend

EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE = 0, 1, 2
# The NVML library (libnvidia-ml.so.1) cannot be loaded at all: not a sick GPU, a node or container set-up.
EXIT_NO_NVML = 3
NO_NVML_HINT = (
    "the NVML library libnvidia-ml.so.1 cannot be loaded: check that the NVIDIA driver is installed on the "
    "host, that this container runs with the NVIDIA container toolkit (runtimeClassName nvidia, or the GPU "
    "Operator's toolkit), and that NVIDIA_VISIBLE_DEVICES is set (all, or the GPUs' UUIDs)"
)
DEFAULT_LISTEN = f"{ServerSettings.host}:{ServerSettings.port}"

F = TypeVar("F", bound=Callable[..., Any])


def _env(name: str) -> str:
    return "GPUGUARD_" + name.upper().replace("-", "_")


def _opt(*decls: str, **kw: Any) -> Callable[[F], F]:
    name = decls[0].lstrip("-").split("/")[0]
    kw.setdefault("envvar", _env(name))
    kw.setdefault("show_envvar", True)
    return click.option(*decls, **kw)


def _gpu_options(f: F) -> F:
    for deco in reversed(
        [
            _opt(
                "--backend",
                type=click.Choice(["nvml", "mock"]),
                default="nvml",
                show_default=True,
                help="nvml: the GPUs through NVIDIA's NVML. mock: a scenario file, no GPU needed.",
            ),
            _opt(
                "--scenario",
                type=str,
                default=None,
                help="Mock scenario file (YAML). Default: the embedded demo.",
            ),
            _opt(
                "--ecc-threshold",
                type=int,
                default=0,
                show_default=True,
                help="Volatile uncorrected ECC errors tolerated per GPU.",
            ),
            _opt(
                "--ignore-xids",
                type=str,
                default=None,
                help="Comma-separated Xids that are not faults; replaces the default list "
                f"({','.join(map(str, sorted(DEFAULT_IGNORED_XIDS)))}).",
            ),
            _opt(
                "--fatal-xids",
                type=str,
                default="",
                help="Comma-separated Xids to remove from the ignored list.",
            ),
            _opt(
                "--expected-gpus",
                type=int,
                default=None,
                help="GPUs this node must have. Default: the count at the first successful NVML init.",
            ),
            _opt(
                "--allow-no-gpu",
                is_flag=True,
                default=False,
                help="An NVML init failure means 'no GPUs here', not a fault.",
            ),
            _opt(
                "--log-format",
                type=click.Choice(["json", "console"]),
                default=None,
                help="Default: console on a terminal, JSON otherwise (in a cluster).",
            ),
        ]
    ):
        f = deco(f)
    return f


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """gpuguard: taints and cordons its own Kubernetes node when a GPU goes bad."""


@cli.command()
@_gpu_options
@_opt(
    "--interval",
    type=float,
    default=3.0,
    show_default=True,
    help="Seconds between polls (>= 0.05). Xids do not wait for it.",
)
@_opt(
    "--node",
    type=str,
    default=None,
    envvar=["GPUGUARD_NODE", "NODE_NAME"],
    help="This agent's node. Default: env NODE_NAME (the downward API).",
)
@_opt(
    "--kubeconfig",
    type=str,
    default=None,
    help="Default: in-cluster config, then KUBECONFIG, then ~/.kube/config.",
)
@_opt(
    "--listen",
    type=str,
    default=DEFAULT_LISTEN,
    show_default=True,
    help="HOST:PORT for /healthz, /readyz and /metrics (port 0: any free port).",
)
@_opt(
    "--dry-run",
    is_flag=True,
    default=False,
    help="Write nothing to the cluster; log the exact change instead. Needs no cluster.",
)
@_opt(
    "--taint-effect",
    type=click.Choice(["NoSchedule", "PreferNoSchedule", "NoExecute"]),
    default="NoSchedule",
    show_default=True,
    help="Effect of gpuguard.io/gpu-unhealthy.",
)
@_opt("--no-cordon", is_flag=True, default=False, help="Taint only; do not cordon.")
@_opt(
    "--recover-after",
    type=int,
    default=3,
    show_default=True,
    help="Consecutive healthy checks before gpuguard removes its own taint.",
)
@_opt("--no-recover", is_flag=True, default=False, help="Never remove the taint; a human does.")
@_opt(
    "--max-quarantined",
    type=str,
    default="10%",
    show_default=True,
    help="Cluster-wide budget of GPU nodes gpuguard may fully quarantine: a count or a percentage of "
    "nodes labelled nvidia.com/gpu.present=true. Past it, only a PreferNoSchedule taint.",
)
@_opt(
    "--flap-window",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds: a fault that returns within this window keeps the node quarantined until the GPUs "
    "stay healthy for a whole window.",
)
@_opt(
    "--state-dir",
    type=str,
    default="/var/lib/gpuguard",
    show_default=True,
    help="Where faults that only a reboot clears are kept across agent restarts ('' to disable).",
)
@_opt(
    "--budget-recheck",
    type=float,
    default=60.0,
    hidden=True,
    help="Seconds between budget lists while a quarantine is deferred.",
)
@_opt(
    "--boot-id-file",
    type=str,
    default="/proc/sys/kernel/random/boot_id",
    hidden=True,
    help="The host's boot ID (tests point it elsewhere to simulate a reboot).",
)
@_opt("--run-for", type=float, default=None, help="Stop after this many seconds (demos, tests).")
@_opt(
    "--nvml-load-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds to wait for a loadable libnvidia-ml.so.1 at start, then exit 3 so kubelet restarts "
    "the container (the container toolkit injects the library at container start).",
)
def watch(**kw: Any) -> int:
    """Watch the GPUs and keep this node's taint in line with their health (the DaemonSet's command)."""
    cfg = _config(kw, watch=True)
    return _watch(cfg)


@cli.command()
@_gpu_options
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
def check(output: str, **kw: Any) -> int:
    """One pass over the GPUs: exit 0 healthy, 1 unhealthy (or no GPU), 2 usage error, 3 no NVML library.

    Usable as an initContainer preflight. Xids are events: a one-shot check sees none that happened
    before it started (the taint written by `watch` is what remembers them).
    """
    cfg = _config(kw, watch=False)
    import logging  # noqa: PLC0415

    from gpuguard import logs  # noqa: PLC0415
    from gpuguard.policy import evaluate  # noqa: PLC0415

    logs.configure(cfg.log_format, level=logging.WARNING)  # stdout is the table; stderr only problems

    backend = _backend(cfg)
    backend.open(lambda: None)
    try:
        snapshot = backend.snapshot()
    finally:
        backend.close()
    # One pass: an unreadable or unidentified GPU fails the preflight at once (watch waits 3 checks).
    verdict = evaluate(snapshot, previous=None, settings=replace(cfg.policy, unreadable_after=1))
    if snapshot.init_error is None and not snapshot.gpus and not cfg.policy.allow_no_gpu:
        # A preflight in a container that got no GPU must not pass.
        verdict = replace(
            verdict,
            node_faults=(
                *verdict.node_faults,
                Fault(GPU_MISSING, "NVML reports no GPUs (pass --allow-no-gpu where that is expected)"),
            ),
        )
    no_library = snapshot.init_error == "LIBRARY_NOT_FOUND" and not cfg.policy.allow_no_gpu
    if no_library:
        click.echo(f"gpuguard: {NO_NVML_HINT}", err=True)
    if output == "json":
        from gpuguard.server import health_body  # noqa: PLC0415

        body = {
            "healthy": verdict.healthy,
            "gpus": health_body(_check_status(verdict))["gpus"],
            "node_reasons": [f.message for f in verdict.node_faults],
        }
        click.echo(json.dumps(body, indent=2))
    else:
        click.echo(_table(verdict))
    if no_library:
        return EXIT_NO_NVML
    return EXIT_OK if verdict.healthy else EXIT_UNHEALTHY


@cli.command()
@_opt(
    "--kubeconfig",
    type=str,
    default=None,
    help="Default: in-cluster config, then KUBECONFIG, then ~/.kube/config.",
)
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
def status(kubeconfig: str | None, output: str) -> int:
    """The cluster view for an operator: nodes quarantined by gpuguard, with reason, since and GPU."""
    from gpuguard.node.writers import load_api_client, quarantined_nodes  # noqa: PLC0415

    try:
        rows = quarantined_nodes(load_api_client(kubeconfig))
    except GpuguardError as exc:
        raise ConfigError(f"status: {exc}") from None
    if output == "json":
        click.echo(json.dumps(rows, indent=2))
        return EXIT_OK
    if not rows:
        click.echo("no node is quarantined by gpuguard")
        return EXIT_OK
    table = [("NODE", "STATE", "REASON", "SINCE", "GPUGUARD-CORDON", "FAULTS")]
    for r in rows:
        table.append(
            (
                r["node"],
                r["state"],
                str(r["reason"]),
                str(r["since"]),
                "yes" if r["cordoned_by_gpuguard"] else "no",
                ",".join(r["faults"]),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    for row in table:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row[:5], widths, strict=True)) + "  " + row[5])
    return EXIT_OK


@cli.command()
def version() -> int:
    """Print gpuguard's version."""
    click.echo(f"gpuguard {__version__}")
    return EXIT_OK


def _config(kw: dict[str, Any], *, watch: bool) -> Config:
    ignored = (
        DEFAULT_IGNORED_XIDS
        if kw["ignore_xids"] is None
        else parse_xids(kw["ignore_xids"], flag="--ignore-xids")
    )
    ignored = ignored - parse_xids(kw["fatal_xids"], flag="--fatal-xids")
    policy = PolicySettings(
        ecc_threshold=kw["ecc_threshold"],
        ignored_xids=frozenset(ignored),
        expected_gpus=kw["expected_gpus"],
        allow_no_gpu=kw["allow_no_gpu"],
    )
    common: dict[str, Any] = {
        "backend": kw["backend"],
        "scenario": kw["scenario"],
        "log_format": kw["log_format"] or "auto",
        "policy": policy,
    }
    if not watch:
        return Config(**common, node=NodeSettings(dry_run=True))
    node = NodeSettings(
        name=kw["node"] or None,
        taint_effect=kw["taint_effect"],
        cordon=not kw["no_cordon"],
        recover=not kw["no_recover"],
        recover_after=kw["recover_after"],
        dry_run=kw["dry_run"],
        kubeconfig=kw["kubeconfig"],
        max_quarantined=kw["max_quarantined"].strip(),
        budget_recheck=kw["budget_recheck"],
        flap_window=kw["flap_window"],
    )
    return Config(
        **common,
        interval=kw["interval"],
        run_for=kw["run_for"],
        nvml_load_timeout=kw["nvml_load_timeout"],
        state_dir=kw["state_dir"] or None,
        boot_id_file=kw["boot_id_file"],
        node=node,
        server=parse_listen(kw["listen"]),
    )


def _backend(cfg: Config) -> Backend:
    if cfg.backend == "mock":
        from gpuguard.nvml.mock import MockBackend, load_scenario  # noqa: PLC0415

        return MockBackend(load_scenario(cfg.scenario))
    from gpuguard.nvml.real import NvmlBackend  # noqa: PLC0415

    return NvmlBackend()


def _watch(cfg: Config) -> int:
    from prometheus_client import REGISTRY  # noqa: PLC0415

    from gpuguard import logs  # noqa: PLC0415
    from gpuguard.agent import Agent  # noqa: PLC0415
    from gpuguard.metrics import Metrics  # noqa: PLC0415
    from gpuguard.node.budget import QuarantineBudget  # noqa: PLC0415
    from gpuguard.node.reconciler import NodeReconciler  # noqa: PLC0415
    from gpuguard.node.writers import make_writer  # noqa: PLC0415
    from gpuguard.server import HealthServer  # noqa: PLC0415
    from gpuguard.state import StateStore, read_boot_id  # noqa: PLC0415

    logs.configure(cfg.log_format)
    backend = _backend(cfg)  # a bad scenario fails here, before anything starts
    metrics = Metrics(REGISTRY)
    writer = make_writer(cfg.node, metrics)
    budget = QuarantineBudget(writer, cfg.node)
    reconciler = NodeReconciler(writer, cfg.node, budget=budget, metrics=metrics)
    state = None
    if cfg.state_dir and not cfg.node.dry_run:
        state = StateStore(cfg.state_dir, boot_id=read_boot_id(cfg.boot_id_file))
    agent = Agent(
        backend=backend,
        reconciler=reconciler,
        policy=cfg.policy,
        interval=cfg.interval,
        node_name=cfg.node.name,
        dry_run=cfg.node.dry_run,
        metrics=metrics,
        state=state,
        flap_window=cfg.node.flap_window,
        library_wait=None if cfg.backend != "nvml" or cfg.policy.allow_no_gpu else cfg.nvml_load_timeout,
    )
    try:
        server = HealthServer(agent.status, host=cfg.server.host, port=cfg.server.port, registry=REGISTRY)
    except OSError as exc:
        raise ConfigError(f"--listen {cfg.server.host}:{cfg.server.port}: {exc.strerror}") from None
    server.start()
    import structlog  # noqa: PLC0415

    structlog.get_logger("gpuguard").info("server.listening", host=cfg.server.host, port=server.port)

    def _stop(signum: int, frame: FrameType | None) -> None:
        agent.stop()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
    try:
        agent.run(run_for=cfg.run_for)
    finally:
        server.stop()
    if agent.no_library:
        structlog.get_logger("gpuguard").error(
            "nvml.library_not_found", waited=cfg.nvml_load_timeout, exit_code=EXIT_NO_NVML, hint=NO_NVML_HINT
        )
        return EXIT_NO_NVML
    return EXIT_OK


def _check_status(verdict: Any) -> Any:
    from gpuguard.model import AgentStatus  # noqa: PLC0415

    return AgentStatus(
        alive=True,
        ready=True,
        node=None,
        verdict=verdict,
        tainted=False,
        cordoned=False,
        dry_run=True,
        last_check=None,
    )


def _table(verdict: Any) -> str:
    rows = [("GPU", "UUID", "NAME", "HEALTHY", "ECC", "REASONS")]
    for g in verdict.gpus:
        ecc = "n/a" if g.ecc_uncorrected is None else str(g.ecc_uncorrected)
        rows.append(
            (
                str(g.index),
                g.uuid,
                g.name or "-",
                "yes" if g.healthy else "NO",
                ecc,
                "; ".join(f.message for f in g.faults) or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True)) + "  " + r[5] for r in rows]
    for f in verdict.node_faults:
        lines.append(f"node: {f.message}")
    lines.append("healthy" if verdict.healthy else "UNHEALTHY")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Entry point: click errors and gpuguard's ConfigError become one line on stderr and exit 2."""
    try:
        rv = cli.main(args=argv, prog_name="gpuguard", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
        sys.exit(EXIT_USAGE)
    except click.ClickException as exc:
        # One line even when click quotes an argument that holds a newline.
        click.echo(f"gpuguard: error: {' '.join(exc.format_message().split())}", err=True)
        sys.exit(EXIT_USAGE)
    except click.exceptions.Abort:
        sys.exit(130)
    except ConfigError as exc:
        click.echo(f"gpuguard: error: {' '.join(str(exc).split())}", err=True)
        sys.exit(EXIT_USAGE)
    sys.exit(rv if isinstance(rv, int) else EXIT_OK)
