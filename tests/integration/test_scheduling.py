"""gpuguard beside the rest of a control plane: the real kube-scheduler places GPU pods on kwok's simulated
nodes, kube-controller-manager runs the DaemonSet, the taint-eviction controller and the admission policy's
type check, and a real agent (the nvml backend on the fake library, as the DaemonSet pod's ServiceAccount)
taints its node.

These tests run on their own control plane (full_control_plane): etcd, kube-apiserver, kube-scheduler,
kube-controller-manager and kwok, all of the pinned version.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from gpuguard.core.config import NodeSettings, QuarantineLimit
from gpuguard.core.model import Fault, GpuVerdict, Verdict
from gpuguard.kube import client as kubeclient
from gpuguard.quarantine.budget import VERIFY_SETTLE
from gpuguard.quarantine.gpu.writers import quarantined_gpus
from gpuguard.quarantine.node.writers import KubeNodeWriter
from gpuguard.quarantine.reconciler import NodeReconciler
from harness.dra import DRIVER, gpu_uuid, nvidia_slice
from harness.dracluster import (
    CLAIM_TEMPLATE,
    DRA,
    allocated_device,
    device_rule,
    dra_node,
    dra_objects,
    publish,
)
from harness.judging import hand_over
from harness.kube import (
    DEPLOY,
    GPUS_OK,
    NAMESPACE,
    TAINT_KEY,
    WORKLOADS,
    Admin,
    Agent,
    admin_client,
    daemon_pod,
    daemon_pod_kubeconfig,
    eventually,
    make_gpu_node,
    pod_ready,
    read_pod,
    with_workloads,
)

pytestmark = pytest.mark.timeout(300)

_names = itertools.count()
ApiException = kubernetes.client.exceptions.ApiException


@pytest.fixture(scope="module")
def cluster(full_control_plane: Any) -> Iterator[Admin]:
    """deploy/ applied (DaemonSet, RBAC, admission policy) and a namespace for the workloads."""
    with admin_client(full_control_plane) as api:
        yield with_workloads(Admin(api))


def make_gpu_pod(
    admin: Admin, node: str, *, tolerations: list[dict[str, str]] | None = None, claim: str | None = None
) -> str:
    """A pod that asks for one GPU and may only run on `node`: the scheduler binds it, kwok runs it. The GPU
    is the device plugin's resource nvidia.com/gpu, or with `claim` (a ResourceClaimTemplate) one DRA
    device claimed through it."""
    name = f"llm-{next(_names)}"
    spec: dict[str, Any] = {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "tolerations": tolerations or [],
        "containers": [
            {
                "name": "server",
                "image": "registry.example/llm-server:1",
                "resources": {"claims": [{"name": "gpu"}]} if claim else {"limits": {"nvidia.com/gpu": "1"}},
            }
        ],
    }
    if claim:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": claim}]
    admin.core.create_namespaced_pod(
        WORKLOADS, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}
    )
    return name


def test_a_gpu_pod_is_bound_by_the_scheduler_and_run_by_kwok(cluster: Admin) -> None:
    node = make_gpu_node(cluster)
    pod = make_gpu_pod(cluster, node)

    def ready() -> dict[str, Any] | None:
        p = read_pod(cluster, pod)
        return p if pod_ready(p) else None

    assert eventually(ready, 60, what="pod Ready")["spec"]["nodeName"] == node
    # The DaemonSet controller placed gpuguard's own pod there too (GPU label, tolerations), and kwok runs it.
    assert eventually(lambda: daemon_pod(cluster, node), 60, what="DaemonSet pod on the node")


def test_a_gpu_pod_stays_pending_on_a_node_without_free_gpus(cluster: Admin) -> None:
    node = make_gpu_node(cluster, gpus=1)
    first, second = make_gpu_pod(cluster, node), make_gpu_pod(cluster, node)
    eventually(lambda: pod_ready(read_pod(cluster, first)), 60, what="first pod Ready")

    def unschedulable() -> bool:
        conditions = (read_pod(cluster, second) or {}).get("status", {}).get("conditions") or []
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)

    assert eventually(unschedulable, 60, what="second pod Unschedulable")


def type_checking(admin: Admin, name: str) -> dict[str, Any]:
    """status.typeChecking of a ValidatingAdmissionPolicy, once kube-controller-manager's type checker has
    checked its current generation."""
    api: Any = kubernetes.client.AdmissionregistrationV1Api(admin.api)

    def checked() -> dict[str, Any] | None:
        live = json.loads(api.read_validating_admission_policy(name, _preload_content=False).data)
        status = live.get("status") or {}
        if "typeChecking" not in status or status.get("observedGeneration") != live["metadata"]["generation"]:
            return None
        return status

    # The status, not typeChecking itself: a policy without warnings has an empty (falsy) typeChecking.
    return eventually(checked, 60, interval=0.5, what=f"status.typeChecking of {name}")["typeChecking"]  # type: ignore[no-any-return]


def test_the_admission_policy_type_check_reports_no_warnings(cluster: Admin) -> None:
    """kube-controller-manager's type checker fills status.typeChecking of every ValidatingAdmissionPolicy;
    a CEL expression that refers to a field the schema lacks, or compares mismatched types, shows up there."""
    policy = next(
        d
        for d in yaml.safe_load_all((DEPLOY / "admission-policy.yaml").read_text())
        if d and d["kind"] == "ValidatingAdmissionPolicy"
    )
    assert type_checking(cluster, policy["metadata"]["name"]).get("expressionWarnings", []) == []


def test_the_type_check_does_warn_about_a_policy_with_a_type_error(cluster: Admin) -> None:
    """The check above could pass on an empty status: this proves the type checker runs and reports."""
    api: Any = kubernetes.client.AdmissionregistrationV1Api(cluster.api)
    name = f"type-error-{next(_names)}"
    api.create_validating_admission_policy(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["UPDATE"],
                            "resources": ["nodes"],
                        }
                    ]
                },
                # Node has no spec.replicas, and a string is no int.
                "validations": [{"expression": "object.spec.replicas > 1 && object.metadata.name == 3"}],
            },
        }
    )
    try:
        warnings = type_checking(cluster, name).get("expressionWarnings", [])
        assert [w["fieldRef"] for w in warnings] == ["spec.validations[0].expression"]
    finally:
        api.delete_validating_admission_policy(name)


def test_no_execute_evicts_the_pods_of_a_bad_node_but_not_tolerating_ones_or_the_agent(
    cluster: Admin, full_control_plane: Any, fakenvml: Path, tmp_path: Path
) -> None:
    node = make_gpu_node(cluster)
    ds_pod = eventually(lambda: daemon_pod(cluster, node), 60, what="DaemonSet pod on the node")
    victim = make_gpu_pod(cluster, node)
    tolerant = make_gpu_pod(
        cluster, node, tolerations=[{"key": TAINT_KEY, "operator": "Exists", "effect": "NoExecute"}]
    )
    for name in (victim, tolerant):
        eventually(lambda name=name: pod_ready(read_pod(cluster, name)), 60, what=f"{name} Ready")  # type: ignore[misc]

    kubeconfig = daemon_pod_kubeconfig(cluster, full_control_plane, ds_pod, tmp_path)
    state = tmp_path / "gpus.state"
    state.write_text(GPUS_OK)
    args = ("--taint-effect", "NoExecute", "--max-quarantined", "100%")
    agent = Agent(node=node, kubeconfig=kubeconfig, state=state, lib=fakenvml, args=args).start()
    try:
        eventually(agent.ready, 15, what="agent /readyz")
        fault_at = time.monotonic()
        state.write_text(GPUS_OK + "xid 0 79\n")
        taint = eventually(lambda: cluster.our_taint(node), 15, what="gpuguard's taint")
        tainted_at = time.monotonic()
        assert taint["effect"] == "NoExecute"
        eventually(lambda: read_pod(cluster, victim) is None, 60, interval=0.1, what="the victim evicted")
        evicted_at = time.monotonic()
        print(
            f"NoExecute: fault -> taint {tainted_at - fault_at:.2f} s, "
            f"taint -> pod gone {evicted_at - tainted_at:.2f} s"
        )
        # The taint manager acts on a node update at once; give it time to act wrongly on the others.
        time.sleep(3)
        for name, namespace in ((tolerant, WORKLOADS), (ds_pod["metadata"]["name"], NAMESPACE)):
            left = read_pod(cluster, name, namespace)
            assert left is not None, f"{name} was evicted"
            assert left["metadata"].get("deletionTimestamp") is None, f"{name} is being deleted"
        assert agent.proc is not None and agent.proc.poll() is None
    finally:
        agent.stop()


# -- a degraded GPU (the second level): scheduled around softly, never cordoned -----------------------


def test_the_scheduler_prefers_a_clean_node_to_a_degraded_one_and_still_uses_the_degraded_one(
    cluster: Admin, full_control_plane: Any, tmp_path: Path
) -> None:
    """The real kube-scheduler and a degraded node as the agent's reconciler marks it (its own token, the
    admission policy enforced): the PreferNoSchedule taint steers a pod that may run on either node to the
    clean one, and a pod that may run only on the degraded node still lands there (never cordoned)."""
    degraded, clean = make_gpu_node(cluster), make_gpu_node(cluster)
    ds_pod = eventually(lambda: daemon_pod(cluster, degraded), 60, what="DaemonSet pod on the node")
    api = kubeclient.load(str(daemon_pod_kubeconfig(cluster, full_control_plane, ds_pod, tmp_path)))
    settings = NodeSettings(name=degraded, max_quarantined=QuarantineLimit.parse("100%"))
    reconciler = NodeReconciler(KubeNodeWriter(degraded, api=api), settings)
    uuids = [gpu_uuid(degraded, i) for i in range(8)]
    nvlink = Fault("nvlink-down", "link 3 inactive", uuid=uuids[1], gpu_index=1)
    hand_over(
        reconciler,
        Verdict(
            gpus=tuple(
                GpuVerdict(index=i, uuid=u, degraded=(nvlink,) * (i == 1)) for i, u in enumerate(uuids)
            )
        ),
        1,
    )
    reconciler.reconcile_now()
    n = cluster.node(degraded)
    assert any(t["key"] == "gpuguard.io/gpu-degraded" for t in n["spec"]["taints"]), n["spec"]
    assert not n["spec"].get("unschedulable")
    # kube-scheduler scores from its own watch of the nodes: give it the taint before the first pod (a pod
    # created at once was sometimes scored against the node without it).
    time.sleep(2.0)

    def pod_on(nodes: list[str]) -> str:
        name = f"llm-{next(_names)}"
        affinity = {"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}
        spec = {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [affinity]}]
                    }
                }
            },
            "containers": [
                {
                    "name": "server",
                    "image": "registry.example/llm-server:1",
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
        }
        cluster.core.create_namespaced_pod(
            WORKLOADS, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}
        )
        return str(
            eventually(
                lambda: (read_pod(cluster, name) or {}).get("spec", {}).get("nodeName"),
                60,
                what=f"{name} bound",
            )
        )

    assert [pod_on([degraded, clean]) for _ in range(3)] == [clean] * 3
    assert pod_on([degraded]) == degraded


# -- one bad GPU out of eight: the DRA device taint (docs/design.md "Per-GPU quarantine") -------------------


def unschedulable(admin: Admin, pod: str) -> bool:
    conditions = (read_pod(admin, pod) or {}).get("status", {}).get("conditions") or []
    return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)


def test_one_bad_gpu_of_eight_costs_one_gpu_through_a_dra_device_taint(
    cluster: Admin, full_control_plane: Any, fakenvml: Path, tmp_path: Path
) -> None:
    """The real scheduler, the controller-manager's device-taint eviction and a real agent: an Xid on GPU 3
    becomes one DeviceTaintRule; the pod holding GPU 3 is evicted (NoExecute), new claims never get GPU 3,
    the other seven keep being allocated, the node stays schedulable; after a reboot the rule is gone and
    GPU 3 is allocated again."""
    dra_objects(cluster)
    node, ds_pod, gpus = dra_node(cluster)

    pods = [make_gpu_pod(cluster, node, claim=CLAIM_TEMPLATE) for _ in range(8)]
    devices: dict[str, str] = {}
    for p in pods:
        eventually(lambda p=p: pod_ready(read_pod(cluster, p)), 90, what=f"{p} Ready")  # type: ignore[misc]
        devices[p] = eventually(lambda p=p: allocated_device(cluster, p), 10, what=f"{p}'s GPU")  # type: ignore[misc]
    assert sorted(devices.values()) == sorted(f"gpu-{i}" for i in range(8))
    holder = next(p for p, d in devices.items() if d == "gpu-3")

    state = tmp_path / "gpus.state"
    state.write_text(gpus)
    kubeconfig = daemon_pod_kubeconfig(cluster, full_control_plane, ds_pod, tmp_path)
    args = ("--taint-effect", "NoExecute", "--max-quarantined", "100%", "--node-resync", "1")
    agent = Agent(node=node, kubeconfig=kubeconfig, state=state, lib=fakenvml, args=args).start()
    rule = f"gpuguard.{node}.gpu-3"
    try:
        eventually(agent.ready, 15, what="agent /readyz")
        fault_at = time.monotonic()
        state.write_text(gpus + "xid 3 79\n")
        taint = eventually(lambda: device_rule(cluster, rule), 15, interval=0.02, what="the DeviceTaintRule")
        visible_at = time.monotonic()
        assert taint["spec"]["deviceSelector"] == {"driver": DRIVER, "pool": node, "device": "gpu-3"}
        assert taint["spec"]["taint"]["effect"] == "NoExecute"
        eventually(lambda: read_pod(cluster, holder) is None, 60, interval=0.1, what="GPU 3's pod evicted")
        evicted_at = time.monotonic()
        print(
            f"device taint: Xid -> rule visible {visible_at - fault_at:.2f} s, "
            f"rule -> pod on GPU 3 gone {evicted_at - visible_at:.2f} s"
        )
        # Only that pod: the other seven keep running, the node carries no taint of gpuguard's.
        time.sleep(2)
        for p in pods:
            if p != holder:
                assert pod_ready(read_pod(cluster, p)), f"{p} was disturbed"
        assert cluster.our_taint(node) is None and not cluster.node(node)["spec"].get("unschedulable")
        # New claims never get GPU 3: the replacement waits although GPU 3 is free ...
        replacement = make_gpu_pod(cluster, node, claim=CLAIM_TEMPLATE)
        eventually(lambda: unschedulable(cluster, replacement), 60, what="replacement Unschedulable")
        # ... and gets a good GPU as soon as one is free: the other seven keep being allocated.
        freed = next(p for p in pods if p != holder)
        cluster.core.delete_namespaced_pod(freed, WORKLOADS, grace_period_seconds=0)
        got = eventually(lambda: allocated_device(cluster, replacement), 90, what="replacement allocated")
        assert got == devices[freed] != "gpu-3"
        # The agent's /healthz names the GPU it holds out; `gpuguard status` lists it.
        _, health = agent.healthz()
        assert [g["device"] for g in health["gpu_quarantines"]] == ["gpu-3"]
        admin_api = kubeclient.load(str(full_control_plane.kubeconfig_path), user_agent="test")
        rows = [r for r in quarantined_gpus(admin_api) if r["node"] == node]
        assert [(r["device"], r["state"], r["reason"]) for r in rows] == [
            ("gpu-3", "gpu-quarantined", "xid-79")
        ]
    finally:
        agent.stop()

    # A reboot clears the Xid's evidence: the new agent (new boot) deletes the rule; GPU 3 is allocated again.
    cluster.set_boot_id(node, "boot-2")
    state.write_text(gpus)
    agent = Agent(
        node=node, kubeconfig=kubeconfig, state=state, lib=fakenvml, args=args, host_boot_id="host-boot-2"
    ).start()
    try:
        eventually(lambda: device_rule(cluster, rule) is None, 30, what="the rule deleted after the reboot")
        again = make_gpu_pod(cluster, node, claim=CLAIM_TEMPLATE)
        assert (
            eventually(lambda: allocated_device(cluster, again), 90, what="GPU 3 allocated again") == "gpu-3"
        )
    finally:
        agent.stop()


def test_a_lost_gpu_on_a_dra_node_still_quarantines_the_node(
    cluster: Admin, full_control_plane: Any, fakenvml: Path, tmp_path: Path
) -> None:
    """A lost GPU makes the whole node turn pods away: the node taint, no device rule, even with slices."""
    node, ds_pod, gpus = dra_node(cluster)
    state = tmp_path / "gpus.state"
    state.write_text(gpus)
    kubeconfig = daemon_pod_kubeconfig(cluster, full_control_plane, ds_pod, tmp_path)
    agent = Agent(
        node=node, kubeconfig=kubeconfig, state=state, lib=fakenvml, args=("--max-quarantined", "100%")
    )
    agent.start()
    try:
        eventually(agent.ready, 15, what="agent /readyz")
        state.write_text(
            gpus.replace(f"gpu 2 uuid={gpu_uuid(node, 2)}", f"gpu 2 uuid={gpu_uuid(node, 2)} lost=1")
        )
        assert eventually(lambda: cluster.tainted_for(node), 15, what="gpuguard's node taint") == "gpu-lost"
        assert device_rule(cluster, f"gpuguard.{node}.gpu-2") is None
    finally:
        agent.stop()


def remembered(state_dir: Path, rule: str) -> bool:
    """The agent's durable state (gpuguard.store.state) lists `rule` among the rules it made."""
    try:
        doc = json.loads((state_dir / "state.json").read_text())
    except (OSError, ValueError):
        return False
    return any(r.get("rule") == rule for r in (doc.get("device_rules") or {}).get("known") or [])


