"""What the repair's integration test and its `make e2e` case share: the executor's RBAC applied, a token
of its ServiceAccount bound to a pod on a node, the executor as a subprocess on the fake NVML library, and
the stand-in for `nvidia-smi --gpu-reset` (it resets the fake GPU through the fake library's state file)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import yaml
from kubernetes import utils

from gpuguard.quarantine.repair.values import ANN_REQUEST, ANN_STATE, parse_record
from harness.agentproc import ROOT, gpuguard_command, scrubbed_env
from harness.dra import DRIVER, gpu_uuid
from harness.dracluster import CLAIM_TEMPLATE, allocated_device, device_rule, dra_node, publish
from harness.kube import (
    DEPLOY,
    NAMESPACE,
    WORKLOADS,
    Admin,
    Agent,
    daemon_pod_kubeconfig,
    eventually,
    make_gpu_node,
    pod_ready,
    read_pod,
    token_kubeconfig,
)
from harness.kubelet import FakeContainer, FakeKubelet, FakePod

EXECUTOR_ACCOUNT = "gpuguard-repair"

# The stand-in for `nvidia-smi --gpu-reset -i N`: the fake GPU N reads as a reset leaves it (recovery
# action NONE, no remap pending) unless the file `<state>.noclear` exists (a reset that does not clear).
RESET_SCRIPT = r"""
import re, sys
from pathlib import Path
state, index = Path(sys.argv[1]), sys.argv[2]
Path(str(state) + ".resets").open("a").write(index + "\n")
if Path(str(state) + ".noclear").exists():
    sys.exit(0)
lines = state.read_text().splitlines()
out = []
for line in lines:
    if line.startswith(f"gpu {index} "):
        line = re.sub(r" (recovery_action|remap_pending|processes)=\d+", "", line)
    out.append(line)
tmp = state.with_suffix(".tmp")
tmp.write_text("\n".join(out) + "\n")
tmp.replace(state)
"""


def apply_repair_rbac(admin: Admin) -> None:
    """The executor's ServiceAccount and RBAC, and the agent's eviction Role it is bound to, in WORKLOADS."""
    texts = [
        (DEPLOY / "eviction" / "rbac.yaml").read_text(),
        (DEPLOY / "repair" / "rbac.yaml").read_text(),
        (DEPLOY / "repair" / "evict-rolebinding.yaml").read_text(),
    ]
    for text in texts:
        for doc in yaml.safe_load_all(text.replace("ml-serving", WORKLOADS)):
            if not doc:
                continue
            try:
                utils.create_from_dict(admin.api, doc)  # type: ignore[no-untyped-call]
            except utils.FailToCreateError as exc:
                if not all(getattr(e, "status", None) == 409 for e in exc.api_exceptions):
                    raise


def executor_token(admin: Admin, node: str) -> str:
    """A token of the executor's ServiceAccount bound to a pod of it on `node` (as its DaemonSet's are)."""
    name = f"gpuguard-repair-{node}"
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "serviceAccountName": EXECUTOR_ACCOUNT,
            "nodeName": node,
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "repair", "image": "registry.example.com/gpuguard:0.1.0"}],
        },
    }
    try:
        admin.core.create_namespaced_pod(NAMESPACE, body)
    except kubernetes.client.exceptions.ApiException as exc:
        if exc.status != 409:
            raise
    return admin.pod_token(name, EXECUTOR_ACCOUNT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def set_gpu(state: Path, index: int, **keys: object) -> None:
    """Set (or with None remove) keys of GPU `index`'s line in the fake NVML state file."""
    lines = state.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"gpu {index} "):
            new = line
            for k, v in keys.items():
                new = re.sub(rf" {k}=\S+", "", new) + (f" {k}={v}" if v is not None else "")
            lines[i] = new
    tmp = state.with_suffix(".set")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(state)


