"""The benchmarks' cluster: a throwaway etcd + kube-apiserver (hack/testenv) with deploy/*.yaml applied, the
agent and the seed-design baseline as processes on the fake NVML library, a node watch that timestamps what
lands, and the helpers that read the API server's audit log and /proc. bench/k8s_bench.py holds the phases
that use it. Nodes are made by harness/kube.py's Admin and agents run through harness/agentproc.py,
the same harness the tests use.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from bench.nvml_bench import LIB_DIR, percentile
from harness import controlplane
from harness.agentproc import WatchProcess, gpuguard_command, scrubbed_env

ROOT = Path(__file__).resolve().parents[1]

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
        self,
        api: Any,
        *,
        field_selector: str | None = None,
        label_selector: str | None = None,
        lister: Callable[..., Any] | None = None,
        value: Callable[[dict[str, Any]], str | None] | None = None,
    ) -> None:
        """`lister` and `value`: another kind than nodes (list_node and the taint's value by default), e.g.
        DeviceTaintRules (RuleWatch); a deleted object's value is None."""
        import kubernetes

        self._list = lister or cast(Any, kubernetes.client.CoreV1Api(api)).list_node
        self._value = value or self.taint_value
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
        listed = json.loads(self._list(_preload_content=False, **self._selectors).data)
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

    def _record(self, t: float, node: dict[str, Any], *, deleted: bool = False) -> None:
        name = str(node["metadata"]["name"])
        value = None if deleted else self._value(node)
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
                self._resp = self._list(
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
                    if ev.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        self._record(t, obj, deleted=ev.get("type") == "DELETED")
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


def rule_watch(api: Any, *, label_selector: str = "app.kubernetes.io/managed-by=gpuguard") -> NodeWatch:
    """A watch on DeviceTaintRules (resource.k8s.io/v1, admin) instead of nodes: a rule's value is the device
    its selector names, None while it does not exist (`tainted`: the rule is there)."""
    import kubernetes

    custom = cast(Any, kubernetes.client.CustomObjectsApi(api))

    def lister(**kw: Any) -> Any:
        return custom.list_cluster_custom_object("resource.k8s.io", "v1", "devicetaintrules", **kw)

    def device(rule: dict[str, Any]) -> str | None:
        return str(((rule.get("spec") or {}).get("deviceSelector") or {}).get("device", ""))

    return NodeWatch(api, label_selector=label_selector, lister=lister, value=device)


def untainted(v: str | None) -> bool:
    return v is None


def tainted(v: str | None) -> bool:
    return v is not None


# -- processes -----------------------------------------------------------------------------------------------


_WATCH_FLAGS: set[str] = set()


def watch_flags() -> set[str]:
    """The flags `gpuguard watch` has in this checkout (read once from --help)."""
    if not _WATCH_FLAGS:
        out = subprocess.run(
            [*gpuguard_command(), "watch", "--help"], capture_output=True, text=True, check=True
        )
        _WATCH_FLAGS.update(w.strip(",") for w in out.stdout.split() if w.startswith("--"))
    return _WATCH_FLAGS


class AgentProc(WatchProcess):
    """`gpuguard watch --backend nvml` as a subprocess on the fake NVML library, against the API server: the
    tests' harness (harness/agentproc.py), run as the image runs it (the console script)."""

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
        self.node, self.kubeconfig, self.state, self.interval = node, kubeconfig, state, interval
        # gpuguard's own durable fault state (--state-dir, default /var/lib/gpuguard) must be one per
        # simulated node and per simulated boot: a fresh directory next to the fake NVML state file.
        self.state_dir = state_dir or state.with_suffix(f".gpuguard-{time.monotonic_ns()}")
        super().__init__(
            *("--backend", "nvml", "--node", node, "--kubeconfig", str(kubeconfig)),
            *("--interval", str(interval)),
            *(["--state-dir", str(self.state_dir)] if "--state-dir" in watch_flags() else []),
            *args,
            env={"LD_LIBRARY_PATH": str(LIB_DIR), "FAKE_NVML_STATE": str(state), **(env or {})},
            command=gpuguard_command(),
            max_lines=5000,
        )

    def start(self) -> AgentProc:
        super().start()
        return self

    def close(self) -> None:
        self.stop()

    @property
    def restored(self) -> bool:
        """The agent restored faults from its durable state at start."""
        return bool(self.events("state.restored"))


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
                env=scrubbed_env({"LD_LIBRARY_PATH": str(LIB_DIR), "FAKE_NVML_STATE": str(self.state)}),
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

        from harness.kube import Admin

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
        """Nodes made the tests' way (Admin.make_node), 16 at a time."""
        from harness.kube import GPU_NODE_LABELS

        every = {**GPU_NODE_LABELS, **(labels or {})}
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda name: self.admin.make_node(name, boot_id=boot_id, labels=every), names))

    def agent_kubeconfig(self, node: str) -> Path:
        """A kubeconfig with a token of the DaemonSet's ServiceAccount bound to a Pod on `node`."""
        from harness.kube import token_kubeconfig

        token = self.admin.agent_token(node)
        return token_kubeconfig(
            self.tmp / f"{node}.kubeconfig", server=self.cp.url, ca_path=self.cp.ca_path, token=token
        )

    def agent_kubeconfigs(self, nodes: list[str]) -> dict[str, Path]:
        with ThreadPoolExecutor(16) as pool:
            return dict(zip(nodes, pool.map(self.agent_kubeconfig, nodes), strict=True))

    def watch(self, *, field_selector: str | None = None, label_selector: str | None = None) -> NodeWatch:
        w = NodeWatch(self.api, field_selector=field_selector, label_selector=label_selector)
        self.on_close(w.close)
        return w

    def agent(self, node: str, kubeconfig: Path, state: Path, **kw: Any) -> AgentProc:
        a = AgentProc(node=node, kubeconfig=kubeconfig, state=state, **kw).start()
        self.on_close(a.close)
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


@contextlib.contextmanager
def cluster() -> Iterator[Cluster]:
    cl = Cluster()
    try:
        yield cl.start()
    finally:
        cl.close()
