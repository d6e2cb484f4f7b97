"""helm for the tests: the pinned Helm 4 (default) or Helm 3 from hack/helm/build.sh, its config, cache and
data directories isolated from the user's. Shared by tests/test_helm.py (templates) and the install tests."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "gpuguard"
BUILD_SCRIPT = ROOT / "hack" / "helm" / "build.sh"
NAMESPACE = "gpuguard"

Docs = list[dict[str, Any]]


@dataclass(frozen=True)
class Helm:
    binary: str
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.binary, *args], env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )

    def render(self, *values: str, release: str = "gpuguard", namespace: str = NAMESPACE) -> Docs:
        result = self.run("template", release, str(CHART), "--namespace", namespace, *values)
        assert result.returncode == 0, result.stderr
        return [d for d in yaml.safe_load_all(result.stdout) if d is not None]

    def notes(self, *values: str, release: str = "gpuguard", namespace: str = NAMESPACE) -> str:
        """The chart's NOTES.txt as `helm install` prints it (a client-side dry run: no cluster)."""
        args = ("install", release, str(CHART), "--namespace", namespace, "--dry-run=client", *values)
        result = self.run(*args)
        assert result.returncode == 0, result.stderr
        return result.stdout.split("NOTES:", 1)[1]


def build_helm(home: Path, *, major: int = 4) -> Helm:
    """Build (or find) the pinned helm of that major version; fail the test on a failed build."""
    if os.environ.get("GPUGUARD_SKIP_HELM") == "1":
        pytest.skip("GPUGUARD_SKIP_HELM=1")
    args = ["--v3"] if major == 3 else []
    try:
        result = subprocess.run(
            [str(BUILD_SCRIPT), *args], capture_output=True, text=True, timeout=1100, check=False
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hack/helm/build.sh did not finish in {exc.timeout} s")
    if result.returncode != 0:
        pytest.fail(
            f"hack/helm/build.sh {' '.join(args)} failed ({result.returncode}; GPUGUARD_SKIP_HELM=1 skips):\n"
            + result.stderr[-3000:]
        )
    binary = result.stdout.strip().splitlines()[-1]
    assert Path(binary).is_file(), result.stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_")}
    env |= {k: str(home / k.lower()) for k in ("HELM_CONFIG_HOME", "HELM_CACHE_HOME", "HELM_DATA_HOME")}
    return Helm(binary, env)
