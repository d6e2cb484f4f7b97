"""`make bench` against a real API server: etcd + kube-apiserver from hack/testenv, started and stopped here.

- Fault-to-taint latency: the real `gpuguard watch --backend nvml` process (fake libnvidia-ml.so.1, pynvml,
  not a dry run) as the DaemonSet's ServiceAccount; the fault is written to the fake library's state file
  and the clock stops when a watch on the node (admin, fieldSelector metadata.name=<node>) delivers the
  taint. The seed-design baseline (bench/baseline.py) is measured the same way in the same run.
- API load: the API server's audit log (user agent gpuguard/<version>), attributed per node.
- Cost on a healthy node: CPU (utime + stime from /proc) and RSS of one agent over a window after /readyz.
- Fleet: bench/fleet.py (1,000 reconcilers + writers, a fault burst, a concurrent foreign writer).
- Start-up: process start to /readyz 200; import time of gpuguard.cli.

Run by bench/run.py; prints nothing itself except progress on stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
TESTENV = ROOT / "hack" / "testenv"
for _p in (ROOT, TESTENV):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import controlplane  # noqa: E402

from bench.fleet import Fleet  # noqa: E402
from bench.nvml_bench import LIB_DIR, gpu_lines, percentile  # noqa: E402

TAINT_KEY = "gpuguard.io/gpu-unhealthy"
UA_PREFIX = "gpuguard/"
FLEET_LABEL = "gpuguard-bench/fleet"
FOREIGN_LABEL = "bench.example.com/foreign-writer"
FOREIGN_TAINT = {
    "key": "bench.example.com/foreign",
    "value": "set-during-burst",
    "effect": "PreferNoSchedule",
}
WRITE_VERBS = {"create", "update", "patch", "delete"}
GPUS = 8


def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def summary(lat: list[float]) -> dict[str, Any]:
    return {
        "n": len(lat),
        "p50_ms": percentile(lat, 50) * 1000,
        "p95_ms": percentile(lat, 95) * 1000,
        "p99_ms": percentile(lat, 99) * 1000,
        "max_ms": max(lat) * 1000,
    }


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """utime + stime per thread (tid -> seconds)."""
    out: dict[int, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def proc_status_mb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} for pid {pid}")


def audit_time(event: dict[str, Any]) -> float:
    stamp = str(event.get("requestReceivedTimestamp", ""))
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def audit_node(event: dict[str, Any]) -> str:
    """The node whose agent made the request: the node name the API server put in the Pod-bound token
    (user extra authentication.kubernetes.io/node-name), which also covers requests that name no node (a
    list); else the node the request was about (the node, or an Event named <node>.<hex>)."""
    bound = ((event.get("user") or {}).get("extra") or {}).get("authentication.kubernetes.io/node-name")
    if bound:
        return str(bound[0])
    ref = event.get("objectRef") or {}
    name = str(ref.get("name", ""))
    if ref.get("resource") == "events":
        return name.rsplit(".", 1)[0]
    return name


def audit_code(event: dict[str, Any]) -> int:
    return int((event.get("responseStatus") or {}).get("code", 0))


def audit_server_ms(event: dict[str, Any]) -> float:
    """How long the API server took: from receiving the request to completing the response."""
    end = datetime.fromisoformat(str(event["stageTimestamp"]).replace("Z", "+00:00")).timestamp()
    return (end - audit_time(event)) * 1000


def server_times(events: Iterable[dict[str, Any]]) -> dict[str, str]:
    """{"patch": "p50 3 ms, max 40 ms", ...}: the API server's own time per kind of request."""
    by: dict[str, list[float]] = defaultdict(list)
    for e in events:
        by[request_kind(e)].append(audit_server_ms(e) / 1000)
    return {
        k: f"p50 {percentile(v, 50) * 1000:.0f} ms, max {max(v) * 1000:.0f} ms" for k, v in sorted(by.items())
    }


def request_kind(e: dict[str, Any]) -> str:
    ref = e.get("objectRef") or {}
    if ref.get("resource") == "events":
        return "event"
    sub = ref.get("subresource")
    return str(e.get("verb")) + (f" {sub}" if sub else "")


def describe_requests(events: Iterable[dict[str, Any]]) -> dict[str, int]:
    """{"get 200": 3, "patch 409": 1, ...}"""
    c: Counter[str] = Counter()
    for e in events:
        c[f"{request_kind(e)} {audit_code(e)}"] += 1
    return dict(sorted(c.items()))


# -- watching nodes ------------------------------------------------------------------------------------------


