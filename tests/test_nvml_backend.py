"""The production `nvml` backend, run for real: gpuguard -> pynvml (NVIDIA's bindings, unpatched) -> ctypes ->
the fake libnvidia-ml.so.1 built from tests/fakenvml, in subprocesses with LD_LIBRARY_PATH set.

Each case gives the verdict and reason the core issue defines, and never a traceback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from harness.agentproc import WatchProcess, healthz, wait_until

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
    """One failed query (or two failed passes) is retried, not judged; check, with one pass, is stricter."""
    s = state_file(
        tmp_path,
        "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\nfail nvmlDeviceGetTotalEccErrors TIMEOUT gpu=1 count=2\n"
        "fail nvmlDeviceGetRemappedRows TIMEOUT gpu=1 count=2\n"
        "fail nvmlDeviceGetFieldValues TIMEOUT gpu=1 count=2\n",
    )
    with watching(fakenvml, s, "--interval", "0.2") as port:
        time.sleep(1.0)
        assert healthz(port)["healthy"]


def test_driver_not_loaded_is_nvml_init(fakenvml: Path, tmp_path: Path) -> None:
    code, doc, _ = check(fakenvml, state_file(tmp_path, "init_error DRIVER_NOT_LOADED\ngpu 0\n"))
    assert code == 1
    assert reasons(doc) == ["nvml-init: NVML initialization failed: DRIVER_NOT_LOADED"]


def test_no_library_at_all_exits_3_with_what_to_check(tmp_path: Path) -> None:
    empty = tmp_path / "nolib"
    empty.mkdir()
    code, doc, err = check(empty, state_file(tmp_path, "gpu 0\n"))
    assert code == 3
    assert reasons(doc) == ["nvml-init: NVML initialization failed: LIBRARY_NOT_FOUND"]
    assert "libnvidia-ml.so.1 cannot be loaded" in err
    assert "container toolkit" in err and "NVIDIA_VISIBLE_DEVICES" in err


def test_check_with_zero_gpus_fails_unless_allowed(fakenvml: Path, tmp_path: Path) -> None:
    s = state_file(tmp_path, "# no GPUs in this container\n")
    code, doc, _ = check(fakenvml, s)
    assert code == 1
    assert reasons(doc) == ["gpu-missing: NVML reports no GPUs (pass --allow-no-gpu where that is expected)"]
    assert check(fakenvml, s, "--allow-no-gpu")[0] == 0


def test_allow_no_gpu_makes_a_missing_library_healthy(tmp_path: Path) -> None:
    empty = tmp_path / "nolib"
    empty.mkdir()
    code, _, _ = check(empty, state_file(tmp_path, "gpu 0\n"), "--allow-no-gpu")
    assert code == 0


# -- the daemon on the real backend: events and changes while it runs ---------------------------------------


@contextmanager
def watching(lib: Path, state: Path, *extra: str) -> Iterator[int]:
    p = WatchProcess("--backend", "nvml", "--dry-run", *extra, env=env(lib, state)).start()
    try:
        port = p.wait_listening()
        wait_until(port, lambda d: d["last_check"] is not None, 10)
        yield port
    finally:
        assert p.stop() == 0, p.lines[-10:]
        assert not p.tracebacks()


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


@pytest.mark.parametrize("code", [13, 70, 84, 141])
def test_an_ignored_xid_leaves_the_node_healthy(fakenvml: Path, tmp_path: Path, code: int) -> None:
    """13 was always ignored; 70 (CE3, RESTART_APP), 84 (NVDEC2, RESTART_APP) and 141 (IGNORE) were faults."""
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\n")
    with watching(fakenvml, s, "--interval", "0.2") as port:
        append(s, f"xid 0 {code}\n")
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
    p = WatchProcess("--backend", "nvml", "--dry-run", "--interval", interval, env=env(fakenvml, s)).start()
    eventually_started = time.monotonic() + 20
    while not p.events("agent.started") and time.monotonic() < eventually_started:
        time.sleep(0.01)
    time.sleep(0.3)
    t0 = time.monotonic()
    assert p.stop(timeout=5) == 0
    assert time.monotonic() - t0 < 2.0


# -- never blind, never wrong: every answer nvml.h documents --------------------------------------------


def wait_for(port: int, pred: Any, timeout: float = 8.0) -> dict[str, Any]:
    doc, _ = wait_until(port, pred, timeout)
    assert pred(doc), doc
    return doc


def watched_and_healthy(n: int) -> Any:
    return lambda d: d["healthy"] and len(d["gpus"]) == n and all(g["xid_watched"] for g in d["gpus"])


def xid_79_on_gpu_1(d: dict[str, Any]) -> bool:
    return any(r.startswith("xid-79: ") for g in d["gpus"] if g["uuid"] == "GPU-0b" for r in g["reasons"])


@pytest.mark.parametrize(
    "rule",
    [
        "fail nvmlDeviceGetUUID UNKNOWN gpu=1 count=2",
        "fail nvmlDeviceGetHandleByIndex NO_PERMISSION gpu=1 count=2",
    ],
)
def test_a_gpu_unidentified_at_start_gets_no_placeholder_and_its_xids_are_seen(
    fakenvml: Path, tmp_path: Path, rule: str
) -> None:
    s = state_file(tmp_path, f"gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n{rule}\n")
    with watching(fakenvml, s, "--interval", "0.2") as port:
        doc = wait_for(port, watched_and_healthy(2))
        assert [g["uuid"] for g in doc["gpus"]] == ["GPU-0a", "GPU-0b"]
        time.sleep(0.5)  # a few more checks: no sticky gpu-missing for a placeholder
        assert healthz(port)["healthy"]
        append(s, "xid 1 79\n")
        wait_for(port, xid_79_on_gpu_1, 3)


@pytest.mark.parametrize(
    "rule", ["fail nvmlSystemGetDriverVersion UNKNOWN count=1", "fail nvmlDeviceGetCount UNKNOWN count=1"]
)
def test_an_init_that_fails_half_way_is_retried_and_xids_are_seen(
    fakenvml: Path, tmp_path: Path, rule: str
) -> None:
    s = state_file(tmp_path, f"gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n{rule}\n")
    with watching(fakenvml, s, "--interval", "0.2") as port:
        wait_for(port, watched_and_healthy(2))
        append(s, "xid 1 79\n")
        wait_for(port, xid_79_on_gpu_1, 3)


@pytest.mark.parametrize(
    "rule",
    [
        "fail nvmlEventSetCreate UNKNOWN count=2",
        "fail nvmlDeviceRegisterEvents UNKNOWN gpu=1 count=1",
        "fail nvmlDeviceRegisterEvents TIMEOUT gpu=1 count=2",
    ],
)
def test_event_set_and_registration_failures_are_retried_until_xids_are_watched(
    fakenvml: Path, tmp_path: Path, rule: str
) -> None:
    s = state_file(tmp_path, f"gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n{rule}\n")
    with watching(fakenvml, s, "--interval", "0.2") as port:
        wait_for(port, lambda d: any(not g["xid_watched"] for g in d["gpus"]), 3)
        wait_for(port, watched_and_healthy(2), 10)
        append(s, "xid 1 79\n")
        wait_for(port, xid_79_on_gpu_1, 3)


@pytest.mark.parametrize("error", ["GPU_IS_LOST", "UNKNOWN"])
def test_a_failed_event_wait_rebuilds_the_event_path_and_checks_every_gpu_at_once(
    fakenvml: Path, tmp_path: Path, error: str
) -> None:
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n")
    with watching(fakenvml, s, "--interval", "3") as port:
        wait_for(port, watched_and_healthy(2))
        time.sleep(0.3)
        t0 = time.monotonic()
        s.write_text(f"gpu 0 uuid=GPU-0a ecc=4\ngpu 1 uuid=GPU-0b\nfail nvmlEventSetWait {error} count=1\n")
        doc = wait_for(port, lambda d: not d["healthy"], 3)
        assert time.monotonic() - t0 < 1.5, "the wait error did not trigger a check of every GPU"
        assert doc["gpus"][0]["reasons"][0].startswith("ecc: 4 ")
        wait_for(port, lambda d: all(g["xid_watched"] for g in d["gpus"]), 5)
        append(s, "xid 1 79\n")
        wait_for(port, xid_79_on_gpu_1, 3)


def test_a_gpu_that_answers_unknown_to_every_query_is_unreadable_after_three_checks(
    fakenvml: Path, tmp_path: Path
) -> None:
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n")
    with watching(fakenvml, s, "--interval", "0.2") as port:
        wait_for(port, watched_and_healthy(2))
        s.write_text("gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b error=UNKNOWN\n")
        doc = wait_for(port, lambda d: not d["healthy"], 3)
        shown = r"gpu-unreadable: every NVML query failed for \d+\.\d s, [34] checks at --interval 0.2 "
        assert re.match(shown, doc["gpus"][1]["reasons"][0])
        s.write_text("gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n")
        wait_for(port, lambda d: d["healthy"], 3)  # it answers again: the reading clears it


def test_reset_required_is_a_fault_at_once_in_watch_and_in_check(fakenvml: Path, tmp_path: Path) -> None:
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n")
    with watching(fakenvml, s, "--interval", "0.2") as port:
        wait_for(port, watched_and_healthy(2))
        s.write_text("gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b error=RESET_REQUIRED\n")
        doc = wait_for(port, lambda d: not d["healthy"], 2)
        assert doc["gpus"][1]["reasons"] == [
            "reset-required: NVML answers RESET_REQUIRED: the GPU must be reset (GPU 1, GPU-0b)"
        ]
    code, doc, _ = check(fakenvml, s)
    assert code == 1 and [r.split(":")[0] for r in reasons(doc)] == ["reset-required"]


def test_check_fails_a_gpu_that_answers_nothing(fakenvml: Path, tmp_path: Path) -> None:
    code, doc, _ = check(
        fakenvml, state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b error=UNKNOWN\n")
    )
    assert code == 1 and [r.split(":")[0] for r in reasons(doc)] == ["gpu-unreadable"]


def test_xid_999_and_mig_instance_ids_read_as_such(fakenvml: Path, tmp_path: Path) -> None:
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n")
    with watching(fakenvml, s, "--interval", "0.2") as port:
        wait_for(port, watched_and_healthy(2))
        append(s, "xid 0 999\nxid 1 79 gi=1 ci=0\n")
        doc = wait_for(port, lambda d: all(g["reasons"] for g in d["gpus"]), 3)
        assert doc["gpus"][0]["reasons"] == [
            "xid-999: unknown Xid (NVML reports 999 when the driver does not name the error) (GPU 0, GPU-0a)"
        ]
        assert doc["gpus"][1]["reasons"] == [
            "xid-79: GPU has fallen off the bus (GPU 1, GPU-0b, MIG GPU instance 1, compute instance 0)"
        ]


def test_a_gpu_whose_xid_registration_is_not_supported_says_so(fakenvml: Path, tmp_path: Path) -> None:
    s = state_file(
        tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\nfail nvmlDeviceRegisterEvents NOT_SUPPORTED gpu=1\n"
    )
    p = WatchProcess("--backend", "nvml", "--dry-run", "--interval", "0.2", env=env(fakenvml, s)).start()
    try:
        port = p.wait_listening()
        doc = wait_for(port, lambda d: len(d["gpus"]) == 2)
        assert [g["xid_watched"] for g in doc["gpus"]] == [True, False]
        assert doc["healthy"]  # not watched is said, not a fault
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            metrics = r.read().decode()
        assert 'gpuguard_gpu_xid_watched{gpu="1",uuid="GPU-0b"} 0.0' in metrics
        assert 'gpuguard_gpu_xid_watched{gpu="0",uuid="GPU-0a"} 1.0' in metrics
    finally:
        p.stop()
    events = p.lines
    watch = [e for e in events if e["event"] == "gpu.xid_watch"]
    assert [(e["uuid"], e["watched"], e["why"]) for e in watch] == [
        ("GPU-0b", False, "xid events not supported")
    ]


def test_the_recovery_action_is_a_fault_naming_the_action(fakenvml: Path, tmp_path: Path) -> None:
    code, doc, _ = check(fakenvml, state_file(tmp_path, "gpu 0 uuid=GPU-0a recovery_action=2\n"))
    assert code == 1
    assert reasons(doc) == [
        "recovery-node-reboot: the driver asks for NODE_REBOOT (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION=2) "
        "(GPU 0, GPU-0a)"
    ]


def test_a_recovery_action_event_wakes_the_agent_at_once(fakenvml: Path, tmp_path: Path) -> None:
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\n")
    with watching(fakenvml, s, "--interval", "3") as port:
        wait_for(port, watched_and_healthy(1))
        time.sleep(0.3)
        t0 = time.monotonic()
        s.write_text("gpu 0 uuid=GPU-0a recovery_action=4\n")
        doc = wait_for(port, lambda d: not d["healthy"], 3)
        assert time.monotonic() - t0 < 1.0
        assert doc["gpus"][0]["reasons"][0].startswith("recovery-drain-and-reset: ")


def test_an_xid_recorded_while_the_driver_asks_for_a_reset_clears_after_the_reset(
    fakenvml: Path, tmp_path: Path
) -> None:
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n")
    with watching(fakenvml, s, "--interval", "0.2") as port:
        wait_for(port, watched_and_healthy(2))
        s.write_text("gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b recovery_action=1\nxid 1 79\n")
        doc = wait_for(port, lambda d: len(d["gpus"][1]["reasons"]) == 2 and d["tainted"], 3)
        assert [r.split(":")[0] for r in doc["gpus"][1]["reasons"]] == ["recovery-gpu-reset", "xid-79"]
        # nvidia-smi -r: the driver's action goes back to NONE; no reboot.
        s.write_text("gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\nxid 1 79\n")
        doc = wait_for(port, lambda d: d["healthy"] and not d["tainted"], 5)
        assert not doc["cordoned"]


def test_without_the_recovery_field_an_xid_still_needs_a_reboot(fakenvml: Path, tmp_path: Path) -> None:
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a recovery_supported=0\n")
    with watching(fakenvml, s, "--interval", "0.2") as port:
        wait_for(port, watched_and_healthy(1))
        append(s, "xid 0 79\n")
        wait_for(port, lambda d: not d["healthy"], 3)
        time.sleep(1.0)
        doc = healthz(port)
        assert not doc["healthy"] and doc["tainted"]


def test_ecc_disabled_and_no_row_remapping_are_not_applicable(fakenvml: Path, tmp_path: Path) -> None:
    code, doc, _ = check(fakenvml, state_file(tmp_path, "gpu 0 ecc_enabled=0 ecc=5 remap_supported=0\n"))
    assert code == 0 and doc["gpus"][0]["healthy"], doc


def test_an_xid_is_attributed_by_uuid_when_the_handle_does_not_match(fakenvml: Path, tmp_path: Path) -> None:
    """NVML may hand out a new handle value for a GPU; the event's device is asked for its UUID."""
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n")
    script = f"""
import time
from gpuguard.nvml.real import NvmlBackend
b = NvmlBackend()
b.open(lambda: None)
b.snapshot()
b._by_handle.clear()  # the handle the event carries is not the one enumerated
open({str(s)!r}, "a").write("xid 1 79\\n")
deadline = time.monotonic() + 5
xids = ()
while not xids and time.monotonic() < deadline:
    time.sleep(0.05)
    xids = b.snapshot().xids
b.close()
print([(x.gpu_index, x.uuid, x.code) for x in xids])
"""
    r = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        env=env(fakenvml, s),
        cwd=ROOT,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[(1, 'GPU-0b', 79)]"


