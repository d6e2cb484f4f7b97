"""Durable fault state: atomic, versioned, keyed by boot, tolerant of corrupt, foreign and unwritable."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from gpuguard.core.config import Config
from gpuguard.core.model import Fault
from gpuguard.store import retry
from gpuguard.store.state import (
    FILE_NAME,
    MAX_BYTES,
    MAX_FAULTS,
    MAX_RULES,
    RuleMemory,
    StateStore,
    read_boot_id,
)
from harness.clock import Clock

XID = Fault("xid-79", "GPU has fallen off the bus (GPU 1, GPU-b)", uuid="GPU-b", gpu_index=1)
LOST = Fault("gpu-lost", "GPU is lost (GPU 0, GPU-a)", uuid="GPU-a", gpu_index=0)


def test_faults_saved_in_one_boot_are_restored_in_the_same_boot(tmp_path: Path) -> None:
    StateStore(tmp_path, boot_id="boot-1").save((XID, LOST))
    assert StateStore(tmp_path, boot_id="boot-1").load() == (XID, LOST)


def test_faults_from_a_previous_boot_are_discarded(tmp_path: Path) -> None:
    StateStore(tmp_path, boot_id="boot-1").save((XID,))
    assert StateStore(tmp_path, boot_id="boot-2").load() == ()


def test_the_file_is_versioned_and_written_atomically(tmp_path: Path) -> None:
    StateStore(tmp_path, boot_id="b").save((XID,))
    doc = json.loads((tmp_path / FILE_NAME).read_text())
    assert doc["kind"] == "gpuguard-state" and doc["version"] == 1 and doc["boot_id"] == "b"
    assert [p.name for p in tmp_path.iterdir()] == [FILE_NAME]  # no temp file left behind


def test_a_temp_file_left_by_a_killed_write_and_a_removed_directory_do_not_stop_the_next_write(
    tmp_path: Path,
) -> None:
    """The write's temp file is the process's own (.state-<pid>.tmp, made anew by each write): one left behind
    by a write that was killed half-way is overwritten; a state directory removed meanwhile is made again."""
    d = tmp_path / "state"
    s = StateStore(d, boot_id="b")
    s.save((XID,))
    (d / f".state-{os.getpid()}.tmp").write_text("x" * 10_000)  # a torn write of this process's last life
    s.save(())
    assert StateStore(d, boot_id="b").load() == ()
    assert sorted(p.name for p in d.iterdir()) == [FILE_NAME]
    assert (d / FILE_NAME).stat().st_mode & 0o777 == 0o600
    shutil.rmtree(d)
    s.save((XID,))
    assert StateStore(d, boot_id="b").load() == (XID,)


def test_an_unchanged_state_is_not_rewritten(tmp_path: Path) -> None:
    s = StateStore(tmp_path, boot_id="b")
    s.save((XID,))
    mtime = (tmp_path / FILE_NAME).stat().st_mtime_ns
    os.utime(tmp_path / FILE_NAME, ns=(1, 1))
    s.save((XID,))
    assert (tmp_path / FILE_NAME).stat().st_mtime_ns == 1 != mtime


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe\x00binary",
        b'{"kind": "something-else", "version": 1}',
        b"[]",
        b'{"kind": "gpuguard-state", "version": 99, "faults": []}',
        b'{"kind": "gpuguard-state", "version": 1, "boot_id": "b", "faults": [{"reason": 7, "detail": "x"}]}',
        b'{"kind": "gpuguard-state", "version": 1, "boot_id": "b"}',
        b"",
    ],
)
def test_a_corrupt_or_foreign_file_is_moved_aside_not_a_crash(tmp_path: Path, content: bytes) -> None:
    (tmp_path / FILE_NAME).write_bytes(content)
    s = StateStore(tmp_path, boot_id="b")
    assert s.load() == ()
    assert not (tmp_path / FILE_NAME).exists()
    assert any(p.name.startswith(f"{FILE_NAME}.corrupt-") for p in tmp_path.iterdir())
    s.save((XID,))  # and the store keeps working
    assert StateStore(tmp_path, boot_id="b").load() == (XID,)


def test_an_unwritable_state_dir_warns_and_runs_on(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    s = StateStore(blocker / "sub", boot_id="b")  # a directory under a regular file cannot exist
    s.save((XID,))  # no exception
    assert s.load() == ()


def test_no_state_dir_means_no_durability(tmp_path: Path) -> None:
    s = StateStore(None, boot_id="b")
    s.save((XID,))
    assert s.load() == ()


def test_saving_a_fault_adds_no_fsync_to_the_faults_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 15: the save runs before the node write; an fsync there cost milliseconds and protects only
    against the kernel's own end, after which the boot ID differs and the file is discarded anyway."""
    calls: list[int] = []
    monkeypatch.setattr(os, "fsync", calls.append)
    StateStore(tmp_path, boot_id="b").save((XID,))
    assert calls == []


