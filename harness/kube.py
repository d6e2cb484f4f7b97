"""Helpers for the integration tests: admin operations on the real API server, the agent's own identity
(a ServiceAccount token bound to a Pod on its node, never admin), and the agent as a real subprocess
(`gpuguard watch --backend nvml` through pynvml and the fake NVML library)."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import kubernetes
import yaml

from harness.agentproc import WatchProcess

utils: Any = kubernetes.utils  # untyped

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
NAMESPACE = "gpuguard"
SERVICE_ACCOUNT = "gpuguard"
TAINT_KEY = "gpuguard.io/gpu-unhealthy"
GPU_NODE_LABELS = {"nvidia.com/gpu.present": "true"}
T = TypeVar("T")


def eventually(fn: Callable[[], T | None], timeout: float, interval: float = 0.05, what: str = "") -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or fn}")
        time.sleep(interval)


class Admin:
    """Cluster-admin operations the tests do themselves (there is no kubelet or controller-manager)."""

    def __init__(self, api: kubernetes.client.ApiClient) -> None:
        self.api = api
        self.core: Any = kubernetes.client.CoreV1Api(api)
        self.apps: Any = kubernetes.client.AppsV1Api(api)

    def make_node(
        self,
        name: str,
        *,
        boot_id: str | None = "boot-1",
        taints: list[dict[str, str]] | None = None,
        unschedulable: bool = False,
        labels: dict[str, str] | None = None,
    ) -> None:
        """A Node as a kubelet would register it: labelled as a GPU node (`labels` replaces that) and with
        the bootID it reports (None: none posted yet). The one way tests and benchmarks make nodes."""
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": GPU_NODE_LABELS if labels is None else labels},
            "spec": {"taints": taints or [], "unschedulable": unschedulable},
        }
        self.core.create_node(body, _preload_content=False)
        if boot_id is not None:
            self.set_boot_id(name, boot_id)

    def set_boot_id(self, name: str, boot_id: str) -> None:
        self.core.patch_node_status(
            name, {"status": {"nodeInfo": {"bootID": boot_id}}}, _preload_content=False
        )

    def node(self, name: str) -> dict[str, Any]:
        resp = self.core.read_node(name, _preload_content=False)
        return json.loads(resp.data)  # type: ignore[no-any-return]

    def our_taint(self, name: str) -> dict[str, Any] | None:
        taints = self.node(name)["spec"].get("taints") or []
        return next((t for t in taints if t["key"] == TAINT_KEY), None)

    def tainted_for(self, name: str) -> str | None:
        """While gpuguard's taint is on the node, the most severe fault its record names (the taint itself
        carries no value: `gpuguard.quarantine.record`), else None."""
        from gpuguard.quarantine.record import FaultRecord

        node = self.node(name)
        if not any(t["key"] == TAINT_KEY for t in node["spec"].get("taints") or ()):
            return None
        return FaultRecord.read(node["metadata"].get("annotations") or {}).primary_reason

    def patch_node(self, name: str, body: dict[str, Any]) -> None:
        self.core.patch_node(name, body, _content_type="application/merge-patch+json")

    def update_node(self, name: str, change: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """What a careful operator's tool does: read, build a merge patch from what it read, write it with the
        resourceVersion; on a 409 (the agent wrote in between, e.g. its node condition) read again."""
        for _ in range(50):
            n = self.node(name)
            body = change(n)
            body.setdefault("metadata", {})["resourceVersion"] = n["metadata"]["resourceVersion"]
            try:
                self.patch_node(name, body)
                return
            except kubernetes.client.exceptions.ApiException as exc:
                if exc.status != 409:
                    raise
        raise AssertionError(f"node {name}: 50 conflicts in a row")

    def events_for(self, node: str) -> list[dict[str, Any]]:
        resp = self.core.list_namespaced_event(
            "default", field_selector=f"involvedObject.name={node}", _preload_content=False
        )
        return json.loads(resp.data)["items"]  # type: ignore[no-any-return]

    def apply_deploy_manifests(self) -> list[str]:
        """Create every manifest in deploy/ (really create: RBAC is not proven by a dry run)."""
        created = []
        for path in sorted(DEPLOY.glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if not doc:
                    continue
                try:
                    utils.create_from_dict(self.api, doc)
                except utils.FailToCreateError as exc:
                    if not all(getattr(e, "status", None) == 409 for e in exc.api_exceptions):
                        raise
                created.append(f"{doc['kind']}/{doc['metadata']['name']}")
        return created

    def agent_token(self, node: str) -> str:
        """A token for gpuguard's ServiceAccount bound to a Pod of the DaemonSet's template on `node`."""
        ds = self.apps.read_namespaced_daemon_set("gpuguard", NAMESPACE, _preload_content=False)
        template = json.loads(ds.data)["spec"]["template"]
        pod_name = f"gpuguard-{node}"
        spec = {**template["spec"], "nodeName": node}
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod_name, "namespace": NAMESPACE, "labels": template["metadata"]["labels"]},
            "spec": spec,
        }
        try:
            self.core.create_namespaced_pod(NAMESPACE, body)
        except kubernetes.client.exceptions.ApiException as exc:
            if exc.status != 409:
                raise
        return self.pod_token(pod_name)

    def pod_token(self, pod_name: str, account: str = SERVICE_ACCOUNT) -> str:
        """A token for the ServiceAccount `account` (default: the agent's) bound to the Pod pod_name in
        gpuguard's namespace."""
        pod = json.loads(self.core.read_namespaced_pod(pod_name, NAMESPACE, _preload_content=False).data)
        req = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": 3600,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod_name,
                    "uid": pod["metadata"]["uid"],
                },
            },
        }
        resp = self.core.create_namespaced_service_account_token(
            account, NAMESPACE, req, _preload_content=False
        )
        return str(json.loads(resp.data)["status"]["token"])


