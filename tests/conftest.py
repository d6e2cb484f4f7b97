"""Shared fixtures: the fake NVML library, built once per session with the machine's gcc, and an environment
without the agent's settings or a proxy."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

ROOT = Path(__file__).resolve().parents[1]
FAKENVML_DIR = ROOT / "build" / "fakenvml"


@pytest.fixture(scope="session")
def fakenvml() -> Path:
    """The directory holding the fake libnvidia-ml.so.1 (built if missing or stale)."""
    subprocess.run([str(ROOT / "tests" / "fakenvml" / "build.sh"), str(FAKENVML_DIR)], check=True)
    assert (FAKENVML_DIR / "libnvidia-ml.so.1").is_file()
    return FAKENVML_DIR


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No GPUGUARD_* variable, NODE_NAME or proxy setting of the caller's environment; set them on the
    monkeypatch it yields."""
    for k in list(os.environ):
        if k.startswith("GPUGUARD_") or k in (
            "NODE_NAME",
            "HTTPS_PROXY",
            "https_proxy",
            "NO_PROXY",
            "no_proxy",
        ):
            monkeypatch.delenv(k)
    yield monkeypatch


@pytest.fixture(autouse=True)
def _structlog_config_restored() -> Iterator[None]:
    """Each test starts from the logging configuration the one before it found: a command run in-process
    (`gpuguard check` sets the level to WARNING) must not hide the next test's info lines from
    capture_logs."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