@pytest.mark.parametrize("noticed", [True, False], ids=["noticed-before-the-crash", "deleted-while-down"])
def test_a_rule_an_operator_deleted_is_not_recreated_after_the_agent_is_killed_and_restarted(
    cluster: Admin, full_control_plane: Any, fakenvml: Path, tmp_path: Path, noticed: bool
) -> None:
    """The memory of a rule deleted by hand lives in the agent's durable state (--state-dir), not only in
    the process: killed (SIGKILL) and started again in the same boot, with the Xid restored from that state
    (the driver does not deliver it again), the agent does not make the rule again."""
    node, ds_pod, gpus = dra_node(cluster)
    state = tmp_path / "gpus.state"
    state.write_text(gpus)
    kubeconfig = daemon_pod_kubeconfig(cluster, full_control_plane, ds_pod, tmp_path)
    args = ("--max-quarantined", "100%", "--node-resync", "1")
    rule = f"gpuguard.{node}.gpu-3"
    custom: Any = kubernetes.client.CustomObjectsApi(cluster.api)
    agent = Agent(node=node, kubeconfig=kubeconfig, state=state, lib=fakenvml, args=args).start()
    try:
        eventually(agent.ready, 15, what="agent /readyz")
        state.write_text(gpus + "xid 3 79\n")
        eventually(lambda: device_rule(cluster, rule), 15, interval=0.02, what="the DeviceTaintRule")
        # Killed once the agent has remembered its rule (after the create answered, in --state-dir): a kill
        # between the create and that write is the window docs/reliability.md names, where a rule deleted by
        # hand is made again; the API server shows the rule before the agent has read its answer.
        eventually(lambda: remembered(agent.state_dir, rule), 5, interval=0.01, what="the rule remembered")
        if noticed:
            custom.delete_cluster_custom_object(DRA, "v1", "devicetaintrules", rule)
            eventually(
                lambda: agent.events("device.rule_removed_by_operator"), 15, what="the deletion noticed"
            )
    finally:
        agent.kill()
    if not noticed:
        custom.delete_cluster_custom_object(DRA, "v1", "devicetaintrules", rule)
    state.write_text(gpus)  # the driver does not deliver the Xid to the new process
    agent = Agent(node=node, kubeconfig=kubeconfig, state=state, lib=fakenvml, args=args).start()
    try:
        eventually(agent.ready, 15, what="the restarted agent's /readyz")
        assert agent.events("state.restored"), "the Xid is restored from the durable state"
        time.sleep(3)  # three --node-resync periods: the rules read again each time
        assert device_rule(cluster, rule) is None
        assert not agent.events("device.tainted") and cluster.our_taint(node) is None
        if not noticed:
            assert agent.events("device.rule_removed_by_operator")
    finally:
        agent.stop()
        # A rule made again would count in the next tests' budgets on this shared control plane.
        with contextlib.suppress(kubernetes.client.ApiException):
            custom.delete_cluster_custom_object(DRA, "v1", "devicetaintrules", rule)


