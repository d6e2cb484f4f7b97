"""Benchmarks of the kernel log as a second source of Xids (gpuguard/nvml/kmsg), beside the NVML path's.
Run by `make bench` through bench/run.py (`nvml_rows`); `python -m bench.kmsg_bench [SECONDS] [SAMPLES]` runs
them on their own and prints JSON.

- The reader idle on a quiet log: a KernelLogReader on a FIFO, which poll() treats as /dev/kmsg (readable
  only when a record comes: the reader sleeps in poll() between records), and on a stand-in regular file
  (read again every 0.5 s); its thread's CPU (schedstat) and wake-ups (voluntary context switches) over
  the window, per hour.
- Log Xid -> /healthz: a `gpuguard watch --backend nvml --dry-run --kernel-log FIFO` on the fake library;
  a driver record written to the FIFO, until /healthz lists the Xid; in the same agent, alternately, an Xid
  line given to the fake library (NVML's event set): the same measure as nvml_bench.xid_latency's.
- Log Xid -> taint (`taint_latency`): on a real API server (bench/cluster.py), agents not in a dry run with
  --kernel-log a FIFO; an Xid 79 through the kernel log only or through NVML only, until a watch on the node
  delivers gpuguard's taint: the same measure as k8s_bench.latency_phase's Xid -> taint. Run by bench/run.py
  in its cluster; `python -m bench.kmsg_bench taint [ROUNDS]` starts a control plane of its own and runs it.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cluster import GPUS, Cluster, cluster, tainted, untainted
from bench.k8s_bench import READY_TIMEOUT
from bench.nvml_bench import _shows, _summary, agent, gpu_lines, wait
from gpuguard.nvml.kmsg.reader import KernelLogReader
from gpuguard.nvml.kmsg.records import driver_record

FIRST_PCI_BUS = 0x3B  # the fake library's GPU 0 (tests/fakenvml)


def _thread_cpu_and_wakeups(tid: int) -> tuple[float, int]:
    task = Path(f"/proc/self/task/{tid}")
    cpu = int((task / "schedstat").read_text().split()[0]) / 1e9
    status = (task / "status").read_text().splitlines()
    switches = next(int(x.split()[1]) for x in status if x.startswith("voluntary_ctxt_switches:"))
    return cpu, switches


def reader_idle(seconds: float = 60.0) -> dict[str, dict[str, float]]:
    """The reader's thread on a quiet FIFO and a quiet stand-in file: CPU seconds and wake-ups per hour."""
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as d:
        for kind in ("fifo", "file"):
            path = Path(d) / kind
            writer = None
            if kind == "fifo":
                os.mkfifo(path)
                writer = os.open(path, os.O_RDWR)  # a writer held open, as the kernel holds /dev/kmsg's
            else:
                path.write_bytes(driver_record(1, 1.0, "0000:3b:00", 13))  # one old record to replay
            reader = KernelLogReader(str(path))
            reader.start(lambda x, at: None, after=None)
            try:
                if not reader.replayed.wait(5):
                    raise TimeoutError(f"the reader did not open the {kind}")
                assert reader._thread is not None and reader._thread.native_id is not None
                tid = reader._thread.native_id
                time.sleep(0.5)  # past the replay: its own last switch, into poll(), is not the window's
                cpu0, woke0 = _thread_cpu_and_wakeups(tid)
                time.sleep(seconds)
                cpu1, woke1 = _thread_cpu_and_wakeups(tid)
            finally:
                reader.stop()
                if writer is not None:
                    os.close(writer)
            scale = 3600.0 / seconds
            out[kind] = {
                "seconds": seconds,
                "cpu_s_per_h": (cpu1 - cpu0) * scale,
                "wakeups_per_h": (woke1 - woke0) * scale,
            }
    return out


