"""Tests for the fake libnvidia-ml.so.1 in tests/fakenvml, driven through the real pynvml.

pynvml caches the loaded library for the whole process, so every scenario runs
in its own Python subprocess with LD_LIBRARY_PATH pointing at the fake. The
subprocess prints ``RESULT {json}`` lines that the test then checks.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD_SH = ROOT / "tests" / "fakenvml" / "build.sh"
LIB_DIR = ROOT / "build" / "fakenvml"
LIB_NAME = "libnvidia-ml.so.1"

# Every NVML symbol the pynvml wrappers gpuguard relies on look up.
REQUIRED_SYMBOLS = [
    "nvmlInit",
    "nvmlInit_v2",
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlErrorString",
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetHandleByUUID",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetEccMode",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRemappedRows",
    "nvmlEventSetCreate",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlDeviceRegisterEvents",
    "nvmlEventSetWait_v2",
    "nvmlEventSetWait",
    "nvmlEventSetFree",
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetRetiredPages",
    "nvmlDeviceGetRetiredPagesPendingStatus",
]

# Runs first in every subprocess script.
PRELUDE = '''
import ctypes, json, os, sys, threading, time
import pynvml as nv

STATE = os.environ.get("FAKE_NVML_STATE", "")
XID = nv.nvmlEventTypeXidCriticalError

def out(**kw):
    print("RESULT " + json.dumps(kw), flush=True)

def err(fn, *args):
    """Name of the NVMLError class fn(*args) raises, or None."""
    try:
        fn(*args)
    except nv.NVMLError as e:
        return type(e).__name__
    return None

def write_state(text, mode="rewrite"):
    """Writes the state file in place ("rewrite", "append") or atomically ("rename")."""
    if mode == "append":
        with open(STATE, "a") as f:
            f.write(text)
    elif mode == "rewrite":
        with open(STATE, "w") as f:
            f.write(text)
    else:
        tmp = STATE + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, STATE)

def read_state():
    with open(STATE) as f:
        return f.read()
'''


@pytest.fixture(scope="session")
def lib_dir() -> Path:
    """Builds the fake library once per session; a compiler failure fails the tests."""
    proc = subprocess.run(["sh", str(BUILD_SH), str(LIB_DIR)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"build.sh failed:\n{proc.stdout}{proc.stderr}"
    assert (LIB_DIR / LIB_NAME).is_file()
    return LIB_DIR


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "gpus.state"


def write(path: Path, text: str) -> None:
    path.write_text(textwrap.dedent(text))


def run_nvml(
    lib_dir: Path,
    script: str,
    state: Path | None,
    *,
    extra_env: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NVML_")}
    env["LD_LIBRARY_PATH"] = str(lib_dir)
    if state is not None:
        env["FAKE_NVML_STATE"] = str(state)
    env.update(extra_env or {})
    code = PRELUDE + textwrap.dedent(script)
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def results(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    merged: dict[str, Any] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            merged.update(json.loads(line.removeprefix("RESULT ")))
    return merged


def nvml(
    lib_dir: Path, script: str, state: Path | None, extra_env: dict[str, str] | None = None
) -> dict[str, Any]:
    return results(run_nvml(lib_dir, script, state, extra_env=extra_env))


# --------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------


def test_build_exports_symbols_and_soname(lib_dir: Path) -> None:
    again = subprocess.run(["sh", str(BUILD_SH), str(lib_dir)], capture_output=True, text=True, check=True)
    assert again.stdout == "", "an up-to-date library must not be rebuilt"

    # Load by path in a subprocess: loading it here would hand this soname to
    # any later in-process CDLL("libnvidia-ml.so.1").
    res = nvml(
        lib_dir,
        f"""
        lib = ctypes.CDLL({str(lib_dir / LIB_NAME)!r})
        out(missing=[n for n in {REQUIRED_SYMBOLS!r} if not hasattr(lib, n)])
        """,
        None,
    )
    assert res["missing"] == []

    readelf = subprocess.run(
        ["readelf", "-d", str(lib_dir / LIB_NAME)], capture_output=True, text=True, check=False
    )
    if readelf.returncode == 0:
        assert "Library soname: [libnvidia-ml.so.1]" in readelf.stdout


# --------------------------------------------------------------------------
# Init, basic queries, argument checks
# --------------------------------------------------------------------------


# One case a row: the state file, the script run against it, and every RESULT it prints (each section's
# table is run by test_the_fake_answers_as_its_state_file_says, below the last).
INIT = [
    pytest.param(
        """\
        # two GPUs
        driver 535.161.08   # trailing comment
        gpu 1
        gpu 0 uuid=GPU-0a name="NVIDIA H200"
        """,
        """
        nv.nvmlInit()
        gpus = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            pci = nv.nvmlDeviceGetPciInfo(h)
            uuid = nv.nvmlDeviceGetUUID(h)
            gpus.append(dict(
                uuid=uuid, name=nv.nvmlDeviceGetName(h), index=nv.nvmlDeviceGetIndex(h),
                by_uuid=nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetHandleByUUID(uuid)),
                busId=pci.busId, busIdLegacy=pci.busIdLegacy,
                domain=pci.domain, bus=pci.bus, device=pci.device,
                pciDeviceId=pci.pciDeviceId,
            ))
        out(driver=nv.nvmlSystemGetDriverVersion(), gpus=gpus,
            unknown_uuid=err(nv.nvmlDeviceGetHandleByUUID, "GPU-nope"),
            init_v2=nv.nvmlLib.nvmlInit_v2(), init_flags=nv.nvmlLib.nvmlInitWithFlags(0))
        nv.nvmlShutdown()
        """,
        {
            "driver": "535.161.08",
            "gpus": [
                {
                    "uuid": "GPU-0a",
                    "name": "NVIDIA H200",
                    "index": 0,
                    "by_uuid": 0,
                    "busId": "00000000:3B:00.0",
                    "busIdLegacy": "0000:3B:00.0",
                    "domain": 0,
                    "bus": 0x3B,
                    "device": 0,
                    "pciDeviceId": 0x233010DE,
                },
                {
                    "uuid": "GPU-00000000-fake-0000-0000-000000000001",
                    "name": "NVIDIA Fake GPU",
                    "index": 1,
                    "by_uuid": 1,
                    "busId": "00000000:3C:00.0",
                    "busIdLegacy": "0000:3C:00.0",
                    "domain": 0,
                    "bus": 0x3C,
                    "device": 0,
                    "pciDeviceId": 0x233010DE,
                },
            ],
            "unknown_uuid": "NVMLError_NotFound",
            "init_v2": 0,
            "init_flags": 0,
        },
        id="the driver, each GPU's UUID, name, index and PCI info, and NotFound for an unknown UUID",
    ),
    pytest.param(
        "",
        """
        nv.nvmlInit()
        out(driver=nv.nvmlSystemGetDriverVersion(), count=nv.nvmlDeviceGetCount(),
            handle0=err(nv.nvmlDeviceGetHandleByIndex, 0))
        """,
        {"driver": "550.54.15", "count": 0, "handle0": "NVMLError_InvalidArgument"},
        id="an empty file has the default driver and no GPU",
    ),
    pytest.param(
        "gpu 0\n",
        """
        nv._LoadNvmlLibrary()  # library loaded but nvmlInit not called yet
        before = err(nv.nvmlDeviceGetCount)
        nv.nvmlInit()
        nv.nvmlInit()
        nv.nvmlShutdown()
        still = nv.nvmlDeviceGetCount()
        nv.nvmlShutdown()
        after = err(nv.nvmlDeviceGetCount)
        extra = err(nv.nvmlShutdown)
        evset = err(nv.nvmlEventSetCreate)
        nv.nvmlInit()
        out(before=before, still=still, after=after, extra=extra, evset=evset,
            again=nv.nvmlDeviceGetCount())
        """,
        {
            "before": "NVMLError_Uninitialized",
            "still": 1,
            "after": "NVMLError_Uninitialized",
            "extra": "NVMLError_Uninitialized",
            "evset": "NVMLError_Uninitialized",
            "again": 1,
        },
        id="init is counted: calls fail Uninitialized before the first and after the last shutdown",
    ),
    pytest.param(
        "init_error DRIVER_NOT_LOADED\ngpu 0\n",
        """
        try:
            nv.nvmlInit()
            out(raised=None)
        except nv.NVMLError_DriverNotLoaded as e:
            out(raised=type(e).__name__, text=str(e))
        """,
        {"raised": "NVMLError_DriverNotLoaded", "text": "Driver Not Loaded"},
        id="init_error DRIVER_NOT_LOADED makes nvmlInit raise DriverNotLoaded",
    ),
]


def test_invalid_arguments_and_buffer_sizes(lib_dir: Path, state: Path) -> None:
    write(state, "gpu 0 uuid=GPU-0a\n")
    res = nvml(
        lib_dir,
        """
        nv.nvmlInit()
        lib = nv.nvmlLib
        h = nv.nvmlDeviceGetHandleByIndex(0)
        small = ctypes.create_string_buffer(6)
        exact = ctypes.create_string_buffer(7)
        count = ctypes.c_ulonglong()
        bogus = ctypes.c_void_p(0x1000)
        data = nv.c_nvmlEventData_t()
        out(
            bad_index=err(nv.nvmlDeviceGetHandleByIndex, 1),
            null_count=lib.nvmlDeviceGetCount_v2(None),
            null_handle_out=lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(0), None),
            null_uuid_in=lib.nvmlDeviceGetHandleByUUID(None, ctypes.byref(nv.c_nvmlDevice_t())),
            bogus_handle=lib.nvmlDeviceGetUUID(bogus, exact, ctypes.c_uint(7)),
            null_device=lib.nvmlDeviceGetUUID(None, exact, ctypes.c_uint(7)),
            small_uuid=lib.nvmlDeviceGetUUID(h, small, ctypes.c_uint(6)),
            exact_uuid=lib.nvmlDeviceGetUUID(h, exact, ctypes.c_uint(7)),
            exact_value=exact.value.decode(),
            small_driver=lib.nvmlSystemGetDriverVersion(small, ctypes.c_uint(6)),
            null_name=lib.nvmlDeviceGetName(h, None, ctypes.c_uint(96)),
            null_pci=lib.nvmlDeviceGetPciInfo_v3(h, None),
            bad_error_type=lib.nvmlDeviceGetTotalEccErrors(
                h, ctypes.c_uint(2), ctypes.c_uint(0), ctypes.byref(count)),
            bad_counter_type=lib.nvmlDeviceGetTotalEccErrors(
                h, ctypes.c_uint(1), ctypes.c_uint(7), ctypes.byref(count)),
            null_remap=lib.nvmlDeviceGetRemappedRows(h, None, None, None, None),
            null_set_out=lib.nvmlEventSetCreate(None),
            wait_null_set=lib.nvmlEventSetWait_v2(None, ctypes.byref(data), ctypes.c_uint(0)),
            free_bogus_set=lib.nvmlEventSetFree(bogus),
            register_zero=err(nv.nvmlDeviceRegisterEvents, h, 0, nv.nvmlEventSetCreate()),
            register_bogus_set=lib.nvmlDeviceRegisterEvents(h, ctypes.c_ulonglong(XID), bogus),
        )
        """,
        state,
    )
    invalid, insufficient = 2, 7
    assert res.pop("bad_index") == "NVMLError_InvalidArgument"
    assert res.pop("register_zero") == "NVMLError_InvalidArgument"
    assert res.pop("small_uuid") == insufficient
    assert res.pop("small_driver") == insufficient
    assert res.pop("exact_uuid") == 0
    assert res.pop("exact_value") == "GPU-0a"
    assert res == dict.fromkeys(res, invalid)


def test_error_strings_and_every_init_error_name(lib_dir: Path, state: Path) -> None:
    """Each NVML_ERROR_* name of pynvml works in init_error and maps to its exception."""
    write(state, "gpu 0\n")
    res = nvml(
        lib_dir,
        """
        names = sorted(n[len("NVML_ERROR_"):] for n in dir(nv) if n.startswith("NVML_ERROR_"))
        raised, strings = {}, {}
        for name in names:
            code = getattr(nv, "NVML_ERROR_" + name)
            write_state("gpu 0\\ninit_error %s  # injected\\n" % name)
            try:
                nv.nvmlInit()
                raised[name] = None
            except nv.NVMLError as e:
                raised[name] = [e.value, type(e).__name__]
            strings[name] = nv.nvmlErrorString(code)
        write_state("gpu 0\\n")
        nv.nvmlInit()  # a retry after the fault is gone succeeds
        out(names=names, raised=raised, strings=strings,
            codes={n: getattr(nv, "NVML_ERROR_" + n) for n in names},
            classes={n: nv.nvmlExceptionClass(getattr(nv, "NVML_ERROR_" + n)).__name__
                     for n in names},
            success=nv.nvmlErrorString(0), bogus=nv.nvmlErrorString(12345),
            count=nv.nvmlDeviceGetCount())
        """,
        state,
    )
    assert len(res["names"]) >= 30
    for name in res["names"]:
        assert res["raised"][name] == [res["codes"][name], res["classes"][name]], name
        if name != "UNKNOWN":
            assert res["strings"][name] not in ("", "Unknown Error"), name
    assert res["strings"]["GPU_IS_LOST"] == "GPU is lost"
    assert res["strings"]["DRIVER_NOT_LOADED"] == "Driver Not Loaded"
    assert res["strings"]["UNKNOWN"] == "Unknown Error"
    assert res["success"] == "Success"
    assert res["bogus"] == "Unknown Error"
    assert res["count"] == 1


@pytest.mark.parametrize("missing", ["env", "file"])
def test_no_state_file(lib_dir: Path, state: Path, missing: str) -> None:
    proc = run_nvml(
        lib_dir,
        "out(raised=err(nv.nvmlInit))",
        None if missing == "env" else state,
    )
    assert results(proc) == {"raised": "NVMLError_DriverNotLoaded"}
    if missing == "env":
        assert "fakenvml: FAKE_NVML_STATE is not set" in proc.stderr
    else:
        assert f"fakenvml: cannot read FAKE_NVML_STATE file {state}" in proc.stderr


def test_library_not_found(tmp_path: Path, state: Path) -> None:
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this host has a real libnvidia-ml installed")
    write(state, "gpu 0\n")
    res = nvml(tmp_path, "out(raised=err(nv.nvmlInit))", state)
    assert res == {"raised": "NVMLError_LibraryNotFound"}


@pytest.mark.parametrize(
    ("content", "line", "reason"),
    [
        ("gpu 0\nbogus 1\n", 2, "unknown keyword 'bogus'"),
        ("gpu 0 color=red   # why\n", 1, "unknown key 'color'"),
        ("gpu 0 ecc=two\n", 1, "bad value 'two' for 'ecc'"),
        ("gpu 0 lost=yes\n", 1, "bad value 'yes' for 'lost'"),
        ("gpu 0 ecc=1 ecc=2\n", 1, "duplicate key 'ecc'"),
        ("gpu 0 ecc\n", 1, "expected key=value, got 'ecc'"),
        ("gpu 0\n\ngpu 2\n", 3, "gpu 1 is missing (gpu indices must be 0..n-1 without gaps)"),
        ("gpu 0\ngpu 0\n", 2, "duplicate gpu 0 (first on line 1)"),
        ("gpu x\n", 1, "expected: gpu <index 0..1023> [key=value...]"),
        ("init_error NOT_A_THING\n", 1, "unknown error name 'NOT_A_THING'"),
        ("gpu 0 error=NOPE\n", 1, "unknown error name 'NOPE'"),
        ("gpu 0 uuid=A\ngpu 1 uuid=A\n", 2, "duplicate uuid 'A' (also gpu 0)"),
        ("gpu 0\nxid 1 79\n", 2, "xid for gpu 1, but there is no such gpu line"),
        ("gpu 0\nxid 0\n", 2, "expected: xid <gpu index> <xid code> [gi=<n>] [ci=<n>]"),
        ('gpu 0 name="H100\n', 1, "unterminated quote"),
        ("driver 1 2\n", 1, "expected: driver <version>"),
    ],
)
def test_malformed_line(lib_dir: Path, state: Path, content: str, line: int, reason: str) -> None:
    state.write_text(content)
    proc = run_nvml(lib_dir, "out(raised=err(nv.nvmlInit))", state)
    assert results(proc) == {"raised": "NVMLError_Unknown"}
    text = content.splitlines()[line - 1]
    assert f"fakenvml: {state}:{line}: {reason}: {text}\n" in proc.stderr


def test_malformed_edit_after_init_keeps_last_good_state(lib_dir: Path, state: Path) -> None:
    write(state, "gpu 0 ecc=1\n")
    proc = run_nvml(
        lib_dir,
        """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        U = nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        V = nv.NVML_VOLATILE_ECC
        write_state("gpu 0 ecc=oops\\n")
        kept = [nv.nvmlDeviceGetTotalEccErrors(h, U, V) for _ in range(5)]
        os.remove(STATE)
        gone = [nv.nvmlDeviceGetTotalEccErrors(h, U, V) for _ in range(3)]
        write_state("gpu 0 ecc=3\\n", "rename")
        out(kept=kept, gone=gone, fixed=nv.nvmlDeviceGetTotalEccErrors(h, U, V))
        """,
        state,
    )
    assert results(proc) == {"kept": [1] * 5, "gone": [1] * 3, "fixed": 3}
    message = f"fakenvml: {state}:1: bad value 'oops' for 'ecc': gpu 0 ecc=oops\n"
    assert proc.stderr.count(message) == 1, proc.stderr
    assert proc.stderr.count("cannot stat FAKE_NVML_STATE") == 1, proc.stderr


# --------------------------------------------------------------------------
# Health data
# --------------------------------------------------------------------------


# Cases as INIT's, run by test_the_fake_answers_as_its_state_file_says.
HEALTH = [
    pytest.param(
        "gpu 0\ngpu 1 ecc=2\n",
        """
        nv.nvmlInit()
        rows = []
        for i in range(2):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            rows.append([
                nv.nvmlDeviceGetEccMode(h),
                nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                               nv.NVML_VOLATILE_ECC),
                nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                               nv.NVML_AGGREGATE_ECC),
                nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                               nv.NVML_VOLATILE_ECC),
            ])
        out(rows=rows)
        """,
        {"rows": [[[1, 1], 0, 0, 0], [[1, 1], 2, 2, 0]]},
        id="ECC mode and counts are the volatile and aggregate uncorrected ones written",
    ),
    pytest.param(
        "gpu 0 ecc_supported=0 ecc=4\n",
        """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        s = nv.nvmlEventSetCreate()
        try:
            nv.nvmlDeviceGetEccMode(h)
            mode = None
        except nv.NVMLError_NotSupported as e:
            mode = type(e).__name__
        out(mode=mode,
            total=err(nv.nvmlDeviceGetTotalEccErrors, h, 1, 0),
            remapped=list(nv.nvmlDeviceGetRemappedRows(h)),
            supported=nv.nvmlDeviceGetSupportedEventTypes(h),
            register_dbe=err(nv.nvmlDeviceRegisterEvents, h,
                             nv.nvmlEventTypeDoubleBitEccError, s),
            register_xid=err(nv.nvmlDeviceRegisterEvents, h, XID, s))
        """,
        {
            "mode": "NVMLError_NotSupported",
            "total": "NVMLError_NotSupported",
            "remapped": [0, 0, 0, 0],
            "supported": 0x8 | 0x4 | 0x10 | 0x8000,
            "register_dbe": "NVMLError_NotSupported",
            "register_xid": None,
        },
        id="a GPU without ECC answers NotSupported to every ECC query",
    ),
    pytest.param(
        """\
        gpu 0
        gpu 1 remap_pending=1 remap_failure=1 remap_corr=3 remap_unc=1
        gpu 2 remap_pending=1
        """,
        """
        nv.nvmlInit()
        out(rows=[list(nv.nvmlDeviceGetRemappedRows(nv.nvmlDeviceGetHandleByIndex(i)))
                  for i in range(3)])
        """,
        {"rows": [[0, 0, 0, 0], [3, 1, 1, 1], [0, 0, 1, 0]]},
        id="remapped rows answer the counts, pending and failure written",
    ),
    pytest.param(
        "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n",
        """
        nv.nvmlInit()
        h1 = nv.nvmlDeviceGetHandleByIndex(1)
        s = nv.nvmlEventSetCreate()
        write_state(read_state().replace("uuid=GPU-0b", "uuid=GPU-0b lost=1"))
        try:
            nv.nvmlDeviceGetUUID(h1)
            uuid = None
        except nv.NVMLError_GpuIsLost as e:
            uuid = type(e).__name__
        out(uuid=uuid,
            others=[err(f, *a) for f, a in [
                (nv.nvmlDeviceGetName, (h1,)),
                (nv.nvmlDeviceGetPciInfo, (h1,)),
                (nv.nvmlDeviceGetEccMode, (h1,)),
                (nv.nvmlDeviceGetTotalEccErrors, (h1, 1, 0)),
                (nv.nvmlDeviceGetRemappedRows, (h1,)),
                (nv.nvmlDeviceGetSupportedEventTypes, (h1,)),
                (nv.nvmlDeviceRegisterEvents, (h1, XID, s)),
                (nv.nvmlDeviceGetHandleByIndex, (1,)),
                (nv.nvmlDeviceGetHandleByUUID, ("GPU-0b",)),
            ]],
            index=nv.nvmlDeviceGetIndex(h1),
            count=nv.nvmlDeviceGetCount(),
            healthy=nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(0)))
        """,
        {
            "uuid": "NVMLError_GpuIsLost",
            "others": ["NVMLError_GpuIsLost"] * 9,
            "index": 1,
            "count": 2,
            "healthy": "GPU-0a",
        },
        id="a lost GPU answers GpuIsLost to every call, the others answer",
    ),
    pytest.param(
        "gpu 0 ecc=1 error=TIMEOUT\n",
        """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        try:
            nv.nvmlDeviceGetTotalEccErrors(h, 1, 0)
            ecc = None
        except nv.NVMLError_Timeout as e:
            ecc = type(e).__name__
        failing = dict(ecc=ecc, uuid=err(nv.nvmlDeviceGetUUID, h),
                       remapped=err(nv.nvmlDeviceGetRemappedRows, h),
                       index=nv.nvmlDeviceGetIndex(h))
        write_state("gpu 0 ecc=1\\n")
        out(failing=failing, recovered=nv.nvmlDeviceGetTotalEccErrors(h, 1, 0))
        """,
        {
            "failing": {
                "ecc": "NVMLError_Timeout",
                "uuid": "NVMLError_Timeout",
                "remapped": "NVMLError_Timeout",
                "index": 0,
            },
            "recovered": 1,
        },
        id="a GPU's error line fails its calls while it stands, and they answer once it is gone",
    ),
]


@pytest.mark.parametrize("mode", ["rewrite", "rename"])
def test_edits_seen_on_next_query(lib_dir: Path, state: Path, mode: str) -> None:
    """Back-to-back same-size edits: the file's mtime may not even change between them."""
    write(state, "gpu 0 ecc=0\n")
    res = nvml(
        lib_dir,
        f"""
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        seen = []
        for i in range(50):
            write_state("gpu 0 ecc=%d\\n" % (i % 10), {mode!r})
            seen.append(nv.nvmlDeviceGetTotalEccErrors(h, 1, 0))
        write_state("gpu 0 ecc=0\\ngpu 1 ecc=7\\n", {mode!r})
        out(seen=seen, count=nv.nvmlDeviceGetCount(),
            gpu1=nv.nvmlDeviceGetTotalEccErrors(nv.nvmlDeviceGetHandleByIndex(1), 1, 0))
        """,
        state,
    )
    assert res == {"seen": [i % 10 for i in range(50)], "count": 2, "gpu1": 7}


