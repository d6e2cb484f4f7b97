"""Issue 29's signals through the real pynvml and the fake libnvidia-ml.so.1: for every signal clean, its
default level, NOT_SUPPORTED, a transient error and recovery; a fabric that never completes on 8 GPUs; a GPU
on the PCI bus (a fake sysfs) but absent from NVML at the first check.

One Python process runs every scenario (pynvml keeps the library it loaded for the process): the real
backend on a clock the script steps, the policy judging each pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gpuguard.core.signaltable import SIGNALS
from tests.test_nvml_backend import ROOT, check, env
from tests.test_nvml_faults import agent, reasons_of, watch_until

_SCRIPT = r"""
import json, sys
from dataclasses import replace
from pathlib import Path
from gpuguard.core.config import PolicySettings
from gpuguard.nvml.real import NvmlBackend
from gpuguard.judge.policy import evaluate

state = Path(sys.argv[1])
scenarios = json.loads(Path(sys.argv[2]).read_text())
results = {}
for name, sc in scenarios.items():
    now = [0.0]
    state.write_text(sc["steps"][0][1])
    b = NvmlBackend(clock=lambda: now[0], pci_root=sc.get("pci_root"))
    b.open(lambda: None)
    prev, out = None, []
    for t, text in sc["steps"]:
        now[0] = float(t)
        state.write_text(text)
        # Stamped with the time as the agent does (a steady pass hands over the last snapshot again).
        snap = replace(b.snapshot(), taken_at=now[0])
        prev = evaluate(snap, previous=prev, settings=PolicySettings())
        out.append({
            "faults": sorted({f.reason for f in prev.faults}),
            "degraded": sorted({f.reason for f in prev.degraded}),
            "errors": [e for g in snap.gpus for e in g.transient_errors],
            "faulty_gpus": len({f.uuid for f in prev.faults if f.uuid}),
        })
    b.close()
    results[name] = out
