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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from gpuguard.quarantine.repair.values import ANN_REQUEST, ANN_STATE, ANN_VETO
from harness.dra import gpu_uuid
from harness.dracluster import CLAIM_TEMPLATE, allocated_device, dra_node, dra_objects
from harness.kube import (
    WORKLOADS,
    Admin,
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
    with_workloads,
)
from harness.repairrig import apply_repair_rbac, executor_token, reset_gpu_3, scene, set_gpu
from tests.integration.test_scheduling import make_gpu_pod, type_checking

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(full_control_plane: Any) -> Iterator[Admin]:
    with admin_client(full_control_plane) as api:
        admin = with_workloads(Admin(api))
        apply_repair_rbac(admin)
        dra_objects(admin)
        yield admin


@pytest.fixture
def sock() -> Iterator[str]:
    folder = tempfile.mkdtemp(prefix="kubelet-", dir="/tmp")
    yield f"{folder}/kubelet.sock"
    shutil.rmtree(folder, ignore_errors=True)


def gpuguard_reasons(admin: Admin, node: str) -> set[str]:
    return {
        e["reason"] for e in admin.events_for(node) if (e.get("source") or {}).get("component") == "gpuguard"
    }


def test_gpu_3_is_reset_proven_and_back_while_its_seven_neighbours_keep_serving(
    cluster: Admin, full_control_plane: Any, fakenvml: Path, tmp_path: Path, sock: str
) -> None:
    with scene(cluster, full_control_plane, lib=fakenvml, work=tmp_path, sock=sock) as s:
        t = reset_gpu_3(s)
        victim = s.by_device["gpu-3"]
        request = json.loads(t.request)
        assert (request["uuid"], request["owner"]) == (gpu_uuid(s.node, 3), s.node)
        assert [e["pod"] for e in s.executor.events("eviction.pod_evicted")] == [f"{WORKLOADS}/{victim}"]
        assert (tmp_path / "gpus.state.resets").read_text().split() == ["3"]
        replacement = next(p for p in s.pods() if p["metadata"]["name"] not in s.uids and pod_ready(p))
        assert replacement["spec"]["nodeName"] == s.spare
        # GPU 3 is back in the schedulable set: a new claim on this node gets it.
        again = make_gpu_pod(cluster, s.node, claim=CLAIM_TEMPLATE)
        assert eventually(lambda: allocated_device(cluster, again), 90, what="GPU 3 allocated") == "gpu-3"
        for name, uid in s.uids.items():
            if name != victim:
                now = read_pod(cluster, name)
                assert now is not None and now["metadata"]["uid"] == uid, name
                assert now["metadata"].get("deletionTimestamp") is None, name
        assert {"GPURepairStarted", "GPURepaired"} <= gpuguard_reasons(cluster, s.node)
        metrics = s.executor.metrics()
        for step, result in (("idle", "proven"), ("reset", "done"), ("proof", "proven")):
            assert f'gpuguard_repair_steps_total{{result="{result}",step="{step}"}} 1.0' in metrics, metrics
        print(
            f"repair: fault -> rule {t.rule:.2f} s, -> request {t.requested:.2f} s, -> proven "
            f"{t.proven:.2f} s, -> GPU 3 back in service {t.back:.2f} s; fault -> replacement Ready "
            f"{t.replaced:.2f} s"
        )

        # A reset that does not clear: GPU 5 stays out, and the node's reboot is asked for.
        (tmp_path / "gpus.state.noclear").write_text("")
        set_gpu(s.state, 5, recovery_action=1)
        eventually(lambda: s.phase(5) == "reboot-requested", 120, interval=0.2, what="a reboot asked for")
        assert gpu_uuid(s.node, 5) in s.executor.sentinel.read_text()
        time.sleep(2)
        assert s.rule(5) is not None  # kept out
        assert {"GPURepairFailed", "GPURebootRequested"} <= gpuguard_reasons(cluster, s.node)

        # A veto stops it: GPU 6 is asked for, and nothing happens to it or its pod.
        cluster.patch_node(s.node, {"metadata": {"annotations": {ANN_VETO: "maintenance"}}})
        set_gpu(s.state, 6, recovery_action=1)
        vetoed = eventually(lambda: s.executor.events("repair.vetoed"), 30, what="repair.vetoed")
        assert vetoed[0]["uuid"] == gpu_uuid(s.node, 6)
        holder = read_pod(cluster, s.by_device["gpu-6"])
        assert holder is not None and holder["metadata"].get("deletionTimestamp") is None
        assert s.phase(6) is None

        # Dry run, the veto lifted: it says what it would do and changes nothing.
        s.restart_executor("dry-run")
        cluster.patch_node(s.node, {"metadata": {"annotations": {ANN_VETO: None}}})
        dry = eventually(lambda: s.executor.events("repair.dry_run"), 30, what="repair.dry_run")
        assert (dry[0]["uuid"], dry[0]["action"]) == (gpu_uuid(s.node, 6), "reset")
        time.sleep(2)
        holder = read_pod(cluster, s.by_device["gpu-6"])
        assert holder is not None and holder["metadata"].get("deletionTimestamp") is None
        assert s.phase(6) is None and s.rule(6) is not None
        assert (tmp_path / "gpus.state.resets").read_text().split() == ["3", "5"]


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


@pytest.mark.parametrize("name", ["gpuguard-repair-request", "gpuguard-repair-executor"])
def test_the_repair_policies_type_check_without_warnings(cluster: Admin, name: str) -> None:
    """kube-controller-manager's type checker finds no field the schema lacks and no mismatched types."""
    assert type_checking(cluster, name).get("expressionWarnings", []) == []
