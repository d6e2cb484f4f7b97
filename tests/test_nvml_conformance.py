"""gpuguard against NVIDIA's own artefacts: nvml.h (PyPI nvidia-nvml-dev) and the lowest nvidia-ml-py allowed.

The fake library is compiled against nvml.h in tests/fakenvml/build.sh (a prototype mismatch fails the build,
tests/test_fakenvml.py shows it). Here: the struct layouts and constants gpuguard relies on, as the C compiler
sees them in nvml.h, against pynvml's ctypes structures and constants; and the pinned lowest nvidia-ml-py
release running the backend through the fake library.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpuguard.core.model import RECOVERY_ACTIONS
from gpuguard.judge import signals as signaljudge
from gpuguard.nvml import real
from gpuguard.nvml.real import fabric, fields

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
#include <stddef.h>
#include <stdio.h>
#include <nvml.h>
#define OFF(t, f) printf("\"%s.%s\": %zu,\n", #t, #f, offsetof(t, f))
#define SIZE(t) printf("\"sizeof %s\": %zu,\n", #t, sizeof(t))
#define CONST(c) printf("\"%s\": %lld,\n", #c, (long long)(c))
int main(void) {
    printf("{\n");
    SIZE(nvmlEventData_t); OFF(nvmlEventData_t, device); OFF(nvmlEventData_t, eventType);
    OFF(nvmlEventData_t, eventData); OFF(nvmlEventData_t, gpuInstanceId);
    OFF(nvmlEventData_t, computeInstanceId);
    SIZE(nvmlPciInfo_t); OFF(nvmlPciInfo_t, busIdLegacy); OFF(nvmlPciInfo_t, busId);
    SIZE(nvmlFieldValue_t); OFF(nvmlFieldValue_t, fieldId); OFF(nvmlFieldValue_t, scopeId);
    OFF(nvmlFieldValue_t, timestamp); OFF(nvmlFieldValue_t, latencyUsec);
    OFF(nvmlFieldValue_t, valueType); OFF(nvmlFieldValue_t, nvmlReturn); OFF(nvmlFieldValue_t, value);
    SIZE(nvmlValue_t);
    CONST(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION); CONST(nvmlEventTypeXidCriticalError);
    CONST(nvmlEventTypeGpuRecoveryAction); CONST(nvmlEventTypeDoubleBitEccError);
    CONST(NVML_SUCCESS); CONST(NVML_ERROR_UNINITIALIZED); CONST(NVML_ERROR_NOT_SUPPORTED);
    CONST(NVML_ERROR_NO_PERMISSION); CONST(NVML_ERROR_TIMEOUT); CONST(NVML_ERROR_LIBRARY_NOT_FOUND);
    CONST(NVML_ERROR_FUNCTION_NOT_FOUND); CONST(NVML_ERROR_GPU_IS_LOST); CONST(NVML_ERROR_RESET_REQUIRED);
    CONST(NVML_ERROR_DRIVER_NOT_LOADED); CONST(NVML_ERROR_UNKNOWN);
    CONST(NVML_MEMORY_ERROR_TYPE_UNCORRECTED); CONST(NVML_VOLATILE_ECC); CONST(NVML_FEATURE_ENABLED);
    CONST(NVML_VALUE_TYPE_DOUBLE); CONST(NVML_VALUE_TYPE_UNSIGNED_INT); CONST(NVML_VALUE_TYPE_UNSIGNED_LONG);
    CONST(NVML_VALUE_TYPE_UNSIGNED_LONG_LONG); CONST(NVML_VALUE_TYPE_SIGNED_LONG_LONG);
    CONST(NVML_VALUE_TYPE_SIGNED_INT);
    CONST(NVML_GPU_RECOVERY_ACTION_NONE); CONST(NVML_GPU_RECOVERY_ACTION_GPU_RESET);
    CONST(NVML_GPU_RECOVERY_ACTION_NODE_REBOOT); CONST(NVML_GPU_RECOVERY_ACTION_DRAIN_P2P);
    CONST(NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET); CONST(NVML_GPU_RECOVERY_ACTION_RECOVER_IMEX_DOMAIN);
    CONST(NVML_GPU_RECOVERY_ACTION_BUS_RESET); CONST(NVML_GPU_RECOVERY_ACTION_SYSTEM_REBOOT);
    SIZE(nvmlGpuFabricInfo_v2_t); OFF(nvmlGpuFabricInfo_v2_t, version);
    OFF(nvmlGpuFabricInfo_v2_t, clusterUuid); OFF(nvmlGpuFabricInfo_v2_t, status);
    OFF(nvmlGpuFabricInfo_v2_t, cliqueId); OFF(nvmlGpuFabricInfo_v2_t, state);
    OFF(nvmlGpuFabricInfo_v2_t, healthMask); CONST(nvmlGpuFabricInfo_v2);
    CONST(NVML_GPU_FABRIC_STATE_NOT_STARTED); CONST(NVML_GPU_FABRIC_STATE_IN_PROGRESS);
    CONST(NVML_GPU_FABRIC_STATE_COMPLETED); CONST(NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE);
    CONST(NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW);
    CONST(NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_RECOVERY);
    CONST(NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY);
    CONST(NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ACCESS_TIMEOUT_RECOVERY);
    CONST(NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_RECOVERY_TRUE);
    CONST(NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_UNHEALTHY_TRUE);
    CONST(NVML_GPU_FABRIC_HEALTH_MASK_ACCESS_TIMEOUT_RECOVERY_TRUE);
    CONST(NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL); CONST(NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL);
    CONST(NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL); CONST(NVML_FI_DEV_NVLINK_LINK_COUNT);
    CONST(NVML_FI_DEV_PCIE_REPLAY_COUNTER);
    CONST(nvmlClocksThrottleReasonHwSlowdown); CONST(nvmlClocksThrottleReasonHwThermalSlowdown);
    CONST(nvmlClocksThrottleReasonHwPowerBrakeSlowdown); CONST(NVML_ERROR_CORRUPTED_INFOROM);
    printf("\"end\": 0}\n");
    return 0;
}
"""


