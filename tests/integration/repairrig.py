"""What the repair's integration test and its `make e2e` case share: the executor's RBAC applied, a token
of its ServiceAccount bound to a pod on a node, the executor as a subprocess on the fake NVML library, and
the stand-in for `nvidia-smi --gpu-reset` (it resets the fake GPU through the fake library's state file)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import kubernetes
import yaml
from kubernetes import utils

from harness.agentproc import ROOT, gpuguard_command, scrubbed_env
from harness.kube import DEPLOY, NAMESPACE, WORKLOADS, Admin

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
    pod = json.loads(admin.core.read_namespaced_pod(name, NAMESPACE, _preload_content=False).data)
    req = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {
            "expirationSeconds": 3600,
            "boundObjectRef": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": name,
                "uid": pod["metadata"]["uid"],
            },
        },
    }
    resp = admin.core.create_namespaced_service_account_token(
        EXECUTOR_ACCOUNT, NAMESPACE, req, _preload_content=False
    )
    return str(json.loads(resp.data)["status"]["token"])


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
        script = state.parent / "reset.py"
        script.write_text(RESET_SCRIPT)
        self.sentinel = state.parent / "reboot" / "reboot-required"
        self.sentinel.parent.mkdir(exist_ok=True)
        self.args = [
            *("repair-executor", "--node", node, "--repair", mode, "--kubeconfig", str(kubeconfig)),
            *("--pod-resources-socket", sock, "--reboot-sentinel", str(self.sentinel)),
            *("--reset-command", f"{sys.executable} {script} {state} {{index}}"),
            *("--poll", "0.3", "--idle-gap", "0.5", "--proof-timeout", "10", "--drain-timeout", "120"),
            *("--log-format", "json"),
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