# --------------------------------------------------------------------------
# Events
# --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["append", "rewrite", "rename", "append-no-inotify", "rename-no-inotify"])
def test_xid_wait_timeout_and_wakeup(lib_dir: Path, state: Path, mode: str) -> None:
    """The no-inotify variants exercise the 5 ms polling fallback."""
    write(state, "gpu 0\ngpu 1\n")
    no_inotify = mode.endswith("-no-inotify")
    mode = mode.removesuffix("-no-inotify")
    res = nvml(
        lib_dir,
        f"""
        MODE = {mode!r}
        def add(lines):
            write_state(lines if MODE == "append" else read_state() + lines, MODE)

        nv.nvmlInit()
        h0, h1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
        s = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(h1, XID, s)

        t = time.monotonic()
        idle = err(nv.nvmlEventSetWait_v2, s, 200)
        idle_s = time.monotonic() - t

        injected = {{}}
        def writer():
            time.sleep(0.1)
            injected["t"] = time.monotonic()
            add("xid 1 79\\n")
        th = threading.Thread(target=writer)
        t = time.monotonic()
        th.start()
        d = nv.nvmlEventSetWait_v2(s, 5000)
        done = time.monotonic()
        th.join()
        event = dict(type=d.eventType, data=d.eventData, gpu=nv.nvmlDeviceGetIndex(d.device),
                     gi=d.gpuInstanceId, ci=d.computeInstanceId)
        again = err(nv.nvmlEventSetWait_v2, s, 200)

        # Two more in one write: gpu 1's reaches this set, gpu 0's is lost:
        # nobody registered for it (nvml.h: events before the registration
        # are not recorded).
        add("xid 0 48\\nxid 1 94\\n")
        second = nv.nvmlEventSetWait_v2(s, 1000).eventData
        nothing = err(nv.nvmlEventSetWait_v2, s, 50)
        nv.nvmlDeviceRegisterEvents(h0, XID, s)
        not_replayed = err(nv.nvmlEventSetWait_v2, s, 50)
        add("xid 0 48\\n")
        parked = nv.nvmlEventSetWait_v2(s, 1000)
        out(idle=idle, idle_s=idle_s, waited_s=done - t, latency_s=done - injected["t"],
            event=event, again=again, second=second, nothing=nothing, not_replayed=not_replayed,
            parked=[parked.eventData, nv.nvmlDeviceGetIndex(parked.device)],
            end=err(nv.nvmlEventSetWait_v2, s, 50))
        nv.nvmlEventSetFree(s)
        nv.nvmlShutdown()
        """,
        state,
        {"FAKE_NVML_NO_INOTIFY": "1"} if no_inotify else None,
    )
    label = mode + (" without inotify" if no_inotify else "")
    print(
        f"\n[{label}] Xid wake-up latency: {res['latency_s'] * 1000:.2f} ms "
        f"(wait returned after {res['waited_s'] * 1000:.1f} ms; 200 ms idle wait took "
        f"{res['idle_s'] * 1000:.1f} ms)"
    )
    assert res["idle"] == "NVMLError_Timeout"
    assert 0.18 <= res["idle_s"] < 1.0
    assert res["event"] == {"type": 8, "data": 79, "gpu": 1, "gi": 0xFFFFFFFF, "ci": 0xFFFFFFFF}
    assert 0.09 <= res["waited_s"] < 1.0
    assert res["latency_s"] < 0.5
    assert res["again"] == "NVMLError_Timeout"
    assert res["second"] == 94
    assert res["nothing"] == "NVMLError_Timeout"
    assert res["not_replayed"] == "NVMLError_Timeout"
    assert res["parked"] == [48, 0]
    assert res["end"] == "NVMLError_Timeout"