class NodeWatch:
    """A Kubernetes watch on nodes (as admin): records when gpuguard's taint appears or goes on each node.

    Lists first (so the current state is known), then watches from the list's resourceVersion; every change
    of a node's taint value (None when untainted) is recorded with the CLOCK_MONOTONIC instant its watch event
    was read off the stream.
    """

    def __init__(
        self, api: Any, *, field_selector: str | None = None, label_selector: str | None = None
    ) -> None:
        import kubernetes

        self._core = cast(Any, kubernetes.client.CoreV1Api(api))
        self._selectors = {
            k: v
            for k, v in (("field_selector", field_selector), ("label_selector", label_selector))
            if v is not None
        }
        self._cond = threading.Condition()
        self.current: dict[str, str | None] = {}
        self.changes: dict[str, list[tuple[float, str | None]]] = defaultdict(list)
        self.objects: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._resp: Any = None
        listed = json.loads(self._core.list_node(_preload_content=False, **self._selectors).data)
        for item in listed["items"]:
            self._record(0.0, item)
        self._rv = str(listed["metadata"]["resourceVersion"])
        self._thread = threading.Thread(target=self._run, name="node-watch", daemon=True)
        self._thread.start()

    @staticmethod
    def taint_value(node: dict[str, Any]) -> str | None:
        for t in (node.get("spec") or {}).get("taints") or []:
            if t.get("key") == TAINT_KEY:
                return str(t.get("value", ""))
        return None

    def _record(self, t: float, node: dict[str, Any]) -> None:
        name = str(node["metadata"]["name"])
        value = self.taint_value(node)
        with self._cond:
            self.objects[name] = node
            if name not in self.current or self.current[name] != value:
                self.current[name] = value
                self.changes[name].append((t, value))
            self._cond.notify_all()

    def _run(self) -> None:
        from kubernetes.watch import watch as watch_module

        iter_resp_lines: Any = watch_module.iter_resp_lines  # untyped

        while not self._stop.is_set():
            try:
                self._resp = self._core.list_node(
                    watch=True,
                    resource_version=self._rv,
                    allow_watch_bookmarks=True,
                    timeout_seconds=3600,
                    _preload_content=False,
                    **self._selectors,
                )
                for line in iter_resp_lines(self._resp):
                    t = time.monotonic()
                    ev = json.loads(line)
                    obj = ev.get("object") or {}
                    if ev.get("type") == "ERROR":
                        raise RuntimeError(f"watch error: {obj}")
                    rv = (obj.get("metadata") or {}).get("resourceVersion")
                    if rv:
                        self._rv = str(rv)
                    if ev.get("type") in ("ADDED", "MODIFIED"):
                        self._record(t, obj)
            except Exception as exc:
                if self._stop.is_set():
                    return
                progress(f"node watch restarts after {type(exc).__name__}: {exc}")
                time.sleep(0.2)

    def close(self) -> None:
        self._stop.set()
        resp = self._resp
        if resp is not None:
            with contextlib.suppress(Exception):
                resp.shutdown()
            with contextlib.suppress(Exception):
                resp.release_conn()
        self._thread.join(2)

    def wait_change(
        self, name: str, pred: Callable[[str | None], bool], *, after: float, timeout: float
    ) -> float:
        """The instant of the first recorded change at or after `after` whose value satisfies pred."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for t, v in self.changes[name]:
                    if t >= after and pred(v):
                        return t
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"node {name}: no matching change after {timeout}s: {self.changes[name]}"
                    )
                self._cond.wait(left)

    def wait_all(
        self, names: Iterable[str], pred: Callable[[str | None], bool], *, after: float, timeout: float
    ) -> dict[str, float]:
        pending = set(names)
        seen: dict[str, float] = {}
        deadline = time.monotonic() + timeout
        with self._cond:
            while pending:
                for name in list(pending):
                    hit = next((t for t, v in self.changes[name] if t >= after and pred(v)), None)
                    if hit is not None:
                        seen[name] = hit
                        pending.discard(name)
                left = deadline - time.monotonic()
                if pending and left <= 0:
                    raise TimeoutError(
                        f"{len(pending)} nodes not matching after {timeout}s: {sorted(pending)[:5]}"
                    )
                if pending:
                    self._cond.wait(min(left, 1.0))
        return seen

    def wait_current(self, name: str, pred: Callable[[str | None], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not pred(self.current.get(name, "<absent>")):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"node {name}: current taint {self.current.get(name)!r} after {timeout}s"
                    )
                self._cond.wait(left)


def untainted(v: str | None) -> bool:
    return v is None


def tainted(v: str | None) -> bool:
    return v is not None


# -- processes -----------------------------------------------------------------------------------------------


def _child_env(state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUGUARD_", "KUBERNETES_"))}
    env.pop("KUBECONFIG", None)
    return {**env, "LD_LIBRARY_PATH": str(LIB_DIR), "FAKE_NVML_STATE": str(state)}


def gpuguard_command() -> list[str]:
    """`gpuguard` exactly as the image runs it (the console script), from this interpreter's venv."""
    script = Path(sys.executable).parent / "gpuguard"
    return [str(script)] if script.exists() else [sys.executable, "-m", "gpuguard"]


_WATCH_FLAGS: set[str] = set()


def watch_flags() -> set[str]:
    """The flags `gpuguard watch` has in this checkout (read once from --help)."""
    if not _WATCH_FLAGS:
        out = subprocess.run(
            [*gpuguard_command(), "watch", "--help"], capture_output=True, text=True, check=True
        )
        _WATCH_FLAGS.update(w.strip(",") for w in out.stdout.split() if w.startswith("--"))
    return _WATCH_FLAGS