def nvml_include() -> Path:
    found = sorted((ROOT / ".venv").glob("lib/python3*/site-packages/nvidia/cu*/include/nvml.h"))
    assert found, "nvml.h not installed: `make install` (the dev extra has nvidia-nvml-dev)"
    return found[-1].parent


@pytest.fixture(scope="module")
def header(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    d = tmp_path_factory.mktemp("probe")
    (d / "probe.c").write_text(PROBE)
    subprocess.run(
        ["gcc", "-Wall", "-Werror", "-I", str(nvml_include()), "-o", str(d / "probe"), str(d / "probe.c")],
        check=True,
    )
    out = subprocess.run([str(d / "probe")], capture_output=True, text=True, check=True).stdout
    doc: dict[str, int] = json.loads(out)
    return doc


def layout(cls: Any) -> dict[str, int]:
    return {name: getattr(cls, name).offset for name, _ in cls._fields_}


def test_pynvml_event_data_matches_nvml_h(header: dict[str, int]) -> None:
    ev = layout(pynvml.c_nvmlEventData_t)
    assert ctypes.sizeof(pynvml.c_nvmlEventData_t) == header["sizeof nvmlEventData_t"]
    for f in ("device", "eventType", "eventData", "gpuInstanceId", "computeInstanceId"):
        assert ev[f] == header[f"nvmlEventData_t.{f}"], f


def test_pynvml_pci_info_and_field_value_match_nvml_h(header: dict[str, int]) -> None:
    assert ctypes.sizeof(pynvml.nvmlPciInfo_t) == header["sizeof nvmlPciInfo_t"]
    assert layout(pynvml.nvmlPciInfo_t)["busId"] == header["nvmlPciInfo_t.busId"]
    fv = layout(pynvml.c_nvmlFieldValue_t)
    assert ctypes.sizeof(pynvml.c_nvmlFieldValue_t) == header["sizeof nvmlFieldValue_t"]
    for f in ("fieldId", "scopeId", "timestamp", "latencyUsec", "valueType", "nvmlReturn", "value"):
        assert fv[f] == header[f"nvmlFieldValue_t.{f}"], f
    assert ctypes.sizeof(pynvml.c_nvmlValue_t) == header["sizeof nvmlValue_t"]


def test_the_constants_gpuguard_uses_are_nvml_hs(header: dict[str, int]) -> None:
    assert real.FI_GPU_RECOVERY_ACTION == header["NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"] == 230
    assert header["nvmlEventTypeXidCriticalError"] == real.EVENT_XID
    assert real.EVENT_RECOVERY_ACTION == header["nvmlEventTypeGpuRecoveryAction"] == 0x8000
    assert real.EVENT_DOUBLE_BIT_ECC == header["nvmlEventTypeDoubleBitEccError"] == 0x2
    for name in (
        "NVML_SUCCESS",
        "NVML_ERROR_UNINITIALIZED",
        "NVML_ERROR_NOT_SUPPORTED",
        "NVML_ERROR_NO_PERMISSION",
        "NVML_ERROR_TIMEOUT",
        "NVML_ERROR_LIBRARY_NOT_FOUND",
        "NVML_ERROR_FUNCTION_NOT_FOUND",
        "NVML_ERROR_GPU_IS_LOST",
        "NVML_ERROR_RESET_REQUIRED",
        "NVML_ERROR_DRIVER_NOT_LOADED",
        "NVML_ERROR_UNKNOWN",
        "NVML_MEMORY_ERROR_TYPE_UNCORRECTED",
        "NVML_VOLATILE_ECC",
        "NVML_FEATURE_ENABLED",
    ):
        assert getattr(pynvml, name) == header[name], name
    # gpuguard's own tables: the value types _recovery_action reads, the recovery action names.
    assert [header[f"NVML_VALUE_TYPE_{t}"] for t in ("DOUBLE", "UNSIGNED_INT", "UNSIGNED_LONG")] == [0, 1, 2]
    assert [
        header[f"NVML_VALUE_TYPE_{t}"] for t in ("UNSIGNED_LONG_LONG", "SIGNED_LONG_LONG", "SIGNED_INT")
    ] == [
        3,
        4,
        5,
    ]
    for value, name in RECOVERY_ACTIONS.items():
        assert header[f"NVML_GPU_RECOVERY_ACTION_{name.upper().replace('-', '_')}"] == value


def test_the_signal_reads_follow_nvml_h(header: dict[str, int]) -> None:
    """Issue 29: the fabric struct gpuguard declares, the field ids, the clock event bits and the fabric
    health mask fields the judge decodes, as nvml.h has them."""
    assert ctypes.sizeof(fabric.FabricInfoV2) == header["sizeof nvmlGpuFabricInfo_v2_t"]
    for name, offset in layout(fabric.FabricInfoV2).items():
        assert offset == header[f"nvmlGpuFabricInfo_v2_t.{name}"], name
    assert header["nvmlGpuFabricInfo_v2"] == fabric.FABRIC_INFO_V2
    assert header["NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"] == fields.FI_NVLINK_CRC_TOTAL
    assert header["NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"] == fields.FI_NVLINK_REPLAY_TOTAL
    assert header["NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL"] == fields.FI_NVLINK_RECOVERY_TOTAL
    assert header["NVML_FI_DEV_NVLINK_LINK_COUNT"] == fields.FI_NVLINK_LINK_COUNT
    assert header["NVML_FI_DEV_PCIE_REPLAY_COUNTER"] == fields.FI_PCIE_REPLAY_COUNTER
    bits = {name: bit for name, (bit, _) in signaljudge.CLOCK_BITS.items()}
    assert bits == {
        "clock-hw-slowdown": header["nvmlClocksThrottleReasonHwSlowdown"],
        "clock-hw-thermal": header["nvmlClocksThrottleReasonHwThermalSlowdown"],
        "clock-power-brake": header["nvmlClocksThrottleReasonHwPowerBrakeSlowdown"],
    }
    shifts = dict(signaljudge.FABRIC_HEALTH)
    assert shifts == {
        "degraded bandwidth": header["NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW"],
        "route recovery": header["NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_RECOVERY"],
        "route unhealthy": header["NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY"],
        "access timeout": header["NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ACCESS_TIMEOUT_RECOVERY"],
    }
    for what in ("DEGRADED_BW", "ROUTE_RECOVERY", "ROUTE_UNHEALTHY", "ACCESS_TIMEOUT_RECOVERY"):
        assert header[f"NVML_GPU_FABRIC_HEALTH_MASK_{what}_TRUE"] == 1  # what the judge reads as "so"
    states = {v: k for k, v in signaljudge.FABRIC_STATES.items()}
    assert states == {
        n: header[f"NVML_GPU_FABRIC_STATE_{n}"] for n in ("NOT_STARTED", "IN_PROGRESS", "COMPLETED")
    }
    assert header["NVML_ERROR_CORRUPTED_INFOROM"] == pynvml.NVML_ERROR_CORRUPTED_INFOROM


# -- the lowest nvidia-ml-py the pin allows ----------------------------------------------------------------


def lowest_pynvml() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if d.startswith("nvidia-ml-py"))
    m = re.search(r">=([\d.]+)", spec)
    assert m and "<" in spec, f"nvidia-ml-py must be pinned to a tested range: {spec}"
    return m.group(1)


