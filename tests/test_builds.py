"""The pinned Go builds share one module cache and one build cache (hack/lib/gobuild.sh), and
hack/build-all.sh, which `make test` runs, builds every binary the tests use."""

from __future__ import annotations

import os
import re
import shutil
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


def test_every_go_build_compiles_with_the_same_flags_so_shared_packages_compile_once() -> None:
    """The build cache is shared, but a compile action is reused only under the same flags: one build without
    -dwarf=false would compile the standard library (and every package it shares) a second time."""
    for name in GO_BUILDS:
        text = (ROOT / "hack" / name / "build.sh").read_text()
        commands = re.findall(r"^[^#\n]*\bgo (?:build|install) (?:[^\n]*\\\n)*[^\n]*", text, re.M)
        assert commands, name
        for command in commands:
            assert "-trimpath" in command and "-gcflags=all=-dwarf=false" in command, (name, command)


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
    assert lines[-1] == "$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile"
    assert re.search(r"^TEST_WORKERS \?= 4$", (ROOT / "Makefile").read_text(), re.M)


def _stub_root(tmp_path: Path, failing: str = "") -> Path:
    """A copy of build-all.sh and gobuild.sh over stub build scripts that print their name (one fails)."""
    root = tmp_path / "root"
    (root / "hack" / "lib").mkdir(parents=True)
    shutil.copy(ROOT / "hack" / "build-all.sh", root / "hack" / "build-all.sh")
    shutil.copy(ROOT / "hack" / "lib" / "gobuild.sh", root / "hack" / "lib" / "gobuild.sh")
    for name in [*GO_BUILDS, "image"]:
        script = root / "hack" / name / "build.sh"
        script.parent.mkdir()
        script.write_text(f'#!/usr/bin/env bash\necho "{name} $*"\nexit {1 if name == failing else 0}\n')
        script.chmod(0o755)
    return root


def _build_all(root: Path, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "GPUGUARD_CACHE": str(cache), "GPUGUARD_SKIP_IMAGE": "1", **env}
    return subprocess.run(
        ["bash", str(root / "hack" / "build-all.sh")], env=full, capture_output=True, text=True, check=False
    )


def test_build_all_empties_the_go_build_cache_after_every_build_succeeded_and_keeps_the_modules(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    for part in ("go/build/00", "go/mod/k8s.io"):
        (cache / part).mkdir(parents=True)
    result = _build_all(_stub_root(tmp_path), cache)
    assert result.returncode == 0, result.stderr
    for name in ("kube", "kube-oldest", "helm4", "helm3", "kwok", "karpenter", "promtool"):
        assert re.search(rf"^build-all: {name} wall \d+ s, cpu \d+ s$", result.stderr, re.M), name
    assert not (cache / "go" / "build").exists()
    assert (cache / "go" / "mod" / "k8s.io").is_dir()


def test_build_all_keeps_the_go_build_cache_when_a_build_failed_or_when_asked(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "go" / "build" / "00").mkdir(parents=True)
    failed = _build_all(_stub_root(tmp_path, failing="kwok"), cache)
    assert failed.returncode == 1
    assert "build-all: kwok failed" in failed.stderr
    assert (cache / "go" / "build" / "00").is_dir()
    kept = _build_all(_stub_root(tmp_path / "again"), cache, GPUGUARD_KEEP_GOCACHE="1")
    assert kept.returncode == 0, kept.stderr
    assert (cache / "go" / "build" / "00").is_dir()