def test_a_fault_saved_just_before_a_sigkill_is_restored(tmp_path: Path) -> None:
    """The process dies the instant save() returns (no exit handlers, no flush by anyone): the kernel
    holds the file, and the next process of the same boot restores the fault."""
    import subprocess
    import sys

    code = (
        "import os, signal, sys; from gpuguard.core.model import Fault; "
        "from gpuguard.store.state import StateStore; "
        "StateStore(sys.argv[1], boot_id='b').save((Fault('xid-79', 'd', uuid='GPU-b', gpu_index=1),)); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=False)
    assert proc.returncode == -9
    assert [f.key for f in StateStore(tmp_path, boot_id="b").load()] == [XID.key]


RULES = RuleMemory(
    known={"gpuguard-n-gpu-1": ("GPU-b", frozenset({"xid-79/GPU-b"}))},
    overridden={"GPU-c": frozenset({"ecc/GPU-c"})},
)


def test_the_rules_memory_and_the_faults_share_the_file_and_neither_write_loses_the_other(
    tmp_path: Path,
) -> None:
    """The agent's thread saves the faults, the reconciler's the rules' memory: each write keeps the other."""
    first = StateStore(tmp_path, boot_id="boot-1")
    first.save((XID,))
    first.save_rules(RULES)
    first.save((XID, LOST))
    again = StateStore(tmp_path, boot_id="boot-1")
    assert again.load_rules() == RULES
    assert again.load() == (XID, LOST)
    # A process whose first write is the rules' memory keeps the faults already in the file.
    third = StateStore(tmp_path, boot_id="boot-1")
    third.save_rules(RuleMemory())
    assert StateStore(tmp_path, boot_id="boot-1").load() == (XID, LOST)


def test_the_rules_memory_of_a_previous_boot_is_discarded(tmp_path: Path) -> None:
    StateStore(tmp_path, boot_id="boot-1").save_rules(RULES)
    assert StateStore(tmp_path, boot_id="boot-2").load_rules() == RuleMemory()


@pytest.mark.parametrize(
    "part",
    [
        {"known": "x", "overridden": []},
        {"known": [{"rule": 1, "uuid": "u", "faults": []}], "overridden": []},
        {"known": [], "overridden": [{"uuid": "u", "faults": ["k"] * 2000}]},
        {"known": []},
    ],
)
def test_a_malformed_rules_memory_is_ignored_and_the_faults_kept(tmp_path: Path, part: object) -> None:
    StateStore(tmp_path, boot_id="b").save((XID,))
    doc = json.loads((tmp_path / FILE_NAME).read_text())
    doc["device_rules"] = part
    (tmp_path / FILE_NAME).write_text(json.dumps(doc))
    store = StateStore(tmp_path, boot_id="b")
    assert store.load() == (XID,) and store.load_rules() == RuleMemory()


def test_a_state_file_of_an_older_gpuguard_without_rules_loads(tmp_path: Path) -> None:
    StateStore(tmp_path, boot_id="b").save((XID,))
    doc = json.loads((tmp_path / FILE_NAME).read_text())
    del doc["device_rules"]
    (tmp_path / FILE_NAME).write_text(json.dumps(doc))
    store = StateStore(tmp_path, boot_id="b")
    assert store.load() == (XID,) and store.load_rules() == RuleMemory()


def test_a_failed_write_is_retried_with_backoff_and_a_fault_saved_after_the_disk_recovers_survives_a_restart(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a directory under a regular file: every write fails, as on a full disk
    clock = Clock()
    s = StateStore(blocker / "sub", boot_id="b", clock=clock)
    with capture_logs() as logs:
        s.save((XID,))
        blocker.unlink()  # the disk recovers
        s.save((XID, LOST))  # within the backoff: not tried yet
        assert not (blocker / "sub" / FILE_NAME).exists()
        clock.t += retry.FIRST_S
        s.save((XID, LOST))  # the same faults, now due: written
        s.save_rules(RULES)
    assert [e["event"] for e in logs] == ["state.unavailable", "state.resumed"]
    again = StateStore(blocker / "sub", boot_id="b")
    assert again.load() == (XID, LOST) and again.load_rules() == RULES


def test_the_backoff_doubles_per_failure_up_to_its_limit(tmp_path: Path) -> None:
    clock = Clock()
    r = retry.WriteRetry(structlog.get_logger(), "state", directory="d", clock=clock)
    waits = []
    for _ in range(9):
        r.failed(OSError(28, "No space left on device"))
        start = clock.t
        while not r.due():
            clock.t += 1
        waits.append(clock.t - start)
    assert waits == [5, 10, 20, 40, 80, 160, 300, 300, 300]


@pytest.mark.parametrize(
    "fault",
    [
        {"reason": 7, "detail": "x"},
        {"reason": "xid-79", "detail": None},
        {"reason": "xid-79", "detail": "x", "uuid": 5},
        {"reason": "xid-79", "detail": "x", "gpu_index": "1"},
        {"reason": "xid-79", "detail": "x", "gpu_index": True},
        {"detail": "x"},
    ],
)
def test_a_fault_with_a_mistyped_field_makes_the_file_corrupt(
    tmp_path: Path, fault: dict[str, object]
) -> None:
    doc = {"kind": "gpuguard-state", "version": 1, "boot_id": "b", "faults": [fault]}
    (tmp_path / FILE_NAME).write_text(json.dumps(doc))
    assert StateStore(tmp_path, boot_id="b").load() == ()
    assert any(p.name.startswith(f"{FILE_NAME}.corrupt-") for p in tmp_path.iterdir())


def test_a_fault_without_uuid_or_index_is_the_nodes_and_loads(tmp_path: Path) -> None:
    doc = {
        "kind": "gpuguard-state",
        "version": 1,
        "boot_id": "b",
        "faults": [{"reason": "xid-79", "detail": "d"}],
    }
    (tmp_path / FILE_NAME).write_text(json.dumps(doc))
    assert StateStore(tmp_path, boot_id="b").load() == (Fault("xid-79", "d"),)


def test_a_restored_faults_reason_is_cut_to_64_characters_and_its_detail_to_512(tmp_path: Path) -> None:
    long = Fault("x" * 100, "d" * 600, uuid="GPU-a", gpu_index=0)
    StateStore(tmp_path, boot_id="b").save((long,))
    (restored,) = StateStore(tmp_path, boot_id="b").load()
    assert restored == Fault("x" * 64, "d" * 512, uuid="GPU-a", gpu_index=0)


def _with_rules(tmp_path: Path, part: object) -> StateStore:
    StateStore(tmp_path, boot_id="b").save((XID,))
    doc = json.loads((tmp_path / FILE_NAME).read_text())
    doc["device_rules"] = part
    (tmp_path / FILE_NAME).write_text(json.dumps(doc))
    return StateStore(tmp_path, boot_id="b")


@pytest.mark.parametrize(("count", "kept"), [(MAX_RULES, True), (MAX_RULES + 1, False)])
def test_at_most_1024_remembered_rules_are_read(tmp_path: Path, count: int, kept: bool) -> None:
    known = [{"rule": f"r-{i}", "uuid": f"GPU-{i}", "faults": [f"ecc/GPU-{i}"]} for i in range(count)]
    store = _with_rules(tmp_path, {"known": known, "overridden": []})
    assert len(store.load_rules().known) == (count if kept else 0)
    assert store.load() == (XID,)


@pytest.mark.parametrize(("length", "kept"), [(512, True), (513, False)])
def test_a_remembered_rules_text_is_at_most_512_characters(tmp_path: Path, length: int, kept: bool) -> None:
    part = {"known": [], "overridden": [{"uuid": "u" * length, "faults": ["k"]}]}
    store = _with_rules(tmp_path, part)
    assert store.load_rules().overridden == ({"u" * length: frozenset({"k"})} if kept else {})


def test_the_rules_memory_is_written_in_a_fixed_order(tmp_path: Path) -> None:
    StateStore(tmp_path, boot_id="b").save_rules(RULES)
    doc = json.loads((tmp_path / FILE_NAME).read_text())
    assert doc["device_rules"] == {
        "known": [{"rule": "gpuguard-n-gpu-1", "uuid": "GPU-b", "faults": ["xid-79/GPU-b"]}],
        "overridden": [{"uuid": "GPU-c", "faults": ["ecc/GPU-c"]}],
    }
    assert doc["faults"] == [] and doc["backend"] == "nvml"


def test_a_save_before_any_load_keeps_the_files_rules(tmp_path: Path) -> None:
    StateStore(tmp_path, boot_id="b").save_rules(RULES)
    StateStore(tmp_path, boot_id="b").save((XID,))  # a new process's first call
    again = StateStore(tmp_path, boot_id="b")
    assert again.load() == (XID,) and again.load_rules() == RULES


def test_an_unchanged_rules_memory_is_not_rewritten(tmp_path: Path) -> None:
    s = StateStore(tmp_path, boot_id="b")
    s.save_rules(RULES)
    os.utime(tmp_path / FILE_NAME, ns=(1, 1))
    s.save_rules(RuleMemory(known=dict(RULES.known), overridden=dict(RULES.overridden)))
    assert (tmp_path / FILE_NAME).stat().st_mtime_ns == 1


def test_a_file_of_another_backend_is_never_restored(tmp_path: Path) -> None:
    StateStore(tmp_path, boot_id="b", backend="mock").save((XID,))
    StateStore(tmp_path, boot_id="b", backend="mock").save_rules(RULES)
    other = StateStore(tmp_path, boot_id="b")
    assert other.load() == () and other.load_rules() == RuleMemory()
    assert StateStore(tmp_path, boot_id="b", backend="mock").load() == (XID,)


# Issue 12's review, defect 12: the mock backend and the host's state directory.
def test_defect_12_faults_a_mock_run_saved_are_never_restored_by_a_real_run(tmp_path: Path) -> None:
    StateStore(tmp_path, boot_id="boot-1", backend="mock").save((XID,))
    assert StateStore(tmp_path, boot_id="boot-1", backend="nvml").load() == ()


def test_the_hosts_boot_id_is_read_stripped_and_an_unreadable_one_is_empty(tmp_path: Path) -> None:
    (tmp_path / "boot_id").write_text("0e9b6a2c-1d4e\n")
    assert read_boot_id(str(tmp_path / "boot_id")) == "0e9b6a2c-1d4e"
    assert read_boot_id(str(tmp_path / "missing")) == ""
    assert read_boot_id(str(tmp_path)) == ""  # a directory: unreadable as a file


# Issue 12's review, defect 11: an unreadable boot ID.
def test_defect_11_an_unreadable_boot_id_never_carries_faults_across_a_reboot(tmp_path: Path) -> None:
    unreadable = str(tmp_path / "no-such-boot-id")
    StateStore(tmp_path / "state", boot_id=read_boot_id(unreadable)).save((XID,))
    # The host rebooted; its boot ID is still unreadable: nothing proves this is the same boot.
    assert StateStore(tmp_path / "state", boot_id=read_boot_id(unreadable)).load() == ()


def test_without_a_boot_id_nothing_is_written_or_read_and_it_says_so(tmp_path: Path) -> None:
    with capture_logs() as logs:
        s = StateStore(tmp_path, boot_id="")
    s.save((XID,))
    s.save_rules(RULES)
    assert list(tmp_path.iterdir()) == [] and s.load() == ()
    assert [e["event"] for e in logs] == ["state.no_boot_id"]
    assert StateStore(None, boot_id="b").path is None


def test_the_file_is_the_agents_alone_and_its_directory_is_made_with_its_parents(tmp_path: Path) -> None:
    StateStore(tmp_path / "a" / "b", boot_id="b").save((XID,))
    path = tmp_path / "a" / "b" / FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    doc = json.loads(path.read_text())
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["written"])


def test_many_writes_leave_no_file_descriptor_open(tmp_path: Path) -> None:
    s = StateStore(tmp_path, boot_id="b")
    before = len(os.listdir("/proc/self/fd"))
    for i in range(20):
        s.save((Fault("xid-79", f"d{i}", uuid="GPU-b", gpu_index=1),))
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_write_that_fails_half_way_leaves_no_temp_file_and_disables_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    s = StateStore(tmp_path, boot_id="b")
    s.save((XID,))
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    s.save((XID, LOST))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "fault", [{"reason": ["xid-79"], "detail": "x"}, {"reason": "xid-79", "detail": ["x"]}]
)
def test_a_fault_whose_reason_or_detail_is_a_list_makes_the_file_corrupt(
    tmp_path: Path, fault: object
) -> None:
    doc = {"kind": "gpuguard-state", "version": 1, "boot_id": "b", "faults": [fault]}
    (tmp_path / FILE_NAME).write_text(json.dumps(doc))
    assert StateStore(tmp_path, boot_id="b").load() == ()


