"""`--evict gpu-pods` on a real control plane: kube-apiserver, kube-controller-manager (its disruption
controller fills the PodDisruptionBudget's status, its ReplicaSet controller replaces an evicted pod),
kube-scheduler and kwok, a real agent (nvml on the fake library, as the DaemonSet pod's ServiceAccount, with
the eviction Role of deploy/eviction/rbac.yaml and every admission policy of deploy/) and a fake kubelet: a
real gRPC server on a unix socket serving the PodResources proto, which maps GPU i to pod i."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from kubernetes import utils

from harness.kube import (
    DEPLOY,
    TAINT_KEY,
    WORKLOADS,
    Admin,
    Agent,
    admin_client,
    daemon_pod,
    eventually,
    make_gpu_node,
    pod_ready,
    read_pod,
    token_kubeconfig,
    with_workloads,
)
from harness.kubelet import FakeContainer, FakeKubelet, FakePod, gpu_pod

pytestmark = pytest.mark.timeout(300)

GPUS = "".join(f"gpu {i} uuid=GPU-it-{i}\n" for i in range(8))


@pytest.fixture(scope="module")
def cluster(full_control_plane: Any) -> Iterator[Admin]:
    """deploy/ applied, the workloads' namespace, and the eviction Role of deploy/eviction/rbac.yaml there."""
    with admin_client(full_control_plane) as api:
        admin = with_workloads(Admin(api))
        text = (DEPLOY / "eviction" / "rbac.yaml").read_text().replace("ml-serving", WORKLOADS)
        for doc in yaml.safe_load_all(text):
            try:
                utils.create_from_dict(admin.api, doc)  # type: ignore[no-untyped-call]
            except utils.FailToCreateError as exc:
                if not all(getattr(e, "status", None) == 409 for e in exc.api_exceptions):
                    raise
        yield admin


@pytest.fixture
def sock() -> Iterator[str]:
    folder = tempfile.mkdtemp(prefix="kubelet-", dir="/tmp")
    yield f"{folder}/kubelet.sock"
    shutil.rmtree(folder, ignore_errors=True)


def pods_of(admin: Admin, selector: str) -> list[dict[str, Any]]:
    resp = admin.core.list_namespaced_pod(WORKLOADS, label_selector=selector, _preload_content=False)
    return json.loads(resp.data)["items"]  # type: ignore[no-any-return]


def gpu_pod_spec(pool: str, **extra: Any) -> dict[str, Any]:
    return {
        "nodeSelector": {"evict-test": pool},
        "terminationGracePeriodSeconds": 1,
        "containers": [
            {
                "name": "server",
                "image": "registry.example/llm:1",
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
            }
        ],
        **extra,
    }


def label_node(admin: Admin, node: str, pool: str) -> None:
    admin.patch_node(node, {"metadata": {"labels": {"evict-test": pool}}})


def gpuguard_events(admin: Admin, namespace: str, kind: str, name: str) -> list[str]:
    """The reasons of gpuguard's Events about one object (the scheduler's and kwok's left out)."""
    resp = admin.core.list_namespaced_event(
        namespace,
        field_selector=f"involvedObject.kind={kind},involvedObject.name={name}",
        _preload_content=False,
    )
    items = json.loads(resp.data)["items"]
    return [e["reason"] for e in items if (e.get("source") or {}).get("component") == "gpuguard"]


