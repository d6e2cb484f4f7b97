"""The first ten minutes: `make run` installs only the runtime (not the dev extra), and a .venv made by
another Python is rebuilt instead of reused. Run with `make -n` in a copy of the Makefile: nothing
installs (the stale .venv is removed when make reads the Makefile, even with -n)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def make_n(tmp_path: Path, target: str) -> str:
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")
    r = subprocess.run(
        ["make", "-n", target, f"PYTHON={sys.executable}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_make_run_installs_gpuguard_without_the_dev_extra(tmp_path: Path) -> None:
    out = make_n(tmp_path, "run")
    assert "pip install -q -e ." in out
    assert "[dev]" not in out
    assert "gpuguard watch --dry-run --backend mock" in out


def test_make_test_installs_the_dev_extra(tmp_path: Path) -> None:
    assert "pip install -q -e '.[dev]'" in make_n(tmp_path, "unit")


def test_a_venv_from_another_python_is_removed_and_rebuilt(tmp_path: Path) -> None:
    fake = tmp_path / ".venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\necho '(3, 9)'\n")
    fake.chmod(0o755)
    (tmp_path / ".venv" / ".installed-runtime").touch()
    out = make_n(tmp_path, "run")
    assert not (tmp_path / ".venv").exists()
    assert "-m venv .venv" in out and "pip install -q -e ." in out  # made again, then installed


def test_a_venv_from_the_same_python_is_kept(tmp_path: Path) -> None:
    venv = tmp_path / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (venv / ".installed-runtime").touch()
    make_n(tmp_path, "run")
    assert (venv / "bin" / "python").exists()


def test_make_clean_removes_the_venv_too(tmp_path: Path) -> None:
    assert "rm -rf .venv" in make_n(tmp_path, "clean")


def test_make_run_says_what_it_is_doing_before_the_silent_install_and_before_the_demo(tmp_path: Path) -> None:
    """pip -q prints nothing for about a minute on a fresh clone: a line first says what is happening."""
    lines = make_n(tmp_path, "run").splitlines()
    pip = next(i for i, line in enumerate(lines) if "pip install -q -e ." in line)
    assert any(line.startswith("echo ") and "installing gpuguard" in line for line in lines[:pip]), lines
    demo = next(i for i, line in enumerate(lines) if "gpuguard watch --dry-run" in line)
    assert lines[demo - 1].startswith("echo ") and "demo" in lines[demo - 1], lines


def test_plain_kube_up_runs_the_controller_manager_so_a_namespace_can_be_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = make_n(tmp_path, "kube-up")
    assert 'harness.controlplane up --with "controller-manager,"' in out
    assert "hack/kwok/build.sh" not in out  # kwok only when asked for
    monkeypatch.setenv("KUBE_UP_WITH", "all")
    assert "hack/kwok/build.sh" in make_n(tmp_path, "kube-up")