@pytest.mark.parametrize(("size", "loads"), [(MAX_BYTES, True), (MAX_BYTES + 1, False)])
def test_at_most_1_mib_of_the_file_is_read(tmp_path: Path, size: int, loads: bool) -> None:
    doc = {"kind": "gpuguard-state", "version": 1, "boot_id": "b", "backend": "nvml", "faults": [], "pad": ""}
    base = len(json.dumps(doc, separators=(",", ":")).encode())
    doc["pad"] = "x" * (size - base)
    (tmp_path / FILE_NAME).write_text(json.dumps(doc, separators=(",", ":")))
    assert (tmp_path / FILE_NAME).stat().st_size == size
    StateStore(tmp_path, boot_id="b").load()
    assert (tmp_path / FILE_NAME).exists() is loads


def test_the_file_is_read_once_and_a_restore_is_logged_only_when_there_are_faults(tmp_path: Path) -> None:
    StateStore(tmp_path, boot_id="b").save((XID,))
    s = StateStore(tmp_path, boot_id="b")
    with capture_logs() as logs:
        assert s.load() == (XID,)
        s.load_rules()
        s.save((XID, LOST))
    assert [e["event"] for e in logs] == ["state.restored"]
    again = StateStore(tmp_path, boot_id="b")
    with capture_logs() as logs:
        again.load_rules()
        again.load_rules()
        again.save_rules(RULES)
    assert [e["event"] for e in logs] == ["state.restored"]
    StateStore(tmp_path / "empty", boot_id="b").save_rules(RULES)
    with capture_logs() as logs:
        StateStore(tmp_path / "empty", boot_id="b").load()
    assert logs == []


