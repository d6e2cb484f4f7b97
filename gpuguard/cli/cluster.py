"""The operator's commands on the cluster: `status` (what gpuguard holds out, from the API server),
`release` (a repeat offender back after repair) and `uninstall` (every gpuguard mark off the nodes), and
how every command on the cluster begins (`node_client`, `_client`) and reports a failed request
(`_api_failed`). Exit 2 for a kubeconfig that cannot work, 4 when the API server is unreachable or refuses
the request."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar, overload

import click

from gpuguard.cli.commands import EXIT_API, EXIT_OK, EXIT_UNHEALTHY, cli
from gpuguard.cli.flags import FLAGS
from gpuguard.cli.releasing import request_options
from gpuguard.core import validation
from gpuguard.core.errors import ConfigError, GpuguardError, NodeUpdateError, TransientApiError


@cli.command()
@FLAGS["kubeconfig"].option()
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
def status(kubeconfig: str | None, output: str) -> int:
    """The fleet at a glance, then what gpuguard holds. A first line sums up: the GPU nodes, how many have a
    ready agent and how many none (named below), the quarantine budget used of its limit, the nodes gated,
    quarantined, degraded and the repeat offenders. Then the nodes quarantined by gpuguard and the GPUs held
    out by its DRA device taint rules (the per-GPU quarantine), with reason, since and GPU, and the degraded
    nodes and GPUs (the DEGRADED column: their signals and GPUs). -o json: the same as one object. Reads
    nodes, gpuguard's DaemonSets and their pods. Exit 0; 2 a kubeconfig that cannot work; 4 the API server is
    unreachable or refused the request."""
    from gpuguard.cli import fleet  # noqa: PLC0415
    from gpuguard.kube import daemonsets, pods  # noqa: PLC0415
    from gpuguard.kube import nodes as kubenodes  # noqa: PLC0415
    from gpuguard.quarantine.gpu.writers import quarantined_gpus  # noqa: PLC0415
    from gpuguard.quarantine.node.writers import degraded_nodes, quarantined_nodes  # noqa: PLC0415

    api = _client("status", kubeconfig)
    try:
        nodes = quarantined_nodes(api)
        degraded = degraded_nodes(api, skip={str(r["node"]) for r in nodes})
        rows = [_printable(r) for r in (*nodes, *degraded, *quarantined_gpus(api))]
        agents = [fleet.agents_of(d) for d in daemonsets.items(api, AGENT_SELECTOR)]
        view = fleet.fleet(
            kubenodes.select(api, "", what="list nodes"), agents, pods.selected(api, AGENT_SELECTOR), rows
        )
    except GpuguardError as exc:
        return _api_failed("status", api, exc)
    from gpuguard.cli import report  # noqa: PLC0415

    if output == "json":
        doc = {"summary": view.summary(), "fleet": view.as_json(), "rows": rows}
        click.echo(json.dumps(_printable(doc), indent=2))
    else:
        # The rows are clean already; the table's own line breaks are not the cluster's.
        click.echo("\n".join([*_printable([view.summary(), *view.notes()]), report.status_table(rows)]))
    return EXIT_OK


# gpuguard's own objects (the DaemonSet and its pods), in the chart and the plain files alike.
AGENT_SELECTOR = "app.kubernetes.io/name=gpuguard"


@cli.command()
@FLAGS["kubeconfig"].option()
@click.option("--node", required=True, help="The node whose held GPUs to release.")
@click.option("--gpu", default=None, help="The GPU's UUID (default: every held GPU of the node, '*').")
@request_options("release")
def release(
    *,
    kubeconfig: str | None,
    node: str,
    gpu: str | None,
    by: str | None,
    force: bool,
    wait: bool,
    timeout: float,
) -> int:
    """Release a GPU held as a repeat offender, after its repair: reads the node, then writes the annotation
    gpuguard.io/release on it; the node's agent checks it, records who released it and when in the GPU's
    history, lifts the hold (and only gpuguard's marks) and removes the annotation at its next re-read.
    The agents' own tokens may not write it (deploy/admission-policy.yaml). Exit 0 written (with --wait:
    lifted); 1 --wait saw no lift; 2 nothing held there, a release pending (--force replaces it) or a
    usage error; 4 the API server is unreachable or refused the request."""
    from gpuguard.cli import releasing  # noqa: PLC0415
    from gpuguard.kube import nodes  # noqa: PLC0415
    from gpuguard.quarantine.repeat.release import ALL, ANN_RELEASE, annotation, parse  # noqa: PLC0415

    who = by if by is not None else os.environ.get("USER") or "unknown"
    gpu = gpu if gpu is not None else ALL

    def request() -> str:
        now = datetime.now(UTC)
        text = annotation(gpu, by=who, at=now)
        parse(text, now=now.timestamp())  # what the agent will accept, checked before it is sent
        return text

    api, text = node_client("release", kubeconfig, node, request)
    try:
        view = releasing.read(api, node)
        why = releasing.refusal(view, gpu, force=force)
        if why is not None:
            raise ConfigError(why)
        nodes.patch(api, node, releasing.body(view, text))
        click.echo(f"{node}: release of {gpu} by {who} written; the agent lifts the hold at its next re-read")
        if not wait:
            return EXIT_OK
        seen = releasing.follow(api, node, ANN_RELEASE, text, timeout=timeout)
    except GpuguardError as exc:
        return _api_failed("release", api, exc)
    outcome = releasing.released(seen, node, gpu, timeout)
    click.echo(outcome.message, err=not outcome.done)
    return EXIT_OK if outcome.done else EXIT_UNHEALTHY


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
@FLAGS["kubeconfig"].option()
@click.option("--node", "nodes", multiple=True, help="A node to clean (repeatable).")
@click.option("--all", "all_nodes", is_flag=True, default=False, help="Every node of the cluster.")
@click.option("--dry-run", is_flag=True, default=False, help="Only say what would be removed.")
def uninstall(kubeconfig: str | None, nodes: tuple[str, ...], all_nodes: bool, dry_run: bool) -> int:
    """Remove what gpuguard placed: its gpuguard.io/ taints, labels and annotations, the GPUHealthy and
    GPUDegraded conditions and the cordons gpuguard made, from the nodes named (--node) or all (--all), and
    gpuguard's DRA DeviceTaintRules of those nodes; an operator's marks under gpuguard's keys stay (an
    operator's gpu-unhealthy taint, needs-repair label or cordon). Run it after removing the DaemonSet (it
    warns while one exists). Ends with a summary line."""
    from gpuguard.cli.uninstall import clean_node, clean_rules, summary  # noqa: PLC0415
    from gpuguard.kube.nodes import names as node_names  # noqa: PLC0415

    if bool(nodes) == all_nodes:
        raise ConfigError("uninstall: name the nodes with --node NAME, or pass --all")
    api = _client("uninstall", kubeconfig)
    try:
        _warn_while_agents_run(api)
        names = list(nodes) if nodes else list(node_names(api))
        plans = []
        for name in names:
            plan = clean_node(api, name, dry_run=dry_run)
            plans.append(plan)
            verb = "would remove" if dry_run and not plan.empty else "removed"
            click.echo(f"{name}: {verb if not plan.empty else 'clean:'} {plan.describe()}")
            if plan.kept:
                click.echo(f"{name}: kept {', '.join(plan.kept)} (an operator's, not gpuguard's)")
        rules = clean_rules(api, nodes or None, dry_run=dry_run)
        for rule in rules:
            click.echo(f"{rule}: {'would delete' if dry_run else 'deleted'} device taint rule")
    except GpuguardError as exc:
        return _api_failed("uninstall", api, exc)
    click.echo(summary(plans, rules, dry_run=dry_run))
    return EXIT_OK


def _warn_while_agents_run(api: Any) -> None:
    """A warning on stderr while gpuguard's DaemonSet exists: its agents put back what uninstall removes."""
    from gpuguard.kube import daemonsets  # noqa: PLC0415

    try:
        running = daemonsets.names(api, AGENT_SELECTOR)
    except NodeUpdateError as exc:
        why = f"HTTP {exc.status}" if exc.status else "no answer"
        click.echo(f"gpuguard: warning: uninstall: could not list gpuguard's DaemonSets ({why})", err=True)
        return
    for name in running:
        click.echo(
            f"gpuguard: warning: uninstall: the DaemonSet {name} still exists: its agents put back what this "
            "removes; remove it first (helm uninstall, or kubectl delete on deploy/daemonset.yaml)",
            err=True,
        )


