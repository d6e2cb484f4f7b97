"""structlog, configured once at the CLI edge: JSON lines in a cluster (or when piped), console on a TTY."""

from __future__ import annotations

import json
import logging
import shutil
import sys
import textwrap
from collections.abc import MutableMapping
from typing import Any

import structlog

_INDENT = "    "


def configure(fmt: str = "auto", *, level: int = logging.INFO) -> None:
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else ConsoleLines(max(80, shutil.get_terminal_size((120, 24)).columns))
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


class ConsoleLines:
    """Console renderer for people: `HH:MM:SS level event key=value ...` within `width` columns; what does not
    fit (a patch, a condition) continues on indented lines, wrapped, never cut. None values are left out."""

    def __init__(self, width: int = 120) -> None:
        self.width = width

    def __call__(self, logger: Any, name: str, event_dict: MutableMapping[str, Any]) -> str:
        ed = dict(event_dict)
        stamp = str(ed.pop("timestamp", ""))[11:19]
        head = f"{stamp} {ed.pop('level', name):<7} {ed.pop('event', '')}".strip()
        trace = ed.pop("exception", None)
        lines: list[str] = []
        current = head
        for key in sorted(ed):
            if ed[key] is None:
                continue
            part = f"{key}={_value(ed[key])}"
            if len(current) + 1 + len(part) <= self.width:
                current += " " + part
                continue
            lines.append(current)
            chunks = textwrap.wrap(
                part, self.width - len(_INDENT), break_long_words=True, break_on_hyphens=False
            ) or [part]
            lines.extend(_INDENT + c for c in chunks[:-1])
            current = _INDENT + chunks[-1]
        lines.append(current)
        if trace:
            lines.append(str(trace))
        return "\n".join(lines)


def _value(v: Any) -> str:
    if isinstance(v, dict | list):
        # A patch or a condition: JSON, as the JSON log carries it and `kubectl patch` takes it.
        return json.dumps(v, separators=(", ", ": "), default=str)
    text = str(v)
    return repr(text) if (not text or any(c.isspace() for c in text)) and isinstance(v, str) else text