def test_watch_without_an_nvml_library_exits_3_after_the_load_timeout(tmp_path: Path) -> None:
    empty = tmp_path / "nolib"
    empty.mkdir()
    t0 = time.monotonic()
    p = WatchProcess(
        *("--backend", "nvml", "--dry-run", "--interval", "0.2", "--nvml-load-timeout", "1"),
        env=env(empty, state_file(tmp_path, "gpu 0\n")),
    ).start()
    assert p.wait(20) == 3
    assert time.monotonic() - t0 < 8
    events = p.lines
    assert any(
        e["event"] == "nvml.library_not_found" and "NVIDIA_VISIBLE_DEVICES" in e["hint"] for e in events
    )


def test_an_uncorrected_ecc_error_wakes_the_agent_at_once_not_at_the_next_poll(
    fakenvml: Path, tmp_path: Path
) -> None:
    """ECC was seen only at the next poll (3 s), so the burst put a pod on the ECC node. The
    double-bit ECC event now wakes the agent like an Xid does; --interval 30 leaves no poll to help."""
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n")
    with watching(fakenvml, s, "--interval", "30") as port:
        wait_for(port, watched_and_healthy(2))
        time.sleep(0.3)
        t0 = time.monotonic()
        s.write_text("gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b ecc=1\n")
        doc = wait_for(port, lambda d: not d["healthy"], 5)
        latency = time.monotonic() - t0
        assert doc["gpus"][1]["reasons"][0].startswith("ecc: 1 uncorrected")
        assert latency < 0.5, f"{latency * 1000:.0f} ms with a 30 s interval"