@pytest.fixture(scope="module")
def old_pynvml() -> Path:
    """nvidia-ml-py at the pin's lower bound, installed once into build/ (pip's cache makes it cheap)."""
    version = lowest_pynvml()
    target = ROOT / "build" / f"nvidia-ml-py-{version}"
    if not (target / "pynvml.py").is_file():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
             f"nvidia-ml-py=={version}"],
            check=True,
        )  # fmt: skip
    return target


def test_the_lowest_pinned_nvidia_ml_py_runs_the_backend(
    fakenvml: Path, old_pynvml: Path, tmp_path: Path
) -> None:
    state = tmp_path / "nvml.state"
    state.write_text("gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b recovery_action=1\n")
    script = f"""
import time, pynvml
from gpuguard.nvml.real import NvmlBackend
b = NvmlBackend()
b.open(lambda: None)
first = b.snapshot()
open({str(state)!r}, "a").write("xid 0 79 gi=3 ci=1\\n")
deadline = time.monotonic() + 5
xids = ()
while not xids and time.monotonic() < deadline:
    time.sleep(0.05)
    xids = b.snapshot().xids
b.close()
print("RESULT", pynvml.__file__, [(g.uuid, g.recovery_action, g.xid_watched) for g in first.gpus],
      [(x.uuid, x.code, x.gpu_instance, x.compute_instance) for x in xids])
"""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("GPUGUARD_", "FAKE_NVML"))},
        "PYTHONPATH": f"{old_pynvml}{os.pathsep}{ROOT}",
        "LD_LIBRARY_PATH": str(fakenvml),
        "FAKE_NVML_STATE": str(state),
    }
    r = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    assert str(old_pynvml) in line
    assert line.endswith("[('GPU-0a', 0, True), ('GPU-0b', 1, True)] [('GPU-0a', 79, 3, 1)]"), line