def test_no_directory_and_no_boot_id_says_nothing() -> None:
    with capture_logs() as logs:
        StateStore(None, boot_id="")
    assert logs == []


def test_the_hosts_boot_id_is_read_from_the_kernel_by_default() -> None:
    kernel = Path("/proc/sys/kernel/random/boot_id")
    if not kernel.exists():
        pytest.skip("no /proc boot_id on this machine")
    default = Config.__dataclass_fields__["boot_id_file"].default
    assert default == str(kernel)
    assert read_boot_id(str(default)) == kernel.read_text().strip() != ""


def test_the_rules_memory_read_first_at_start_reads_the_file_and_logs_the_restore_once(
    tmp_path: Path,
) -> None:
    """At start the per-GPU quarantine reads the rules' memory before the agent reads the faults: one
    read and one `state.restored` line between them, not one each."""
    StateStore(tmp_path, boot_id="b").save((XID,))
    StateStore(tmp_path, boot_id="b").save_rules(RULES)
    s = StateStore(tmp_path, boot_id="b")
    with capture_logs() as logs:
        assert s.load_rules() == RULES
        assert s.load() == (XID,)
    assert [e["event"] for e in logs] == ["state.restored"]


def _doc(**fields: object) -> dict[str, object]:
    return {"kind": "gpuguard-state", "version": 1, "boot_id": "b", "backend": "nvml", "faults": [], **fields}