# -- an idle node costs almost nothing -----------------------------------------------------------------


def _voluntary_switches(pid: int) -> int:
    """How often the process's threads went to sleep and were woken, all threads together."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        for line in status.read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def test_an_idle_agent_does_not_wake_between_polls(fakenvml: Path, tmp_path: Path) -> None:
    """The event wait timed out every second (3,600 wake-ups an hour); now it blocks for minutes, the HTTP
    server and the node writer block until there is work, so between two polls no thread wakes up."""
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n")
    p = WatchProcess("--backend", "nvml", "--dry-run", "--interval", "30", env=env(fakenvml, s)).start()
    try:
        port = p.wait_listening()
        wait_for(port, watched_and_healthy(2))
        time.sleep(0.5)  # the /healthz requests above are served and done
        before = _voluntary_switches(p.pid)
        time.sleep(4.0)
        woke = _voluntary_switches(p.pid) - before
        assert woke <= 1, f"{woke} wake-ups in 4 s between two polls"
    finally:
        assert p.stop() == 0
    assert not p.tracebacks()


def test_sigterm_ends_the_long_event_wait_at_once_and_frees_the_set_only_after_it(
    fakenvml: Path, tmp_path: Path
) -> None:
    """Blocking for minutes must not make stopping slow: a signal interrupts the wait (nvml.h: TIMEOUT when
    "interrupt arrived"); nvmlEventSetFree is not relied on to wake it, and is called only once the thread
    has left the set (the fake library says so on stderr otherwise)."""
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n")
    p = WatchProcess("--backend", "nvml", "--dry-run", "--interval", "30", env=env(fakenvml, s)).start()
    port = p.wait_listening()
    wait_for(port, watched_and_healthy(2))
    time.sleep(0.5)
    t0 = time.monotonic()
    assert p.stop(timeout=10) == 0
    took = time.monotonic() - t0
    assert took < 1.0, f"stopped in {took:.2f} s"
    stderr = [d["line"] for d in p.lines if d["event"] == "non-json"]
    assert not [line for line in stderr if "another thread waits on" in line], stderr
    assert not p.events("nvml.event_thread_stuck")
    assert p.events("agent.stopping")


def test_a_backend_opened_off_the_main_thread_bounds_its_wait_and_still_stops(
    fakenvml: Path, tmp_path: Path
) -> None:
    """Only the main thread can install the wake signal's handler; elsewhere the wait is bounded (1 s), so
    close() still returns within two seconds and never frees the set under the waiting thread."""
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\n")
    script = """