def xid_latency(samples: int = 30, gpus: int = 8, interval: float = 3.0) -> dict[str, Any]:
    """Log Xid -> /healthz and NVML Xid -> /healthz, alternately in one agent: {"kmsg": ..., "nvml": ...}."""
    lat: dict[str, list[float]] = {"kmsg": [], "nvml": []}
    with tempfile.TemporaryDirectory() as d:
        state, fifo = Path(d) / "nvml.state", Path(d) / "kmsg"
        state.write_text(gpu_lines(gpus))
        os.mkfifo(fifo)
        writer = os.open(fifo, os.O_RDWR)
        try:
            with agent(state, "--interval", str(interval), "--kernel-log", str(fifo)) as (_, port):
                text = state.read_text()
                for i in range(2 * samples):
                    source = "kmsg" if i % 2 == 0 else "nvml"
                    code, gpu = 2000 + i, i % gpus  # unknown Xids are faults: a new reason each sample
                    time.sleep(random.uniform(0.05, 0.3))  # land at a random phase of the poll
                    t0 = time.perf_counter()
                    if source == "kmsg":
                        pci = f"0000:{FIRST_PCI_BUS + gpu:02x}:00"
                        os.write(writer, driver_record(10 + i, time.monotonic(), pci, code))
                    else:
                        text += f"xid {gpu} {code}\n"
                        state.write_text(text)
                    wait(port, _shows(f"xid-{code}:"), 10)
                    lat[source].append(time.perf_counter() - t0)
        finally:
            os.close(writer)
    return {source: _summary(values) for source, values in lat.items()}


def taint_latency(cl: Cluster, *, rounds: int = 10, interval: float = 3.0) -> dict[str, Any]:
    """Log Xid -> taint and NVML Xid -> taint, side by side: two nodes, each with an agent with --kernel-log a
    FIFO; each round one Xid 79 on each node in turn, through the kernel log on one and through NVML on the
    other (swapped every round), timed from the write to a watch on the node delivering the taint. An Xid
    is sticky until a reboot: each round reboots the nodes (a new bootID, fresh state files and FIFOs) and
    starts new agents, which recover them, as latency_phase's Xid rounds do. {"kmsg": ..., "nvml": ...}."""
    work = cl.tmp / "kmsg-taint"
    work.mkdir()
    nodes = ["kmsg-taint-0", "kmsg-taint-1"]
    cl.make_nodes(nodes)
    kubeconfigs = cl.agent_kubeconfigs(nodes)
    watches = {n: cl.watch(field_selector=f"metadata.name={n}") for n in nodes}
    lat: dict[str, list[float]] = {"kmsg": [], "nvml": []}
    for r in range(rounds):
        writers: dict[str, int] = {}
        agents = []
        sources, gpu = [("kmsg", "nvml")[(i + r) % 2] for i in range(len(nodes))], r % GPUS
        try:
            for n in nodes:
                if r:
                    cl.admin.set_boot_id(n, f"boot-{r}")
                state, fifo = work / f"{n}-{r}.state", work / f"{n}-{r}.kmsg"
                state.write_text(gpu_lines(GPUS))
                os.mkfifo(fifo)
                writers[n] = os.open(fifo, os.O_RDWR)  # held open, as the kernel holds /dev/kmsg's
                args = ("--recover-after", "1", "--budget-count-spread", "0", "--kernel-log", str(fifo))
                agents.append(cl.agent(n, kubeconfigs[n], state, interval=interval, args=args))
            for a in agents:
                a.wait_ready(READY_TIMEOUT)
            for n in nodes:
                watches[n].wait_current(n, untainted, 15)
            time.sleep(1.0)
            for a, source in zip(agents, sources, strict=True):
                time.sleep(random.uniform(0.05, 0.3))  # land at a random phase of the poll
                t0 = time.monotonic()
                if source == "kmsg":
                    pci = f"0000:{FIRST_PCI_BUS + gpu:02x}:00"
                    os.write(writers[a.node], driver_record(1, time.monotonic(), pci, 79))
                else:
                    with a.state.open("a") as f:
                        f.write(f"xid {gpu} 79\n")
                lat[source].append(watches[a.node].wait_change(a.node, tainted, after=t0, timeout=10) - t0)
        finally:
            for a in agents:
                a.stop()
            for w in writers.values():
                os.close(w)
        # The fault judged on the GPU written, by its own source: a kernel-log record of a PCI bus no GPU
        # has would be a node-level fault (kmsg.xid_unattributed) and taint the node just as fast.
        for a, source in zip(agents, sources, strict=True):
            judged = [e.get("gpu") for e in a.events("gpu.unhealthy")]
            if judged != [gpu] or a.events("kmsg.xid_unattributed"):
                raise RuntimeError(f"{a.node}: {source} Xid on GPU {gpu} judged on GPUs {judged}")
    return {source: _summary(values) for source, values in lat.items()}


def main() -> int:
    if sys.argv[1:2] == ["taint"]:
        with cluster() as cl:
            rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 10
            print(json.dumps(taint_latency(cl, rounds=rounds), indent=2))
        return 0
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    samples = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    print(json.dumps({"idle": reader_idle(seconds), "latency": xid_latency(samples)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