@pytest.mark.parametrize(
    "doc",
    [
        _doc(faults="x"),
        _doc(faults=[1]),
        _doc(faults=["xid-79"]),
        _doc(faults=[[1]]),
        _doc(faults=[None]),
        _doc(faults={"reason": "xid-79"}),
        _doc(faults=None),
        _doc(faults=7),
        _doc(faults=[{"reason": "xid-79", "detail": "x"}] * 1025),
        _doc(boot_id=["b"]),
        _doc(boot_id=None),
        _doc(backend={"nvml": 1}),
        _doc(backend=1),
    ],
    ids=lambda d: ",".join(f"{k}={json.dumps(v)[:20]}" for k, v in d.items() if v != _doc()[k]),
)
def test_a_state_file_with_a_wrong_typed_field_is_moved_aside_not_a_crash(
    tmp_path: Path, doc: dict[str, object]
) -> None:
    """The agent's start restores this file: an exception here was a crash loop in a DaemonSet."""
    (tmp_path / FILE_NAME).write_text(json.dumps(doc))
    s = StateStore(tmp_path, boot_id="b")
    with capture_logs() as logs:
        assert s.load() == ()
    assert [e["event"] for e in logs] == ["state.corrupt"]
    assert not (tmp_path / FILE_NAME).exists()
    s.save((XID,))
    assert StateStore(tmp_path, boot_id="b").load() == (XID,)