def test_slices_a_dra_driver_publishes_after_the_agent_started_are_used_from_the_next_fault(
    cluster: Admin, full_control_plane: Any, fakenvml: Path, tmp_path: Path
) -> None:
    """The DRA driver starts after the agent (its slices are not there at the agent's first read): the first
    GPU fault gets the node taint at once (never no quarantine), the agent reads the slices again after
    that write, and the next GPU fault gets its DeviceTaintRule, without an agent restart."""
    node, ds_pod, gpus = dra_node(cluster, published=False)
    state = tmp_path / "gpus.state"
    state.write_text(gpus)
    kubeconfig = daemon_pod_kubeconfig(cluster, full_control_plane, ds_pod, tmp_path)
    # --slice-refresh 0: the fault comes seconds after the agent's first read (600 s by default).
    args = ("--max-quarantined", "100%", "--slice-refresh", "0")
    agent = Agent(node=node, kubeconfig=kubeconfig, state=state, lib=fakenvml, args=args).start()
    custom: Any = kubernetes.client.CustomObjectsApi(cluster.api)
    try:
        eventually(agent.ready, 15, what="agent /readyz")
        publish(cluster, node)
        state.write_text(gpus + "xid 3 79\n")
        taint = eventually(lambda: cluster.tainted_for(node), 15, what="the node taint (no device known)")
        assert taint == "xid-79"
        # The refresh follows the taint's write on the same thread: the next fault is reconciled after it.
        state.write_text(gpus + "xid 3 79\nxid 5 79\n")
        rule = eventually(
            lambda: device_rule(cluster, f"gpuguard.{node}.gpu-5"), 15, what="GPU 5's DeviceTaintRule"
        )
        assert rule["spec"]["deviceSelector"]["device"] == "gpu-5"
        assert [e["gpus"] for e in agent.events("device.slices_changed")] == [8]
    finally:
        agent.stop()
        # Blocking rules count in every agent's budget: none left for the next tests.
        for name in (f"gpuguard.{node}.gpu-3", f"gpuguard.{node}.gpu-5"):
            with contextlib.suppress(ApiException):
                custom.delete_cluster_custom_object(DRA, "v1", "devicetaintrules", name)