print(json.dumps(results))
"""

# signal: (the clean gpu keys, [(time, the tripped gpu keys)], the call that NOT_SUPPORTED / a transient
# error names, when it recovers). The fabric, the PCIe link and the NVLink states are read every 30 s (at
# once while a fabric is not completed), the InfoROM every 600 s: a change is read when they are due.
SIGNAL_CASES: dict[str, tuple[str, list[tuple[float, str]], str, float]] = {
    "fabric-incomplete": (
        "fabric_state=3",
        [(40, "fabric_state=2"), (400, "fabric_state=2")],
        "nvmlDeviceGetGpuFabricInfoV",
        1000,
    ),
    "fabric-status": (
        "fabric_state=3",
        [(40, "fabric_state=3 fabric_status=UNKNOWN")],
        "nvmlDeviceGetGpuFabricInfoV",
        1000,
    ),
    "fabric-degraded": (
        "fabric_state=3 fabric_health=170",
        [(40, "fabric_state=3 fabric_health=169")],
        "nvmlDeviceGetGpuFabricInfoV",
        1000,
    ),
    "nvlink-down": (
        "nvlink_links=18",
        [(40, "nvlink_links=18 nvlink_down=3")],
        "nvmlDeviceGetNvLinkState",
        1000,
    ),
    "nvlink-errors": (
        "nvlink_links=18",
        [(10, "nvlink_links=18 nvlink_crc=5000 nvlink_replay=900 nvlink_recovery=101")],
        "nvmlDeviceGetFieldValues",
        1000,
    ),
    "pcie-width": ("pcie_width=16", [(40, "pcie_width=8")], "nvmlDeviceGetCurrPcieLinkWidth", 1000),
    "pcie-replays": ("pcie_replays=3", [(10, "pcie_replays=12")], "nvmlDeviceGetFieldValues", 1000),
    "clock-hw-slowdown": (
        "clock_events=1",
        [(t, "clock_events=9") for t in range(3, 21, 3)],
        "nvmlDeviceGetCurrentClocksEventReasons",
        1000,
    ),
    "clock-hw-thermal": (
        "clock_events=0",
        [(t, "clock_events=64") for t in range(3, 21, 3)],
        "nvmlDeviceGetCurrentClocksEventReasons",
        1000,
    ),
    "clock-power-brake": (
        "clock_events=0",
        [(t, "clock_events=128") for t in range(3, 21, 3)],
        "nvmlDeviceGetCurrentClocksEventReasons",
        1000,
    ),
    "retired-pages": (
        "retired_supported=1 retired_sbe=3",
        [(10, "retired_supported=1 retired_sbe=40 retired_dbe=23")],
        "nvmlDeviceGetRetiredPages",
        1000,
    ),
    "retired-pending": (
        "retired_supported=1",
        [(10, "retired_supported=1 retired_pending=1")],
        "nvmlDeviceGetRetiredPagesPendingStatus",
        1000,
    ),
    "row-remap-pending": ("remap_pending=0", [(10, "remap_pending=1")], "nvmlDeviceGetRemappedRows", 1000),
    # Validated every 600 s: the change is read at the next validation.
    "inforom-invalid": ("inforom_valid=1", [(700, "inforom_valid=0")], "nvmlDeviceValidateInforom", 1400),
}


# Read less often than every pass: when the first read after the one at 0 comes (nvml.real.signalreads).
FIRST_READ_AGAIN = {
    "fabric-incomplete": 30.0,
    "fabric-status": 30.0,
    "fabric-degraded": 30.0,
    "pcie-width": 30.0,
    "nvlink-down": 30.0,
    "inforom-invalid": 600.0,
}


def gpus(keys: str, extra: str = "") -> str:
    return f"gpu 0 uuid=GPU-0a {keys}\ngpu 1 uuid=GPU-0b\n{extra}"


def scenarios(pci_root: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, (clean, bad, call, back) in SIGNAL_CASES.items():
        out[f"{name}/tripped"] = {
            "steps": [(0, gpus(clean)), *[(t, gpus(k)) for t, k in bad], (back, gpus(clean))]
        }
        unsupported = f"fail {call} NOT_SUPPORTED gpu=0\n"
        out[f"{name}/not-supported"] = {
            "steps": [(0, gpus(clean, unsupported)), *[(t, gpus(k, unsupported)) for t, k in bad]]
        }
        failing = f"fail {call} UNKNOWN gpu=0\n"
        out[f"{name}/transient"] = {
            "steps": [
                (0, gpus(clean)),
                (FIRST_READ_AGAIN.get(name, 5), gpus(clean, failing)),
                *[(t, gpus(k)) for t, k in bad],
                (back, gpus(clean, failing)),
            ]
        }
    # A GPU without a fabric answers state NOT_SUPPORTED: not applicable, never asked again.
    out["fabric-state-not-supported"] = {
        "steps": [(0, gpus("fabric_state=0")), (40, gpus("fabric_state=2")), (400, gpus("fabric_state=2"))]
    }
    eight = "".join(f"gpu {i} fabric_state=1\n" for i in range(8))
    out["fabric-never-completes"] = {"steps": [(0, eight), (100, eight), (400, eight)]}
    out["gpu-missing-at-boot"] = {"steps": [(0, gpus("")), (3, gpus(""))], "pci_root": pci_root}
    return out


def fake_sysfs(root: Path) -> Path:
    """Two GPUs NVML lists (3B, 3C), one it does not (3D), an NVSwitch and a GPU passed to a VM."""
    devices = root / "devices"
    entries = {
        "0000:3b:00.0": ("0x10de", "0x030200", "nvidia"),
        "0000:3c:00.0": ("0x10de", "0x030200", "nvidia"),
        "0000:3d:00.0": ("0x10de", "0x030200", None),
        "0000:41:00.0": ("0x10de", "0x068000", "nvidia-nvswitch"),
        "0000:42:00.0": ("0x10de", "0x030200", "vfio-pci"),
        "0000:00:1f.0": ("0x8086", "0x060100", "lpc_ich"),
    }
    for address, (vendor, klass, driver) in entries.items():
        d = devices / address
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(klass + "\n")
        if driver:
            (root / "drivers" / driver).mkdir(parents=True, exist_ok=True)
            os.symlink(root / "drivers" / driver, d / "driver")
    return devices


@pytest.fixture(scope="module")
def results(fakenvml: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("signals")
    plan = tmp / "scenarios.json"
    plan.write_text(json.dumps(scenarios(str(fake_sysfs(tmp / "sys")))))
    state = tmp / "nvml.state"
    state.write_text("")
    r = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(state), str(plan)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env(fakenvml, state),
        cwd=ROOT,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, list[dict[str, Any]]] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def found(step: dict[str, Any], name: str) -> str:
    return "fault" if name in step["faults"] else "degraded" if name in step["degraded"] else ""


def test_every_gpu_signal_has_a_case_through_pynvml() -> None:
    assert set(SIGNAL_CASES) == set(SIGNALS.names()) - {"gpu-missing", "pcie-width-max", "pcie-gen"}


@pytest.mark.parametrize("name", sorted(SIGNAL_CASES))
def test_a_signal_through_pynvml_is_clean_then_takes_its_level_then_recovers(
    name: str, results: dict[str, list[dict[str, Any]]]
) -> None:
    steps = results[f"{name}/tripped"]
    assert [found(s, name) for s in steps] == [""] * (len(steps) - 2) + [SIGNALS.level(name), ""], steps
    assert all(not s["errors"] for s in steps)


@pytest.mark.parametrize("name", sorted(SIGNAL_CASES))
def test_a_signal_whose_call_answers_not_supported_is_never_judged(
    name: str, results: dict[str, list[dict[str, Any]]]
) -> None:
    steps = results[f"{name}/not-supported"]
    assert all(found(s, name) == "" and not s["errors"] for s in steps), steps


@pytest.mark.parametrize("name", sorted(SIGNAL_CASES))
def test_a_transient_error_of_a_signal_read_is_no_fault_and_no_clear(
    name: str, results: dict[str, list[dict[str, Any]]]
) -> None:
    steps = results[f"{name}/transient"]
    assert steps[1]["errors"] and found(steps[1], name) == "", steps[1]
    assert not steps[1]["faults"] and not steps[1]["degraded"]
    assert found(steps[-2], name) == SIGNALS.level(name)
    assert steps[-1]["errors"] and found(steps[-1], name) == SIGNALS.level(name), steps[-1]


def test_a_fabric_that_never_completes_on_an_8_gpu_node_faults_every_gpu(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    steps = results["fabric-never-completes"]
    assert [s["faulty_gpus"] for s in steps] == [0, 0, 8]
    assert steps[-1]["faults"] == ["fabric-incomplete"]


def test_a_gpu_on_the_pci_bus_but_absent_from_nvml_is_gpu_missing_at_the_first_check(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    steps = results["gpu-missing-at-boot"]
    assert [s["faults"] for s in steps] == [["gpu-missing"], ["gpu-missing"]]


def test_check_fails_at_once_on_a_fabric_down_since_boot_and_a_mock_scenario_boots_with_its_start(
    fakenvml: Path, tmp_path: Path
) -> None:
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    if uptime < 400:
        pytest.skip("the host booted within the fabric's grace")
    state = tmp_path / "nvml.state"
    state.write_text("".join(f"gpu {i} fabric_state=2\n" for i in range(8)))
    code, doc, _ = check(fakenvml, state)
    assert code == 1
    assert {r.split(":")[0] for g in doc["gpus"] for r in g["reasons"]} == {"fabric-incomplete"}
    assert len(doc["gpus"]) == 8
    scenario = tmp_path / "s.yaml"
    scenario.write_text("gpus: 2\nevents:\n  - {at: 0, gpu: 1, fabric_state: in_progress}\n")
    r = subprocess.run(
        [sys.executable, "-m", "gpuguard", "check", "--backend", "mock", "--scenario", str(scenario)],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False, env=env(fakenvml, state),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout  # the scenario's node has just booted: within the grace
    r = subprocess.run(
        [sys.executable, "-m", "gpuguard", "check", "--backend", "mock", "--scenario", str(scenario),
         "--at", "400"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False, env=env(fakenvml, state),
    )  # fmt: skip
    assert r.returncode == 1 and "fabric-incomplete" in r.stdout, r.stdout


def test_a_signal_read_that_hangs_is_gpu_unresponsive_naming_the_call(fakenvml: Path, tmp_path: Path) -> None:
    """Every signal read runs under the pass's deadline: a clock event read that never returns on GPU 1 is
    that GPU's gpu-unresponsive, naming the call, within the deadline; GPU 0 stays healthy."""
    two = "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n"
    state = tmp_path / "nvml.state"
    state.write_text(two)
    with agent(fakenvml, state, "--nvml-call-timeout", "1") as p:
        state.write_text(two + "hang nvmlDeviceGetCurrentClocksEventReasons gpu=1\n")
        doc, took, _ = watch_until(p, lambda d: "gpu-unresponsive" in reasons_of(d, "GPU-0b"), 6)
        assert reasons_of(doc, "GPU-0b") == ["gpu-unresponsive"] and reasons_of(doc, "GPU-0a") == [], doc
        assert doc["nvml_stuck_calls"] == [
            "nvmlDeviceGetCurrentClocksEventReasons has not returned within 1 s (GPU 1, GPU-0b)"
        ]
        assert took < 1 + 1.5
        state.write_text(two)
        doc, _, _ = watch_until(p, lambda d: not reasons_of(d, "GPU-0b"), 5)
        assert reasons_of(doc, "GPU-0b") == [] and doc["nvml_stuck_calls"] == []