# Cases as INIT's, run by test_the_fake_answers_as_its_state_file_says.
EVENTS = [
    # nvml.h, nvmlDeviceRegisterEvents: "All events that occurred before this call are not recorded".
    pytest.param(
        "gpu 0\nxid 0 13\nxid 0 31\n",
        """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        a = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(h, XID | nv.nvmlEventTypePState, a)
        first = err(nv.nvmlEventSetWait_v2, a, 100)
        write_state("xid 0 77\\n", "append")
        a_end = [nv.nvmlEventSetWait_v2(a, 1000).eventData, err(nv.nvmlEventSetWait_v2, a, 50)]
        b = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(h, XID, b)
        b_old = err(nv.nvmlEventSetWait_v2, b, 50)

        write_state("xid 0 43\\n", "append")  # both sets listen now: both get it
        both = [nv.nvmlEventSetWait_v2(x, 1000).eventData for x in (a, b)]
        nv.nvmlEventSetFree(a)
        nv.nvmlEventSetFree(b)

        # Truncating xid lines fires nothing and does not re-arm them.
        write_state("gpu 0\\nxid 0 13\\n")
        nv.nvmlShutdown()
        nv.nvmlInit()  # re-init does not replay anything either
        c = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(h, XID, c)
        replay = err(nv.nvmlEventSetWait_v2, c, 50)
        # The mark is 4, the file now has 1 xid line: of these four, only the
        # last one (the 4th xid line) is new.
        write_state("xid 0 1\\nxid 0 2\\nxid 0 3\\nxid 0 4\\n", "append")
        after_truncate = [nv.nvmlEventSetWait_v2(c, 1000).eventData]
        after_truncate.append(err(nv.nvmlEventSetWait_v2, c, 50))
        out(first=first, a_end=a_end, b_old=b_old, both=both, replay=replay,
            after_truncate=after_truncate)
        """,
        {
            "first": "NVMLError_Timeout",
            "a_end": [77, "NVMLError_Timeout"],
            "b_old": "NVMLError_Timeout",
            "both": [43, 43],
            "replay": "NVMLError_Timeout",
            "after_truncate": [4, "NVMLError_Timeout"],
        },
        id="events that happened before a registration are not delivered",
    ),
    pytest.param(
        "gpu 0\n",
        """
        nv.nvmlInit()
        s = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(0), XID, s)
        write_state("xid 0 62\\n", "append")
        buf = (ctypes.c_ubyte * 32)(*([0xAB] * 32))
        rc = nv.nvmlLib.nvmlEventSetWait(s, ctypes.byref(buf), ctypes.c_uint(1000))
        raw = bytes(buf)
        out(rc=rc, type=int.from_bytes(raw[8:16], sys.byteorder),
            data=int.from_bytes(raw[16:24], sys.byteorder), tail=list(raw[24:]),
            v2_size=ctypes.sizeof(nv.c_nvmlEventData_t), pci_size=ctypes.sizeof(nv.nvmlPciInfo_t))
        """,
        {
            "rc": 0,
            "type": 8,
            "data": 62,
            "tail": [0xAB] * 8,
            "v2_size": 32,
            "pci_size": 68,
        },
        id="the v1 wait fills only the old struct",
    ),
    # More uncorrected ECC errors (ecc= goes up) is one nvmlEventTypeDoubleBitEccError event (eventData 0)
    # to each set registered for it on that GPU before it happened; none where ECC is off or unsupported,
    # none when the count goes down.
    pytest.param(
        "gpu 0\ngpu 1\ngpu 2 ecc_enabled=0\n",
        """
        DBE = nv.nvmlEventTypeDoubleBitEccError
        nv.nvmlInit()
        h = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(3)]
        supported = [nv.nvmlDeviceGetSupportedEventTypes(x) & DBE for x in h]
        xid_only = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(h[0], XID, xid_only)
        s = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(h[0], XID | DBE, s)
        nv.nvmlDeviceRegisterEvents(h[1], DBE, s)
        write_state("gpu 0 ecc=2\\ngpu 1\\ngpu 2 ecc_enabled=0\\n")
        d = nv.nvmlEventSetWait_v2(s, 1000)
        first = [d.eventType, d.eventData, nv.nvmlDeviceGetIndex(d.device), d.gpuInstanceId]
        then = err(nv.nvmlEventSetWait_v2, s, 50)
        late = nv.nvmlEventSetCreate()  # registered after the error: not delivered to it
        nv.nvmlDeviceRegisterEvents(h[0], DBE, late)
        late_got = err(nv.nvmlEventSetWait_v2, late, 50)
        write_state("gpu 0 ecc=0\\ngpu 1 ecc=1\\ngpu 2 ecc_enabled=0 ecc=5\\n")  # down, up, ECC off
        d = nv.nvmlEventSetWait_v2(s, 1000)
        second = [d.eventType, nv.nvmlDeviceGetIndex(d.device)]
        out(supported=supported, first=first, then=then, late=late_got, second=second,
            rest=err(nv.nvmlEventSetWait_v2, s, 50), xid_only=err(nv.nvmlEventSetWait_v2, xid_only, 50),
            register_off=err(nv.nvmlDeviceRegisterEvents, h[2], DBE, s))
        """,
        {
            "supported": [2, 2, 0],
            "first": [2, 0, 0, 0xFFFFFFFF],
            "then": "NVMLError_Timeout",
            "late": "NVMLError_Timeout",
            "second": [2, 1],
            "rest": "NVMLError_Timeout",
            "xid_only": "NVMLError_Timeout",
            "register_off": "NVMLError_NotSupported",
        },
        id="an uncorrected ECC error is a double-bit ECC event for sets registered before",
    ),
]


