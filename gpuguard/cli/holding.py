"""`gpuguard hold`: an operator puts one GPU back under a repeat offender's hold (after a rollback that lost
the agent's history, or when the operator knows better than the count), with release's protections: it
reads the node first, refuses what makes no sense (a GPU already held, a hold not yet handled without
--force), and --wait follows the node until the agent holds the GPU. The agent owns the GPU history; this only
writes the request, the annotation gpuguard.io/hold (gpuguard.quarantine.repeat.hold)."""

from __future__ import annotations

import os
from datetime import UTC, datetime

import click

from gpuguard.cli import releasing
from gpuguard.cli.cluster import _api_failed, node_client
from gpuguard.cli.commands import EXIT_OK, EXIT_UNHEALTHY, cli
from gpuguard.cli.flags import FLAGS
from gpuguard.core.errors import ConfigError, GpuguardError
from gpuguard.kube import nodes
from gpuguard.quarantine.node.view import NodeView
from gpuguard.quarantine.repeat import hold as holds


@cli.command()
@FLAGS["kubeconfig"].option()
@click.option("--node", required=True, help="The node of the GPU to hold.")
@click.option("--gpu", required=True, help="The GPU's UUID (one GPU; `gpuguard history --node` lists them).")
@releasing.request_options("hold")
def hold(
    *,
    kubeconfig: str | None,
    node: str,
    gpu: str,
    by: str | None,
    force: bool,
    wait: bool,
    timeout: float,
) -> int:
    """Hold a GPU for repair as a repeat offender is held (its quarantine stays across reboots and resets)
    until `gpuguard release`: reads the node, then writes the annotation gpuguard.io/hold on it; the node's
    agent checks it (a GPU of that node, repeat offenders on), records who held it and when in the GPU's
    history, holds it and removes the annotation at its next read of the node. The agents' own tokens may not
    write it (deploy/admission-policy.yaml). Exit 0 written (with --wait: held); 1 --wait saw no hold; 2 the
    GPU already held, a hold pending (--force replaces it) or a usage error; 4 the API server is unreachable
    or refused the request."""
    who = by if by is not None else os.environ.get("USER") or "unknown"

    def request() -> str:
        now = datetime.now(UTC)
        text = holds.annotation(gpu, by=who, at=now)
        holds.parse(text, now=now.timestamp())  # what the agent will accept, checked before it is sent
        return text

    api, text = node_client("hold", kubeconfig, node, request)
    try:
        view = releasing.read(api, node)
        why = refusal(view, gpu, force=force)
        if why is not None:
            raise ConfigError(why)
        nodes.patch(api, node, releasing.body(view, text, key=holds.ANN_HOLD))
        click.echo(f"{node}: hold of {gpu} by {who} written; the agent holds it at its next read of the node")
        if not view.holds_gpuguard_state() and not view.repeat_offenders:
            click.echo(f"gpuguard: note: hold: {NOT_REREAD.format(node=node)}", err=True)
        if not wait:
            return EXIT_OK
        seen = releasing.follow(api, node, holds.ANN_HOLD, text, timeout=timeout)
    except GpuguardError as exc:
        return _api_failed("hold", api, exc)
    outcome = outcome_of(seen, node, gpu, timeout)
    click.echo(outcome.message, err=not outcome.done)
    return EXIT_OK if outcome.done else EXIT_UNHEALTHY


# The agent re-reads its node only while it holds something there (a node it holds nothing on costs no
# request: docs/design.md, "Re-reads"); a restarted agent reads it at once.
NOT_REREAD = (
    "gpuguard holds nothing on {node}, so its agent does not re-read the node: it reads the hold at its next "
    "start or fault; to hold now, restart it: kubectl -n gpuguard delete pod "
    "-l app.kubernetes.io/name=gpuguard --field-selector spec.nodeName={node}"
)


def refusal(view: NodeView, gpu: str, *, force: bool) -> str | None:
    """Why this hold must not be written (one line), or None. Pure."""
    pending = releasing.pending_refusal(view, holds.ANN_HOLD, "hold", force=force)
    if pending is not None:
        return pending
    if gpu in view.repeat_offenders:
        return f"{gpu} of {view.name} is already held (`gpuguard release` lifts it)"
    return None


def outcome_of(view: NodeView | None, node: str, gpu: str, timeout: float) -> releasing.Outcome:
    if view is None:
        return releasing.unhandled(node, "hold", timeout)
    if gpu in view.repeat_offenders:
        return releasing.Outcome(True, f"{node}: the agent holds {gpu}")
    return releasing.Outcome(
        False,
        f"{node}: the agent handled the hold but does not hold {gpu} (its log says why: repeat.hold_refused)",
    )