def token_kubeconfig(path: Path, *, server: str, ca_path: Path, token: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "test", "cluster": {"server": server, "certificate-authority": str(ca_path)}}
                ],
                "users": [{"name": "gpuguard", "user": {"token": token}}],
                "contexts": [{"name": "gpuguard", "context": {"cluster": "test", "user": "gpuguard"}}],
                "current-context": "gpuguard",
            }
        )
    )
    return path


def token_client(server: str, ca_path: Path, token: str) -> kubernetes.client.ApiClient:
    cfg = kubernetes.client.Configuration()
    cfg.host = server
    cfg.ssl_ca_cert = str(ca_path)
    cfg.api_key = {"authorization": f"Bearer {token}"}
    return kubernetes.client.ApiClient(cfg)


@contextmanager
def admin_client(cluster: Any) -> Iterator[kubernetes.client.ApiClient]:
    """A client of `cluster` (a controlplane.ControlPlane) as its admin, closed at the end."""
    client: kubernetes.client.ApiClient = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=str(cluster.kubeconfig_path)
    )
    with closing(client):
        yield client


WORKLOADS = "workloads"


def with_workloads(admin: Admin) -> Admin:
    """deploy/ applied (DaemonSet, RBAC, admission policy) and the WORKLOADS namespace, once the token
    controller has filled in its default ServiceAccount (pods wait for it otherwise)."""
    admin.apply_deploy_manifests()
    try:
        admin.core.create_namespace({"metadata": {"name": WORKLOADS}})
    except kubernetes.client.exceptions.ApiException as exc:
        if exc.status != 409:
            raise

    def default_account() -> bool:
        try:
            admin.core.read_namespaced_service_account("default", WORKLOADS)
        except kubernetes.client.exceptions.ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    eventually(default_account, 30, what=f"ServiceAccount default in {WORKLOADS}")
    return admin