def test_a_free_or_shutdown_under_a_waiter_does_not_wake_it_or_crash(lib_dir: Path, state: Path) -> None:
    """nvml.h does not say that nvmlEventSetFree or nvmlShutdown wakes a thread waiting on the set, so the
    fake does not either: the waiter returns at its timeout (safely: INVALID_ARGUMENT or UNINITIALIZED),
    and the library says on stderr that the caller did something nvml.h leaves undefined."""
    write(state, "gpu 0\n")
    proc = run_nvml(
        lib_dir,
        """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)

        def wait_in_thread(s):
            r = {}
            def run():
                t = time.monotonic()
                r["err"] = err(nv.nvmlEventSetWait_v2, s, 600)
                r["s"] = time.monotonic() - t
            th = threading.Thread(target=run)
            th.start()
            return th, r

        s = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(h, XID, s)
        th, freed = wait_in_thread(s)
        time.sleep(0.2)
        nv.nvmlEventSetFree(s)
        th.join()
        stale = [err(nv.nvmlEventSetWait_v2, s, 10), err(nv.nvmlEventSetFree, s),
                 err(nv.nvmlDeviceRegisterEvents, h, XID, s)]

        s2 = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(h, XID, s2)
        th, shut = wait_in_thread(s2)
        time.sleep(0.2)
        nv.nvmlShutdown()
        th.join()
        after = [err(nv.nvmlEventSetWait_v2, s2, 10), err(nv.nvmlEventSetFree, s2)]
        nv.nvmlInit()
        out(freed=freed, stale=stale, shut=shut, after=after,
            reinit=err(nv.nvmlEventSetWait_v2, s2, 10))
        """,
        state,
    )
    res = results(proc)
    assert res["freed"]["err"] == "NVMLError_InvalidArgument"
    assert 0.55 < res["freed"]["s"] < 2.0  # not woken: it slept to its 600 ms timeout
    assert res["stale"] == ["NVMLError_InvalidArgument"] * 3
    assert res["shut"]["err"] == "NVMLError_Uninitialized"
    assert 0.55 < res["shut"]["s"] < 2.0
    assert res["after"] == ["NVMLError_Uninitialized"] * 2
    assert res["reinit"] == "NVMLError_InvalidArgument"
    assert "fakenvml: nvmlEventSetFree on an event set another thread waits on" in proc.stderr
    assert "fakenvml: nvmlShutdown on an event set another thread waits on" in proc.stderr