class Executor:
    """`gpuguard repair-executor` as a subprocess; `lines`: its JSON log lines."""

    def __init__(
        self, *, node: str, kubeconfig: Path, state: Path, lib: Path, sock: str, mode: str = "on"
    ) -> None:
        self.kw: dict[str, Any] = {"node": node, "kubeconfig": kubeconfig, "state": state, "lib": lib}
        self.kw |= {"sock": sock, "mode": mode}
        script = state.parent / "reset.py"
        script.write_text(RESET_SCRIPT)
        self.sentinel = state.parent / "reboot" / "reboot-required"
        self.sentinel.parent.mkdir(exist_ok=True)
        self.args = [
            *("repair-executor", "--node", node, "--repair", mode, "--kubeconfig", str(kubeconfig)),
            *("--pod-resources-socket", sock, "--reboot-sentinel", str(self.sentinel)),
            *("--reset-command", f"{sys.executable} {script} {state} {{index}}"),
            *("--poll", "0.3", "--idle-gap", "0.5", "--proof-timeout", "10", "--drain-timeout", "120"),
            *("--log-format", "json", "--metrics-port", str(free_port())),
        ]
        self.env = {"LD_LIBRARY_PATH": str(lib), "FAKE_NVML_STATE": str(state)}
        self.lines: list[dict[str, Any]] = []
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> Executor:
        self.proc = subprocess.Popen(
            [*gpuguard_command(), *self.args],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=scrubbed_env(self.env),
            cwd=ROOT,
        )
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                self.lines.append(json.loads(line))
            except json.JSONDecodeError:
                self.lines.append({"event": "non-json", "line": line.rstrip()})

    def metrics(self) -> str:
        port = self.args[self.args.index("--metrics-port") + 1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.lines if e.get("event") == name]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        errors = [e for e in self.lines if e.get("event") == "repair.tick_error" or "exception" in e]
        assert not errors, errors


# -- the scene: 8 pods on the 8 DRA GPUs of a node, the agent, the executor, a spare node ------------------


@dataclass
class Scene:
    admin: Admin
    node: str
    spare: str
    app: str
    state: Path
    uids: dict[str, str]  # pod name -> UID, the eight first placed
    by_device: dict[str, str]  # device -> pod name
    agent: Any
    executor: Executor
    work: Path
    stop: threading.Event = field(default_factory=threading.Event)

    def pods(self) -> list[dict[str, Any]]:
        resp = self.admin.core.list_namespaced_pod(
            WORKLOADS, label_selector=f"app={self.app}", _preload_content=False
        )
        return json.loads(resp.data)["items"]  # type: ignore[no-any-return]

    def phase(self, index: int) -> str | None:
        ann = self.admin.node(self.node)["metadata"].get("annotations") or {}
        entry = parse_record(ann.get(ANN_STATE)).get(gpu_uuid(self.node, index))
        return None if entry is None else entry.phase

    def rule(self, index: int) -> dict[str, Any] | None:
        return device_rule(self.admin, f"gpuguard.{self.node}.gpu-{index}")

    def restart_executor(self, mode: str) -> None:
        self.executor.stop()
        self.executor = Executor(**{**self.executor.kw, "mode": mode}).start()


def _deployment(app: str, pool: str, replicas: int) -> dict[str, Any]:
    spec = {
        "nodeSelector": {"repair-test": pool},
        "terminationGracePeriodSeconds": 1,
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": CLAIM_TEMPLATE}],
        "containers": [
            {"name": "server", "image": "registry.example/llm:1", "resources": {"claims": [{"name": "gpu"}]}}
        ],
    }
    return {
        "metadata": {"name": app},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": app}},
            "template": {"metadata": {"labels": {"app": app}}, "spec": spec},
        },
    }


