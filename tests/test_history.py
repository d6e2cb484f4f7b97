"""Each GPU's fault history (gpuguard/store/history.py): durable across a SIGKILL mid-write, bounded, and a
corrupt or foreign file moved aside with a log line, never a crash."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gpuguard.store import retry
from gpuguard.store.history import (
    FILE_NAME,
    MAX_BYTES,
    MAX_EPISODES,
    MAX_GPUS,
    MAX_REASONS,
    MAX_RELEASES,
    MAX_TEXT,
    MAX_UUID,
    Episode,
    GpuHistory,
    HistoryStore,
    Release,
    bounded,
    serialize,
)
from harness.clock import Clock

EPISODE = Episode(reasons=("xid-79",), first_seen=1000.0, boot_id="boot-a", ended="reboot", ended_at=1100.0)


def test_a_history_saved_is_the_history_loaded(tmp_path: Path) -> None:
    history = {
        "GPU-a": GpuHistory(
            episodes=(EPISODE, Episode(reasons=("ecc", "xid-48"), first_seen=2000.0, boot_id="boot-b")),
            releases=(Release(by="alice", at=1500.0),),
            escalated=2000.0,
        ),
        "GPU-b": GpuHistory(),
    }
    assert HistoryStore(tmp_path).save(history)
    assert HistoryStore(tmp_path).load() == history
    assert [p.name for p in tmp_path.iterdir()] == [FILE_NAME]  # no temp file left behind
    doc = json.loads((tmp_path / FILE_NAME).read_text())
    assert doc["kind"] == "gpuguard-history" and doc["version"] == 1


def test_no_file_is_an_empty_history_and_no_directory_keeps_none(tmp_path: Path) -> None:
    assert HistoryStore(tmp_path).load() == {}
    assert HistoryStore(None).load() == {}
    assert HistoryStore(None).save({"GPU-a": GpuHistory()}) is False


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b'{"kind": "something-else", "version": 1, "gpus": {}}',
        b'{"kind": "gpuguard-history", "version": 99, "gpus": {}}',
        b'{"kind": "gpuguard-history", "version": 1, "gpus": {"GPU-a": {"episodes": "x"}}}',
        b'{"kind": "gpuguard-history", "version": 1, "gpus": {"GPU-a": {"episodes": [], "releases": [],'
        b' "escalated": "yesterday"}}}',
        b'{"kind": "gpuguard-history", "version": 1, "gpus": {"GPU-a": {"episodes": [{"reasons": [],'
        b' "first_seen": 1, "boot_id": "b", "ended": "exploded", "ended_at": 2}], "releases": [],'
        b' "escalated": null}}}',
        b"[" * 100000,
    ],
)
def test_a_corrupt_or_foreign_file_is_moved_aside_with_a_log_line_not_a_crash(
    tmp_path: Path, content: bytes
) -> None:
    (tmp_path / FILE_NAME).write_bytes(content)
    with capture_logs() as logs:
        assert HistoryStore(tmp_path).load() == {}
    assert [e for e in logs if e["event"] == "history.corrupt"]
    assert not (tmp_path / FILE_NAME).exists()
    assert any(p.name.startswith(f"{FILE_NAME}.bad-") for p in tmp_path.iterdir())


def test_a_file_larger_than_the_limit_is_moved_aside(tmp_path: Path) -> None:
    (tmp_path / FILE_NAME).write_bytes(b" " * (MAX_BYTES + 1))
    assert HistoryStore(tmp_path).load() == {}
    assert any(p.name.startswith(f"{FILE_NAME}.bad-") for p in tmp_path.iterdir())


def test_a_failed_write_is_retried_with_backoff_and_durability_resumes_when_the_disk_does(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    clock = Clock()
    store = HistoryStore(blocker / "sub", clock=clock)  # a directory under a regular file: writes fail
    held = {"GPU-a": GpuHistory(episodes=(EPISODE,))}
    with capture_logs() as logs:
        assert store.save(held) is False
        assert store.save({"GPU-a": GpuHistory()}) is False
        blocker.unlink()
        assert store.save(held) is False  # within the backoff
        clock.t += retry.FIRST_S
        assert store.save(held) is True
    assert [e["event"] for e in logs] == ["history.unavailable", "history.resumed"]  # once each
    assert HistoryStore(blocker / "sub").load() == held


def test_the_history_is_bounded_per_gpu_and_in_gpus_and_the_held_gpus_are_kept_last() -> None:
    many = tuple(Episode(reasons=("ecc",), first_seen=float(i)) for i in range(MAX_EPISODES + 10))
    releases = tuple(Release(by="op", at=float(i)) for i in range(MAX_RELEASES + 3))
    history = {f"GPU-{i:03d}": GpuHistory(episodes=many[: i + 1]) for i in range(MAX_GPUS + 5)}
    history["GPU-old-held"] = GpuHistory(episodes=many[:1], escalated=0.0)
    history["GPU-000"] = GpuHistory(episodes=many, releases=releases)
    out = bounded(history)
    assert len(out) == MAX_GPUS
    assert "GPU-old-held" in out  # a held GPU is the last one dropped
    assert "GPU-001" not in out  # the least recently active go first
    assert out["GPU-000"].episodes == many[-MAX_EPISODES:]  # the newest kept
    assert out["GPU-000"].releases == releases[-MAX_RELEASES:]


def test_the_largest_history_the_bounds_allow_fits_the_file_limit(tmp_path: Path) -> None:
    text = "x" * MAX_TEXT
    episode = Episode(
        reasons=(text,) * MAX_REASONS,
        first_seen=1e10,
        boot_id=text,
        ended="counter-reset",
        ended_at=1e10 + 0.123456789,
    )
    gpu = GpuHistory(
        episodes=(episode,) * MAX_EPISODES,
        releases=(Release(by=text, at=1e10 + 0.123456789),) * MAX_RELEASES,
        escalated=1e10,
    )
    history = {f"GPU-{i:0{MAX_UUID - 4}d}": gpu for i in range(MAX_GPUS)}
    size = len(json.dumps(serialize(history), separators=(",", ":")))
    assert size < MAX_BYTES, size
    print(f"the largest history: {size} bytes")
    assert HistoryStore(tmp_path).save(history)
    assert HistoryStore(tmp_path).load() == history


_WRITER = """
import json, sys
from gpuguard.store.history import Episode, GpuHistory, HistoryStore, serialize
store = HistoryStore(sys.argv[1])
def history(n):
    episodes = tuple(Episode(reasons=("xid-79",), first_seen=float(n), boot_id="b" * 60) for _ in range(32))
    return {f"GPU-{i:02d}": GpuHistory(episodes=episodes, escalated=float(n)) for i in range(64)}
store.save(history(1))
print(flush=True)
# The serialized text of two generations, written in turn: the loop spends its time in the write itself
# (open, write, fsync, rename), where a kill must never leave a torn or empty file.
payloads = [json.dumps(serialize(history(n)), separators=(",", ":")).encode() for n in (2, 3)]
n = 0
while True:
    store._replace(payloads[n % 2])
    n += 1
"""


def test_the_history_survives_a_sigkill_mid_write_the_file_is_always_the_old_or_the_new_one(
    tmp_path: Path,
) -> None:
    """A writer in a loop (two generations of a ~300 KB history in turn), killed at moments that fall
    inside writes: what is on disk always loads, whole, as one generation the writer wrote."""
    seen = set()
    for round_ in range(8):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        proc.stdout.readline()  # the first save is done: the file exists
        time.sleep(0.02 + 0.013 * round_)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        with capture_logs() as logs:
            history = HistoryStore(tmp_path).load()
        assert not [e for e in logs if e["event"] == "history.corrupt"], logs
        assert len(history) == 64
        generations = {h.escalated for h in history.values()}
        assert len(generations) == 1  # one write's content, not a mix
        seen |= generations
    assert seen <= {1.0, 2.0, 3.0}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f"{FILE_NAME}.bad-")]
