"""What a durable write does to the disk, in order: the tests of gpuguard.store.atomic and of each kept file's
store (signal baselines) assert the fsync-rename-fsync sequence through this one tracer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest


def trace_syncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The fsyncs (the file's path, or 'dir') and renames (`rename <src> -> <dst>`, names only) made after
    the call, in order, in the list returned; the real calls still run."""
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        calls.append(f"rename {Path(src).name} -> {Path(dst).name}")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return calls