def test_a_state_file_nested_deeper_than_the_stack_is_moved_aside(tmp_path: Path) -> None:
    (tmp_path / FILE_NAME).write_text("[" * 200_000)
    assert StateStore(tmp_path, boot_id="b").load() == ()
    assert not (tmp_path / FILE_NAME).exists()


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_state_path_that_is_not_a_regular_file_is_moved_aside_without_blocking(
    tmp_path: Path, kind: str
) -> None:
    """A FIFO would block a plain open() for ever (no writer); it is refused at once."""
    path = tmp_path / FILE_NAME
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    with capture_logs() as logs:
        assert StateStore(tmp_path, boot_id="b").load() == ()
    assert logs[0]["event"] == "state.corrupt" and "not a regular file" in logs[0]["error"]
    assert not path.exists()


def test_more_faults_than_the_reader_accepts_are_written_within_its_limit_and_a_fatal_fault_is_kept(
    tmp_path: Path,
) -> None:
    """An Xid 79 first (the oldest), then more faults a reading clears than the file may hold: the file
    written loads at the next start (never moved aside), the Xid 79 in it, the oldest others left out."""
    others = tuple(
        Fault("gpu-unreadable", f"d{i}", uuid=f"GPU-{i:04d}", gpu_index=i) for i in range(MAX_FAULTS + 50)
    )
    with capture_logs() as logs:
        StateStore(tmp_path, boot_id="b").save((XID, *others))
    restored = StateStore(tmp_path, boot_id="b").load()
    assert len(restored) == MAX_FAULTS and restored[0] == XID
    assert restored[1:] == others[-(MAX_FAULTS - 1) :]
    assert [e["event"] for e in logs] == ["state.faults_not_kept"]
    assert [p.name for p in tmp_path.iterdir()] == [FILE_NAME]


def test_texts_longer_than_the_reader_keeps_are_cut_by_the_writer_and_rules_past_its_limits_left_out(
    tmp_path: Path,
) -> None:
    long = Fault("xid-79", "x" * 2000, uuid="GPU-b", gpu_index=1)
    rules = RuleMemory(known={"r" * 600: ("GPU-b", frozenset({"xid-79/GPU-b"})), **RULES.known})
    s = StateStore(tmp_path, boot_id="b")
    s.save((long,))
    s.save_rules(rules)
    again = StateStore(tmp_path, boot_id="b")
    assert again.load() == (Fault("xid-79", "x" * 512, uuid="GPU-b", gpu_index=1),)
    assert again.load_rules().known == RULES.known


def test_a_boot_id_file_past_4_kib_is_unreadable(tmp_path: Path) -> None:
    (tmp_path / "boot_id").write_text("b" * (4 * 1024 + 1))
    (tmp_path / "small").write_text("b" * (4 * 1024))
    assert read_boot_id(str(tmp_path / "boot_id")) == ""
    assert read_boot_id(str(tmp_path / "small")) == "b" * 4096


