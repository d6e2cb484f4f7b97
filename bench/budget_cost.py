"""What keeping the quarantine budget off the fault's path costs the API server (issue 15, point 1).

The design (gpuguard/quarantine/node/budgetwatch.py): every agent holds one metadata-only watch of the nodes
labelled gpuguard.io/quarantined=true, and lists the GPU nodes' metadata in the background (at most about
once a second fleet-wide). The alternative it replaced: one metadata list of every GPU node in each fault's
path (and one more for the order check). Measured here, on a real kube-apiserver with a fleet of GPU nodes:

- held watches: the API server's RSS and idle CPU with 0..N watches open (the agents' selector, their
  Accept header, one TLS connection each, as N agents would hold them);
- fan-out: the API server's CPU while the fleet's nodes change (a kubelet's status updates: every watcher's
  selector is evaluated against every node event, matching or not) and while quarantines come and go
  (matching: an event written to every watcher), with 0 and with N watches;
- the lists: the API server's CPU and wall time of one metadata list of the whole GPU fleet.

`python -m bench.budget_cost` runs it on its own control plane (about 3 minutes); bench/run.py calls
`budget_cost_phase` on the bench's cluster, and `python -m bench.fleet_scale --watch-cost` with as many
watches as nodes (5,000 measured, docs/design.md). Extrapolated to 5,000 agents in `extrapolate`, linearly
in the number of watches and of events (the API server's watch cache does one filter per watcher per event).
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import ssl
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlparse

from bench.cluster import Cluster, proc_cpu_seconds, proc_status_mb, progress

ROOT = Path(__file__).resolve().parents[1]

SELECTOR = "gpuguard.io/quarantined=true,nvidia.com/gpu.present=true"
_METADATA = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
_METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


class HeldWatches:
    """N watches as N agents hold them (one TLS connection each), opened and drained by a child process (so
    that reading thousands of streams does not starve this process's own writers of the interpreter)."""

    def __init__(self, cl: Cluster, token: str) -> None:
        import subprocess

        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench.budget_cost", "--hold", cl.cp.url, str(cl.cp.ca_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(token + "\n")
        self._proc.stdin.flush()
        self.held = 0
        self.bytes = 0

    def grow(self, total: int) -> None:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(f"{total}\n")
        self._proc.stdin.flush()
        reply = self._proc.stdout.readline().split()
        if not reply or reply[0] != "ok":
            raise RuntimeError(f"watch holder: {reply}")
        self.held, self.bytes = int(reply[1]), int(reply[2])

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(5)


def _hold(url_text: str, ca: str) -> None:
    """The child: reads the token, then target numbers of watches on stdin; answers "ok <held> <bytes>"."""
    url = urlparse(url_text)
    host, port = url.hostname or "127.0.0.1", url.port or 443
    ctx = ssl.create_default_context(cafile=ca)
    # Raw stdin, lines split here: a buffered reader would keep a line that select() then never reports.
    pending = b""
    while b"\n" not in pending:
        pending += os.read(0, 4096)
    first, pending = pending.split(b"\n", 1)
    token = first.decode().strip()
    query = urlencode(
        {"watch": "1", "labelSelector": SELECTOR, "allowWatchBookmarks": "true", "timeoutSeconds": "3600"}
    )
    request = (
        f"GET /api/v1/nodes?{query} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n"
        f"Accept: {_METADATA}\r\nUser-Agent: gpuguard-bench/watch\r\n\r\n"
    ).encode()

    def open_one(_: int) -> ssl.SSLSocket:
        s = ctx.wrap_socket(socket.create_connection((host, port)), server_hostname=host)
        s.sendall(request)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                raise RuntimeError("watch closed before its headers")
            head += chunk
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"watch refused: {head[:200]!r}")
        s.setblocking(False)
        return s

    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ, data="commands")
    held = 0
    received = 0
    while True:
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            want = int(line)
            with ThreadPoolExecutor(8) as pool:
                for s in pool.map(open_one, range(want - held)):
                    sel.register(s, selectors.EVENT_READ)
                    held += 1
            print(f"ok {held} {received}", flush=True)
        for key, _ in sel.select():
            if key.data == "commands":
                chunk = os.read(0, 4096)
                if not chunk:
                    return
                pending += chunk
                continue
            try:
                data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                received += len(data)
                if not data:
                    sel.unregister(key.fileobj)
                    held -= 1
            except (ssl.SSLWantReadError, BlockingIOError):
                pass
            except OSError:
                sel.unregister(key.fileobj)
                held -= 1


