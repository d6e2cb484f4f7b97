"""Benchmarks of the production NVML path: the real `gpuguard watch --backend nvml` process, pynvml
and the fake libnvidia-ml.so.1 (tests/fakenvml).
Run by `make bench` through bench/run.py; prints nothing itself.

- Xid -> /healthz: an Xid line appended to the fake library's state file, until /healthz lists it.
- ECC -> /healthz: the ECC counter set, until /healthz turns unhealthy (a double-bit ECC event wakes the
  agent, as an Xid does).
- CPU per check: backend.snapshot() + policy.evaluate() in one process, for N GPUs.
- RSS of the agent after it ran.
- The idle floor (IdleFloor): a bare interpreter that imports the libraries the agent imports and does the
  same NVML reads at the same interval, nothing else; an idle agent's CPU, wake-ups and RSS are measured
  beside it over the same window. `python -m bench.nvml_bench idle [SECONDS]` runs it on its own against a
  dry-run agent (no API server).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from harness.agentproc import WatchProcess, healthz

ROOT = Path(__file__).resolve().parents[1]
LIB_DIR = ROOT / "build" / "fakenvml"


def env_for(state: Path) -> dict[str, str]:
    return {"LD_LIBRARY_PATH": str(LIB_DIR), "FAKE_NVML_STATE": str(state)}


# Every health signal read (issue 29): an HGX GPU's 18 NVLinks and its fabric, on top of what every fake GPU
# answers (the PCIe link, the clock event reasons, the InfoROM, the PCIe replay counter).
ALL_SIGNALS = " nvlink_links=18 fabric_state=3 fabric_health=170"


def gpu_lines(n: int, ecc: dict[int, int] | None = None, *, signals: str = "") -> str:
    ecc = ecc or {}
    return "".join(f"gpu {i} uuid=GPU-bench-{i:03d} ecc={ecc.get(i, 0)}{signals}\n" for i in range(n))


@contextmanager
def agent(state: Path, *args: str) -> Iterator[tuple[WatchProcess, int]]:
    p = WatchProcess("--backend", "nvml", "--dry-run", *args, env=env_for(state), max_lines=1000).start()
    try:
        port = p.wait_listening()
        wait(port, lambda d: d["last_check"] is not None, 10)
        yield p, port
    finally:
        p.stop()


def wait(port: int, pred: Callable[[dict[str, Any]], bool], timeout: float) -> float:
    """Seconds until pred(/healthz) holds, polling every millisecond or so."""
    start = time.perf_counter()
    while True:
        if pred(healthz(port)):
            return time.perf_counter() - start
        if time.perf_counter() - start > timeout:
            raise TimeoutError("condition not met")
        time.sleep(0.001)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def xid_latency(samples: int = 60, gpus: int = 8, interval: float = 3.0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        state = Path(d) / "nvml.state"
        state.write_text(gpu_lines(gpus))
        lat: list[float] = []
        with agent(state, "--interval", str(interval)) as (_, port):
            text = state.read_text()
            for i in range(samples):
                code = 1000 + i  # unknown Xids are faults; a distinct code per sample is a new reason
                gpu = i % gpus
                time.sleep(random.uniform(0.05, 0.3))  # land at a random phase of the poll
                text += f"xid {gpu} {code}\n"
                t0 = time.perf_counter()
                state.write_text(text)
                wait(port, _shows(f"xid-{code}:"), 10)
                lat.append(time.perf_counter() - t0)
    return _summary(lat)


def _shows(prefix: str) -> Callable[[dict[str, Any]], bool]:
    return lambda doc: any(r.startswith(prefix) for g in doc["gpus"] for r in g["reasons"])


def ecc_latency(samples: int = 20, gpus: int = 8, interval: float = 3.0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        state = Path(d) / "nvml.state"
        state.write_text(gpu_lines(gpus))
        lat: list[float] = []
        with agent(state, "--interval", str(interval)) as (_, port):
            for i in range(samples):
                time.sleep(random.uniform(0, interval))  # a random phase of the poll
                t0 = time.perf_counter()
                state.write_text(gpu_lines(gpus, {i % gpus: 1}))
                wait(port, lambda doc: not doc["healthy"], interval + 5)
                lat.append(time.perf_counter() - t0)
                state.write_text(gpu_lines(gpus))
                wait(port, lambda doc: doc["healthy"], interval + 5)
    return _summary(lat)


def _summary(lat: list[float]) -> dict[str, Any]:
    return {
        "n": len(lat),
        "p50_ms": percentile(lat, 50) * 1000,
        "p95_ms": percentile(lat, 95) * 1000,
        "p99_ms": percentile(lat, 99) * 1000,
        "max_ms": max(lat) * 1000,
    }


_CPU_WORKER = r"""
import json, sys, time
from gpuguard.core.config import PolicySettings
from gpuguard.nvml.real import NvmlBackend
from gpuguard.judge.policy import evaluate
b = NvmlBackend(); b.open(lambda: None)
settings = PolicySettings(); v = None
for _ in range(20):
    v = evaluate(b.snapshot(), previous=v, settings=settings)
