"""Repair on a real control plane (kube-apiserver, kube-controller-manager, kube-scheduler, kwok), a real
agent on the fake NVML library as its DaemonSet pod's ServiceAccount, every admission policy of deploy/, a
fake kubelet serving PodResources, and the repair executor as its own ServiceAccount, whose reset command is
a stand-in that resets the fake GPU: 8 pods on the 8 DRA GPUs of a node, GPU_RESET on GPU 3 -> that pod
evicted, its replacement on another node, GPU 3 reset, proven and allocatable again, the other seven pods
untouched; a reset that does not clear asks for a reboot; a veto stops it; dry-run changes nothing."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from gpuguard.quarantine.repair.values import ANN_REQUEST, ANN_STATE, ANN_VETO, parse_record
from harness.dra import DRIVER, gpu_uuid
from harness.kube import (
    WORKLOADS,
    Admin,
    Agent,
    admin_client,
    api_message,
    daemon_pod,
    eventually,
    make_gpu_node,
    pod_ready,
    policy_denial,
    read_pod,
    refused_by,
    token_client,
    token_kubeconfig,
    with_workloads,
)
from harness.kubelet import FakeContainer, FakeKubelet, FakePod
from tests.integration.repairrig import Executor, apply_repair_rbac, executor_token, set_gpu
from tests.integration.test_scheduling import (
    CLAIM_TEMPLATE,
    _dra_objects,
    allocated_device,
    daemon_pod_kubeconfig,
    device_rule,
    dra_node,
    make_gpu_pod,
    publish,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(full_control_plane: Any) -> Iterator[Admin]:
    with admin_client(full_control_plane) as api:
        admin = with_workloads(Admin(api))
        apply_repair_rbac(admin)
        _dra_objects(admin)
        yield admin


@pytest.fixture
def sock() -> Iterator[str]:
    folder = tempfile.mkdtemp(prefix="kubelet-", dir="/tmp")
    yield f"{folder}/kubelet.sock"
    shutil.rmtree(folder, ignore_errors=True)


def pods_of(admin: Admin, selector: str) -> list[dict[str, Any]]:
    resp = admin.core.list_namespaced_pod(WORKLOADS, label_selector=selector, _preload_content=False)
    return json.loads(resp.data)["items"]  # type: ignore[no-any-return]


def phase(admin: Admin, node: str, uuid: str) -> str | None:
    ann = admin.node(node)["metadata"].get("annotations") or {}
    entry = parse_record(ann.get(ANN_STATE)).get(uuid)
    return None if entry is None else entry.phase


def deployment(app: str, pool: str, replicas: int) -> dict[str, Any]:
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


def test_gpu_3_is_reset_proven_and_back_while_its_seven_neighbours_keep_serving(
    cluster: Admin, full_control_plane: Any, fakenvml: Path, tmp_path: Path, sock: str
) -> None:
    pool = f"r{time.monotonic_ns() % 10**9}"
    app = f"llm-{pool}"
    node, ds_pod, gpus = dra_node(cluster)
    cluster.patch_node(node, {"metadata": {"labels": {"repair-test": pool}}})
    apps: Any = kubernetes.client.AppsV1Api(cluster.api)
    apps.create_namespaced_deployment(WORKLOADS, deployment(app, pool, 8))

    def eight_ready() -> list[dict[str, Any]] | None:
        running = [p for p in pods_of(cluster, f"app={app}") if pod_ready(p)]
        return running if len(running) == 8 else None

    first = eventually(eight_ready, 120, interval=0.3, what="8 replicas Ready")
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in first}
    devices = {n: eventually(lambda n=n: allocated_device(cluster, n), 20, what=f"{n}'s GPU") for n in uids}  # type: ignore[misc]
    assert sorted(devices.values()) == [f"gpu-{i}" for i in range(8)]
    by_device = {d: n for n, d in devices.items()}
    # Somewhere for a replacement to go, once the eight are placed.
    spare = make_gpu_node(cluster)
    publish(cluster, spare)
    cluster.patch_node(spare, {"metadata": {"labels": {"repair-test": pool}}})

    state = tmp_path / "gpus.state"
    state.write_text(gpus)
    for i in range(8):
        set_gpu(state, i, processes=1)  # each pod's process on its GPU
    table = [
        FakePod(WORKLOADS, n, [FakeContainer("server", claims=[(DRIVER, node, d)])])
        for n, d in devices.items()
    ]
    agent_config = daemon_pod_kubeconfig(cluster, full_control_plane, ds_pod, tmp_path)
    executor_config = tmp_path / "executor.kubeconfig"
    token_kubeconfig(
        executor_config,
        server=full_control_plane.url,
        ca_path=full_control_plane.ca_path,
        token=executor_token(cluster, node),
    )
    args = ("--repair", "on", "--max-quarantined", "100%", "--node-resync", "1")
    stop = threading.Event()
    with FakeKubelet(sock, pods=table) as kubelet:

        def kubelet_follows() -> None:
            """The kubelet forgets an evicted pod and its process ends, as a real node's would."""
            while not stop.is_set():
                for name, device in devices.items():
                    pod = read_pod(cluster, name)
                    if (pod is None or pod["metadata"].get("deletionTimestamp")) and any(
                        p.name == name for p in kubelet.pods
                    ):
                        kubelet.remove(WORKLOADS, name)
                        set_gpu(state, int(device.split("-")[1]), processes=None)
                stop.wait(0.2)

        follower = threading.Thread(target=kubelet_follows, daemon=True)
        follower.start()
        agent = Agent(node=node, kubeconfig=agent_config, state=state, lib=fakenvml, args=args).start()
        executor = Executor(
            node=node, kubeconfig=executor_config, state=state, lib=fakenvml, sock=sock
        ).start()
        try:
            eventually(agent.ready, 20, what="agent /readyz")
            fault_at = time.monotonic()
            set_gpu(state, 3, recovery_action=1)
            rule3 = f"gpuguard.{node}.gpu-3"
            eventually(lambda: device_rule(cluster, rule3), 20, what="GPU 3's DeviceTaintRule")
            request = eventually(
                lambda: (cluster.node(node)["metadata"].get("annotations") or {}).get(ANN_REQUEST),
                20,
                what="the agent's repair request",
            )
            assert json.loads(request)["uuid"] == gpu_uuid(node, 3) and json.loads(request)["owner"] == node
            victim = by_device["gpu-3"]
            eventually(
                lambda: phase(cluster, node, gpu_uuid(node, 3)) == "proven", 120, interval=0.2, what="proven"
            )
            proven_at = time.monotonic()
            evicted = executor.events("eviction.pod_evicted")
            assert [e["pod"] for e in evicted] == [f"{WORKLOADS}/{victim}"]
            assert (tmp_path / "gpus.state.resets").read_text().split() == ["3"]
            eventually(lambda: device_rule(cluster, rule3) is None, 30, interval=0.1, what="GPU 3 let go")
            back_at = time.monotonic()

            def replaced() -> dict[str, Any] | None:
                new = [
                    p
                    for p in pods_of(cluster, f"app={app}")
                    if p["metadata"]["name"] not in uids and pod_ready(p)
                ]
                return new[0] if new else None

            replacement = eventually(replaced, 90, interval=0.3, what="the replacement Ready")
            replaced_at = time.monotonic()
            assert replacement["spec"]["nodeName"] == spare
            # GPU 3 is back in the schedulable set: a new claim on this node gets it.
            again = make_gpu_pod(cluster, node, claim=CLAIM_TEMPLATE)
            assert eventually(lambda: allocated_device(cluster, again), 90, what="GPU 3 allocated") == "gpu-3"
            for name, uid in uids.items():
                if name != victim:
                    now = read_pod(cluster, name)
                    assert now is not None and now["metadata"]["uid"] == uid, name
                    assert now["metadata"].get("deletionTimestamp") is None, name
            reasons = [
                e["reason"]
                for e in cluster.events_for(node)
                if (e.get("source") or {}).get("component") == "gpuguard"
            ]
            assert {"GPURepairStarted", "GPURepaired"} <= set(reasons), reasons
            print(
                f"repair: fault -> proven {proven_at - fault_at:.2f} s, -> GPU 3 back in service "
                f"{back_at - fault_at:.2f} s; fault -> replacement Ready {replaced_at - fault_at:.2f} s"
            )

            # A reset that does not clear: GPU 5 stays out, and the node's reboot is asked for.
            (tmp_path / "gpus.state.noclear").write_text("")
            set_gpu(state, 5, recovery_action=1)
            uuid5 = gpu_uuid(node, 5)
            eventually(
                lambda: phase(cluster, node, uuid5) == "reboot-requested",
                120,
                interval=0.2,
                what="reboot asked",
            )
            assert executor.sentinel.exists() and uuid5 in executor.sentinel.read_text()
            time.sleep(2)
            assert device_rule(cluster, f"gpuguard.{node}.gpu-5") is not None  # kept out
            reasons = [
                e["reason"]
                for e in cluster.events_for(node)
                if (e.get("source") or {}).get("component") == "gpuguard"
            ]
            assert {"GPURepairFailed", "GPURebootRequested"} <= set(reasons), reasons

            # A veto stops it: GPU 6 is asked for, and nothing happens to it or its pod.
            cluster.patch_node(node, {"metadata": {"annotations": {ANN_VETO: "maintenance"}}})
            set_gpu(state, 6, recovery_action=1)
            uuid6 = gpu_uuid(node, 6)
            eventually(lambda: executor.events("repair.vetoed"), 30, what="repair.vetoed")
            assert executor.events("repair.vetoed")[0]["uuid"] == uuid6
            holder6 = read_pod(cluster, by_device["gpu-6"])
            assert holder6 is not None and holder6["metadata"].get("deletionTimestamp") is None
            assert phase(cluster, node, uuid6) is None

            # Dry run, veto lifted: it says what it would do and changes nothing.
            executor.stop()
            executor = Executor(
                node=node, kubeconfig=executor_config, state=state, lib=fakenvml, sock=sock, mode="dry-run"
            ).start()
            cluster.patch_node(node, {"metadata": {"annotations": {ANN_VETO: None}}})
            dry = eventually(lambda: executor.events("repair.dry_run"), 30, what="repair.dry_run")
            assert dry[0]["uuid"] == uuid6 and dry[0]["action"] == "reset"
            time.sleep(2)
            holder6 = read_pod(cluster, by_device["gpu-6"])
            assert holder6 is not None and holder6["metadata"].get("deletionTimestamp") is None
            assert phase(cluster, node, uuid6) is None
            assert (tmp_path / "gpus.state.resets").read_text().split() == ["3", "5"]
        finally:
            stop.set()
            executor.stop()
            agent.stop()
            apps.delete_namespaced_deployment(app, WORKLOADS)