@contextmanager
def scene(admin: Admin, cluster: Any, *, lib: Path, work: Path, sock: str) -> Iterator[Scene]:
    """Eight replicas Ready on the eight GPUs of a DRA node (each GPU's pod a process on it), a spare node
    for the replacement, a fake kubelet that forgets an evicted pod (and its process ends), the agent with
    --repair on and the executor on; all stopped at the end."""
    pool = f"r{time.monotonic_ns() % 10**9}"
    app = f"llm-{pool}"
    node, ds_pod, gpus = dra_node(admin)
    admin.patch_node(node, {"metadata": {"labels": {"repair-test": pool}}})
    apps: Any = kubernetes.client.AppsV1Api(admin.api)
    apps.create_namespaced_deployment(WORKLOADS, _deployment(app, pool, 8))

    def eight_ready() -> list[dict[str, Any]] | None:
        resp = admin.core.list_namespaced_pod(WORKLOADS, label_selector=f"app={app}", _preload_content=False)
        running = [p for p in json.loads(resp.data)["items"] if pod_ready(p)]
        return running if len(running) == 8 else None

    first = eventually(eight_ready, 120, interval=0.3, what="8 replicas Ready")
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in first}
    devices = {n: eventually(lambda n=n: allocated_device(admin, n), 20, what=f"{n}'s GPU") for n in uids}  # type: ignore[misc]
    assert sorted(devices.values()) == [f"gpu-{i}" for i in range(8)]
    spare = make_gpu_node(admin)  # somewhere for a replacement to go, once the eight are placed
    publish(admin, spare)
    admin.patch_node(spare, {"metadata": {"labels": {"repair-test": pool}}})
    state = work / "gpus.state"
    state.write_text(gpus)
    for i in range(8):
        set_gpu(state, i, processes=1)
    table = [
        FakePod(WORKLOADS, n, [FakeContainer("server", claims=[(DRIVER, node, d)])])
        for n, d in devices.items()
    ]
    agent_config = daemon_pod_kubeconfig(admin, cluster, ds_pod, work)
    executor_config = token_kubeconfig(
        work / "executor.kubeconfig",
        server=cluster.url,
        ca_path=cluster.ca_path,
        token=executor_token(admin, node),
    )
    args = ("--repair", "on", "--max-quarantined", "100%", "--node-resync", "1")
    with FakeKubelet(sock, pods=table) as kubelet:
        stop = threading.Event()

        def kubelet_follows() -> None:
            while not stop.is_set():
                for name, device in devices.items():
                    pod = read_pod(admin, name)
                    gone = pod is None or pod["metadata"].get("deletionTimestamp")
                    if gone and any(p.name == name for p in kubelet.pods):
                        kubelet.remove(WORKLOADS, name)
                        set_gpu(state, int(device.split("-")[1]), processes=None)
                stop.wait(0.2)

        threading.Thread(target=kubelet_follows, daemon=True).start()
        agent = Agent(node=node, kubeconfig=agent_config, state=state, lib=lib, args=args).start()
        executor = Executor(node=node, kubeconfig=executor_config, state=state, lib=lib, sock=sock).start()
        s = Scene(
            admin,
            node,
            spare,
            app,
            state,
            uids,
            {d: n for n, d in devices.items()},
            agent,
            executor,
            work,
            stop,
        )
        try:
            eventually(agent.ready, 20, what="agent /readyz")
            yield s
        finally:
            stop.set()
            s.executor.stop()
            agent.stop()
            apps.delete_namespaced_deployment(app, WORKLOADS)


@dataclass(frozen=True)
class Timings:
    """Seconds from the fault (GPU_RESET written to the fake driver) to each step."""

    rule: float
    requested: float
    proven: float
    back: float  # the GPU's DeviceTaintRule gone: back in the ResourceSlice's schedulable set
    replaced: float  # the evicted pod's replacement Ready on the spare node
    request: str = ""  # the agent's request, as written


def reset_gpu_3(s: Scene) -> Timings:
    """GPU_RESET on GPU 3, then each step timed until it is back in service and its pod replaced."""
    replaced_at: list[float] = []

    def watch_replacement() -> None:  # timed on its own: it may come before the GPU is back, or after
        while not s.stop.is_set() and not replaced_at:
            if any(p["metadata"]["name"] not in s.uids and pod_ready(p) for p in s.pods()):
                replaced_at.append(time.monotonic())
            s.stop.wait(0.1)

    t0 = time.monotonic()
    threading.Thread(target=watch_replacement, daemon=True).start()
    set_gpu(s.state, 3, recovery_action=1)
    eventually(lambda: s.rule(3), 20, interval=0.02, what="GPU 3's DeviceTaintRule")
    rule = time.monotonic() - t0
    request = eventually(
        lambda: (s.admin.node(s.node)["metadata"].get("annotations") or {}).get(ANN_REQUEST),
        20,
        interval=0.02,
        what="the agent's repair request",
    )
    requested = time.monotonic() - t0
    eventually(lambda: s.phase(3) == "proven", 120, interval=0.05, what="GPU 3 proven")
    proven = time.monotonic() - t0
    eventually(lambda: s.rule(3) is None, 30, interval=0.05, what="GPU 3 let go")
    back = time.monotonic() - t0

    eventually(lambda: replaced_at, 90, interval=0.1, what="the replacement Ready")
    return Timings(rule, requested, proven, back, replaced_at[0] - t0, str(request))
