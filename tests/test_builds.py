"""The pinned Go builds share one module cache and one build cache (hack/lib/gobuild.sh), and
hack/build-all.sh, which `make test` runs, builds every binary the tests use."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GO_BUILDS = ["testenv", "kwok", "karpenter", "helm", "promtool"]


def _go_env(cache: Path, build_dir: Path) -> dict[str, str]:
    script = (
        f'source "{ROOT}/hack/lib/gobuild.sh"; go_shared_env "{build_dir}"; '
        'printf "%s\\n" "GOPATH=$GOPATH" "GOMODCACHE=$GOMODCACHE" "GOCACHE=$GOCACHE" '
        '"GOTOOLCHAIN=$GOTOOLCHAIN"'
    )
    env = {**os.environ, "GPUGUARD_CACHE": str(cache)}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


def test_every_pinned_build_gets_the_same_shared_module_and_build_cache(tmp_path: Path) -> None:
    a = _go_env(tmp_path, tmp_path / "kwok" / "v1")
    b = _go_env(tmp_path, tmp_path / "helm" / "v4")
    assert a == b
    assert a["GOMODCACHE"] == str(tmp_path / "go" / "mod")
    assert a["GOCACHE"] == str(tmp_path / "go" / "build")
    assert a["GOTOOLCHAIN"] == "local"


def test_the_private_caches_of_the_earlier_layout_are_removed_and_the_binary_kept(tmp_path: Path) -> None:
    build_dir = tmp_path / "kwok" / "v0.8.0"
    for private in ("gopath/pkg/mod/x", "gocache/00"):
        (build_dir / private).mkdir(parents=True)
    (build_dir / "kwok").write_text("binary")
    _go_env(tmp_path, build_dir)
    assert sorted(p.name for p in build_dir.iterdir()) == ["kwok"]


def test_every_go_build_script_uses_the_shared_environment_and_sets_no_cache_of_its_own() -> None:
    for name in GO_BUILDS:
        text = (ROOT / "hack" / name / "build.sh").read_text()
        assert re.search(r"^go_shared_env ", text, re.M), name
        assert not re.search(r"^\s*export (GOCACHE|GOMODCACHE|GOPATH)=", text, re.M), name


def test_build_all_builds_every_binary_the_tests_use_in_two_lanes_beside_the_image() -> None:
    text = (ROOT / "hack" / "build-all.sh").read_text()
    calls = re.findall(r"timed \S+ (hack/\S+/build\.sh(?: --\S+)?)", text)
    assert sorted(calls) == [
        "hack/helm/build.sh",
        "hack/helm/build.sh --v3",
        "hack/image/build.sh",
        "hack/karpenter/build.sh",
        "hack/kwok/build.sh",
        "hack/promtool/build.sh",
        "hack/testenv/build.sh",
        "hack/testenv/build.sh --oldest",
    ]
    assert re.search(r"^\s+timed image hack/image/build.sh &$", text, re.M)
    assert re.search(r"^lane_kube &$", text, re.M)
    assert re.search(r"^lane_tools \|\| status=1$", text, re.M)
    make_test = (ROOT / "Makefile").read_text().split("\ntest:", 1)[1].split("\n\n", 1)[0]
    lines = [line.strip() for line in make_test.splitlines()[1:]]
    assert lines.index("$(MAKE) --no-print-directory lint-code") < lines.index("hack/build-all.sh")
    assert lines[-1] == "$(BIN)/python -m pytest -q"