def test_a_signal_ends_a_wait_with_timeout_as_nvml_h_documents(lib_dir: Path, state: Path) -> None:
    """nvml.h, nvmlEventSetWait_v2: NVML_ERROR_TIMEOUT "if no event arrived in specified timeout or
    interrupt arrived": a signal to the waiting thread ends a long wait at once."""
    write(state, "gpu 0\n")
    res = nvml(
        lib_dir,
        """
        import signal
        signal.signal(signal.SIGUSR2, lambda *_: None)
        nv.nvmlInit()
        s = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(0), XID, s)
        r = {}
        def run():
            t = time.monotonic()
            r["err"] = err(nv.nvmlEventSetWait_v2, s, 60000)
            r["s"] = time.monotonic() - t
        th = threading.Thread(target=run)
        th.start()
        time.sleep(0.3)
        signal.pthread_kill(th.ident, signal.SIGUSR2)
        th.join(10)
        # The set is still good afterwards: the next event is delivered.
        write_state("xid 0 48\\n", "append")
        out(r=r, next=nv.nvmlEventSetWait_v2(s, 1000).eventData)
        """,
        state,
    )
    assert res["r"]["err"] == "NVMLError_Timeout"
    assert res["r"]["s"] < 1.0
    assert res["next"] == 48


def test_queries_run_while_another_thread_waits(lib_dir: Path, state: Path) -> None:
    write(state, "gpu 0 ecc=0\ngpu 1\n")
    res = nvml(
        lib_dir,
        """
        nv.nvmlInit()
        h0, h1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
        s = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(h1, XID, s)
        got = {}
        def waiter():
            got["xid"] = nv.nvmlEventSetWait_v2(s, 5000).eventData
        th = threading.Thread(target=waiter)
        th.start()
        time.sleep(0.05)
        n = 2000
        t = time.monotonic()
        for _ in range(n):
            nv.nvmlDeviceGetTotalEccErrors(h0, 1, 0)
        per_call_us = (time.monotonic() - t) / n * 1e6
        write_state("gpu 0 ecc=5\\ngpu 1\\n")
        ecc = nv.nvmlDeviceGetTotalEccErrors(h0, 1, 0)
        alive = th.is_alive()
        write_state("xid 1 119\\n", "append")
        th.join(2)
        out(per_call_us=per_call_us, ecc=ecc, alive=alive, xid=got.get("xid"),
            done=not th.is_alive())
        """,
        state,
    )
    print(f"\nquery cost while another thread waits: {res['per_call_us']:.1f} us/call")
    assert res["per_call_us"] < 500
    assert res["ecc"] == 5
    assert res["alive"], "the waiter must still be blocked before the Xid is written"
    assert res["xid"] == 119
    assert res["done"]