def _apiserver_pid(cl: Cluster) -> int:
    state = cl.cp.state
    assert state is not None and state.apiserver_pid is not None
    return int(state.apiserver_pid)


def _heap_mb(cl: Cluster) -> float:
    """The API server's Go heap in use (its /metrics): memory without the garbage RSS still holds."""
    _, body = cl.cp.get("/metrics")
    for line in body.splitlines():
        if line.startswith("go_memstats_heap_inuse_bytes "):
            return float(line.split()[1]) / 2**20
    return float("nan")


def _cpu_rate(pid: int, seconds: float, work: Any = None) -> float:
    """The API server's CPU (cores) over `seconds`, while `work(stop)` runs in a thread if given."""
    stop = threading.Event()
    t = threading.Thread(target=work, args=(stop,), daemon=True) if work else None
    c0, w0 = proc_cpu_seconds(pid), time.monotonic()
    if t:
        t.start()
    time.sleep(seconds)
    stop.set()
    if t:
        t.join(10)
    return (proc_cpu_seconds(pid) - c0) / (time.monotonic() - w0)


def budget_cost_phase(
    cl: Cluster, fleet_nodes: list[str], *, steps: tuple[int, ...] = (0, 250, 500, 1000), window: float = 15.0
) -> dict[str, Any]:
    """The measurements in the module's docstring, at each number of held watches in `steps`."""
    pid = _apiserver_pid(cl)
    token = cl.admin.agent_token(fleet_nodes[0])
    core = cl.core
    churn_nodes = fleet_nodes[:20]
    counts = {"status": 0, "quarantine": 0}

    def status_updates(stop: threading.Event) -> None:
        """Kubelet-like status updates of the fleet's nodes, 20 a second (round robin)."""
        i = 0
        while not stop.is_set():
            name = fleet_nodes[i % len(fleet_nodes)]
            body = {"status": {"nodeInfo": {"kernelVersion": f"bench-{i}"}}}
            core.patch_node_status(name, body, _preload_content=False)
            counts["status"] += 1
            i += 1
            stop.wait(0.05)

    def quarantines(stop: threading.Event) -> None:
        """Quarantines that come and go on 20 nodes, 10 label changes a second (each reaches every watch)."""
        i = 0
        while not stop.is_set():
            name = churn_nodes[i % len(churn_nodes)]
            on = (i // len(churn_nodes)) % 2 == 0
            body = {"metadata": {"labels": {"gpuguard.io/quarantined": "true" if on else None}}}
            core.patch_node(name, body, _content_type="application/merge-patch+json", _preload_content=False)
            counts["quarantine"] += 1
            i += 1
            stop.wait(0.1)

    held = HeldWatches(cl, token)
    rows: list[dict[str, Any]] = []
    try:
        for n in steps:
            progress(f"budget cost: {n} watches held")
            c0, w0 = proc_cpu_seconds(pid), time.monotonic()
            opened = n - held.held
            held.grow(n)
            open_cpu = proc_cpu_seconds(pid) - c0
            open_s = time.monotonic() - w0
            time.sleep(5)
            rss = proc_status_mb(pid, "VmRSS")
            idle = _cpu_rate(pid, window)
            counts["status"] = 0
            status = _cpu_rate(pid, window, status_updates)
            status_n = counts["status"]
            counts["quarantine"] = 0
            quar = _cpu_rate(pid, window, quarantines)
            quar_n = counts["quarantine"]
            rows.append(
                {
                    "watches": n,
                    "open_ms_per_watch": open_cpu / max(opened, 1) * 1000,
                    "open_s": open_s,
                    "rss_mb": rss,
                    "idle_cores": idle,
                    "status_cores": status,
                    "status_events_per_s": status_n / window,
                    "quarantine_cores": quar,
                    "quarantine_events_per_s": quar_n / window,
                    "heap_inuse_mb": _heap_mb(cl),
                }
            )
            progress(f"budget cost: {rows[-1]}")
        held.grow(held.held)
        watch_bytes = held.bytes
    finally:
        held.close()
    for name in churn_nodes:
        core.patch_node(
            name,
            {"metadata": {"labels": {"gpuguard.io/quarantined": None}}},
            _content_type="application/merge-patch+json",
            _preload_content=False,
        )
    lists = _list_cost(cl, pid, token)
    return {"rows": rows, "watch_bytes": watch_bytes, "list": lists, "gpu_nodes": len(fleet_nodes)}


def _list_cost(cl: Cluster, pid: int, token: str, n: int = 20) -> dict[str, float]:
    """One metadata list of every GPU node (the count; before issue 15, every fault's budget list), by a
    keep-alive client with the agents' token: the API server's CPU per list, the wall time with decoding."""
    import http.client

    url = urlparse(cl.cp.url)
    ctx = ssl.create_default_context(cafile=str(cl.cp.ca_path))
    conn = http.client.HTTPSConnection(url.hostname or "127.0.0.1", url.port, context=ctx, timeout=30)
    headers = {
        "Authorization": f"Bearer {token}",
        "Accept": _METADATA_LIST,
        "User-Agent": "gpuguard-bench/list",
    }
    query = urlencode({"labelSelector": "nvidia.com/gpu.present=true"})
    walls = []
    size = 0
    try:
        c0 = proc_cpu_seconds(pid)
        for _ in range(n):
            t0 = time.monotonic()
            conn.request("GET", f"/api/v1/nodes?{query}", headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            json.loads(data)
            walls.append(time.monotonic() - t0)
            size = len(data)
        cpu = (proc_cpu_seconds(pid) - c0) / n
    finally:
        conn.close()
    walls.sort()
    return {"server_cpu_ms": cpu * 1000, "wall_ms_p50": walls[len(walls) // 2] * 1000, "bytes": size}


def extrapolate(raw: dict[str, Any], *, agents: int = 5000) -> dict[str, float]:
    """Linear in watches (memory, per-event filtering) and in fleet size (a list's cost)."""
    rows = raw["rows"]
    first, last = rows[0], rows[-1]
    dw = last["watches"] - first["watches"]
    rss_per_watch = (last["rss_mb"] - first["rss_mb"]) / dw
    idle_per_watch = (last["idle_cores"] - first["idle_cores"]) / dw
    # Cores per (event x watcher): the difference the watches make, per event and per watch.
    status_per = (
        max(0.0, last["status_cores"] - first["status_cores"]) / dw / max(last["status_events_per_s"], 1e-9)
    )
    quar_per = (
        max(0.0, last["quarantine_cores"] - first["quarantine_cores"])
        / dw
        / max(last["quarantine_events_per_s"], 1e-9)
    )
    scale = agents / raw["gpu_nodes"]
    # 5,000 nodes whose kubelets update their status once a minute (NodeLease on; status on change, at least
    # every 5 minutes: one a minute is generous); quarantines: a 10% burst of 500 nodes within a minute.
    node_events = agents / 60.0
    return {
        "rss_per_watch_kb": rss_per_watch * 1024,
        "rss_mb": rss_per_watch * agents,
        "idle_cores": max(0.0, idle_per_watch * agents),
        "status_filter_us": status_per * 1e6,
        "status_cores": status_per * node_events * agents,
        "quarantine_event_us": quar_per * 1e6,
        "burst_cores": quar_per * (agents * 0.1 / 60.0) * agents,
        "rewatch_per_s": agents / 300.0,
        "count_list_cpu_ms": raw["list"]["server_cpu_ms"] * scale,
        "count_cores": raw["list"]["server_cpu_ms"]
        * scale
        / 1000
        * 1.0,  # about one list a second fleet-wide
        "old_burst_list_core_s": raw["list"]["server_cpu_ms"] * scale / 1000 * 2 * agents * 0.1,
    }


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--hold":
        _hold(sys.argv[2], sys.argv[3])
        return 0
    from bench.cluster import cluster

    with cluster() as cl:
        names = [f"cost-{i}" for i in range(1000)]
        progress("budget cost: 1,000 GPU nodes")
        cl.make_nodes(names)
        raw = budget_cost_phase(cl, names)
    raw["at_5000"] = extrapolate(raw)
    print(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
