"""The production `nvml` backend, run for real: gpuguard -> pynvml (NVIDIA's bindings, unpatched) -> ctypes ->
the fake libnvidia-ml.so.1 built from tests/fakenvml, in subprocesses with LD_LIBRARY_PATH set.

Each case gives the verdict and reason the core issue defines, and never a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.agentproc import healthz, read_port, spawn_watch, wait_until

ROOT = Path(__file__).resolve().parents[1]
BASE_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("GPUGUARD_", "FAKE_NVML"))}
BASE_ENV.pop("NODE_NAME", None)


def env(lib: Path | str, state: Path) -> dict[str, str]:
    return {**BASE_ENV, "LD_LIBRARY_PATH": str(lib), "FAKE_NVML_STATE": str(state)}


def check(lib: Path | str, state: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    r = subprocess.run(
        [sys.executable, "-m", "gpuguard", "check", "--backend", "nvml", "-o", "json", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env(lib, state),
        cwd=ROOT,
        check=False,
    )
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else {}, r.stderr


def state_file(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "nvml.state"
    p.write_text(text)
    return p


def reasons(doc: dict[str, Any]) -> list[str]:
    out: list[str] = [r for g in doc["gpus"] for r in g["reasons"]]
    return out + list(doc["node_reasons"])


def test_healthy_gpus_read_through_pynvml(fakenvml: Path, tmp_path: Path) -> None:
    s = state_file(tmp_path, 'driver 550.54.15\ngpu 0 uuid=GPU-0a name="NVIDIA H200"\ngpu 1 uuid=GPU-0b\n')
    code, doc, _ = check(fakenvml, s)
    assert code == 0
    assert [(g["index"], g["uuid"], g["healthy"]) for g in doc["gpus"]] == [
        (0, "GPU-0a", True),
        (1, "GPU-0b", True),
    ]


def test_volatile_uncorrected_ecc_count_is_a_fault(fakenvml: Path, tmp_path: Path) -> None:
    code, doc, _ = check(fakenvml, state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b ecc=2\n"))
    assert code == 1
    assert reasons(doc) == ["ecc: 2 uncorrected volatile ECC errors (GPU 1, GPU-0b)"]


def test_ecc_threshold_applies_to_the_nvml_count(fakenvml: Path, tmp_path: Path) -> None:
    code, _, _ = check(fakenvml, state_file(tmp_path, "gpu 0 ecc=2\n"), "--ecc-threshold", "2")
    assert code == 0


def test_ecc_not_supported_is_not_applicable_not_a_fault(fakenvml: Path, tmp_path: Path) -> None:
    code, doc, _ = check(fakenvml, state_file(tmp_path, "gpu 0 uuid=GPU-0a ecc_supported=0 ecc=9\n"))
    assert code == 0 and doc["gpus"][0]["healthy"]


def test_a_lost_gpu_is_gpu_lost(fakenvml: Path, tmp_path: Path) -> None:
    code, doc, _ = check(fakenvml, state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b lost=1\n"))
    assert code == 1
    assert [r.split(":")[0] for r in reasons(doc)] == ["gpu-lost"]


def test_a_remapped_row_failure_is_row_remap(fakenvml: Path, tmp_path: Path) -> None:
    code, doc, _ = check(fakenvml, state_file(tmp_path, "gpu 0 uuid=GPU-0a remap_failure=1\n"))
    assert code == 1 and reasons(doc) == ["row-remap: row remapping failed (GPU 0, GPU-0a)"]


def test_a_pending_row_remap_is_not_a_fault(fakenvml: Path, tmp_path: Path) -> None:
    code, _, _ = check(fakenvml, state_file(tmp_path, "gpu 0 remap_pending=1\n"))
    assert code == 0


def test_fewer_gpus_than_expected_is_gpu_missing(fakenvml: Path, tmp_path: Path) -> None:
    code, doc, _ = check(fakenvml, state_file(tmp_path, "gpu 0\n"), "--expected-gpus", "2")
    assert code == 1 and reasons(doc) == ["gpu-missing: expected 2 GPUs, NVML reports 1"]


def test_a_transient_nvml_error_is_not_a_fault_on_its_own(fakenvml: Path, tmp_path: Path) -> None:
    code, doc, _ = check(
        fakenvml, state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b error=TIMEOUT\n")
    )
    assert code == 0, doc


def test_driver_not_loaded_is_nvml_init(fakenvml: Path, tmp_path: Path) -> None:
    code, doc, _ = check(fakenvml, state_file(tmp_path, "init_error DRIVER_NOT_LOADED\ngpu 0\n"))
    assert code == 1
    assert reasons(doc) == ["nvml-init: NVML initialization failed: DRIVER_NOT_LOADED"]


def test_no_library_at_all_is_nvml_init_library_not_found(tmp_path: Path) -> None:
    empty = tmp_path / "nolib"
    empty.mkdir()
    code, doc, _ = check(empty, state_file(tmp_path, "gpu 0\n"))
    assert code == 1
    assert reasons(doc) == ["nvml-init: NVML initialization failed: LIBRARY_NOT_FOUND"]


def test_allow_no_gpu_makes_a_missing_library_healthy(tmp_path: Path) -> None:
    empty = tmp_path / "nolib"
    empty.mkdir()
    code, _, _ = check(empty, state_file(tmp_path, "gpu 0\n"), "--allow-no-gpu")
    assert code == 0


# -- the daemon on the real backend: events and changes while it runs ---------------------------------------


@contextmanager
def watching(lib: Path, state: Path, *extra: str) -> Iterator[int]:
    p = spawn_watch("--backend", "nvml", "--dry-run", *extra, env=env(lib, state))
    lines: list[str] = []
    try:
        port = read_port(p, lines)
        wait_until(port, lambda d: d["last_check"] is not None, 10)
        yield port
    finally:
        p.terminate()
        _, err = p.communicate(timeout=10)
        assert p.returncode == 0, err
        assert "Traceback" not in "".join(lines) + err


def append(state: Path, line: str) -> None:
    state.write_text(state.read_text() + line)


def test_a_fatal_xid_shows_on_healthz_well_under_a_second_with_interval_3(
    fakenvml: Path, tmp_path: Path
) -> None:
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n")
    with watching(fakenvml, s, "--interval", "3") as port:
        time.sleep(0.2)
        t0 = time.monotonic()
        append(s, "xid 1 79\n")
        doc, _ = wait_until(port, lambda d: not d["healthy"], 3)
        latency = time.monotonic() - t0
        assert not doc["healthy"]
        assert doc["gpus"][1]["reasons"] == ["xid-79: GPU has fallen off the bus (GPU 1, GPU-0b)"]
        assert latency < 0.5, f"{latency * 1000:.0f} ms with a 3 s interval"
        doc, _ = wait_until(port, lambda d: d["tainted"], 2)
        assert doc["tainted"] and doc["cordoned"]


def test_an_ignored_xid_leaves_the_node_healthy(fakenvml: Path, tmp_path: Path) -> None:
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\n")
    with watching(fakenvml, s, "--interval", "0.2") as port:
        append(s, "xid 0 13\n")
        time.sleep(1.0)
        doc = healthz(port)
        assert doc["healthy"] and not doc["tainted"]


def test_ecc_changes_while_running_are_seen_at_the_next_poll(fakenvml: Path, tmp_path: Path) -> None:
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n")
    with watching(fakenvml, s, "--interval", "0.2") as port:
        s.write_text("gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b ecc=4\n")
        doc, took = wait_until(port, lambda d: not d["healthy"], 3)
        assert doc["gpus"][1]["reasons"][0].startswith("ecc: 4 uncorrected")
        assert took < 0.2 * 2 + 0.3


def test_a_gpu_lost_while_running_is_gpu_lost(fakenvml: Path, tmp_path: Path) -> None:
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n")
    with watching(fakenvml, s, "--interval", "0.2") as port:
        s.write_text("gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b lost=1\n")
        doc, _ = wait_until(port, lambda d: not d["healthy"], 3)
        assert doc["gpus"][1]["uuid"] == "GPU-0b"
        assert doc["gpus"][1]["reasons"][0].startswith("gpu-lost: ")


def test_a_device_count_drop_keeps_the_gpu_listed_as_missing(fakenvml: Path, tmp_path: Path) -> None:
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n")
    with watching(fakenvml, s, "--interval", "0.2") as port:
        s.write_text("gpu 0 uuid=GPU-0a\n")
        doc, _ = wait_until(port, lambda d: not d["healthy"], 3)
        assert [g["uuid"] for g in doc["gpus"]] == ["GPU-0a", "GPU-0b"]
        assert doc["gpus"][1]["reasons"][0].startswith("gpu-missing: ")


@pytest.mark.parametrize("interval", ["0.2", "3"])
def test_sigterm_shuts_nvml_down_within_two_seconds(fakenvml: Path, tmp_path: Path, interval: str) -> None:
    s = state_file(tmp_path, "gpu 0\n")
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuguard",
            "watch",
            "--backend",
            "nvml",
            "--dry-run",
            "--listen",
            "127.0.0.1:0",
            "--interval",
            interval,
            "--log-format",
            "json",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env(fakenvml, s),
        cwd=ROOT,
    )
    assert p.stderr is not None
    while "agent.started" not in p.stderr.readline():
        pass
    time.sleep(0.3)
    t0 = time.monotonic()
    p.terminate()
    assert p.wait(5) == 0
    assert time.monotonic() - t0 < 2.0