def test_an_xid_on_gpu_3_evicts_only_its_pod_a_pdb_holds_it_back_until_it_allows_and_a_toleration_keeps_one(
    cluster: Admin, full_control_plane: Any, fakenvml: Path, tmp_path: Path, sock: str
) -> None:
    pool = f"p{time.monotonic_ns() % 10**9}"
    app = f"train-{pool}"
    node = make_gpu_node(cluster)
    label_node(cluster, node, pool)
    ds_pod = eventually(lambda: daemon_pod(cluster, node), 60, what="DaemonSet pod on the node")
    apps: Any = kubernetes.client.AppsV1Api(cluster.api)
    policy: Any = kubernetes.client.PolicyV1Api(cluster.api)
    apps.create_namespaced_deployment(
        WORKLOADS,
        {
            "metadata": {"name": app},
            "spec": {
                "replicas": 7,
                "selector": {"matchLabels": {"app": app}},
                "template": {"metadata": {"labels": {"app": app}}, "spec": gpu_pod_spec(pool)},
            },
        },
    )
    keeper = f"zz-keeper-{pool}"  # sorts last: GPU 7
    tolerate = [{"key": TAINT_KEY, "operator": "Exists"}]
    cluster.core.create_namespaced_pod(
        WORKLOADS, {"metadata": {"name": keeper}, "spec": gpu_pod_spec(pool, tolerations=tolerate)}
    )
    policy.create_namespaced_pod_disruption_budget(
        WORKLOADS,
        {"metadata": {"name": app}, "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": app}}}},
    )

    def eight_ready() -> list[dict[str, Any]] | None:
        running = [p for p in pods_of(cluster, f"app={app}") if pod_ready(p)]
        k = read_pod(cluster, keeper)
        if len(running) != 7 or k is None or not pod_ready(k):
            return None
        return [*sorted(running, key=lambda p: p["metadata"]["name"]), k]

    first = eventually(eight_ready, 90, interval=0.2, what="7 replicas and the keeper Ready")
    assert {p["spec"]["nodeName"] for p in first} == {node}
    names = [p["metadata"]["name"] for p in first]
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in first}
    victim = names[3]

    def budget_computed() -> bool:
        pdb = json.loads(
            policy.read_namespaced_pod_disruption_budget(app, WORKLOADS, _preload_content=False).data
        )
        status = pdb.get("status") or {}
        return (
            status.get("observedGeneration") == pdb["metadata"]["generation"]
            and status.get("currentHealthy") == 7
        )

    eventually(budget_computed, 60, interval=0.2, what="the disruption controller's PDB status")
    # Somewhere for the replacement to go, once the pods are placed.
    spare = make_gpu_node(cluster)
    label_node(cluster, spare, pool)

    kubeconfig = token_kubeconfig(
        tmp_path / "agent.kubeconfig",
        server=full_control_plane.url,
        ca_path=full_control_plane.ca_path,
        token=cluster.pod_token(ds_pod["metadata"]["name"]),
    )
    state = tmp_path / "gpus.state"
    state.write_text(GPUS)
    args = (
        *("--evict", "gpu-pods", "--pod-resources-socket", sock, "--max-quarantined", "100%"),
        *("--quarantine", "node"),
    )
    with FakeKubelet(
        sock, pods=[gpu_pod(WORKLOADS, n, f"GPU-it-{i}") for i, n in enumerate(names)]
    ) as kubelet:
        agent = Agent(node=node, kubeconfig=kubeconfig, state=state, lib=fakenvml, args=args).start()
        try:
            eventually(agent.ready, 15, what="agent /readyz")
            fault_at = time.monotonic()
            state.write_text(GPUS + "xid 3 79\n")
            eventually(lambda: cluster.our_taint(node), 15, what="gpuguard's taint")
            # The PDB allows no disruption: refused (429), retried, reported; the pod stays.
            eventually(lambda: len(agent.events("eviction.blocked")) >= 2, 30, what="two refusals")
            blocked = agent.events("eviction.blocked")[0]
            assert blocked["pod"] == f"{WORKLOADS}/{victim}" and blocked["gpus"] == ["GPU-it-3"]
            assert "disruption budget" in blocked["error"]
            pod = read_pod(cluster, victim)
            assert pod is not None and pod["metadata"].get("deletionTimestamp") is None
            eventually(
                lambda: "GPUEvictionBlocked" in gpuguard_events(cluster, "default", "Node", node),
                10,
                what="GPUEvictionBlocked about the node",
            )
            assert gpuguard_events(cluster, WORKLOADS, "Pod", victim) == ["GPUEvictionBlocked"]
            # The budget allows one: the next retry goes through.
            allowed_at = time.monotonic()
            policy.patch_namespaced_pod_disruption_budget(app, WORKLOADS, {"spec": {"maxUnavailable": 1}})
            eventually(
                lambda: (read_pod(cluster, victim) or {"metadata": {"deletionTimestamp": "gone"}})[
                    "metadata"
                ].get("deletionTimestamp"),
                90,
                interval=0.1,
                what="the victim evicted",
            )
            evicted_at = time.monotonic()
            kubelet.remove(WORKLOADS, victim)
            assert agent.events("eviction.pod_evicted")[0]["pod"] == f"{WORKLOADS}/{victim}"
            for namespace, kind, name in ((WORKLOADS, "Pod", victim), ("default", "Node", node)):

                def told(n: str = namespace, k: str = kind, o: str = name) -> bool:
                    return "GPUPodEvicted" in gpuguard_events(cluster, n, k, o)

                eventually(told, 10, what=f"GPUPodEvicted about {kind} {name}")

            def replaced() -> dict[str, Any] | None:
                new = [
                    p
                    for p in pods_of(cluster, f"app={app}")
                    if p["metadata"]["name"] not in uids and pod_ready(p)
                ]
                return new[0] if new else None

            replacement = eventually(replaced, 60, interval=0.2, what="the ReplicaSet's new pod Ready")
            ready_at = time.monotonic()
            assert replacement["spec"]["nodeName"] == spare  # the taint keeps it off the bad node
            # The other seven (six replicas and the keeper) were not touched.
            for name in names:
                if name == victim:
                    continue
                now = read_pod(cluster, name)
                assert now is not None and now["metadata"]["uid"] == uids[name], name
                assert now["metadata"].get("deletionTimestamp") is None, name
            assert len(agent.events("eviction.pod_evicted")) == 1

            # GPU 7 fails under the pod that tolerates gpuguard's taint: kept, said once.
            state.write_text(GPUS + "xid 3 79\nxid 7 79\n")
            kept = eventually(lambda: agent.events("eviction.pod_kept"), 15, what="the keeper kept")
            assert kept[0]["pod"] == f"{WORKLOADS}/{keeper}" and kept[0]["why"] == "tolerates-taint"
            time.sleep(2)
            now = read_pod(cluster, keeper)
            assert now is not None and now["metadata"].get("deletionTimestamp") is None
            assert len(agent.events("eviction.pod_evicted")) == 1
            assert not agent.events("eviction.failed") and not agent.events("eviction.event_failed")
            print(
                f"eviction: PDB allows -> evicted {evicted_at - allowed_at:.2f} s, "
                f"evicted -> replacement Ready on {spare} {ready_at - evicted_at:.2f} s "
                f"(fault at +0, evicted at +{evicted_at - fault_at:.2f} s)"
            )
        finally:
            agent.stop()
            apps.delete_namespaced_deployment(app, WORKLOADS)
            cluster.core.delete_namespaced_pod(keeper, WORKLOADS)