import json, threading, time
from gpuguard.nvml.real import NvmlBackend
b = NvmlBackend()
t = threading.Thread(target=b.open, args=(lambda: None,)); t.start(); t.join()
snap = b.snapshot()
time.sleep(0.3)
t0 = time.monotonic(); b.close(); took = time.monotonic() - t0
print(json.dumps({"wait_ms": b._events._wait_ms, "watched": snap.gpus[0].xid_watched, "took": took,
                  "threads": threading.active_count()}))
"""
    r = subprocess.run(
        [sys.executable, "-c", script],
        env=env(fakenvml, s),
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["wait_ms"] == 1000 and out["watched"] and out["threads"] == 1
    assert out["took"] < 2.0
    assert "another thread waits on" not in r.stderr


_STEADY = r"""
import json, sys, time
from pathlib import Path
from gpuguard.nvml.real import NvmlBackend
state = Path(sys.argv[1])
b = NvmlBackend()
b.open(lambda: None)
first = b.snapshot(); second = b.snapshot()
out = {"steady_same_snapshot": second is first}
state.write_text(state.read_text().replace("uuid=GPU-1 ecc=0", "uuid=GPU-1 ecc=1"))
changed = b.snapshot()
out["changed_new_snapshot"] = changed is not first
out["unchanged_gpu_same_reading"] = changed.gpus[0] is first.gpus[0]
out["changed_gpu_reads"] = [changed.gpus[1] is first.gpus[1], changed.gpus[1].ecc_uncorrected]
with state.open("a") as f:
    f.write("xid 0 79\n")