# --------------------------------------------------------------------------
# What nvml.h documents beyond the basics: injected per-call errors, ECC
# switched off, no row remapping, the recovery action, MIG instance ids.
# --------------------------------------------------------------------------


# Cases as INIT's, run by test_the_fake_answers_as_its_state_file_says.
DOCUMENTED = [
    pytest.param(
        """\
        gpu 0
        gpu 1
        fail nvmlDeviceGetUUID UNKNOWN gpu=1 count=2
        fail nvmlDeviceGetHandleByIndex NO_PERMISSION gpu=0 count=1
        fail nvmlSystemGetDriverVersion UNKNOWN count=1
        fail nvmlDeviceGetCount TIMEOUT count=1
        fail nvmlEventSetCreate MEMORY count=1
        fail nvmlDeviceGetFieldValues RESET_REQUIRED gpu=0
        """,
        """
        nv.nvmlInit()
        h1 = nv.nvmlDeviceGetHandleByIndex(1)
        uuid = [err(nv.nvmlDeviceGetUUID, h1) for _ in range(3)]
        handle = [err(nv.nvmlDeviceGetHandleByIndex, 0) for _ in range(2)]
        driver = [err(nv.nvmlSystemGetDriverVersion) for _ in range(2)]
        count = [err(nv.nvmlDeviceGetCount) for _ in range(2)]
        create = [err(nv.nvmlEventSetCreate) for _ in range(2)]
        h0 = nv.nvmlDeviceGetHandleByIndex(0)
        fields = [err(nv.nvmlDeviceGetFieldValues, h, [230]) for h in (h0, h1)]
        # A rewrite that keeps the rule keeps its progress: no new UUID failure.
        write_state(read_state() + "# touched\\n")
        again = err(nv.nvmlDeviceGetUUID, h1)
        out(uuid=uuid, handle=handle, driver=driver, count=count, create=create, fields=fields, again=again)
        """,
        {
            "uuid": ["NVMLError_Unknown", "NVMLError_Unknown", None],
            "handle": ["NVMLError_NoPermission", None],
            "driver": ["NVMLError_Unknown", None],
            "count": ["NVMLError_Timeout", None],
            "create": ["NVMLError_Memory", None],
            "fields": ["NVMLError_ResetRequired", None],
            "again": None,
        },
        id="fail lines inject an error into one call for a count of calls",
    ),
    # nvml.h: after NVML_ERROR_UNKNOWN from nvmlDeviceRegisterEvents the set is undefined, free it.
    pytest.param(
        "gpu 0\nfail nvmlDeviceRegisterEvents UNKNOWN count=1\n",
        """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        bad = nv.nvmlEventSetCreate()
        first = err(nv.nvmlDeviceRegisterEvents, h, XID, bad)
        retry_same = err(nv.nvmlDeviceRegisterEvents, h, XID, bad)
        good = nv.nvmlEventSetCreate()
        fresh = err(nv.nvmlDeviceRegisterEvents, h, XID, good)
        write_state("xid 0 79\\n", "append")
        out(first=first, retry_same=retry_same, fresh=fresh,
            bad_wait=err(nv.nvmlEventSetWait_v2, bad, 100),
            good_wait=nv.nvmlEventSetWait_v2(good, 1000).eventData)
        """,
        {
            "first": "NVMLError_Unknown",
            "retry_same": None,
            "fresh": None,
            "bad_wait": "NVMLError_Unknown",
            "good_wait": 79,
        },
        id="a registration that fails Unknown leaves the set unusable",
    ),
    pytest.param(
        "gpu 0 ecc=1\ngpu 1\nhang nvmlDeviceGetTotalEccErrors gpu=0\n",
        """
        import signal
        signal.signal(signal.SIGUSR2, lambda *a: None)
        nv.nvmlInit()
        h0, h1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
        got = []
        t = threading.Thread(target=lambda: got.append(nv.nvmlDeviceGetTotalEccErrors(h0, 1, 0)), daemon=True)
        t.start()
        time.sleep(0.3)
        signal.pthread_kill(t.ident, signal.SIGUSR2)  # a signal does not end a hung call
        time.sleep(0.1)
        hung = t.is_alive()
        others = [nv.nvmlDeviceGetTotalEccErrors(h1, 1, 0), nv.nvmlDeviceGetUUID(h0), nv.nvmlDeviceGetCount()]
        write_state("gpu 0 ecc=2\\ngpu 1\\n")
        t.join(2)
        out(hung=hung, others=others, returned=not t.is_alive(), got=got)
        """,
        {
            "hung": True,
            "others": [0, "GPU-00000000-fake-0000-0000-000000000000", 2],
            "returned": True,
            "got": [2],
        },
        id="a hang line blocks that call on that GPU until it is removed",
    ),
    pytest.param(
        "gpu 0\n",
        """
        nv.nvmlInit()
        s = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(0), XID, s)
        got = []
        t = threading.Thread(target=lambda: got.append(err(nv.nvmlEventSetWait_v2, s, 200)), daemon=True)
        t.start()
        time.sleep(0.05)
        write_state("hang nvmlEventSetWait\\n", "append")
        time.sleep(0.6)
        hung = t.is_alive()
        write_state("gpu 0\\nxid 0 79\\n")
        t.join(2)
        out(hung=hung, returned=not t.is_alive(), got=got)
        """,
        {"hung": True, "returned": True, "got": [None]},
        id="a hang line stops a wait that already blocks from returning",
    ),
    pytest.param(
        "gpu 0 retired_supported=1 retired_sbe=2 retired_dbe=1 retired_pending=1\ngpu 1\n",
        """
        nv.nvmlInit()
        h0, h1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
        out(sbe=len(nv.nvmlDeviceGetRetiredPages(h0, 0)), dbe=len(nv.nvmlDeviceGetRetiredPages(h0, 1)),
            pending=nv.nvmlDeviceGetRetiredPagesPendingStatus(h0),
            other=[err(nv.nvmlDeviceGetRetiredPages, h1, 0),
                   err(nv.nvmlDeviceGetRetiredPagesPendingStatus, h1)],
            bad_cause=err(nv.nvmlDeviceGetRetiredPages, h0, 2))
        """,
        {
            "sbe": 2,
            "dbe": 1,
            "pending": 1,
            "other": ["NVMLError_NotSupported", "NVMLError_NotSupported"],
            "bad_cause": "NVMLError_InvalidArgument",
        },
        id="retired pages answer where supported and not otherwise",
    ),
    pytest.param(
        "gpu 0 ecc_enabled=0 ecc=3 remap_supported=0\n",
        """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        out(mode=list(nv.nvmlDeviceGetEccMode(h)), total=err(nv.nvmlDeviceGetTotalEccErrors, h, 1, 0),
            remap=err(nv.nvmlDeviceGetRemappedRows, h), ecc_events=nv.nvmlDeviceGetSupportedEventTypes(h) & 3)
        """,
        {
            "mode": [0, 0],
            "total": "NVMLError_NotSupported",
            "remap": "NVMLError_NotSupported",
            "ecc_events": 0,
        },
        id="ECC supported but disabled, and no row remapping",
    ),
    pytest.param(
        "gpu 0\ngpu 1 recovery_supported=0\n",
        """
        nv.nvmlInit()
        h0, h1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
        def field(h):
            v = nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])[0]
            return [v.fieldId, v.nvmlReturn, v.valueType, v.value.uiVal if v.nvmlReturn == 0 else None]
        s = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(h0, XID | 0x8000, s)
        before = field(h0)
        write_state("gpu 0 recovery_action=1\\ngpu 1 recovery_supported=0\\n")
        d = nv.nvmlEventSetWait_v2(s, 1000)
        event = [d.eventType, d.eventData, nv.nvmlDeviceGetIndex(d.device)]
        out(before=before, after=field(h0), event=event, unsupported=field(h1),
            register_unsupported=err(nv.nvmlDeviceRegisterEvents, h1, 0x8000, s))
        """,
        {
            "before": [230, 0, 1, 0],
            "after": [230, 0, 1, 1],
            "event": [0x8000, 0, 0],
            "unsupported": [230, 3, 1, None],
            "register_unsupported": "NVMLError_NotSupported",
        },
        id="the recovery action field and its event",
    ),
    pytest.param(
        "gpu 0\n",
        """
        nv.nvmlInit()
        s = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(0), XID, s)
        write_state("xid 0 13 gi=2 ci=0\\n", "append")
        d = nv.nvmlEventSetWait_v2(s, 1000)
        out(ev=[d.eventData, d.gpuInstanceId, d.computeInstanceId])
        """,
        {"ev": [13, 2, 0]},
        id="MIG Xids carry the GPU and compute instance",
    ),
]