def test_only_its_own_node_and_only_gpuguards_shape_a_token_can_write(
    cluster: Admin, full_control_plane: Any, tmp_path: Path
) -> None:
    """A second node's tokens, the agent's and the executor's, cannot make the executor of this node act."""
    a, _ds_a, _ = dra_node(cluster)
    b = make_gpu_node(cluster)
    ds_b = eventually(lambda: daemon_pod(cluster, b), 60, what="DaemonSet pod on b")
    ds_a = eventually(lambda: daemon_pod(cluster, a), 60, what="DaemonSet pod on a")
    core = kubernetes.client.CoreV1Api
    url, ca = full_control_plane.url, full_control_plane.ca_path
    agent_b = core(token_client(url, ca, cluster.pod_token(ds_b["metadata"]["name"])))
    client_a = token_client(url, ca, cluster.pod_token(ds_a["metadata"]["name"]))
    client_a.user_agent = "gpuguard"  # the agent's field manager (the node policy bounds its managedFields)
    agent_a = core(client_a)
    exec_b = core(token_client(url, ca, executor_token(cluster, b)))
    exec_a = core(token_client(url, ca, executor_token(cluster, a)))
    deadline = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 600))

    def ask(owner: str, uuid: str = "GPU-x-3") -> dict[str, Any]:
        value = json.dumps(
            {"deadline": deadline, "owner": owner, "uuid": uuid}, separators=(",", ":"), sort_keys=True
        )
        return {"metadata": {"annotations": {ANN_REQUEST: value}}}

    # Node b's agent cannot write a request on node a at all (both policies refuse; either may answer).
    try:
        agent_b.patch_node(a, ask(a))
        raise AssertionError("node b's agent wrote a request on node a")
    except kubernetes.client.exceptions.ApiException as exc:
        assert exc.status == 403 and any(
            policy_denial(p) in api_message(exc)
            for p in ("gpuguard-own-node-only", "gpuguard-repair-request")
        ), api_message(exc)
    # Node a's agent cannot name another owner, nor write anything but gpuguard's shape.
    refused_by("gpuguard-repair-request", lambda: agent_a.patch_node(a, ask(b)))
    refused_by("gpuguard-repair-request", lambda: agent_a.patch_node(a, ask(a, uuid='GPU-x","y')))
    bad = {"metadata": {"annotations": {ANN_REQUEST: '{"uuid":"GPU-x"}'}}}
    refused_by("gpuguard-repair-request", lambda: agent_a.patch_node(a, bad))
    # ... nor the executor's record or the operator's veto.
    refused_by(
        "gpuguard-repair-request",
        lambda: agent_a.patch_node(a, {"metadata": {"annotations": {ANN_VETO: "x"}}}),
    )
    forged = {"metadata": {"annotations": {ANN_STATE: "{}"}}}
    refused_by("gpuguard-repair-request", lambda: agent_a.patch_node(a, forged))
    agent_a.patch_node(a, ask(a))  # its own request, in shape: admitted
    # Node b's executor cannot write node a; node a's writes only its record there.
    refused_by("gpuguard-repair-executor", lambda: exec_b.patch_node(a, forged))
    refused_by("gpuguard-repair-executor", lambda: exec_a.patch_node(a, {"metadata": {"labels": {"x": "y"}}}))
    refused_by(
        "gpuguard-repair-executor",
        lambda: exec_a.patch_node(a, {"metadata": {"annotations": {ANN_VETO: None, "gpuguard.io/x": "1"}}}),
    )
    refused_by("gpuguard-repair-executor", lambda: exec_a.patch_node(a, {"spec": {"unschedulable": True}}))
    exec_a.patch_node(a, forged)  # its record: admitted