def test_the_last_kernel_log_record_judged_is_restored_in_the_same_boot_and_only_rises(
    tmp_path: Path,
) -> None:
    """The kernel log's sequence number rides in the state file: a restart in the same boot reads it back
    (0 included), a save without one keeps it, and a lower one never moves it back."""
    assert StateStore(tmp_path, boot_id="b").kernel_seq() is None  # no file yet
    s = StateStore(tmp_path, boot_id="b")
    s.save((XID,), kernel_seq=0)
    assert StateStore(tmp_path, boot_id="b").kernel_seq() == 0
    s.save((XID,), kernel_seq=7)
    s.save((XID, LOST))  # no record judged since: the last one stays
    s.save((XID, LOST), kernel_seq=3)  # an older record: never back
    again = StateStore(tmp_path, boot_id="b")
    assert again.kernel_seq() == 7 and again.load() == (XID, LOST)
    assert StateStore(tmp_path, boot_id="other").kernel_seq() is None


@pytest.mark.parametrize("seq", [-1, True, "7", 7.0])
def test_a_kernel_seq_that_is_no_whole_number_from_0_reads_as_none(tmp_path: Path, seq: object) -> None:
    StateStore(tmp_path, boot_id="b").save((XID,), kernel_seq=5)
    doc = json.loads((tmp_path / FILE_NAME).read_text())
    (tmp_path / FILE_NAME).write_text(json.dumps({**doc, "kernel_seq": seq}))
    again = StateStore(tmp_path, boot_id="b")
    assert again.kernel_seq() is None and again.load() == (XID,)


def test_a_remembered_rule_at_the_readers_limits_is_written(tmp_path: Path) -> None:
    """At the limits exactly (a 512-character text, 1024 fault keys) a rule is kept; one past them is not
    (the test above)."""
    keys = frozenset(f"xid-{i}/GPU-{'k' * 400}" for i in range(MAX_RULES))
    rules = RuleMemory(known={"r" * 512: ("GPU-b", frozenset({"xid-79/GPU-b"})), "s": ("GPU-c", keys)})
    s = StateStore(tmp_path, boot_id="b")
    s.save_rules(rules)
    assert StateStore(tmp_path, boot_id="b").load_rules() == rules


def test_a_file_of_exactly_1_mib_keeps_the_rules_memory_and_one_byte_more_drops_it_not_the_faults(
    tmp_path: Path,
) -> None:
    """The reader takes at most MAX_BYTES: a rules memory that would make the file larger is left out (the
    faults are what matters), one that makes it exactly that large is written whole."""

    def rules(extra: int, pad: int) -> RuleMemory:
        big = {
            name: (f"GPU-{name}", frozenset(f"{name}{i:04}".ljust(400, "k") for i in range(MAX_RULES)))
            for name in ("a", "b")
        }
        more = {"c": ("GPU-c", frozenset(f"c{i:04}".ljust(400, "k") for i in range(extra)))} if extra else {}
        return RuleMemory(known={**big, **more, "d": ("GPU-d", frozenset({"d" * pad}))})

    def size(memory: RuleMemory, where: Path) -> int:
        StateStore(where, boot_id="b").save_rules(memory)
        assert StateStore(where, boot_id="b").load_rules() == memory  # within the limit: written whole
        return (where / FILE_NAME).stat().st_size

    one = size(rules(1, 1), tmp_path / "one")
    cost = size(rules(2, 1), tmp_path / "two") - one  # a key more
    extra = 1 + (MAX_BYTES - one - 50) // cost
    pad = 1 + MAX_BYTES - size(rules(extra, 1), tmp_path / "padded")
    assert 1 <= pad <= 512
    assert size(rules(extra, pad), tmp_path / "exact") == MAX_BYTES
    s = StateStore(tmp_path / "over", boot_id="b")
    s.save((XID,))
    with capture_logs() as logs:
        s.save_rules(rules(extra, pad + 1))
    again = StateStore(tmp_path / "over", boot_id="b")
    assert again.load() == (XID,) and again.load_rules() == RuleMemory()
    assert [e["event"] for e in logs] == ["state.rules_not_kept"]


def test_faults_whose_write_failed_are_written_by_the_next_due_save_of_the_same(tmp_path: Path) -> None:
    """The agent saves the same faults at every check: one whose write failed is not taken for written."""
    blocker = tmp_path / "file"
    blocker.write_text("x")  # every write fails, as on a full disk
    clock = Clock()
    s = StateStore(blocker / "sub", boot_id="b", clock=clock)
    s.save((XID,))
    blocker.unlink()  # the disk recovers
    clock.t += retry.FIRST_S
    s.save((XID,))
    assert StateStore(blocker / "sub", boot_id="b").load() == (XID,)