deadline = time.monotonic() + 5
with_xid = b.snapshot()
while not with_xid.xids and time.monotonic() < deadline:
    time.sleep(0.02)
    with_xid = b.snapshot()
after = b.snapshot()
out["xid_once"] = [len(with_xid.xids), with_xid is changed, len(after.xids), after is with_xid]
b.close()
print(json.dumps(out))
"""


def test_a_steady_gpu_is_read_every_pass_into_the_same_objects_and_a_change_or_an_xid_into_new_ones(
    fakenvml: Path, tmp_path: Path
) -> None:
    """An idle check allocates no readings: the snapshot of a pass where every GPU read the same values and no
    Xid came is the previous one (the agent's remembered evaluation then matches by identity); any change,
    on any GPU, or an Xid gives a new one, and an Xid is handed over once."""
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0 ecc=0\ngpu 1 uuid=GPU-1 ecc=0\n")
    r = subprocess.run(
        [sys.executable, "-c", _STEADY, str(s)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env(fakenvml, s),
        cwd=ROOT,
        check=True,
    )
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {
        "steady_same_snapshot": True,
        "changed_new_snapshot": True,
        "unchanged_gpu_same_reading": True,
        "changed_gpu_reads": [False, 1],
        "xid_once": [1, False, 0, False],
    }


def _wakeups(pid: int) -> int:
    """Voluntary context switches of every thread of a live process (a thread went to sleep: one wake-up)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        lines = status.splitlines()
        total += sum(int(x.split()[1]) for x in lines if x.startswith("voluntary_ctxt_switches:"))
    return total


def test_an_idle_poll_wakes_the_reading_thread_once_and_the_agents_thread_once(
    fakenvml: Path, tmp_path: Path
) -> None:
    """The reading thread keeps a plan between polls (it sleeps until the next poll's time and runs the pass
    by itself), so an idle poll is two wake-ups in the whole process, plus up to two more of the agent's
    thread when it wakes while the reading thread still holds the GIL (more often the busier the machine);
    handing each pass over woke the two threads four to five times a poll on a quiet machine, the idle CPU
    goal's cost (docs/performance.md). The least of three windows is the one least disturbed by other
    processes; tests/test_planned_pass.py pins the plan itself (no job handed over per poll)."""
    s = state_file(tmp_path, "".join(f"gpu {i} uuid=GPU-{i}\n" for i in range(8)))
    p = WatchProcess("--backend", "nvml", "--dry-run", "--interval", "0.1", env=env(fakenvml, s)).start()
    windows = []
    try:
        p.wait_first_check(15)
        time.sleep(0.5)  # past the start-up
        for _ in range(3):
            before, t0 = _wakeups(p.pid), time.monotonic()
            time.sleep(2.0)
            windows.append((_wakeups(p.pid) - before) / ((time.monotonic() - t0) / 0.1))
    finally:
        assert p.stop() == 0
    assert min(windows) < 3.5, f"wake-ups a poll in three windows: {[round(w, 2) for w in windows]}"
