"""hack/mutation.py (`make mutation`) on a module of two lines with one test: it makes exactly the two mutants
the operators promise, runs each against the test the coverage pass saw execute its line, and reports the one
the test kills and the one it lets survive."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MODULE = "def negate(flag: bool) -> bool:\n    return not flag\n"
# Kills `return flag` (True for True); misses `return None` (falsy like the right answer).
TEST = "from tiny import negate\n\n\ndef test_negate():\n    assert not negate(True)\n"


def test_the_mutator_reports_the_mutant_a_test_kills_and_the_one_it_misses(tmp_path: Path) -> None:
    pytest.importorskip("coverage")
    (tmp_path / "tiny.py").write_text(MODULE)
    (tmp_path / "test_tiny.py").write_text(TEST)
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(ROOT / "hack" / "mutation.py"), "--root", str(tmp_path), "--jobs", "1"]
    cmd += ["--module", "tiny.py", "--tests", "test_tiny.py", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stderr
    results = {m["desc"]: m["result"] for m in json.loads(out.read_text())}
    assert results == {"return not flag -> return None": "survived", "not flag -> flag": "killed"}
    assert "tiny.py                                 2       1       0        0      50.0%" in r.stdout
    assert "[survived] tiny.py negate: return not flag -> return None" in r.stdout


def test_the_mutator_leaves_dunder_all_alone_and_mutates_the_code_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`__all__` names what a star import takes, read by mypy and ruff and by no running code: wording."""
    spec = importlib.util.spec_from_file_location("mutation", ROOT / "hack" / "mutation.py")
    assert spec is not None and spec.loader is not None
    mutation = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "mutation", mutation)  # its dataclasses look their module up
    spec.loader.exec_module(mutation)
    (tmp_path / "tiny.py").write_text('__all__ = ["LIMIT"]\nLIMIT = 3\n')
    assert [m.desc for m in mutation.mutants(tmp_path, "tiny.py")] == ["3 -> 4"]
    # A Literal type's values are read by mypy alone: the same wording.
    (tmp_path / "typed.py").write_text('from typing import Literal\nKind = Literal["a", "b"]\nLIMIT = 3\n')
    assert [m.desc for m in mutation.mutants(tmp_path, "typed.py")] == ["3 -> 4"]