def test_a_fabric_that_answers_state_not_supported_is_not_applicable_and_not_asked_again(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    steps = results["fabric-state-not-supported"]
    assert all(not s["faults"] and not s["degraded"] and not s["errors"] for s in steps), steps


def test_check_compares_the_pci_bus_under_pci_root_with_nvml(fakenvml: Path, tmp_path: Path) -> None:
    state = tmp_path / "nvml.state"
    state.write_text(gpus(""))
    code, doc, _ = check(fakenvml, state, "--pci-root", str(fake_sysfs(tmp_path / "sys")))
    assert code == 1
    assert doc["node_reasons"] == [
        "gpu-missing: an NVIDIA GPU at PCI 0000:3d:00.0 is on the PCI bus but absent from NVML"
    ], doc
    code, doc, _ = check(fakenvml, state, "--pci-root", str(tmp_path / "nowhere"))
    assert code == 0, doc  # a bus that cannot be read is not judged (logged), never a fault


# -- end to end, through what the downstream half shows (/healthz, check) ------------------------------------


def test_one_nvlink_down_under_a_watching_agent_degrades_that_gpu_on_healthz_and_clears(
    fakenvml: Path, tmp_path: Path
) -> None:
    """The real agent, pynvml and the fake library: a link goes down on GPU 1 (its recovery counter moves,
    so the link states are read at once): /healthz lists GPU 1's nvlink-down beside its reasons, the node
    stays healthy; the link back up clears it."""
    base = "gpu 0 uuid=GPU-0a nvlink_links=18\ngpu 1 uuid=GPU-0b nvlink_links=18{}\n"
    state = tmp_path / "nvml.state"
    state.write_text(base.format(""))
    with agent(fakenvml, state) as p:
        state.write_text(base.format(" nvlink_down=3 nvlink_recovery=1"))
        doc, _, _ = watch_until(p, lambda d: any(g["degraded"] for g in d["gpus"]), 5)
        by_uuid = {g["uuid"]: g for g in doc["gpus"]}
        assert [r.split(":")[0] for r in by_uuid["GPU-0b"]["degraded"]] == ["nvlink-down"], doc
        assert by_uuid["GPU-0a"]["degraded"] == [] and doc["healthy"], doc
        with urllib.request.urlopen(f"http://127.0.0.1:{p.port}/metrics", timeout=2) as r:
            text = r.read().decode()
        # The PCIe link is shown (the fake's default: Gen4 x16).
        assert 'gpuguard_gpu_pcie_link_generation{gpu="1",uuid="GPU-0b"} 4.0' in text
        assert 'gpuguard_gpu_pcie_link_width{gpu="1",uuid="GPU-0b"} 16.0' in text
        state.write_text(base.format(" nvlink_recovery=2"))  # retrained, the counter moved: read at once
        doc, _, _ = watch_until(p, lambda d: not any(g["degraded"] for g in d["gpus"]), 5)
        assert not any(g["degraded"] for g in doc["gpus"]), doc


def test_check_lists_a_degraded_gpu_and_exits_0_unless_fail_on_degraded(
    fakenvml: Path, tmp_path: Path
) -> None:
    state = tmp_path / "nvml.state"
    state.write_text(gpus("inforom_valid=0"))
    code, doc, _ = check(fakenvml, state)
    assert code == 0, doc
    assert [r.split(":")[0] for g in doc["gpus"] for r in g["degraded"]] == ["inforom-invalid"], doc
    code, _, _ = check(fakenvml, state, "--fail-on-degraded")
    assert code == 1
