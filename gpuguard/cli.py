"""Command line: `gpuguard watch` (the daemon), `gpuguard check` (one pass, a preflight), `gpuguard version`.

The only module that reads flags and the environment. Every flag can also come from env
`GPUGUARD_<FLAG_NAME>` (e.g. GPUGUARD_INTERVAL); --node also from NODE_NAME (the downward API).
Exit codes: 0 ok/healthy, 1 unhealthy (check), 2 usage or configuration error: one line, no traceback;
3 no NVML library; 4 (status, uninstall) the API server is unreachable or refused the request.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from gpuguard import __version__, validation
from gpuguard.config import (
    DEFAULT_IGNORED_XIDS,
    GPU_COUNT_LABEL,
    GPU_NODE_SELECTOR,
    Config,
    NodeSettings,
    PolicySettings,
    ServerSettings,
    parse_listen,
    parse_xids,
)
from gpuguard.errors import ConfigError, GpuguardError, NodeUpdateError, TransientApiError

EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE = 0, 1, 2
# The NVML library (libnvidia-ml.so.1) cannot be loaded at all: not a sick GPU, a node or container set-up.
EXIT_NO_NVML = 3
# `status` and `uninstall`: the API server did not answer, or refused the request (not a usage error).
EXIT_API = 4
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
                help="Comma-separated Xids that are not faults ('' for none); replaces the default list "
                f"({', '.join(map(str, sorted(DEFAULT_IGNORED_XIDS)))}).",
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
                help="'No GPU here' (no NVML library, no driver, zero GPUs) is not a fault; a broken driver "
                "still is.",
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


# Help as wide as the terminal, up to 120 columns (click's own default stops at 80).
HELP_WIDTH = 120


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": HELP_WIDTH})
@click.version_option(__version__, "-V", "--version", prog_name="gpuguard", message="%(prog)s %(version)s")
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
@_opt(
    "--gate-taint-key",
    default="gpuguard.io/unverified",
    show_default=True,
    help="The startup gate's taint key: nodes that register with it get no workload before gpuguard's "
    "first complete healthy check (e.g. startup-taint.cluster-autoscaler.kubernetes.io/gpuguard for "
    "Cluster Autoscaler; any key listed in a Karpenter NodePool's startupTaints).",
)
@_opt(
    "--gate-removal",
    type=click.Choice(["gpuguard", "external"]),
    default="gpuguard",
    show_default=True,
    help="Who lifts the gate: gpuguard itself, or a node-readiness controller that removes it when the "
    "GPUHealthy condition turns True (gpuguard then only writes the condition).",
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
    "the GPU nodes (--gpu-node-selector). Past it, only a PreferNoSchedule taint.",
)
@_opt(
    "--gpu-node-selector",
    type=str,
    default=GPU_NODE_SELECTOR,
    show_default=True,
    help="Label selector of the GPU nodes a percentage budget counts: the DaemonSet's nodeSelector, "
    "as key=value[,key=value] ('' for every node).",
)
@_opt(
    "--quarantine",
    type=click.Choice(["auto", "node", "gpu"]),
    default="auto",
    show_default=True,
    help="What a fault of one GPU (ECC, an Xid, a row-remap failure, a GPU reset asked for) quarantines: "
    "auto that GPU alone (a DRA DeviceTaintRule) where the node's GPUs are in ResourceSlices of "
    "--dra-driver, else the node; node always the node; gpu as auto, an unpublished GPU logged as an error.",
)
@_opt(
    "--dra-driver",
    type=str,
    default="gpu.nvidia.com",
    show_default=True,
    help="The DRA driver whose ResourceSlices (pool = the node's name) publish the GPUs, matched by UUID.",
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
    help="Where faults that only a reboot clears are kept across agent restarts ('' to disable; a dry run "
    "keeps none).",
)
@_opt(
    "--startup-jitter",
    type=float,
    default=NodeSettings.startup_jitter,
    show_default=True,
    help="Seconds: the first request to the API server waits a random 0..this, so agents that start at "
    "once across a fleet do not arrive together (0: none). A fault found meanwhile does not wait.",
)
@_opt(
    "--api-qps",
    type=float,
    default=NodeSettings.api_qps,
    show_default=True,
    help="Client-side rate limit: API requests per second on average (0: none).",
)
@_opt(
    "--api-burst",
    type=int,
    default=NodeSettings.api_burst,
    show_default=True,
    help="Client-side rate limit: requests sent at once before --api-qps applies.",
)
@_opt(
    "--budget-recheck",
    type=float,
    default=60.0,
    hidden=True,
    help="Seconds between budget lists while a quarantine is deferred.",
)
@_opt(
    "--budget-count-spread",
    type=float,
    default=3600.0,
    hidden=True,
    help="Seconds over which the first GPU-node count (a percentage budget) falls after start.",
)
@_opt(
    "--slice-refresh",
    type=float,
    default=600.0,
    hidden=True,
    help="Seconds: a GPU fault that finds no device re-reads the slices if the last read is older.",
)
@_opt(
    "--node-resync",
    type=float,
    default=30.0,
    hidden=True,
    help="Seconds between re-reads of the node while gpuguard holds anything on it.",
)
@_opt(
    "--refusal-backoff",
    type=float,
    default=NodeSettings.refusal_backoff,
    hidden=True,
    help="Seconds a request the API server refused is not sent again (tests shorten it).",
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
@_opt(
    "--nvml-call-timeout",
    type=float,
    default=5.0,
    hidden=True,
    help="Seconds one NVML call may take before its GPU (or the node) is reported unresponsive.",
)
def watch(**kw: Any) -> int:
    """Watch the GPUs and keep this node's taint in line with their health (the DaemonSet's command)."""
    cfg = _config(kw, watch=True)
    from gpuguard import running  # noqa: PLC0415 - the agent's imports only for the command that runs it

    if running.watch(cfg):
        import structlog  # noqa: PLC0415

        structlog.get_logger("gpuguard").error(
            "nvml.library_not_found", waited=cfg.nvml_load_timeout, exit_code=EXIT_NO_NVML, hint=NO_NVML_HINT
        )
        return EXIT_NO_NVML
    return EXIT_OK


@cli.command()
@_gpu_options
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option(
    "--at",
    "at",
    type=click.FloatRange(min=0),
    default=None,
    help="Mock backend only: check the scenario as it stands this many seconds in (its events up to then, "
    "Xids included, have happened).",
)
@_opt(
    "--node",
    type=str,
    default=None,
    envvar=["GPUGUARD_NODE", "NODE_NAME"],
    help="The node this check runs on: with a cluster named (in-cluster, --kubeconfig or KUBECONFIG) and "
    "no --expected-gpus, its --expected-gpus-label is the GPU count to expect. Default: env NODE_NAME.",
)
@_opt(
    "--kubeconfig",
    type=str,
    default=None,
    help="The cluster to read --node from. Default: in-cluster config, then KUBECONFIG; never "
    "~/.kube/config.",
)
@_opt(
    "--expected-gpus-label",
    type=str,
    default=GPU_COUNT_LABEL,
    show_default=True,
    help="The node label holding how many GPUs the node has (GPU Feature Discovery's; an instance type's "
    "count where the cloud labels one). Empty: never read the node.",
)
def check(output: str, at: float | None, **kw: Any) -> int:
    """One pass over the GPUs: exit 0 healthy, 1 unhealthy (or no GPU), 2 usage error, 3 no NVML library.

    Usable as an initContainer preflight. Xids are events: a one-shot check sees none that happened
    before it started (the taint written by `watch` is what remembers them).
    """
    cfg = _config(kw, watch=False)
    import logging  # noqa: PLC0415

    from gpuguard import logs, report, running  # noqa: PLC0415

    logs.configure(cfg.log_format, level=logging.WARNING)  # stdout is the table; stderr only problems
    result = running.check_once(cfg, at=at)
    if result.no_library:
        click.echo(f"gpuguard: {NO_NVML_HINT}", err=True)
    verdict = result.verdict
    click.echo(report.verdict_json(verdict) if output == "json" else report.verdict_table(verdict))
    if result.no_library:
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
    """The cluster view for an operator: nodes quarantined by gpuguard, and GPUs held out by its DRA device
    taint rules (the per-GPU quarantine), with reason, since and GPU. Exit 0; 2 a kubeconfig that cannot
    work; 4 the API server is unreachable or refused the request."""
    from gpuguard.quarantine.gpu.writers import quarantined_gpus  # noqa: PLC0415
    from gpuguard.quarantine.node.writers import quarantined_nodes  # noqa: PLC0415

    api = _client("status", kubeconfig)
    try:
        rows = [_printable(r) for r in (*quarantined_nodes(api), *quarantined_gpus(api))]
    except GpuguardError as exc:
        return _api_failed("status", api, exc)
    from gpuguard import report  # noqa: PLC0415

    click.echo(json.dumps(rows, indent=2) if output == "json" else report.status_table(rows))
    return EXIT_OK


def _printable(value: Any) -> Any:
    """A value read from the API, for the terminal: no control characters in the table or the JSON (another
    node's annotations can hold anything, an escape sequence included)."""
    if isinstance(value, str):
        return validation.printable(value)
    if isinstance(value, list):
        return [_printable(v) for v in value]
    if isinstance(value, dict):
        return {k: _printable(v) for k, v in value.items()}
    return value


@cli.command()
@_opt(
    "--kubeconfig",
    type=str,
    default=None,
    help="Default: in-cluster config, then KUBECONFIG, then ~/.kube/config.",
)
@click.option("--node", "nodes", multiple=True, help="A node to clean (repeatable).")
@click.option("--all", "all_nodes", is_flag=True, default=False, help="Every node of the cluster.")
@click.option("--dry-run", is_flag=True, default=False, help="Only say what would be removed.")
def uninstall(kubeconfig: str | None, nodes: tuple[str, ...], all_nodes: bool, dry_run: bool) -> int:
    """Remove every gpuguard.io/ taint, label and annotation, the GPUHealthy condition and the cordons
    gpuguard made, from the nodes named (--node) or all (--all), and gpuguard's DRA DeviceTaintRules of
    those nodes. Run it after removing the DaemonSet."""
    from gpuguard.cleanup import clean_node, clean_rules, node_names  # noqa: PLC0415

    if bool(nodes) == all_nodes:
        raise ConfigError("uninstall: name the nodes with --node NAME, or pass --all")
    api = _client("uninstall", kubeconfig)
    try:
        names = list(nodes) if nodes else list(node_names(api))
        for name in names:
            plan = clean_node(api, name, dry_run=dry_run)
            verb = "would remove" if dry_run and not plan.empty else "removed"
            click.echo(f"{name}: {verb if not plan.empty else 'clean:'} {plan.describe()}")
        for rule in clean_rules(api, nodes or None, dry_run=dry_run):
            click.echo(f"{rule}: {'would delete' if dry_run else 'deleted'} device taint rule")
    except GpuguardError as exc:
        return _api_failed("uninstall", api, exc)
    return EXIT_OK


def _client(command: str, kubeconfig: str | None) -> Any:
    """The API client of `status` and `uninstall`; a kubeconfig that cannot work is a usage error (exit 2)."""
    from gpuguard.kube import client as kubeclient  # noqa: PLC0415

    try:
        return kubeclient.load(kubeconfig)
    except GpuguardError as exc:
        raise ConfigError(f"{command}: {exc}") from None


def _api_failed(command: str, api: Any, exc: GpuguardError) -> int:
    """One line on stderr saying what happened to the request; exit 4 (not 2: the command was right)."""
    if not isinstance(exc, NodeUpdateError):
        raise ConfigError(f"{command}: {exc}") from None
    server = getattr(getattr(api, "creds", None), "server", "")
    if isinstance(exc, TransientApiError) and exc.status is None:
        what = f"the API server {server} is unreachable"
    elif isinstance(exc, TransientApiError):
        what = f"the API server {server} is unavailable (HTTP {exc.status})"
    else:
        what = f"the API server {server} refused the request (HTTP {exc.status})"
    click.echo(f"gpuguard: error: {command}: {what}: {' '.join(str(exc).split())}", err=True)
    return EXIT_API


@cli.command()
def version() -> int:
    """Print gpuguard's version."""
    click.echo(f"gpuguard {__version__}")
    return EXIT_OK


# Options whose empty value means something ("no state", "no ignored Xid", "every node"): an empty
# GPUGUARD_<FLAG> means the same as the empty flag. click would take an empty variable for "unset".
_EMPTY_MEANS_EMPTY = ("state_dir", "ignore_xids", "gpu_node_selector")


def _empty_env_values(kw: dict[str, Any]) -> dict[str, Any]:
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return kw
    out = dict(kw)
    for name in _EMPTY_MEANS_EMPTY:
        if (
            name in kw
            and ctx.get_parameter_source(name) == click.core.ParameterSource.DEFAULT
            and os.environ.get(_env(name)) == ""
        ):
            out[name] = ""
    return out


def _given(name: str) -> bool:
    """Whether a flag (or its env variable) was given, rather than left at its default."""
    ctx = click.get_current_context(silent=True)
    source = ctx.get_parameter_source(name) if ctx is not None else None
    return source not in (None, click.core.ParameterSource.DEFAULT) or os.environ.get(_env(name)) == ""


def _config(kw: dict[str, Any], *, watch: bool) -> Config:
    try:
        return _settings(_empty_env_values(kw), watch=watch)
    except ConfigError as exc:
        raise ConfigError(_named_by_source(str(exc))) from None


def _named_by_source(message: str) -> str:
    """A validation error names the flag (config.py knows nothing else): where the value came from the
    environment, it names the variable the operator set instead (GPUGUARD_RUN_FOR=0 is not --run-for)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return message
    for param in ctx.command.params:
        name = param.name or ""
        flags = [o for o in getattr(param, "opts", ()) if o.startswith("--")]
        source = ctx.get_parameter_source(name)
        from_env = source == click.core.ParameterSource.ENVIRONMENT or (
            name in _EMPTY_MEANS_EMPTY
            and source == click.core.ParameterSource.DEFAULT
            and os.environ.get(_env(name)) == ""
        )
        if not flags or not from_env:
            continue
        envvar = param.envvar
        names = [str(v) for v in envvar] if isinstance(envvar, list | tuple) else [str(envvar or _env(name))]
        variable = next((v for v in names if v in os.environ), names[0])
        message = re.sub(rf"(?<![\w-]){re.escape(flags[0])}(?![\w-])", variable, message)
    return message


def _settings(kw: dict[str, Any], *, watch: bool) -> Config:
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
        node = NodeSettings(dry_run=True, name=kw.get("node") or None, kubeconfig=kw.get("kubeconfig"))
        label = (kw.get("expected_gpus_label") or "").strip()
        return Config(**common, node=node, expected_gpus_label=label)
    node = NodeSettings(
        name=kw["node"] or None,
        taint_effect=kw["taint_effect"],
        gate_taint_key=kw["gate_taint_key"].strip(),
        gate_removal=kw["gate_removal"],
        cordon=not kw["no_cordon"],
        recover=not kw["no_recover"],
        recover_after=kw["recover_after"],
        dry_run=kw["dry_run"],
        kubeconfig=kw["kubeconfig"],
        max_quarantined=kw["max_quarantined"].strip(),
        gpu_node_selector=kw["gpu_node_selector"].strip(),
        node_resync=kw["node_resync"],
        refusal_backoff=kw["refusal_backoff"],
        budget_recheck=kw["budget_recheck"],
        budget_count_spread=kw["budget_count_spread"],
        slice_refresh=kw["slice_refresh"],
        flap_window=kw["flap_window"],
        startup_jitter=kw["startup_jitter"],
        api_qps=kw["api_qps"],
        api_burst=kw["api_burst"],
        quarantine=kw["quarantine"],
        dra_driver=kw["dra_driver"].strip(),
    )
    return Config(
        **common,
        interval=kw["interval"],
        run_for=kw["run_for"],
        nvml_load_timeout=kw["nvml_load_timeout"],
        nvml_call_timeout=kw["nvml_call_timeout"],
        # A mock run keeps no state in the host's directory unless told to: its made-up faults must never
        # be restored by a later real run on that host.
        state_dir=(kw["state_dir"] or None) if kw["backend"] != "mock" or _given("state_dir") else None,
        boot_id_file=kw["boot_id_file"],
        node=node,
        server=parse_listen(kw["listen"]),
    )


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