@pytest.mark.parametrize(("gpus", "script", "expected"), [*INIT, *HEALTH, *EVENTS, *DOCUMENTED])
def test_the_fake_answers_as_its_state_file_says(
    lib_dir: Path, state: Path, gpus: str, script: str, expected: dict[str, Any]
) -> None:
    write(state, gpus)
    assert nvml(lib_dir, script, state) == expected


@pytest.mark.parametrize("error", ["GPU_IS_LOST", "UNKNOWN"])
def test_a_wait_can_be_made_to_fail_while_it_blocks(lib_dir: Path, state: Path, error: str) -> None:
    write(state, "gpu 0\n")
    res = nvml(
        lib_dir,
        f"""
        nv.nvmlInit()
        s = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(0), XID, s)
        rule = "fail nvmlEventSetWait {error} count=1\\n"
        threading.Timer(0.1, lambda: write_state(rule, "append")).start()
        t = time.monotonic()
        first = err(nv.nvmlEventSetWait_v2, s, 5000)
        took = time.monotonic() - t
        out(first=first, took=took, then=err(nv.nvmlEventSetWait_v2, s, 50))
        """,
        state,
    )
    assert res["first"] == {"GPU_IS_LOST": "NVMLError_GpuIsLost", "UNKNOWN": "NVMLError_Unknown"}[error]
    assert res["took"] < 1.0 and res["then"] == "NVMLError_Timeout"


