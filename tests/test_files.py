"""gpuguard.core.files: every file gpuguard reads is a regular file of at most a stated size, read whole, or
one line naming the file and the problem; never a read without end, never a wait on a FIFO."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from gpuguard.core import files
from gpuguard.core.errors import ConfigError, ScenarioError


def test_a_file_within_its_bound_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    assert files.read_bytes(path, limit=100, what="thing") == b"x" * 100
    assert files.read_text(path, limit=100, what="thing") == "x" * 100


def test_a_file_one_byte_over_its_bound_is_refused_naming_the_file_and_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 65537)
    with pytest.raises(ConfigError) as err:
        files.read_bytes(path, limit=64 * files.KIB, what="token file")
    assert str(err.value) == f"token file {path}: 65537 bytes, more than the 64 KiB allowed"


def test_dev_zero_is_refused_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"^scenario /dev/zero: not a regular file$"):
        files.read_bytes("/dev/zero", limit=files.MIB, what="scenario")
    assert time.monotonic() - started < 1


def test_a_fifo_without_a_writer_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    result: list[BaseException] = []
    thread = threading.Thread(target=lambda: _catch(result, fifo), daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), "blocked on the FIFO"
    assert isinstance(result[0], ConfigError) and str(result[0]).endswith("not a regular file")


def _catch(out: list[BaseException], path: Path) -> None:
    try:
        files.read_bytes(path, limit=10, what="x")
    except ConfigError as exc:
        out.append(exc)


def test_a_proc_file_whose_size_reads_0_is_read(tmp_path: Path) -> None:
    if not Path("/proc/uptime").exists():
        pytest.skip("no /proc")
    assert float(files.read_text("/proc/uptime", limit=4 * files.KIB, what="uptime").split()[0]) > 0


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: None, "no such file"),
        (lambda p: p.mkdir(), "not a regular file"),
        (lambda p: p.write_bytes(b"\xff\xfe"), "not UTF-8 text (byte 0)"),
    ],
)
def test_each_problem_is_one_line_of_the_callers_error_class(tmp_path: Path, setup, message: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "s.yaml"
    setup(path)
    with pytest.raises(ScenarioError) as err:
        files.read_text(path, limit=100, what="scenario", error=ScenarioError)
    assert str(err.value) == f"scenario {path}: {message}"


def test_an_unreadable_file_says_why(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads a mode-000 file")
    path = tmp_path / "f"
    path.write_text("x")
    path.chmod(0)
    with pytest.raises(ConfigError, match="cannot open: Permission denied"):
        files.read_bytes(path, limit=10, what="x")


@pytest.mark.parametrize(
    ("limit", "text"), [(files.MIB * 4, "4 MiB"), (files.KIB * 64, "64 KiB"), (100, "100 bytes")]
)
def test_sizes_are_said_in_the_unit_they_were_chosen_in(limit: int, text: str) -> None:
    assert files.size_text(limit) == text


def test_a_missing_file_whose_name_has_a_newline_is_named_on_one_line(tmp_path: Path) -> None:
    """Found by tests/test_fuzz.py: a kubeconfig's client-key "\\n" made a two-line error."""
    with pytest.raises(ConfigError) as exc:
        files.read_bytes(tmp_path / "a\nb", limit=10, what="kubeconfig x: client-key")
    assert "\n" not in str(exc.value) and "a\\nb: no such file" in str(exc.value)