# kwok (hack/testenv, full control plane) runs the nodes that carry this annotation.
KWOK_ANNOTATION = {"kwok.x-k8s.io/node": "fake"}
_kwok_names = itertools.count()


def make_gpu_node(
    admin: Admin,
    *,
    gpus: int = 8,
    taints: list[dict[str, str]] | None = None,
    labels: dict[str, str] | None = None,
) -> str:
    """A kwok node shaped like a GPU node: the GPU labels (GPU Feature Discovery's; `labels` replaces them:
    another platform's, or none for a CPU node), nvidia.com/gpu capacity, heartbeated by kwok."""
    name = f"kwok-gpu-{next(_kwok_names)}-{int(time.time() * 1000) % 100000}"
    resources = {"cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": str(gpus)}
    admin.core.create_node(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": KWOK_ANNOTATION,
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    **(
                        labels
                        if labels is not None
                        else {
                            "nvidia.com/gpu.present": "true",
                            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                            "nvidia.com/gpu.count": str(gpus),
                        }
                    ),
                },
            },
            "spec": {"taints": taints or []},
            "status": {"capacity": resources, "allocatable": resources},
        }
    )
    eventually(lambda: node_ready(admin, name), 30, what=f"kwok marks {name} Ready")
    return name


def node_ready(admin: Admin, name: str) -> bool:
    conditions = admin.node(name).get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def read_pod(admin: Admin, name: str, namespace: str = "workloads") -> dict[str, Any] | None:
    try:
        resp = admin.core.read_namespaced_pod(name, namespace, _preload_content=False)
    except kubernetes.client.exceptions.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return json.loads(resp.data)  # type: ignore[no-any-return]


def pod_ready(pod: dict[str, Any] | None) -> bool:
    conditions = (pod or {}).get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def daemon_pod(admin: Admin, node: str) -> dict[str, Any] | None:
    """The pod the DaemonSet controller created for `node`, once it runs there."""
    resp = admin.core.list_namespaced_pod(
        NAMESPACE, field_selector=f"spec.nodeName={node}", _preload_content=False
    )
    for pod in json.loads(resp.data)["items"]:
        owners = pod["metadata"].get("ownerReferences") or []
        if any(o["kind"] == "DaemonSet" for o in owners) and pod_ready(pod):
            return pod  # type: ignore[no-any-return]
    return None


def daemon_pod_kubeconfig(admin: Admin, cluster: Any, ds_pod: dict[str, Any], tmp_path: Path) -> Path:
    """The agent runs as the DaemonSet pod's ServiceAccount, with a token bound to that very pod."""
    return token_kubeconfig(
        tmp_path / "agent.kubeconfig",
        server=cluster.url,
        ca_path=cluster.ca_path,
        token=admin.pod_token(ds_pod["metadata"]["name"]),
    )


# -- admission policies: one preamble for test_admission and test_device_admission ---------------------------


def policy_denial(policy: str) -> str:
    """How the API server begins a refusal by the ValidatingAdmissionPolicy `policy` (and its binding of
    the same name): asserting it means a 403 from RBAC cannot pass for the policy's."""
    return f"ValidatingAdmissionPolicy '{policy}' with binding '{policy}' denied request: "


def api_message(exc: Any) -> str:
    """The message of an ApiException's Status body (the body itself where it is not one)."""
    try:
        return str(json.loads(exc.body or "")["message"])
    except (TypeError, ValueError, KeyError):
        return str(exc.body)


def refused_by(policy: str, call: Callable[[], Any]) -> str:
    """Run a write that `policy` must refuse; return the policy's own message (after its prefix)."""
    try:
        call()
    except kubernetes.client.exceptions.ApiException as exc:
        text = api_message(exc)
        assert exc.status == 403, text
        assert policy_denial(policy) in text, text
        return text.split(policy_denial(policy), 1)[1]
    raise AssertionError(f"{policy} did not refuse the write")


