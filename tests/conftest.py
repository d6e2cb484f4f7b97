"""Shared fixtures: the fake NVML library, built once per session with the machine's gcc."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAKENVML_DIR = ROOT / "build" / "fakenvml"


@pytest.fixture(scope="session")
def fakenvml() -> Path:
    """The directory holding the fake libnvidia-ml.so.1 (built if missing or stale)."""
    subprocess.run([str(ROOT / "tests" / "fakenvml" / "build.sh"), str(FAKENVML_DIR)], check=True)
    assert (FAKENVML_DIR / "libnvidia-ml.so.1").is_file()
    return FAKENVML_DIR