class AgentProc:
    """`gpuguard watch --backend nvml` as a subprocess on the fake NVML library, against the API server."""

    def __init__(
        self,
        *,
        node: str,
        kubeconfig: Path,
        state: Path,
        interval: float = 3.0,
        args: tuple[str, ...] = (),
        state_dir: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.env = env or {}
        self.node, self.kubeconfig, self.state, self.interval, self.args = (
            node,
            kubeconfig,
            state,
            interval,
            args,
        )
        # gpuguard's own durable fault state (--state-dir, default /var/lib/gpuguard) must be one per
        # simulated node and per simulated boot: a fresh directory next to the fake NVML state file.
        self.state_dir = state_dir or state.with_suffix(f".gpuguard-{time.monotonic_ns()}")
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.t_start = 0.0
        self.t_listening = 0.0
        self.lines: list[dict[str, Any]] = []
        self.restored = False
        self._listening = threading.Event()

    def start(self) -> AgentProc:
        cmd = [
            *gpuguard_command(),
            "watch",
            "--backend",
            "nvml",
            "--node",
            self.node,
            "--kubeconfig",
            str(self.kubeconfig),
            "--interval",
            str(self.interval),
            "--listen",
            "127.0.0.1:0",
            "--log-format",
            "json",
            *(["--state-dir", str(self.state_dir)] if "--state-dir" in watch_flags() else []),
            *self.args,
        ]
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**_child_env(self.state), **self.env},
            cwd=ROOT,
        )
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                doc = {"event": "non-json", "line": line.rstrip()}
            if len(self.lines) < 5000:
                self.lines.append(doc)
            if doc.get("event") == "state.restored":
                self.restored = True
            if doc.get("event") == "server.listening":
                self.port = int(doc["port"])
                self.t_listening = time.monotonic()
                self._listening.set()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait_ready(self, timeout: float = 60.0) -> float:
        """The CLOCK_MONOTONIC instant /readyz first answered 200 (polled every 2 ms)."""
        deadline = time.monotonic() + timeout
        while not self._listening.wait(0.002):
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"agent for {self.node} never listened: {self.lines[-10:]}")
        url = f"http://127.0.0.1:{self.port}/readyz"
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic()
            except (urllib.error.URLError, OSError):
                pass
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"agent for {self.node} not ready after {timeout}s: {self.lines[-10:]}")
            time.sleep(0.002)

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"agent for {self.node} exited {self.proc.returncode}: {self.lines[-10:]}")

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line.get("event") == name]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class BaselineProc:
    """bench/baseline.py (the seed design's loop) as a subprocess on the fake NVML library."""

    def __init__(self, *, node: str, kubeconfig: Path, state: Path, log: Path, interval: float = 3.0) -> None:
        self.node, self.kubeconfig, self.state, self.interval, self.log = (
            node,
            kubeconfig,
            state,
            interval,
            log,
        )
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> BaselineProc:
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.baseline",
                    "--node",
                    self.node,
                    "--kubeconfig",
                    str(self.kubeconfig),
                    "--interval",
                    str(self.interval),
                ],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=_child_env(self.state),
                cwd=ROOT,
            )
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(timeout)
        if not box or "ready" not in box[0]:
            raise RuntimeError(f"baseline for {self.node} not ready: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


# -- the cluster and its phases ------------------------------------------------------------------------------


class Cluster:
    """A throwaway control plane with deploy/*.yaml applied; everything started through it is stopped by
    close(), also when a phase fails."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="gpuguard-bench-"))
        self.cp = controlplane.ControlPlane(self.tmp / "cp", allow_build=True)
        self._stoppables: list[Callable[[], None]] = []
        self.admin: Any = None
        self.api: Any = None

    def start(self) -> Cluster:
        import kubernetes

        from tests.integration.kube import Admin

        t0 = time.monotonic()
        self.cp.start()
        self.started_s = time.monotonic() - t0
        self.api = self.admin_client(pool=64)
        self.admin = Admin(self.api)
        self.admin.apply_deploy_manifests()
        self.version = str(self.cp.version().get("gitVersion", "?"))
        self.core: Any = kubernetes.client.CoreV1Api(self.api)
        progress(f"kube-apiserver {self.version} ready at {self.cp.url} in {self.started_s:.1f} s")
        return self

    def admin_client(self, pool: int = 16) -> Any:
        import kubernetes

        cfg = kubernetes.client.Configuration()
        config: Any = kubernetes.config  # its loaders are untyped
        config.load_kube_config(config_file=str(self.cp.kubeconfig_path), client_configuration=cfg)
        cfg.connection_pool_maxsize = pool
        return kubernetes.client.ApiClient(cfg)

    def on_close(self, fn: Callable[[], None]) -> None:
        self._stoppables.append(fn)

    def close(self) -> None:
        for fn in reversed(self._stoppables):
            try:
                fn()
            except Exception as exc:
                progress(f"cleanup step failed: {exc!r}")
        self._stoppables.clear()
        self.cp.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- helpers

    def make_nodes(
        self, names: list[str], *, boot_id: str | None = "boot-0", labels: dict[str, str] | None = None
    ) -> None:
        def one(name: str) -> None:
            body = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": {"nvidia.com/gpu.present": "true", **(labels or {})}},
                "spec": {"taints": [], "unschedulable": False},
            }
            self.core.create_node(body, _preload_content=False)
            if boot_id is not None:
                self.admin.set_boot_id(name, boot_id)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, names))

    def agent_kubeconfig(self, node: str) -> Path:
        """A kubeconfig with a token of the DaemonSet's ServiceAccount bound to a Pod on `node`."""
        from tests.integration.kube import token_kubeconfig

        token = self.admin.agent_token(node)
        return token_kubeconfig(
            self.tmp / f"{node}.kubeconfig", server=self.cp.url, ca_path=self.cp.ca_path, token=token
        )

    def agent_kubeconfigs(self, nodes: list[str]) -> dict[str, Path]:
        with ThreadPoolExecutor(16) as pool:
            return dict(zip(nodes, pool.map(self.agent_kubeconfig, nodes), strict=True))

    def watch(self, **selectors: str) -> NodeWatch:
        w = NodeWatch(self.api, **selectors)
        self.on_close(w.close)
        return w

    def agent(self, node: str, kubeconfig: Path, state: Path, **kw: Any) -> AgentProc:
        a = AgentProc(node=node, kubeconfig=kubeconfig, state=state, **kw).start()
        self.on_close(a.stop)
        return a

    def audit(
        self, since: int, *, start: float | None = None, end: float | None = None
    ) -> list[dict[str, Any]]:
        """gpuguard's requests (user agent gpuguard/<version>), each once (stage ResponseComplete)."""
        events = self.cp.audit_events(user_agent_prefix=UA_PREFIX, since_line=since, stage="ResponseComplete")
        return [
            e
            for e in events
            if (start is None or audit_time(e) >= start) and (end is None or audit_time(e) <= end)
        ]

    def apf_levels(self) -> dict[str, dict[str, str]]:
        """The API server's API Priority and Fairness counters per priority level (debug endpoint, admin)."""
        status, body = self.cp.get("/debug/api_priority_and_fairness/dump_priority_levels")
        if status != 200:
            return {}
        rows = [[c.strip() for c in line.split(",")] for line in body.strip().splitlines()]
        header = rows[0]
        return {r[0]: dict(zip(header, r, strict=False)) for r in rows[1:] if r and r[0]}

    def apf_seats(self) -> dict[str, int]:
        _, body = self.cp.get("/metrics")
        out: dict[str, int] = {}
        for line in body.splitlines():
            if line.startswith("apiserver_flowcontrol_nominal_limit_seats{"):
                level = line.split('priority_level="', 1)[1].split('"', 1)[0]
                out[level] = int(float(line.rsplit(" ", 1)[1]))
        return out

    def gpu_nodes(self) -> int:
        listed = self.core.list_node(label_selector="nvidia.com/gpu.present=true", _preload_content=False)
        return len(json.loads(listed.data)["items"])

    def apiserver_flags(self) -> str:
        """The max-in-flight flags the control plane passes (none: the defaults apply)."""
        args = self.cp._apiserver_args()
        return " ".join(a for a in args if "inflight" in a) or "none"


# -- item 1 (and part of 3): fault-to-taint latency ----------------------------------------------------------


def latency_phase(
    cl: Cluster,
    *,
    rounds: int = 5,
    lanes: int = 10,
    interval: float = 3.0,
    quiet: Callable[[bool], None] = lambda on: None,
) -> dict[str, Any]:
    """`rounds` x `lanes` samples of each: gpuguard Xid, gpuguard ECC, baseline Xid, baseline ECC. `quiet`
    is called with True before the gpuguard Xid rounds (milliseconds) and with False after them."""
    work = cl.tmp / "latency"
    work.mkdir()
    xid_nodes = [f"lat-xid-{i}" for i in range(lanes)]
    ecc_nodes = [f"lat-ecc-{i}" for i in range(lanes)]
    base_ecc_nodes = [f"base-ecc-{i}" for i in range(lanes)]
    base_xid_nodes = [f"base-xid-{i}" for i in range(lanes)]
    every = xid_nodes + ecc_nodes + base_ecc_nodes + base_xid_nodes
    cl.make_nodes(every)
    kubeconfigs = cl.agent_kubeconfigs(every)
    watches = {n: cl.watch(field_selector=f"metadata.name={n}") for n in every}
    since = cl.cp.audit_line_count()
    transitions: list[tuple[str, str, float, float]] = []  # kind, node, wall start, wall end
    tlock = threading.Lock()
    restored: list[str] = []

    def start_round(nodes: list[str], r: int) -> tuple[list[AgentProc], float]:
        """New agent processes after a simulated reboot (a new bootID; a fresh --state-dir, as a new boot
        discards the old one; fake NVML state files without old xid lines). They recover the nodes."""
        agents = []
        for n in nodes:
            if r:
                cl.admin.set_boot_id(n, f"boot-{r}")
            state = work / f"{n}.state"
            state.write_text(gpu_lines(GPUS))
            agents.append(
                cl.agent(n, kubeconfigs[n], state, interval=interval, args=("--recover-after", "1"))
            )
        wall = time.time()
        for a in agents:
            a.wait_ready()
        for n in nodes:
            watches[n].wait_current(n, untainted, 15)
        return agents, wall

    def end_round(
        kind: str,
        nodes: list[str],
        agents: list[AgentProc],
        *,
        r: int,
        started: float,
        injected: dict[str, float],
    ) -> None:
        time.sleep(0.5)  # the Event after the last taint
        for a in agents:
            a.stop()
            if a.restored:
                restored.append(a.node)
        end = time.time()
        with tlock:
            for n in nodes:
                if r:
                    transitions.append(
                        ("recovery at agent start (incl. its start-up requests)", n, started, injected[n])
                    )
                transitions.append((kind, n, injected[n], end))

    # Xid, gpuguard, on a quiet machine: Xids are sticky until a reboot, so each round reboots the nodes and
    # starts new agents, then one Xid per node, one node after the other.
    progress(f"latency: gpuguard Xid, {rounds} rounds x {lanes} nodes")
    xid_lat: list[float] = []
    quiet(True)
    for r in range(rounds):
        agents, started = start_round(xid_nodes, r)
        time.sleep(1.0)
        injected: dict[str, float] = {}
        for n in xid_nodes:
            time.sleep(random.uniform(0.05, 0.3))
            injected[n] = time.time()
            t0 = time.monotonic()
            with (work / f"{n}.state").open("a") as f:
                f.write(f"xid {r % GPUS} 79\n")
            xid_lat.append(watches[n].wait_change(n, tainted, after=t0, timeout=10) - t0)
        end_round("Xid -> taint", xid_nodes, agents, r=r, started=started, injected=injected)
    quiet(False)

    # ECC (gpuguard, in rounds of new agents again: the flap window would otherwise hold the quarantine), and
    # the seed baseline's ECC and Xid lanes, all at once. Every sample waits a random phase of the 3 s poll.
    progress(
        f"latency: gpuguard ECC ({rounds} rounds x {lanes} nodes), "
        f"baseline ECC and Xid ({lanes} lanes x {rounds})"
    )
    results: dict[str, list[float]] = defaultdict(list)
    errors: list[str] = []

    def inject_and_wait(kind: str, n: str, i: int) -> float:
        state = work / f"{n}.state"
        time.sleep(0.3 + random.uniform(0, interval))
        t0 = time.monotonic()
        if kind.endswith("xid"):
            with state.open("a") as f:
                f.write(f"xid {i % GPUS} 79\n")
        else:
            state.write_text(gpu_lines(GPUS, {i % GPUS: 1}))
        lat = watches[n].wait_change(n, tainted, after=t0, timeout=interval + 15) - t0
        with tlock:
            results[kind].append(lat)
        return lat

    def gpuguard_ecc() -> None:
        try:
            for r in range(rounds):
                agents, started = start_round(ecc_nodes, r)
                injected: dict[str, float] = {}

                def one(n: str, r: int = r, injected: dict[str, float] = injected) -> None:
                    injected[n] = time.time() + 0.3  # sleeps 0.3 s + a random phase before the write
                    inject_and_wait("gpuguard-ecc", n, r)

                with ThreadPoolExecutor(len(ecc_nodes)) as pool:
                    list(pool.map(one, ecc_nodes))
                end_round("ECC -> taint", ecc_nodes, agents, r=r, started=started, injected=injected)
        except Exception as exc:
            errors.append(f"gpuguard ECC: {exc!r}")

    def baseline_lane(kind: str, n: str) -> None:
        try:
            for i in range(rounds):
                watches[n].wait_current(n, untainted, interval + 15)
                inject_and_wait(kind, n, i)
                time.sleep(0.3)
                if kind.endswith("ecc"):
                    (work / f"{n}.state").write_text(gpu_lines(GPUS))
                watches[n].wait_current(n, untainted, interval + 15)
        except Exception as exc:
            errors.append(f"{kind} {n}: {exc!r}")

    baselines: list[BaselineProc] = []
    for n in base_ecc_nodes + base_xid_nodes:
        state = work / f"{n}.state"
        state.write_text(gpu_lines(GPUS))
        b = BaselineProc(
            node=n, kubeconfig=kubeconfigs[n], state=state, log=work / f"{n}.log", interval=interval
        )
        baselines.append(b.start())
        cl.on_close(b.stop)
    for b in baselines:
        b.wait_ready()
    threads = [threading.Thread(target=gpuguard_ecc, daemon=True)]
    threads += [
        threading.Thread(target=baseline_lane, args=("baseline-ecc", n), daemon=True) for n in base_ecc_nodes
    ]
    threads += [
        threading.Thread(target=baseline_lane, args=("baseline-xid", n), daemon=True) for n in base_xid_nodes
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for b in baselines:
        b.stop()
    if errors:
        raise RuntimeError("latency lanes failed: " + "; ".join(errors[:5]))
    if restored:
        raise RuntimeError(f"agents restored faults from an earlier run's --state-dir: {restored[:5]}")

    # Requests per transition, from the audit log: gpuguard's requests about the node (and its Events)
    # between the injection and the agent's stop (or between the agent's start and the injection).
    events = cl.audit(since)
    by_node: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_node[audit_node(e)].append(e)
    per_kind: dict[str, list[int]] = defaultdict(list)
    detail: dict[str, Counter[str]] = defaultdict(Counter)
    server: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for kind, n, start, end in transitions:
        inside = [e for e in by_node[n] if start <= audit_time(e) < end]
        per_kind[kind].append(len(inside))
        detail[kind].update(describe_requests(inside))
        server[kind].extend(inside)
    return {
        "lanes": lanes,
        "xid": summary(xid_lat),
        "ecc": summary(results["gpuguard-ecc"]),
        "baseline_xid": summary(results["baseline-xid"]),
        "baseline_ecc": summary(results["baseline-ecc"]),
        "transitions": {
            k: {
                "n": len(v),
                "max": max(v),
                "min": min(v),
                "mean": statistics.fmean(v),
                "requests": dict(detail[k]),
                "server": server_times(server[k]),
            }
            for k, v in per_kind.items()
        },
    }


# -- item 5: start-up ----------------------------------------------------------------------------------------


def startup_phase(cl: Cluster, runs: int = 5) -> dict[str, Any]:
    node = "startup-0"
    cl.make_nodes([node])
    kubeconfig = cl.agent_kubeconfig(node)
    state = cl.tmp / "startup.state"
    state.write_text(gpu_lines(GPUS))
    ready, listening = [], []
    for _ in range(runs):
        a = cl.agent(node, kubeconfig, state)
        t = a.wait_ready()
        ready.append(t - a.t_start)
        listening.append(a.t_listening - a.t_start)
        a.stop()
    # One more run with -X importtime (PYTHONPROFILEIMPORTTIME): where the start-up goes.
    a = cl.agent(node, kubeconfig, state, env={"PYTHONPROFILEIMPORTTIME": "1"})
    a.wait_ready()
    a.stop()
    top: list[tuple[int, str]] = []
    for doc in a.events("non-json"):
        line = str(doc.get("line", ""))
        if line.startswith("import time:") and "|" in line:
            parts = line.split("|")
            name = parts[2]
            if parts[1].strip().isdigit() and name.startswith(" ") and not name.startswith("  "):
                top.append((int(parts[1]), name.strip()))
    top.sort(reverse=True)
    return {
        "imports_top": [(name, us / 1000) for us, name in top[:5]],
        "runs": runs,
        "median_s": statistics.median(ready),
        "min_s": min(ready),
        "max_s": max(ready),
        "listening_median_s": statistics.median(listening),
    }


def import_time(runs: int = 5) -> dict[str, Any]:
    py = sys.executable
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    r = subprocess.run(
        [py, "-X", "importtime", "-c", "import gpuguard.cli"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=True,
    )
    cumulative = next(
        int(line.split("|")[1]) for line in r.stderr.splitlines() if line.rstrip().endswith("| gpuguard.cli")
    )
    r = subprocess.run(
        [py, "-X", "importtime", "-c", "import kubernetes.client"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=True,
    )
    kube = next(
        int(line.split("|")[1])
        for line in r.stderr.splitlines()
        if line.rstrip().endswith("| kubernetes.client")
    )

    def wall(code: str) -> float:
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            subprocess.run([py, "-c", code], check=True, env=env, cwd=ROOT)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    probe = subprocess.run(
        [py, "-c", "import sys, gpuguard.cli; print(int('kubernetes' in sys.modules))"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=True,
    )
    return {
        "importtime_ms": cumulative / 1000,
        "kubernetes_importtime_ms": kube / 1000,
        "wall_ms": wall("import gpuguard.cli") * 1000,
        "bare_ms": wall("pass") * 1000,
        "kubernetes_imported": probe.stdout.strip() == "1",
    }


# -- item 4: the fleet ---------------------------------------------------------------------------------------


def _foreign_writer(api: Any, names: list[str], at: float, out: dict[str, int]) -> None:
    """Admin read-modify-write with the resourceVersion precondition: adds a label and a taint to each node,
    re-reading on every 409, starting at the same instant as gpuguard's burst."""
    import kubernetes

    core: Any = kubernetes.client.CoreV1Api(api)
    lock = threading.Lock()

    def one(name: str) -> None:
        for attempt in range(50):
            node = json.loads(core.read_node(name, _preload_content=False).data)
            taints = [t for t in node["spec"].get("taints") or [] if t.get("key") != FOREIGN_TAINT["key"]]
            body = {
                "metadata": {
                    "resourceVersion": node["metadata"]["resourceVersion"],
                    "labels": {FOREIGN_LABEL: "burst"},
                },
                "spec": {"taints": [*taints, FOREIGN_TAINT]},
            }
            try:
                core.patch_node(
                    name, body, _content_type="application/merge-patch+json", _preload_content=False
                )
                with lock:
                    out["writes"] += 1
                    out["conflicts"] += attempt
                return
            except kubernetes.client.exceptions.ApiException as exc:
                if exc.status != 409:
                    raise
        raise RuntimeError(f"foreign writer gave up on {name}")

    while (left := at - time.monotonic()) > 0:
        time.sleep(min(left, 0.01))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, names))


def _check_nodes(cl: Cluster, names: list[str], faulty: set[str], *, expect_ours: bool) -> dict[str, int]:
    listed = json.loads(cl.core.list_node(label_selector=f"{FLEET_LABEL}=true", _preload_content=False).data)
    nodes = {n["metadata"]["name"]: n for n in listed["items"]}
    out = Counter[str]()
    for name in names:
        n = nodes[name]
        taints = n["spec"].get("taints") or []
        ours = any(t["key"] == TAINT_KEY for t in taints)
        if name in faulty:
            out["foreign_taint_kept"] += any(t == FOREIGN_TAINT for t in taints)
            out["foreign_label_kept"] += n["metadata"].get("labels", {}).get(FOREIGN_LABEL) == "burst"
            out["ours_as_expected"] += ours == expect_ours
        else:
            out["others_untouched"] += not ours and FOREIGN_LABEL not in n["metadata"].get("labels", {})
    return dict(out)


def fleet_phase(
    cl: Cluster, *, nodes: int = 1000, processes: int = 2, fraction: float = 0.1
) -> tuple[Fleet, dict[str, Any]]:
    """Leaves the fleet running and healthy (for the idle window); the caller stops it."""
    names = [f"fleet-{i:04d}" for i in range(nodes)]
    name_set = set(names)
    t0 = time.monotonic()
    cl.make_nodes(names, boot_id=None, labels={FLEET_LABEL: "true"})
    progress(f"fleet: {nodes} nodes created in {time.monotonic() - t0:.1f} s")
    t0 = time.monotonic()
    kubeconfigs = cl.agent_kubeconfigs(names)
    tokens_s = time.monotonic() - t0
    progress(f"fleet: {nodes} Pods and Pod-bound ServiceAccount tokens in {tokens_s:.1f} s")
    watch = cl.watch(label_selector=f"{FLEET_LABEL}=true")
    fleet = Fleet(kubeconfigs, processes=processes, workdir=cl.tmp)
    cl.on_close(fleet.stop)
    created = fleet.start()
    progress(
        f"fleet: {processes} processes x {nodes // processes} reconcilers "
        f"created in {created['seconds']:.1f} s"
    )
    apf0 = cl.apf_levels()

    # Start-up: every reconciler gets its first (healthy) verdict at the same instant and reads its node once.
    since = cl.cp.audit_line_count()
    wall0 = time.time()
    at = time.monotonic() + 0.5
    done = fleet.submit("healthy", at=at, streak=1)
    startup_s = max(d["idle_at"] for d in done) - at
    startup_reconciled = sum(d["reconciled"] for d in done)
    stats_startup = fleet.stats()
    wall1 = time.time()
    startup_events = [e for e in cl.audit(since, start=wall0, end=wall1 + 1) if audit_node(e) in name_set]
    apf1 = cl.apf_levels()
    progress(f"fleet: start-up reconcile of {nodes} nodes in {startup_s:.2f} s")

    # The burst: 10% fault at once while an admin writer adds a label and a taint to the same nodes.
    faulty = names[:: round(1 / fraction)]
    faulty_set = set(faulty)
    since = cl.cp.audit_line_count()
    wall0 = time.time()
    at = time.monotonic() + 1.0
    foreign = {"writes": 0, "conflicts": 0}
    writer = threading.Thread(target=_foreign_writer, args=(cl.api, faulty, at, foreign), daemon=True)
    writer.start()
    done = fleet.submit("ecc", names=faulty, at=at, streak=0)
    seen = watch.wait_all(faulty, tainted, after=at, timeout=120)
    all_visible_s = max(seen.values()) - at
    first_visible_s = min(seen.values()) - at
    writer.join(120)
    time.sleep(1.0)
    wall1 = time.time()
    burst_events = [e for e in cl.audit(since, start=wall0, end=wall1) if audit_node(e) in faulty_set]
    after_burst = _check_nodes(cl, names, set(faulty), expect_ours=True)
    apf2 = cl.apf_levels()
    stats_burst = _delta(fleet.stats(), stats_startup)
    progress(f"fleet: {len(faulty)} taints visible {all_visible_s:.2f} s after the burst; {after_burst}")

    # Recovery (the ECC counters read 0 again for 3 checks), then the fleet is healthy for the idle window.
    since = cl.cp.audit_line_count()
    wall0 = time.time()
    fleet.submit("healthy", names=faulty, streak=3)
    watch.wait_all(faulty, untainted, after=0.0, timeout=120)
    time.sleep(1.0)
    recovery_events = [e for e in cl.audit(since, start=wall0) if audit_node(e) in faulty_set]
    after_recovery = _check_nodes(cl, names, set(faulty), expect_ours=False)
    watch.close()

    # One more healthy verdict for every node before the idle window: whatever start-up left undone (a write
    # refused with 429 is planned again at the next verdict) happens here, so the window sees steady state.
    since = cl.cp.audit_line_count()
    wall0 = time.time()
    fleet.submit("healthy", streak=3)
    time.sleep(1.0)
    settle_events = [e for e in cl.audit(since, start=wall0) if audit_node(e) in name_set]

    writes = Counter(
        audit_node(e)
        for e in burst_events
        if e["verb"] in WRITE_VERBS
        and audit_code(e) < 400
        and (e.get("objectRef") or {}).get("resource") == "nodes"
    )
    per_node = Counter(audit_node(e) for e in burst_events)
    return fleet, {
        "nodes": nodes,
        "processes": processes,
        "faulty": len(faulty),
        "created_s": created["seconds"],
        "startup_s": startup_s,
        "startup_reconciled": startup_reconciled,
        "startup_requests": describe_requests(startup_events),
        "startup_server": server_times(startup_events),
        "startup_apf_rejected": _apf_delta(apf0, apf1, "workload-low", "RejectedRequests"),
        "burst_submit_spread_ms": max(d["submit_spread_s"] for d in done) * 1000,
        "first_visible_s": first_visible_s,
        "all_visible_s": all_visible_s,
        "burst_requests": describe_requests(burst_events),
        "burst_server": server_times(burst_events),
        "burst_apf_rejected": _apf_delta(apf1, apf2, "workload-low", "RejectedRequests"),
        "burst_node_writes_max": max(writes.values()) if writes else 0,
        "burst_node_writes_mean": statistics.fmean(writes[n] for n in faulty),
        "burst_requests_per_node_max": max(per_node.values()) if per_node else 0,
        "burst_requests_per_node_mean": statistics.fmean(per_node[n] for n in faulty),
        "reconciler_log": stats_burst["counts"],
        "reconciler_errors": stats_burst["errors"],
        "foreign": foreign,
        "after_burst": after_burst,
        "after_recovery": after_recovery,
        "recovery_requests": describe_requests(recovery_events),
        "settle_requests": describe_requests(settle_events),
        "startup_log": stats_startup["counts"],
        "apf_seats": cl.apf_seats(),
        "apf_levels": {k: apf2.get(k, {}) for k in ("workload-low", "exempt")},
    }


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    counts = {k: v - before["counts"].get(k, 0) for k, v in after["counts"].items()}
    return {"counts": counts, "errors": after["errors"]}


def _apf_delta(
    before: dict[str, dict[str, str]], after: dict[str, dict[str, str]], level: str, col: str
) -> int:
    try:
        return int(after[level][col]) - int(before[level][col])
    except (KeyError, ValueError):
        return -1


# -- items 2 and 3: the idle window --------------------------------------------------------------------------


class IdleWindow:
    """One agent (8 GPUs, --interval 3) and the whole fleet, healthy, for `seconds`; other phases may run
    meanwhile on other nodes (requests are attributed per node)."""

    def __init__(self, cl: Cluster, fleet: Fleet | None, seconds: float) -> None:
        self.cl, self.fleet, self.seconds = cl, fleet, seconds
        node = "idle-0"
        cl.make_nodes([node])
        state = cl.tmp / "idle.state"
        state.write_text(gpu_lines(GPUS))
        self.node = node
        self.agent = cl.agent(node, cl.agent_kubeconfig(node), state, interval=3.0)
        self.audit_start = cl.cp.audit_line_count()
        self.agent.wait_ready()
        self.startup_requests = describe_requests(
            e for e in cl.audit(self.audit_start) if audit_node(e) == node
        )
        self.since = cl.cp.audit_line_count()
        self.wall0 = time.time()
        self.t0 = time.monotonic()
        self.cpu0 = proc_cpu_seconds(self.agent.pid)
        self.threads0 = thread_cpu_seconds(self.agent.pid)
        self.paused_s = 0.0
        self._paused_at: float | None = None
        if fleet is not None:
            fleet.start_loop(3.0, streak=3)
        progress(f"idle window: {seconds:.0f} s from now, agent pid {self.agent.pid}")

    def quiet(self, on: bool) -> None:
        """Pause the fleet's verdict loop (it keeps about half a core busy) while a wall-clock figure of
        milliseconds is measured; its nodes stay healthy and idle meanwhile."""
        if self.fleet is None:
            return
        if on and self._paused_at is None:
            self.fleet.stop_loop()
            self._paused_at = time.monotonic()
        elif not on and self._paused_at is not None:
            self.paused_s += time.monotonic() - self._paused_at
            self._paused_at = None
            self.fleet.start_loop(3.0)

    def finish(self) -> dict[str, Any]:
        left = self.t0 + self.seconds - time.monotonic()
        if left > 0:
            progress(f"idle window: waiting {left:.0f} s more")
            time.sleep(left)
        cpu1 = proc_cpu_seconds(self.agent.pid)
        threads1 = thread_cpu_seconds(self.agent.pid)
        window = time.monotonic() - self.t0
        rss = proc_status_mb(self.agent.pid, "VmRSS")
        hwm = proc_status_mb(self.agent.pid, "VmHWM")
        wall1 = time.time()
        rounds, loop_cpu = 0, 0.0
        self.quiet(False)
        if self.fleet is not None:
            stopped = self.fleet.stop_loop()
            rounds = min(s["rounds"] for s in stopped)
            loop_cpu = sum(s["cpu_s"] for s in stopped)
        events = self.cl.audit(self.since, start=self.wall0, end=wall1)
        agent_events = [e for e in events if audit_node(e) == self.node]
        fleet_events = [e for e in events if audit_node(e).startswith("fleet-")]
        offsets = sorted(audit_time(e) - self.wall0 for e in fleet_events + agent_events)
        self.agent.stop()
        return {
            "window_s": window,
            "cpu_s": cpu1 - self.cpu0,
            "cpu_s_per_hour": (cpu1 - self.cpu0) * 3600 / window,
            # In the order the threads were created: main (the check loop), then the others.
            "thread_cpu_s": [
                round(threads1[t] - self.threads0.get(t, 0.0), 3)
                for t in sorted(threads1)
                if t in self.threads0
            ],
            "rss_mb": rss,
            "hwm_mb": hwm,
            "agent_requests": len(agent_events),
            "agent_requests_per_hour": len(agent_events) * 3600 / window,
            "agent_startup_requests": self.startup_requests,
            "fleet_requests": len(fleet_events),
            "fleet_detail": describe_requests(fleet_events),
            "request_offsets_s": [round(o, 1) for o in offsets[:5]] + [round(o, 1) for o in offsets[-5:]],
            "fleet_rounds": rounds,
            "fleet_paused_s": self.paused_s,
            "fleet_loop_cpu_s": loop_cpu,
            "fleet_cpu_us_per_verdict": loop_cpu / max(1, rounds * len(self.fleet.names)) * 1e6
            if self.fleet is not None
            else 0.0,
        }


@contextlib.contextmanager
def cluster() -> Iterator[Cluster]:
    cl = Cluster()
    try:
        yield cl.start()
    finally:
        cl.close()