n = int(sys.argv[1])
t0 = time.process_time(); w0 = time.perf_counter()
for _ in range(n):
    v = evaluate(b.snapshot(), previous=v, settings=settings)
cpu = time.process_time() - t0; wall = time.perf_counter() - w0
b.close()
print(json.dumps({"cpu_us": cpu / n * 1e6, "wall_us": wall / n * 1e6, "gpus": len(v.gpus),
                  "healthy": v.healthy}))
"""


def cpu_per_check(gpus: int, checks: int = 300, *, signals: str = "") -> dict[str, Any]:
    """`signals`: ALL_SIGNALS for GPUs that answer every health signal's read (NVLink, fabric)."""
    with tempfile.TemporaryDirectory() as d:
        state = Path(d) / "nvml.state"
        state.write_text(gpu_lines(gpus, signals=signals))
        r = subprocess.run(
            [sys.executable, "-c", _CPU_WORKER, str(checks)],
            capture_output=True,
            text=True,
            check=True,
            env=env_for(state),
            cwd=ROOT,
        )
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    if out["gpus"] != gpus or not out["healthy"]:
        raise RuntimeError(f"CPU bench with {gpus} GPUs read {out}: {r.stdout[-2000:]} {r.stderr[-2000:]}")
    return out


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def agent_rss(gpus: int = 8, seconds: float = 20.0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        state = Path(d) / "nvml.state"
        state.write_text(gpu_lines(gpus))
        with agent(state, "--interval", "0.05") as (p, _):
            time.sleep(seconds)
            rss = rss_mb(p.pid)
            cpu = _proc_cpu_seconds(p.pid)
    return {"rss_mb": rss, "seconds": seconds, "interval": 0.05, "cpu_s": cpu}


def _proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs)


# -- the idle floor ------------------------------------------------------------------------------------------

# The third-party modules `gpuguard watch` loads (everything in sys.modules that is neither the standard
# library nor gpuguard), printed as JSON: the floor imports exactly these.
_AGENT_LIBRARIES = r"""
import json, sys
import gpuguard.cli, gpuguard.runtime.root, gpuguard.runtime.agent, gpuguard.core.metrics
import gpuguard.runtime.server, gpuguard.store.state
import gpuguard.quarantine.reconciler, gpuguard.quarantine.node.writers, gpuguard.quarantine.node.budget
import gpuguard.nvml.real
import prometheus_client
std = sys.stdlib_module_names
print(json.dumps(sorted(m for m in sys.modules
                        if m.split(".")[0] not in std and m.split(".")[0] != "gpuguard" and m != "__main__")))
"""

# The floor: the same NVML reads as one check of NvmlBackend.snapshot() (the device count, then per GPU the
# uncorrected ECC count, the remapped rows, one field-values call: the recovery action and the health
# signals' counters, the clock event reasons; every 30 s the PCIe link, the fabric and the NVLink states;
# every 600 s the InfoROM), once per interval, nothing else. A read that answers NOT_SUPPORTED is dropped,
# as the agent drops it.
_FLOOR = r"""
import ctypes, importlib, json, sys, time
for name in json.loads(sys.argv[2]):
    try:
        importlib.import_module(name)
    except Exception:
        pass
import pynvml
pynvml.nvmlInit()
interval = float(sys.argv[1])
handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
links = {}
for h in handles:
    fv = pynvml.nvmlDeviceGetFieldValues(h, [91])[0]
    links[id(h)] = fv.value.uiVal if fv.nvmlReturn == 0 else 0
fields = {id(h): [230, 38, 52, 59, 94] if links[id(h)] else [230, 94] for h in handles}
class Fabric(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("clusterUuid", ctypes.c_ubyte * 16), ("status", ctypes.c_int),
                ("cliqueId", ctypes.c_uint), ("state", ctypes.c_uint), ("healthMask", ctypes.c_uint)]
V2 = ctypes.sizeof(Fabric) | 2 << 24
def slow(h):
    for call in (lambda: pynvml.nvmlDeviceGetCurrPcieLinkWidth(h),
                 lambda: pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h),
                 lambda: pynvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(Fabric(version=V2)))):
        try:
            call()
        except pynvml.NVMLError:
            pass
    for link in range(links[id(h)]):
        pynvml.nvmlDeviceGetNvLinkState(h, link)
print(json.dumps({"gpus": len(handles), "modules": len(sys.modules)}), flush=True)
passes = 0
while True:
    pynvml.nvmlDeviceGetCount()
    for h in handles:
        pynvml.nvmlDeviceGetUUID(h)  # a check confirms each GPU's identity before it records a reading
        pynvml.nvmlDeviceGetTotalEccErrors(
            h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
        )
        pynvml.nvmlDeviceGetRemappedRows(h)
        pynvml.nvmlDeviceGetFieldValues(h, fields[id(h)])
        pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)
        if passes % max(1, round(30 / interval)) == 0:
            slow(h)
        if passes % max(1, round(600 / interval)) == 0:
            pynvml.nvmlDeviceValidateInforom(h)
    passes += 1
    time.sleep(interval)
"""


