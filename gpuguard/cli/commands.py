"""The command group and the node's commands: `watch` (the daemon), `check` (one pass, a preflight),
`version`; and `main`, which turns every usage error into one line and exit 2."""

from __future__ import annotations

import sys
from typing import Any

import click

from gpuguard import __version__
from gpuguard.cli import settings
from gpuguard.cli.flag import Finite
from gpuguard.cli.flags import FLAGS, GPU_FLAGS, WATCH_FLAGS, options
from gpuguard.core.errors import ConfigError

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
DEFAULT_LISTEN = FLAGS["listen"].click_default

# Help as wide as the terminal, up to 120 columns (click's own default stops at 80).
HELP_WIDTH = 120


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": HELP_WIDTH})
@click.version_option(__version__, "-V", "--version", prog_name="gpuguard", message="%(prog)s %(version)s")
def cli() -> None:
    """gpuguard: taints and cordons its own Kubernetes node when a GPU goes bad."""


@cli.command()
@options(WATCH_FLAGS)
def watch(**kw: Any) -> int:
    """Watch the GPUs and keep this node's taint in line with their health (the DaemonSet's command)."""
    cfg = settings.config(kw, watch=True)
    from gpuguard.runtime import root  # noqa: PLC0415 - the agent's imports only for the command that runs it

    if root.watch(cfg):
        import structlog  # noqa: PLC0415

        structlog.get_logger(__name__).error(
            "nvml.library_not_found", waited=cfg.nvml_load_timeout, exit_code=EXIT_NO_NVML, hint=NO_NVML_HINT
        )
        return EXIT_NO_NVML
    return EXIT_OK


@cli.command()
@options(GPU_FLAGS)
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option(
    "--at",
    "at",
    type=Finite(minimum=0),
    default=None,
    help="Mock backend only: check the scenario as it stands this many seconds in (its events up to then, "
    "Xids included, have happened).",
)
@FLAGS["node"].option(
    help="The node this check runs on: with a cluster named (in-cluster, --kubeconfig or KUBECONFIG) and "
    "no --expected-gpus, its --expected-gpus-label is the GPU count to expect. Default: env NODE_NAME."
)
@FLAGS["kubeconfig"].option(
    help="The cluster to read --node from. Default: in-cluster config, then KUBECONFIG; never ~/.kube/config."
)
@options(("expected_gpus_label",))
@click.option(
    "--fail-on-degraded",
    is_flag=True,
    default=False,
    help="Exit 1 also when a GPU (or the node) is only degraded (by default listed, and exit 0).",
)
def check(output: str, at: float | None, fail_on_degraded: bool, **kw: Any) -> int:
    """One pass over the GPUs: exit 0 healthy, 1 unhealthy (or no GPU), 2 usage error, 3 no NVML library.
    Degraded GPUs are listed and exit 0, unless --fail-on-degraded.

    Usable as an initContainer preflight. Xids are events: a one-shot check sees none that happened
    before it started (the taint written by `watch` is what remembers them).
    """
    cfg = settings.config(kw, watch=False)
    import logging  # noqa: PLC0415

    from gpuguard.cli import report  # noqa: PLC0415
    from gpuguard.core import logs  # noqa: PLC0415
    from gpuguard.runtime import root  # noqa: PLC0415

    logs.configure(cfg.log_format, level=logging.WARNING)  # stdout is the table; stderr only problems
    result = root.check_once(cfg, at=at)
    if result.no_library:
        click.echo(f"gpuguard: {NO_NVML_HINT}", err=True)
    verdict = result.verdict
    click.echo(report.verdict_json(verdict) if output == "json" else report.verdict_table(verdict))
    if result.no_library:
        return EXIT_NO_NVML
    if not verdict.healthy or (fail_on_degraded and verdict.degraded):
        return EXIT_UNHEALTHY
    return EXIT_OK


@cli.command()
def version() -> int:
    """Print gpuguard's version."""
    click.echo(f"gpuguard {__version__}")
    return EXIT_OK


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
