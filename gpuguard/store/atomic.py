"""The files gpuguard keeps across restarts (state.json, history.json, signal-baselines.json): each written
whole by one rename, and one that cannot be read moved aside (each caller logs its own stable event).

A write is a temp file of this process (`.<stem>-<pid>.tmp` beside the file, mode 0600, made anew each time),
one write() of the whole text, then os.replace over the old file: a reader, or an agent killed at any moment,
sees the old file or the new one, never a torn one. `durable=True` adds an fsync of the temp file before the
rename and one of the directory after it, so the new file also survives a power cut; the caller decides, as
the cost is milliseconds (state.py's write runs in a fault's path before the taint and goes without; see its
docstring). The temp file is removed when the write or the rename fails, and the error (OSError) is the
caller's to map: every caller today turns it into a warning and runs on without the file.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


def write_atomically(path: Path, data: bytes, *, durable: bool, temp_stem: str | None = None) -> None:
    """Replace `path` by `data`. The temp file is `.<temp_stem>-<pid>.tmp` (`temp_stem`: the file's name by
    default); the directory is made at the first write (or when it was removed), not at every one. Raises
    OSError, the old file intact and no temp file left, when the write or the rename fails."""
    directory = path.parent
    tmp = directory / f".{temp_stem or path.name}-{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # left by a write of an earlier life of this pid that was killed half-way
    try:
        fd = os.open(tmp, _FLAGS, 0o600)
    except FileNotFoundError:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, _FLAGS, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)  # the new content on disk before the name points at it
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)  # the rename itself survives a power cut
        finally:
            os.close(dfd)


def move_aside(path: Path, *, tag: str) -> Path:
    """Rename a corrupt or foreign file to `<name>.<tag>-<unix time>`, so the next write starts a new one and
    the old one stays for a person to read. Never raises: a file that cannot be moved stays where it is (and
    is replaced at the next write). Returns where the file is now, for the caller's warning, which names its
    own stable event (`state.corrupt`, `history.corrupt`, `baselines.corrupt`)."""
    aside = path.with_name(f"{path.name}.{tag}-{int(time.time())}")
    try:
        path.replace(aside)
    except OSError:
        return path
    return aside