def test_a_malformed_hang_line_is_refused(lib_dir: Path, state: Path) -> None:
    write(state, "gpu 0\nhang nvmlDeviceGetFoo\n")
    proc = run_nvml(lib_dir, "out(init=err(nv.nvmlInit))", state)
    assert results(proc) == {"init": "NVMLError_Unknown"}
    assert "expected: hang <NVML function> [gpu=<n>]" in proc.stderr


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # A prototype that differs from nvml.h by one pointer type.
        (
            "nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,",
            "nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, int *corrRows,",
        ),
        # The legacy entry point with the old struct type instead of nvml.h's.
        (
            "nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data,",
            "nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, legacy_event_data_t *data,",
        ),
        # An exported function nvml.h does not declare.
        (
            "const char *nvmlErrorString(nvmlReturn_t result)",
            "const char *nvmlErrorStrin(nvmlReturn_t result)",
        ),
    ],
)
def test_the_build_fails_when_an_entry_point_does_not_match_nvml_h(
    tmp_path: Path, old: str, new: str
) -> None:
    src = (ROOT / "tests" / "fakenvml" / "fakenvml.c").read_text()
    assert old in src
    (tmp_path / "fakenvml").mkdir()
    (tmp_path / "fakenvml" / "fakenvml.c").write_text(src.replace(old, new, 1))
    (tmp_path / "fakenvml" / "build.sh").write_bytes(BUILD_SH.read_bytes())
    inc = next((ROOT / ".venv").glob("lib/python3*/site-packages/nvidia/cu*/include"))
    proc = subprocess.run(
        ["sh", str(tmp_path / "fakenvml" / "build.sh"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={**os.environ, "NVML_INCLUDE": str(inc)},
        check=False,
    )
    assert proc.returncode != 0
    assert "error" in proc.stderr
