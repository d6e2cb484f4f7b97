"""structlog, configured once at the CLI edge: JSON lines in a cluster (or when piped), console on a TTY."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(fmt: str = "auto", *, level: int = logging.INFO) -> None:
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *([structlog.processors.format_exc_info] if fmt == "json" else []),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