def test_beside_a_noexecute_device_taint_rule_gpuguard_leaves_the_eviction_to_kube_controller_manager(
    cluster: Admin, full_control_plane: Any, fakenvml: Path, tmp_path: Path, sock: str
) -> None:
    """DRA: the Xid on GPU 3 becomes a NoExecute DeviceTaintRule, whose eviction controller in
    kube-controller-manager evicts the pod holding it; gpuguard, also set to evict, sends no eviction of its
    own (never twice), and says why it keeps out."""
    from harness.dracluster import CLAIM_TEMPLATE, allocated_device, dra_node, dra_objects
    from tests.integration.test_scheduling import make_gpu_pod

    dra_objects(cluster)
    node, ds_pod, gpus = dra_node(cluster)
    pods = [make_gpu_pod(cluster, node, claim=CLAIM_TEMPLATE) for _ in range(8)]
    devices: dict[str, str] = {}
    for p in pods:
        eventually(lambda p=p: pod_ready(read_pod(cluster, p)), 90, what=f"{p} Ready")  # type: ignore[misc]
        devices[p] = eventually(lambda p=p: allocated_device(cluster, p), 10, what=f"{p}'s GPU")  # type: ignore[misc]
    holder = next(p for p, d in devices.items() if d == "gpu-3")
    table = [
        FakePod(WORKLOADS, p, [FakeContainer("server", claims=[("gpu.nvidia.com", node, d)])])
        for p, d in devices.items()
    ]
    kubeconfig = token_kubeconfig(
        tmp_path / "agent.kubeconfig",
        server=full_control_plane.url,
        ca_path=full_control_plane.ca_path,
        token=cluster.pod_token(ds_pod["metadata"]["name"]),
    )
    state = tmp_path / "gpus.state"
    state.write_text(gpus)
    args = (
        *("--taint-effect", "NoExecute", "--max-quarantined", "100%"),
        *("--evict", "gpu-pods", "--pod-resources-socket", sock),
    )
    with FakeKubelet(sock, pods=table):
        agent = Agent(node=node, kubeconfig=kubeconfig, state=state, lib=fakenvml, args=args).start()
        try:
            eventually(agent.ready, 15, what="agent /readyz")
            state.write_text(gpus + "xid 3 79\n")
            kept = eventually(lambda: agent.events("eviction.pod_kept"), 15, what="gpuguard keeps out")
            assert kept[0]["pod"] == f"{WORKLOADS}/{holder}"
            # The rule was NoExecute when gpuguard looked (or kube-controller-manager was already at work).
            assert kept[0]["why"] in ("dra-noexecute", "terminating", "not-on-this-node"), kept[0]
            eventually(
                lambda: read_pod(cluster, holder) is None, 60, interval=0.1, what="GPU 3's pod evicted"
            )
            time.sleep(2)
            assert not agent.events("eviction.pod_evicted") and not agent.events("eviction.blocked")
            assert not agent.events("eviction.failed")
            for p in pods:
                if p != holder:
                    assert pod_ready(read_pod(cluster, p)), f"{p} was disturbed"
            print(f"beside DRA NoExecute: gpuguard kept out ({kept[0]['why']})")
        finally:
            agent.stop()