def test_gpus_faulting_at_the_same_instant_past_the_budget_end_with_exactly_the_budgets_worth_blocking(
    cluster: Admin, full_control_plane: Any, fakenvml: Path, tmp_path: Path
) -> None:
    """Three DRA nodes of one GPU each (a rule costs a whole node), a budget of one node over a pool of
    their own: an Xid on every node at once. Each agent may see room before the others' rules land; the
    order check steps back all but the earliest, and the state holds past the settled second check."""
    pool = f"rules-{int(time.time() * 1000) % 10**8}"
    args = ("--max-quarantined", "1", "--gpu-node-selector", f"gpuguard-test/pool={pool}")
    custom: Any = kubernetes.client.CustomObjectsApi(cluster.api)
    agents, rules = [], []
    try:
        for i in range(3):
            node = make_gpu_node(cluster, gpus=1)
            cluster.core.patch_node(node, {"metadata": {"labels": {"gpuguard-test/pool": pool}}})
            cluster.set_boot_id(node, "boot-1")
            custom.create_cluster_custom_object(DRA, "v1", "resourceslices", nvidia_slice(node, gpus=1))
            ds_pod = eventually(lambda n=node: daemon_pod(cluster, n), 60, what="DaemonSet pod")  # type: ignore[misc]
            state = tmp_path / f"gpus-{i}.state"
            gpu = f"gpu 0 uuid={gpu_uuid(node, 0)}\n"
            state.write_text(gpu)
            (tmp_path / f"a{i}").mkdir()
            kubeconfig = daemon_pod_kubeconfig(cluster, full_control_plane, ds_pod, tmp_path / f"a{i}")
            agent = Agent(node=node, kubeconfig=kubeconfig, state=state, lib=fakenvml, args=args).start()
            agents.append((agent, state, gpu))
            rules.append(f"gpuguard.{node}.gpu-0")
        for agent, _, _ in agents:
            eventually(agent.ready, 15, what="agent /readyz")
        for _, state, gpu in agents:
            state.write_text(gpu + "xid 0 79\n")

        def effects() -> list[str]:
            return [
                ((device_rule(cluster, r) or {}).get("spec") or {}).get("taint", {}).get("effect", "")
                for r in rules
            ]

        eventually(
            lambda: sorted(effects()) == ["NoSchedule", "None", "None"], 30, what="one of three blocking"
        )
        time.sleep(VERIFY_SETTLE + 3)  # past every agent's second order check: nothing moves any more
        assert sorted(effects()) == ["NoSchedule", "None", "None"]
        docs = [device_rule(cluster, r) or {} for r in rules]
        blocking = [d for d in docs if d["spec"]["taint"]["effect"] == "NoSchedule"]

        def place(d: dict[str, Any]) -> tuple[str, str]:
            return d["metadata"]["annotations"]["gpuguard.io/since"], d["metadata"]["name"]

        for d in docs:
            if d is blocking[0]:
                continue
            why = d["metadata"]["annotations"]["gpuguard.io/quarantine-deferred"]
            if why.startswith("quarantine budget spent:"):
                # Stepped back by the order check: the rule that kept its place is earlier in the order.
                assert place(blocking[0]) < place(d), (blocking[0]["metadata"], d["metadata"])
            else:
                # Deferred at its create (an agent slower to write saw the budget already spent): made no
                # earlier than the blocking rule. Its since (whole seconds) may tie, and the tie goes by name.
                assert why == "budget spent", why
                assert d["metadata"]["creationTimestamp"] >= blocking[0]["metadata"]["creationTimestamp"]
    finally:
        for agent, _, _ in agents:
            agent.stop()
        for r in rules:
            with contextlib.suppress(ApiException):
                custom.delete_cluster_custom_object(DRA, "v1", "devicetaintrules", r)
