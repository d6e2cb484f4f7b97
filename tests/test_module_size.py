"""Every module under gpuguard/ keeps to the project's 400-line limit (one idea per module): a module that
grows past it is carved, not waived. EXCEPTIONS names any module allowed more, each with its reason."""

from __future__ import annotations

from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gpuguard"
LIMIT = 400
# path relative to gpuguard/ -> why it may be longer (none today).
EXCEPTIONS: dict[str, str] = {}


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def oversized(package: Path, limit: int = LIMIT) -> dict[str, int]:
    """The modules under `package` longer than `limit` lines, not excepted, by path relative to it."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        count = _lines(path)
        if count > limit and rel not in EXCEPTIONS:
            found[rel] = count
    return found


def test_no_module_under_gpuguard_is_longer_than_400_lines() -> None:
    assert oversized(PACKAGE) == {}, "carve these modules (or list them in EXCEPTIONS with the reason)"


def test_every_exception_names_a_module_that_exists_and_needs_it() -> None:
    for rel, why in EXCEPTIONS.items():
        assert why.strip(), rel
        assert _lines(PACKAGE / rel) > LIMIT, f"{rel} is within the limit now: drop its exception"


@pytest.mark.parametrize("extra", [1, 50])
def test_a_module_one_line_past_the_limit_is_found(tmp_path: Path, extra: int) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "big.py").write_text("x = 1\n" * (LIMIT + extra))
    (tmp_path / "small.py").write_text("x = 1\n" * LIMIT)
    assert oversized(tmp_path) == {"sub/big.py": LIMIT + extra}
