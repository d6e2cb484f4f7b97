"""Bounded reads of every file gpuguard is given: a mock scenario, the state file, a kubeconfig, a
ServiceAccount token, the TLS files a kubeconfig names, the host's /proc files.

Each is a regular file of at most a stated size, read whole, or refused with one line that names the file and
the problem: nothing gpuguard reads can make it read without end (`--scenario /dev/zero`), block on open (a
FIFO), or hold in memory a file far larger than any it needs. The shape of what is read is each parser's own
check; this module only bounds the bytes, and turns YAML's errors into that one line (`parse_yaml`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from gpuguard.core.errors import ConfigError

KIB = 1 << 10
MIB = 1 << 20


def shown(path: str | Path) -> str:
    """A path as one line: a name with a newline or another control character (a kubeconfig can name any
    string) is shown escaped, as Python's repr would, so an error naming it stays one line."""
    text = str(path)
    return text if text.isprintable() else repr(text)[1:-1]


def read_bytes(path: str | Path, *, limit: int, what: str, error: type[ConfigError] = ConfigError) -> bytes:
    """The file's bytes; `error` ("{what} {path}: ...", one line) if it is missing, unreadable, not a regular
    file or larger than `limit` bytes (checked before reading, and again while reading: a file that grows)."""
    name = f"{what} {shown(path)}"
    try:
        # O_NONBLOCK: a FIFO's open() does not wait for a writer; it is refused below as not a regular file.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise error(f"{name}: no such file") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise error(f"{name}: cannot open: {_reason(exc)}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{name}: not a regular file")
        if info.st_size > limit:
            raise error(f"{name}: {info.st_size} bytes, more than the {size_text(limit)} allowed")
        chunks: list[bytes] = []
        left = limit + 1  # one byte more than allowed tells a file that grew since fstat
        while left > 0:
            chunk = os.read(fd, min(left, MIB))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise error(f"{name}: more than the {size_text(limit)} allowed")
        return b"".join(chunks)
    except OSError as exc:
        raise error(f"{name}: cannot read: {_reason(exc)}") from None
    finally:
        os.close(fd)


def read_text(path: str | Path, *, limit: int, what: str, error: type[ConfigError] = ConfigError) -> str:
    """The file as UTF-8 text, under read_bytes' bounds; `error` if it is not UTF-8."""
    data = read_bytes(path, limit=limit, what=what, error=error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path}: not UTF-8 text (byte {exc.start})") from None


def check_file(path: str | Path, *, limit: int, what: str, error: type[ConfigError] = ConfigError) -> None:
    """A file handed to a library by its path (TLS wants paths): it exists, is a regular file and is at most
    `limit` bytes; `error` otherwise, as read_bytes."""
    read_bytes(path, limit=limit, what=what, error=error)


def size_text(limit: int) -> str:
    """1048576 -> '1 MiB', 65536 -> '64 KiB'."""
    if limit % MIB == 0:
        return f"{limit // MIB} MiB"
    if limit % KIB == 0:
        return f"{limit // KIB} KiB"
    return f"{limit} bytes"


def _reason(exc: Exception) -> str:
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return " ".join(text.split())[:200]


def parse_yaml(text: str, *, what: str, error: type[ConfigError] = ConfigError) -> Any:
    """`text` as YAML (safe_load); `error`, one line naming `what`, the line and the problem, when it is not
    YAML, holds a value Python cannot build (2001-02-30, !!float x) or nests too deeply. The one way
    gpuguard reads the YAML it is given (a kubeconfig, --signals-config, a mock scenario)."""
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise error(f"{what}: not valid YAML{where}: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise error(f"{what}: not valid YAML: {_one_line(exc)[:200]}") from None
    except RecursionError:
        raise error(f"{what}: nested too deeply") from None
    except (ValueError, TypeError, AttributeError, OverflowError) as exc:
        raise error(f"{what}: a value YAML cannot build: {_one_line(exc)[:120]}") from None


def _one_line(exc: object) -> str:
    return " ".join(str(exc).split())