T = TypeVar("T")


@overload
def node_client(command: str, kubeconfig: str | None, node: str) -> Any: ...
@overload
def node_client(
    command: str, kubeconfig: str | None, node: str, request: Callable[[], T]
) -> tuple[Any, T]: ...
def node_client(
    command: str, kubeconfig: str | None, node: str, request: Callable[[], T] | None = None
) -> Any:
    """How a command about one node begins: the node's name checked, then `request` (what the command will
    write, built and checked before anything is sent; its value comes back beside the client), then the API
    client (`_client`). A bad name or request is a usage error (exit 2) that names the command."""
    try:
        validation.node_name(node)
        made = request() if request is not None else None
    except (ConfigError, ValueError) as exc:
        raise ConfigError(f"{command}: {exc}") from None
    api = _client(command, kubeconfig)
    return api if request is None else (api, made)


def _client(command: str, kubeconfig: str | None) -> Any:
    """The API client of the commands on the cluster; a kubeconfig that cannot work is a usage error
    (exit 2). A kubeconfig that turns TLS verification off is said once, not by a urllib3 warning per
    request (six for one `status`)."""
    from gpuguard.kube import client as kubeclient  # noqa: PLC0415

    try:
        api = kubeclient.load(kubeconfig)
    except GpuguardError as exc:
        raise ConfigError(f"{command}: {exc}") from None
    if api.creds.insecure and api.creds.server.startswith("https://"):
        warnings.filterwarnings("ignore", message="Unverified HTTPS request")
        click.echo(
            f"gpuguard: warning: {command}: the API server's certificate is not verified "
            "(insecure-skip-tls-verify in the kubeconfig)",
            err=True,
        )
    return api


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
