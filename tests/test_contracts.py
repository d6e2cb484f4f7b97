"""The import contracts hold rules, not a snapshot: in a scratch copy of the package, one import that breaks a
rule makes `lint-imports` fail (an upward import between the packages by stage, an import across a layer's
independent packages, the node quarantine importing the GPU quarantine, the policy importing the API
client), and the copy as it is passes. lint-imports runs on the copy with its own config, the copy first on
PYTHONPATH."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _copy(tmp_path: Path) -> Path:
    scratch = tmp_path / "scratch"
    shutil.copytree(ROOT / "gpuguard", scratch / "gpuguard", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", scratch / "pyproject.toml")
    return scratch


def _lint(scratch: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(scratch), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(scratch / "pyproject.toml"), "--no-cache"],
        check=False,
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _add_import(scratch: Path, module: str, line: str) -> None:
    path = scratch / "gpuguard" / module
    path.write_text(path.read_text() + f"\n{line}  # noqa: E402, F401\n")


def test_the_contracts_pass_on_an_unchanged_copy_of_the_package(tmp_path: Path) -> None:
    done = _lint(_copy(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert " broken" in done.stdout and "0 broken" in done.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        (
            "quarantine/node/plan.py",
            "from gpuguard.quarantine.gpu import rules as _gpu_rules",
            "the quarantine package",
        ),
        ("judge/policy.py", "import gpuguard.kube.client", "nothing pure imports the API client"),
        ("core/model.py", "import gpuguard.cli", "layers by stage"),
        ("store/history.py", "import gpuguard.quarantine.record", "layers by stage"),
        ("kube/pods.py", "import gpuguard.nvml.base", "layers by stage"),
        ("runtime/health.py", "import gpuguard.runtime.agent", "the runtime package"),
    ],
    ids=[
        "the node quarantine imports the GPU quarantine",
        "the policy imports the API client",
        "the model imports the CLI: an upward import",
        "a kept file imports the quarantine: an upward import",
        "the API client imports the NVML layer beside it",
        "the /healthz body imports the loop",
    ],
)
def test_one_import_that_breaks_a_rule_fails_lint_imports(
    tmp_path: Path, module: str, line: str, contract: str
) -> None:
    scratch = _copy(tmp_path)
    _add_import(scratch, module, line)
    done = _lint(scratch)
    assert done.returncode != 0, done.stdout
    listed = " ".join(done.stdout.split())
    verdict = re.search(r"\b(KEPT|BROKEN)\b", listed[listed.index(contract) :])
    assert verdict is not None and verdict[1] == "BROKEN", done.stdout