def agent_libraries() -> list[str]:
    r = subprocess.run(
        [sys.executable, "-c", _AGENT_LIBRARIES], capture_output=True, text=True, check=True, cwd=ROOT
    )
    names: list[str] = json.loads(r.stdout.strip().splitlines()[-1])
    return names


def task_cpu_and_wakeups(pid: int) -> tuple[float, int]:
    """CPU seconds (nanosecond precision: schedstat's run time, summed over the threads) and voluntary context
    switches (a thread went to sleep: one wake-up each) of a live process."""
    cpu_ns, switches = 0, 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            cpu_ns += int((task / "schedstat").read_text().split()[0])
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    switches += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
    return cpu_ns / 1e9, switches


class IdleFloor:
    """The floor process and an idle agent (`agent_pid`), sampled together: start now, finish() at the end of
    the window. The floor reads its own fake GPUs (as many as the agent's) at the agent's interval."""

    def __init__(self, agent_pid: int, *, gpus: int = 8, interval: float = 3.0) -> None:
        self.agent_pid, self.gpus, self.interval = agent_pid, gpus, interval
        self.libraries = agent_libraries()
        self._dir = tempfile.TemporaryDirectory()
        state = Path(self._dir.name) / "floor.state"
        state.write_text(gpu_lines(gpus, signals=ALL_SIGNALS))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _FLOOR, str(interval), json.dumps(self.libraries)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env_for(state)},
            cwd=ROOT,
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        if not first:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"the floor process failed: {err}")
        self.floor_info = json.loads(first)
        time.sleep(interval)  # one read of the floor's own done before the window opens
        self.t0 = time.monotonic()
        self.agent0 = task_cpu_and_wakeups(agent_pid)
        self.floor0 = task_cpu_and_wakeups(self.proc.pid)

    def finish(self) -> dict[str, Any]:
        agent1 = task_cpu_and_wakeups(self.agent_pid)
        floor1 = task_cpu_and_wakeups(self.proc.pid)
        window = time.monotonic() - self.t0
        agent_rss, floor_rss = rss_mb(self.agent_pid), rss_mb(self.proc.pid)
        self.proc.kill()
        self.proc.wait()
        self._dir.cleanup()
        per_hour = 3600 / window
        agent_cpu = (agent1[0] - self.agent0[0]) * per_hour
        floor_cpu = (floor1[0] - self.floor0[0]) * per_hour
        return {
            "window_s": window,
            "gpus": self.gpus,
            "interval": self.interval,
            "agent_cpu_s_per_hour": agent_cpu,
            "floor_cpu_s_per_hour": floor_cpu,
            "ratio": agent_cpu / floor_cpu if floor_cpu > 0 else float("inf"),
            "agent_wakeups_per_hour": (agent1[1] - self.agent0[1]) * per_hour,
            "floor_wakeups_per_hour": (floor1[1] - self.floor0[1]) * per_hour,
            "agent_rss_mb": agent_rss,
            "floor_rss_mb": floor_rss,
            "libraries": len(self.libraries),
            "floor_modules": self.floor_info["modules"],
        }


class IdleVsFloor:
    """A dry-run agent (no API server: nothing but its own checks) and the floor, idle side by side from now
    until finish(). `make bench` runs it beside its other phases; `idle_vs_floor` on its own."""

    def __init__(self, gpus: int = 8, interval: float = 3.0) -> None:
        self._dir = tempfile.TemporaryDirectory()
        state = Path(self._dir.name) / "nvml.state"
        state.write_text(gpu_lines(gpus, signals=ALL_SIGNALS))  # every health signal read, by both
        self._agent = agent(state, "--interval", str(interval))
        p, _ = self._agent.__enter__()
        time.sleep(interval)  # past the start-up
        self.floor = IdleFloor(p.pid, gpus=gpus, interval=interval)

    def finish(self) -> dict[str, Any]:
        try:
            return self.floor.finish()
        finally:
            self._agent.__exit__(None, None, None)
            self._dir.cleanup()


def idle_vs_floor(seconds: float = 600.0, gpus: int = 8, interval: float = 3.0) -> dict[str, Any]:
    """A dry-run agent (no API server) and the floor, idle side by side for `seconds`."""
    pair = IdleVsFloor(gpus, interval)
    time.sleep(seconds)
    return pair.finish()


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "idle":
        print(json.dumps(idle_vs_floor(float(sys.argv[2]) if len(sys.argv) > 2 else 600.0), indent=1))
    else:
        raise SystemExit("usage: python -m bench.nvml_bench idle [SECONDS]")
