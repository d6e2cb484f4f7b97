"""Issue 29's documentation against the code: design.md's signal table is the shipped table, row for row;
operations.md says what every signal's reason means and what to do."""

from __future__ import annotations

import re
from pathlib import Path

from gpuguard.core.signaltable import SIGNALS

ROOT = Path(__file__).resolve().parents[1]


def section(path: Path, heading: str) -> str:
    text = path.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_design_md_has_one_row_per_signal_with_its_reading_numbers_level_source_and_dcgm_watch() -> None:
    rows = {}
    for line in section(ROOT / "docs" / "design.md", "Health signals").splitlines():
        m = re.match(r"^\| `([a-z-]+)` \| (.*) \|$", line)
        if m:
            rows[m[1]] = [c.strip() for c in m[2].split(" | ")]
    assert list(rows) == list(SIGNALS.names())
    for s in SIGNALS:
        reading, threshold, window, level, source, dcgm = rows[s.name]
        assert (reading, float(threshold), float(window), level) == (
            s.reading,
            s.threshold,
            s.window_s,
            f"`{s.level}`",
        )
        assert (source, dcgm) == (s.source, s.dcgm)


def test_operations_md_says_what_each_signal_means_and_what_to_do() -> None:
    text = section(ROOT / "docs" / "operations.md", "Health signals")
    named = set(re.findall(r"^\| `([a-z-]+)`", text, flags=re.M)) | set(
        re.findall(r"`(clock-[a-z-]+)`", text)
    )
    assert set(SIGNALS.names()) - {"pcie-width-max", "pcie-gen"} <= named
    assert "`pcie-gen`" in text  # shown, not judged: said why