def enforced_admin(
    admin_api: kubernetes.client.ApiClient, *, policy: str, probe: Callable[[Admin], Callable[[], Any]]
) -> Admin:
    """deploy/ applied (the DaemonSet, RBAC, the admission policies) and `policy` enforced: policies and
    bindings reach the admission plugin through informers a moment after creation, so this waits until the
    dry-run write `probe(admin)` returns is denied by `policy` itself."""
    admin = Admin(admin_api)
    created = admin.apply_deploy_manifests()
    wanted = {"DaemonSet/gpuguard", f"ValidatingAdmissionPolicy/{policy}"}
    assert wanted | {f"ValidatingAdmissionPolicyBinding/{policy}"} <= set(created), created
    write = probe(admin)

    def denied() -> bool:
        try:
            write()
        except kubernetes.client.exceptions.ApiException as exc:
            return exc.status == 403 and policy_denial(policy) in api_message(exc)
        return False

    started = time.monotonic()
    eventually(denied, 30, interval=0.1, what=f"{policy} to be enforced")
    print(f"{policy} enforced {time.monotonic() - started:.2f}s after the manifests were applied")
    return admin


def unique_node(admin: Admin, prefix: str, **kw: Any) -> str:
    """A node with a name no earlier run of the same cluster used (GPUGUARD_KUBECONFIG_REUSE=1)."""
    name = f"{prefix}-{next(_node_names)}-{int(time.time() * 1000) % 100000}"
    admin.make_node(name, **kw)
    return name


_node_names = itertools.count()

GPUS_OK = "gpu 0 uuid=GPU-it-0\ngpu 1 uuid=GPU-it-1\n"


class Agent(WatchProcess):
    """`gpuguard watch --backend nvml` as a subprocess (harness/agentproc.py), on the fake NVML library, as
    the ServiceAccount: durable state per node (never the machine's /var/lib/gpuguard), keyed by a boot ID the
    test owns. `env`: extra environment (a setting without a flag of its own in older versions)."""

    def __init__(
        self,
        *,
        node: str,
        kubeconfig: Path,
        state: Path,
        lib: Path,
        args: tuple[str, ...] = (),
        state_dir: Path | None = None,
        host_boot_id: str = "host-boot-1",
        env: dict[str, str] | None = None,
    ) -> None:
        self.node, self.kubeconfig, self.state, self.lib = node, kubeconfig, state, lib
        self.state_dir = state_dir or state.parent / f"{node}-gpuguard-state"
        self.boot_id_file = state.parent / f"{node}-boot-id"
        self.boot_id_file.write_text(host_boot_id + "\n")
        super().__init__(
            *("--backend", "nvml", "--node", node, "--kubeconfig", str(kubeconfig)),
            *("--interval", "0.2", "--recover-after", "2"),
            *("--state-dir", str(self.state_dir), "--boot-id-file", str(self.boot_id_file)),
            *args,
            env={"LD_LIBRARY_PATH": str(lib), "FAKE_NVML_STATE": str(state), **(env or {})},
        )

    @property
    def started_at(self) -> float:
        return self.t_start

    def start(self) -> Agent:
        super().start()
        self.wait_listening(20)
        return self

    def stop(self, timeout: float = 10.0) -> int:
        code = super().stop(timeout)
        assert not self.tracebacks(), self.lines
        return code


def agent_as_node(admin: Admin, cluster: Any, node: str, *, state: Path, lib: Path, **kw: Any) -> Agent:
    """An agent (not started) for `node` on `cluster`, with the DaemonSet ServiceAccount's token bound to a
    Pod on that node, as the real agent runs; kw: Agent's (args, host_boot_id, env, ...)."""
    kubeconfig = token_kubeconfig(
        state.parent / f"{node}.kubeconfig",  # per node: agents may share a state file, never a token
        server=cluster.url,
        ca_path=cluster.ca_path,
        token=admin.agent_token(node),
    )
    return Agent(node=node, kubeconfig=kubeconfig, state=state, lib=lib, **kw)
