"""No internal ticket numbers in what ships: the package, its data, the docs, the manifests, the chart and
the README name a feature ("the health signals", "repeat offenders"), never the issue that asked for it
("issue 29"), which a user has never seen. Tests, bench scripts and git history may keep them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("gpuguard", "docs", "deploy", "README.md")
# "issue 29", "Issue 29's", "issues 24 and 31", "issue #29", "issues #24, #31".
TICKET = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)


def _shipped_files() -> list[Path]:
    """The tracked files under SHIPPED (git's list; the tree itself where there is no git checkout)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", *SHIPPED], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        files = [ROOT / name for name in out.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        tops = [ROOT / top for top in SHIPPED]
        files = [p for top in tops for p in ([top] if top.is_file() else top.rglob("*"))]
    return [p for p in files if p.is_file() and "__pycache__" not in p.parts]


def _mentions(text: str) -> list[str]:
    return [m.group(0) for m in TICKET.finditer(text)]


def test_the_pattern_catches_each_way_a_ticket_is_written() -> None:
    text = "issue 29, Issue 30's, issues 24 and 31, issue #7, ISSUE  15"
    assert _mentions(text) == ["issue 29", "Issue 30", "issues 24", "issue #7", "ISSUE  15"]


def test_the_pattern_leaves_words_and_external_references_alone() -> None:
    assert _mentions("an issue of the API server, 3 issues, NVSentinel #883, tissue 5, color #fff") == []


def test_the_shipped_files_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _shipped_files()}
    assert {"README.md", "gpuguard/core/data/signals.json", "docs/design.md"} <= names
    assert any(n.startswith("deploy/helm/") for n in names)


def test_no_shipped_file_names_an_internal_ticket_number() -> None:
    found = []
    for path in _shipped_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary: no prose
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{number}: {m}" for m in _mentions(line)]
    assert not found, f"{len(found)} ticket numbers (name the feature instead):\n" + "\n".join(found)
