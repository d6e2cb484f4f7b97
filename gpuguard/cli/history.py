"""`gpuguard history`: the fault episodes, releases and holds of a node's GPUs, from a laptop: read from the
summary its agent publishes on the node (the annotation gpuguard.io/gpu-history,
gpuguard.quarantine.repeat.published), not from the agent's file. Nothing read is trusted: the summary is
parsed within its bounds and every text cleaned of terminal escapes before it is shown."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import UTC, datetime

import click

from gpuguard.cli import releasing
from gpuguard.cli.cluster import _api_failed, _printable, node_client
from gpuguard.cli.commands import EXIT_OK, EXIT_UNHEALTHY, cli
from gpuguard.cli.flags import FLAGS
from gpuguard.core import validation
from gpuguard.core.errors import ConfigError, GpuguardError
from gpuguard.quarantine.repeat import published
from gpuguard.quarantine.repeat.published import GpuSummary, Summary


@cli.command()
@FLAGS["kubeconfig"].option()
@click.option("--node", required=True, help="The node whose GPUs' history to show.")
@click.option("--gpu", default=None, help="Only this GPU (its UUID).")
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
def history(kubeconfig: str | None, node: str, gpu: str | None, output: str) -> int:
    """The GPUs' history on a node, as its agent publishes it: each GPU's last fault episodes (reasons, when
    each began and how it ended), its last releases, and whether it is held for repair (by its episodes, or
    by an operator's `gpuguard hold`). Exit 0; 1 the node's summary is not one gpuguard writes; 2 no node or
    GPU of that name, or a usage error; 4 the API server is unreachable or refused the request."""
    api = node_client("history", kubeconfig, node)
    try:
        view = releasing.read(api, node)
    except GpuguardError as exc:
        return _api_failed("history", api, exc)
    text = view.annotations.get(published.ANN_HISTORY)
    try:
        found = published.read(text) if text is not None else Summary(gpus={}, more=0)
    except ValueError as exc:
        click.echo(f"gpuguard: error: history: {node}'s {published.ANN_HISTORY} annotation: {exc}", err=True)
        return EXIT_UNHEALTHY
    gpus = found.gpus
    if gpu is not None:
        if gpu not in gpus:
            listed = f" (GPUs with a history: {', '.join(sorted(gpus))})" if gpus else ""
            raise ConfigError(_printable(f"history: no history of {gpu} on {node}{listed}"))
        gpus = {gpu: gpus[gpu]}
    if output == "json":
        doc = {"node": node, "gpus": {u: asdict(g) for u, g in gpus.items()}, "more": found.more}
        click.echo(json.dumps(_printable(doc), indent=2))
    else:
        click.echo(table(node, gpus, more=found.more))
    return EXIT_OK


def table(node: str, gpus: dict[str, GpuSummary], *, more: int = 0) -> str:
    """A first line that sums up the node, then one row per episode, release and hold, by GPU and time."""
    held = sum(1 for g in gpus.values() if g.held_at is not None)
    first = f"{node}: {len(gpus)} GPUs with a history, {held} held for repair"
    if more:
        first += f" ({more} more GPUs left out of the node's summary)"
    if not gpus:
        return f"{node}: no GPU history (no fault episode recorded by its agent)"
    rows: list[tuple[str, ...]] = [("GPU", "WHEN", "WHAT", "DETAIL")]
    notes = []
    for uuid, g in sorted(gpus.items()):
        events: list[tuple[int, str, str]] = []
        for e in g.episodes:
            end = f"ended {_at(e.ended_at)} by {e.ended}" if e.ended and e.ended_at is not None else "open"
            events.append((e.first_seen, "episode", f"{e.reasons}, {end}"))
        events += [(at, "release", f"by {by}") for by, at in g.releases]
        if g.held_at is not None:
            why = f"by {g.held_by} (gpuguard hold)" if g.held_by else "a repeat offender (its fault episodes)"
            events.append((g.held_at, "hold", f"{why}; until `gpuguard release`"))
        rows += [(uuid, _at(t), what, detail) for t, what, detail in sorted(events)]
        if g.episodes_total > len(g.episodes) or g.releases_total > len(g.releases):
            notes.append(
                f"{validation.printable(uuid)}: the last {len(g.episodes)} of {g.episodes_total} episodes "
                f"and {len(g.releases)} of {g.releases_total} releases shown (the node's summary; "
                "the agent's history.json keeps more)"
            )
    rows = [tuple(validation.printable(c) for c in r) for r in rows]  # what the node holds, for a terminal
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3] for r in rows]
    return "\n".join([first, *lines, *notes])


def _at(t: int) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%MZ")
