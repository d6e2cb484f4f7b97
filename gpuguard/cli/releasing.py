"""`gpuguard release`, read before it writes: the node's held GPUs (its annotation
`gpuguard.io/repeat-offenders`, written by its agent) decide whether there is anything to release, a release
the agent has not handled yet is not overwritten without --force, and --wait follows the node until the agent
has handled it. The agent owns the GPU history; this only writes the request (gpuguard.quarantine.repeat)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from gpuguard.cli.flag import Finite
from gpuguard.core import validation
from gpuguard.core.config import RELEASE_WAIT
from gpuguard.core.errors import ConfigError, PermanentApiError
from gpuguard.kube import client as kubeclient
from gpuguard.kube import nodes
from gpuguard.quarantine.node.view import NodeView
from gpuguard.quarantine.repeat.release import ALL, ANN_RELEASE

POLL_S = 2.0


def request_options(verb: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options `release` and `hold` share: who, --force over a pending request, --wait and its timeout."""
    shared = (
        click.option(
            "--by", default=None, help=f"Who {verb}s it, as the history records it (default: $USER)."
        ),
        click.option(
            "--force", is_flag=True, default=False, help=f"Replace a {verb} its agent has not handled yet."
        ),
        click.option(
            "--wait", is_flag=True, default=False, help=f"Wait until the agent has handled the {verb}."
        ),
        click.option(
            "--timeout",
            type=Finite(minimum=0),
            default=RELEASE_WAIT,
            show_default=True,
            help="Seconds --wait waits.",
        ),
    )

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(shared):
            f = option(f)
        return f

    return decorate


def read(api: kubeclient.Client, node: str) -> NodeView:
    """The node as it is now; a node that does not exist is a usage error (a mistyped name)."""
    try:
        return NodeView.from_api(nodes.read(api, node))
    except PermanentApiError as exc:
        if exc.status == 404:
            raise ConfigError(f"no node named {node}") from None
        raise


def refusal(view: NodeView, gpu: str, *, force: bool) -> str | None:
    """Why this release must not be written (one line), or None. Pure."""
    held = view.repeat_offenders
    pending = pending_refusal(view, ANN_RELEASE, "release", force=force)
    if pending is not None:
        return pending
    listed = f" (held: {validation.printable(', '.join(sorted(held)))})" if held else ""
    if gpu == ALL and not held:
        return f"nothing held on {view.name}: no GPU of it is a repeat offender"
    if gpu != ALL and gpu not in held:
        return f"nothing held on {gpu} of {view.name}{listed}"
    return None


def pending_refusal(view: NodeView, key: str, what: str, *, force: bool) -> str | None:
    """Why a request (a release, a hold) must not replace the one its agent has not handled yet, or None.
    What the node holds is shown with terminal escapes made visible (another writer put it there)."""
    pending = view.annotations.get(key)
    if pending is None or force:
        return None
    return (
        f"a {what} is already pending on {view.name} ({validation.printable(pending)}), not yet handled by "
        "its agent; --force replaces it"
    )


def body(view: NodeView, text: str, *, key: str = ANN_RELEASE) -> dict[str, object]:
    """The write: the annotation `key` (a release, or a hold), on the node as it was read (a node that moved
    on answers 409)."""
    return {"metadata": {"resourceVersion": view.resource_version, "annotations": {key: text}}}


@dataclass(frozen=True)
class Outcome:
    """How a release ended, as --wait saw it: lifted, refused by the agent (its log says why), or not
    handled within the timeout."""

    done: bool
    message: str


def released(view: NodeView | None, node: str, gpu: str, timeout: float) -> Outcome:
    """How a release ended, from the node once its agent handled it (`follow`; None: not within the
    timeout): the hold lifted, or still there. Pure."""
    if view is None:
        return unhandled(node, "release", timeout)
    still = sorted(view.repeat_offenders) if gpu == ALL else [gpu] * (gpu in view.repeat_offenders)
    if not still:
        return Outcome(True, f"{node}: the agent lifted the hold on {_what(gpu)}")
    return Outcome(
        False,
        f"{node}: the agent handled the release but still holds {', '.join(still)} "
        "(its log says why: repeat.release_refused, repeat.release_matched_none)",
    )


def follow(
    api: kubeclient.Client,
    node: str,
    key: str,
    text: str,
    *,
    timeout: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> NodeView | None:
    """The node once its agent has handled the request `text` under the annotation `key` (gone or
    replaced); None when `timeout` seconds passed first."""
    deadline = clock() + timeout
    while True:
        view = NodeView.from_api(nodes.read(api, node))
        if view.annotations.get(key) != text:
            return view
        if clock() >= deadline:
            return None
        sleep(min(POLL_S, max(0.0, deadline - clock())))


def unhandled(node: str, what: str, timeout: float) -> Outcome:
    return Outcome(
        False,
        f"{node}: the agent has not handled the {what} within {timeout:g} s (is gpuguard running "
        f"on the node? the {what} stays written and is handled when it is)",
    )


def _what(gpu: str) -> str:
    return "every held GPU" if gpu == ALL else gpu
