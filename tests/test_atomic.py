"""gpuguard.store.atomic: a kept file is replaced whole by one rename (durably: the temp file synced before
it, the directory after), a failed write or rename leaves the old file and no temp file, and a corrupt file is
moved aside."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from gpuguard.store import atomic
from harness.synctrace import trace_syncs


def test_a_durable_write_syncs_the_temp_file_then_renames_then_syncs_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = trace_syncs(monkeypatch)
    atomic.write_atomically(tmp_path / "kept.json", b"new", durable=True)
    tmp = f".kept.json-{os.getpid()}.tmp"
    assert calls == [str(tmp_path / tmp), f"rename {tmp} -> kept.json", "dir"]
    assert (tmp_path / "kept.json").read_bytes() == b"new"


def test_a_write_that_is_not_durable_renames_without_any_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = trace_syncs(monkeypatch)
    atomic.write_atomically(tmp_path / "state.json", b"new", durable=False, temp_stem="state")
    assert calls == [f"rename .state-{os.getpid()}.tmp -> state.json"]
    assert (tmp_path / "state.json").read_bytes() == b"new"


def test_the_file_is_0600_and_replaces_the_old_one_whole(tmp_path: Path) -> None:
    path = tmp_path / "kept.json"
    path.write_bytes(b"old content, longer than the new one")
    atomic.write_atomically(path, b"new", durable=True)
    assert path.read_bytes() == b"new"
    assert path.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json"]


def test_the_directory_is_made_at_the_first_write(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "kept.json"
    atomic.write_atomically(path, b"x" * 300_000, durable=True)
    assert path.read_bytes() == b"x" * 300_000


def test_a_temp_file_left_by_an_earlier_life_of_this_pid_is_replaced_not_appended_to(tmp_path: Path) -> None:
    (tmp_path / f".kept.json-{os.getpid()}.tmp").write_bytes(b"x" * 10_000)
    atomic.write_atomically(tmp_path / "kept.json", b"new", durable=False)
    assert (tmp_path / "kept.json").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json"]


@pytest.mark.parametrize("durable", [True, False])
@pytest.mark.parametrize(
    "failure",
    [
        ("write", OSError(28, "No space left on device"), 0),  # the disk full mid-write
        ("replace", OSError(5, "Input/output error"), 1),  # the file synced, then the rename fails
    ],
)
def test_a_failed_write_or_rename_leaves_the_old_file_and_no_temp_file(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    durable: bool,
    failure: tuple[str, OSError, int],
) -> None:
    call, error, fsyncs = failure  # the call that fails, its error, the fsyncs made before it
    path = tmp_path / "kept.json"
    path.write_bytes(b"old")
    synced: list[int] = []
    real_fsync = os.fsync

    def fail(*args: Any) -> None:
        raise error

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, call, fail)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match=error.strerror):
        atomic.write_atomically(path, b"new", durable=durable)
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json"]
    assert len(synced) == (fsyncs if durable else 0)  # never the directory's: no rename happened


def test_a_directory_that_cannot_be_made_raises_and_leaves_nothing(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError):
        atomic.write_atomically(blocker / "sub" / "kept.json", b"new", durable=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_corrupt_file_is_moved_aside_under_its_tag_and_the_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(time, "time", lambda: 1700000000.5)
    path = tmp_path / "kept.json"
    path.write_text("{not json")
    aside = atomic.move_aside(path, tag="bad")
    assert aside == tmp_path / "kept.json.bad-1700000000"
    assert aside.read_text() == "{not json" and not path.exists()


def test_a_file_that_cannot_be_moved_aside_stays_where_it_is_and_nothing_raises(tmp_path: Path) -> None:
    missing = tmp_path / "gone" / "kept.json"  # its directory does not exist: the rename fails
    assert atomic.move_aside(missing, tag="corrupt") == missing
