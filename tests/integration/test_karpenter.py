"""gpuguard's startup gate beside an autoscaler: Karpenter's kwok provider (sigs.k8s.io/karpenter, built by
hack/karpenter/build.sh) provisions simulated GPU nodes for pending pods, the real kube-scheduler places the
pods and a real gpuguard agent (the nvml backend on the fake library, as the DaemonSet pod's ServiceAccount)
checks each new node's GPUs.

The convention under test (README "Startup gate", docs/operations.md): the NodePool lists gpuguard's gate
in `spec.template.spec.startupTaints`. Karpenter then puts the gate on every node it launches, treats the
gated node as capacity for the pods it launched it for (no second node for the same pods), and counts the
node as initialized only once gpuguard has removed the gate. A node whose GPU is bad keeps the gate and gets
gpuguard's fault taint, which Karpenter does not know as a start-up taint: it launches a replacement.
The contrasts: the same gate as an ordinary NodePool taint makes Karpenter launch nothing at all, and a gate
the kubelet adds (--register-with-taints) without the startupTaints entry makes it launch node after node.

These tests run on a control plane of their own (karpenter_control_plane): the one of test_scheduling.py
plus Karpenter, which would otherwise launch nodes for the pods other tests leave pending on purpose.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from harness import controlplane
from harness.kube import (
    GPUS_OK,
    TAINT_KEY,
    WORKLOADS,
    Admin,
    Agent,
    admin_client,
    daemon_pod,
    eventually,
    pod_ready,
    token_kubeconfig,
    with_workloads,
)

pytestmark = pytest.mark.timeout(300)

GATE = "gpuguard.io/unverified"
GPUS_PER_NODE = 8  # hack/karpenter/instance-types.json: the one instance type, gpu-8x
GPU_BAD = "gpu 0 uuid=GPU-it-0\ngpu 1 uuid=GPU-it-1 lost=1\n"  # off the bus before the first check
NODEPOOL_LABEL = "karpenter.sh/nodepool"
KARPENTER = ("karpenter.sh", "v1")
_names = itertools.count()


@pytest.fixture(scope="module")
def cluster(karpenter_control_plane: Any) -> Iterator[Admin]:
    """deploy/ applied (DaemonSet, RBAC, admission policy), a namespace for the workloads and the
    KWOKNodeClass every NodePool here refers to."""
    with admin_client(karpenter_control_plane) as api:
        admin = with_workloads(Admin(api))
        custom(admin).create_cluster_custom_object(
            "karpenter.kwok.sh",
            "v1alpha1",
            "kwoknodeclasses",
            {
                "apiVersion": "karpenter.kwok.sh/v1alpha1",
                "kind": "KWOKNodeClass",
                "metadata": {"name": "gpu"},
            },
        )
        yield admin


def custom(admin: Admin) -> Any:
    return kubernetes.client.CustomObjectsApi(admin.api)


def make_nodepool(
    admin: Admin, *, startup_taints: list[dict[str, str]], taints: list[dict[str, str]] | None = None
) -> str:
    """A NodePool of GPU nodes (the GPU labels the DaemonSet selects on, 8 GPUs each) that never removes a
    node by itself (no consolidation), at most 5 nodes."""
    name = f"gpu-{next(_names)}"
    custom(admin).create_cluster_custom_object(
        *KARPENTER,
        "nodepools",
        {
            "apiVersion": "karpenter.sh/v1",
            "kind": "NodePool",
            "metadata": {"name": name},
            "spec": {
                "template": {
                    "metadata": {
                        "labels": {
                            "nvidia.com/gpu.present": "true",
                            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                        }
                    },
                    "spec": {
                        "nodeClassRef": {
                            "group": "karpenter.kwok.sh",
                            "kind": "KWOKNodeClass",
                            "name": "gpu",
                        },
                        "requirements": [
                            {
                                "key": "node.kubernetes.io/instance-type",
                                "operator": "In",
                                "values": ["gpu-8x"],
                            }
                        ],
                        "startupTaints": startup_taints,
                        "taints": taints or [],
                        "expireAfter": "Never",
                    },
                },
                "disruption": {"consolidationPolicy": "WhenEmpty", "consolidateAfter": "Never"},
                "limits": {"nvidia.com/gpu": str(5 * GPUS_PER_NODE)},
            },
        },
    )
    return name


def make_pods(admin: Admin, nodepool: str, count: int) -> list[str]:
    """`count` pods of one GPU each, for `nodepool`'s nodes, with no toleration for gpuguard's taints (as
    deploy/examples/inference-preflight.yaml)."""
    names = []
    for _ in range(count):
        name = f"llm-{nodepool}-{next(_names)}"
        admin.core.create_namespaced_pod(
            WORKLOADS,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "labels": {"app": nodepool}},
                "spec": {
                    "nodeSelector": {NODEPOOL_LABEL: nodepool},
                    "containers": [
                        {
                            "name": "server",
                            "image": "registry.example/llm-server:1",
                            "resources": {"limits": {"nvidia.com/gpu": "1"}},
                        }
                    ],
                },
            },
        )
        names.append(name)
    return names


def pods_of(admin: Admin, nodepool: str) -> list[dict[str, Any]]:
    resp = admin.core.list_namespaced_pod(WORKLOADS, label_selector=f"app={nodepool}", _preload_content=False)
    return json.loads(resp.data)["items"]  # type: ignore[no-any-return]


def nodeclaims_of(admin: Admin, nodepool: str) -> list[dict[str, Any]]:
    found = custom(admin).list_cluster_custom_object(
        *KARPENTER, "nodeclaims", label_selector=f"{NODEPOOL_LABEL}={nodepool}"
    )
    return found["items"]  # type: ignore[no-any-return]


def nodes_of(admin: Admin, nodepool: str) -> list[dict[str, Any]]:
    resp = admin.core.list_node(label_selector=f"{NODEPOOL_LABEL}={nodepool}", _preload_content=False)
    return json.loads(resp.data)["items"]  # type: ignore[no-any-return]


def taint_keys(node: dict[str, Any]) -> set[str]:
    return {t["key"] for t in node["spec"].get("taints") or []}


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in obj.get("status", {}).get("conditions") or [] if c["type"] == kind), {})


def registered_and_gated(node: dict[str, Any]) -> bool:
    """Karpenter registered the node (its own karpenter.sh/unregistered taint gone, the NodePool's startup
    taints added) and kwok runs it (Ready)."""
    keys = taint_keys(node)
    return (
        "karpenter.sh/unregistered" not in keys
        and GATE in keys
        and condition(node, "Ready").get("status") == "True"
    )


def describe(admin: Admin, nodepool: str) -> str:
    """What a failed wait shows: the NodePool's nodes (taints, Ready), NodeClaims (Initialized) and pods."""
    lines = []
    for n in nodes_of(admin, nodepool):
        ready = condition(n, "Ready").get("status")
        lines.append(f"node {n['metadata']['name']} Ready={ready} taints={sorted(taint_keys(n))}")
    for c in nodeclaims_of(admin, nodepool):
        init = condition(c, "Initialized")
        node = c.get("status", {}).get("nodeName")
        state = f"Initialized={init.get('status')} {init.get('reason')}"
        lines.append(f"nodeclaim {c['metadata']['name']} node={node} {state}")
    for p in pods_of(admin, nodepool):
        sched = condition(p, "PodScheduled")
        where = f"node={p['spec'].get('nodeName')} phase={p['status'].get('phase')}"
        lines.append(f"pod {p['metadata']['name']} {where} {sched.get('message', '')}")
    return "\n".join(lines)


class AgentPerNode:
    """What the DaemonSet does for every node Karpenter launches, with a real agent process: once started, a
    thread starts `gpuguard watch` for each node of the NodePool as soon as the DaemonSet controller's pod
    runs there, on the GPUs `gpus(node)` describes."""

    def __init__(self, admin: Admin, cluster: Any, nodepool: str, lib: Path, tmp: Path) -> None:
        self.admin, self.cluster, self.nodepool, self.lib, self.tmp = admin, cluster, nodepool, lib, tmp
        self.agents: dict[str, Agent] = {}
        self.gpus: Callable[[str], str] = lambda _node: GPUS_OK
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, gpus: Callable[[str], str]) -> None:
        self.gpus = gpus
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for node in nodes_of(self.admin, self.nodepool):
                    name = node["metadata"]["name"]
                    pod = None if name in self.agents else daemon_pod(self.admin, name)
                    if pod is not None:
                        self._start(name, pod["metadata"]["name"])
                self._stop.wait(0.2)
        except BaseException as exc:  # reported by stop(), in the test's thread
            self.error = exc

    def _start(self, node: str, pod: str) -> None:
        """The agent as the DaemonSet's pod on `node` (kwok runs the pod; it tolerates the gate), with a token
        of gpuguard's ServiceAccount bound to that very pod."""
        state = self.tmp / f"{node}.state"
        state.write_text(self.gpus(node))
        kubeconfig = token_kubeconfig(
            self.tmp / f"{node}.kubeconfig",
            server=self.cluster.url,
            ca_path=self.cluster.ca_path,
            token=self.admin.pod_token(pod),
        )
        agent = Agent(
            node=node, kubeconfig=kubeconfig, state=state, lib=self.lib, args=("--max-quarantined", "100%")
        )
        self.agents[node] = agent
        agent.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        for agent in self.agents.values():
            if agent.proc is not None and agent.proc.poll() is None:
                agent.stop()
        if self.error is not None:
            raise self.error


@pytest.fixture
def agents(
    cluster: Admin, karpenter_control_plane: Any, fakenvml: Path, tmp_path: Path
) -> Iterator[Callable[[str], AgentPerNode]]:
    started: list[AgentPerNode] = []

    def make(nodepool: str) -> AgentPerNode:
        a = AgentPerNode(cluster, karpenter_control_plane, nodepool, fakenvml, tmp_path)
        started.append(a)
        return a

    yield make
    for a in started:
        a.stop()


def kubectl(cp: Any, *args: str) -> str:
    """The pinned kubectl (hack/testenv) as the admin, as an operator runs it."""
    bins = controlplane.cached_binaries()
    assert bins is not None and bins.kubectl is not None
    result = subprocess.run(
        [str(bins.kubectl), f"--kubeconfig={cp.kubeconfig_path}", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_karpenter_launches_gated_nodes_once_and_pods_land_only_where_gpuguard_verified_the_gpus(
    cluster: Admin, karpenter_control_plane: Any, agents: Callable[[str], AgentPerNode]
) -> None:
    pool = make_nodepool(cluster, startup_taints=[{"key": GATE, "effect": "NoSchedule"}])
    pods = make_pods(cluster, pool, 12)  # 8 + 4: two gpu-8x nodes

    # Karpenter launches two nodes for the 12 pods, each registered behind the gate.
    def two_gated() -> list[dict[str, Any]] | None:
        listed = nodes_of(cluster, pool)
        return listed if len(listed) >= 2 and all(map(registered_and_gated, listed)) else None

    nodes = eventually(two_gated, 90, interval=0.5, what="two nodes registered behind the gate")
    # No agent runs yet (as between a node's registration and its DaemonSet pod's start). Karpenter knows the
    # gate as a start-up taint: it counts the gated nodes as capacity for the pending pods and launches
    # nothing more, and it waits for the gate's removal before it calls a node initialized.
    time.sleep(12)  # longer than Karpenter's batch window (10 s at most) and several provisioning passes
    claims = nodeclaims_of(cluster, pool)
    assert len(claims) == 2, [c["metadata"]["name"] for c in claims]
    for claim in claims:
        initialized = condition(claim, "Initialized")
        assert initialized.get("status") != "True", claim["metadata"]["name"]
        assert initialized.get("reason") == "StartupTaintsExist", initialized
    assert all(not p["spec"].get("nodeName") for p in pods_of(cluster, pool)), "a pod bound to a gated node"

    # The agents start: the first node has a GPU off the bus, every other one is healthy.
    bad = sorted(n["metadata"]["name"] for n in nodes)[0]
    runner = agents(pool)
    runner.start(lambda node: GPU_BAD if node == bad else GPUS_OK)

    def all_ready() -> list[dict[str, Any]] | None:
        listed = pods_of(cluster, pool)
        return listed if len(listed) == len(pods) and all(map(pod_ready, listed)) else None

    try:
        placed = eventually(all_ready, 120, interval=0.5, what="all 12 pods Ready")
    except AssertionError:
        print(describe(cluster, pool), f"agents: {sorted(runner.agents)}, error: {runner.error!r}", sep="\n")
        raise

    # The bad node keeps the gate beside gpuguard's fault taint and got no pod; Karpenter launched exactly one
    # replacement for it, and every pod runs on a node whose gate gpuguard lifted.
    bad_node = cluster.node(bad)
    assert {GATE, TAINT_KEY} <= taint_keys(bad_node)
    hosts = {p["spec"]["nodeName"] for p in placed}
    assert bad not in hosts
    claims = nodeclaims_of(cluster, pool)
    assert len(claims) == 3, [c["metadata"]["name"] for c in claims]
    for host in hosts:
        assert GATE not in taint_keys(cluster.node(host)), host

    def hosts_initialized() -> dict[str, dict[str, Any]] | None:
        by_node = {c["status"]["nodeName"]: condition(c, "Initialized") for c in nodeclaims_of(cluster, pool)}
        return by_node if all(by_node[h].get("status") == "True" for h in hosts) else None

    # Karpenter marks a claim initialized in its own reconcile, shortly after the gate's removal.
    by_node = eventually(hosts_initialized, 30, interval=0.5, what="the hosts' NodeClaims Initialized")
    assert by_node[bad].get("status") != "True"
    assert by_node[bad].get("reason") == "StartupTaintsExist", by_node[bad]

    # docs/operations.md: deleting the bad node's NodeClaim returns the machine, and nothing else moves. Its
    # agent goes with the node (as the DaemonSet's pod would).
    runner.agents[bad].stop()
    bad_claim = next(c["metadata"]["name"] for c in claims if c["status"]["nodeName"] == bad)
    kubectl(karpenter_control_plane, "delete", "nodeclaim", bad_claim, "--wait=false")
    eventually(
        lambda: bad not in {n["metadata"]["name"] for n in nodes_of(cluster, pool)}, 60, what="bad node gone"
    )
    assert {n["metadata"]["name"] for n in nodes_of(cluster, pool)} == hosts
    assert all(map(pod_ready, pods_of(cluster, pool)))


def test_the_gate_as_an_ordinary_nodepool_taint_makes_karpenter_launch_nothing(cluster: Admin) -> None:
    """The contrast: listed under `taints` instead of `startupTaints`, Karpenter takes the gate for a taint
    the nodes keep for ever. Pods without a toleration for it can never run there, so it launches no node and
    the pods stay pending (Karpenter says why on the pod)."""
    pool = make_nodepool(cluster, startup_taints=[], taints=[{"key": GATE, "effect": "NoSchedule"}])
    (pod,) = make_pods(cluster, pool, 1)

    def karpenter_says_why() -> list[str]:
        resp = cluster.core.list_namespaced_event(
            WORKLOADS, field_selector=f"involvedObject.name={pod}", _preload_content=False
        )
        return [
            e["message"]
            for e in json.loads(resp.data)["items"]
            if "karpenter" in (e.get("reportingComponent") or e.get("source", {}).get("component") or "")
            and "did not tolerate" in e["message"]
        ]

    messages = eventually(karpenter_says_why, 60, interval=0.5, what="Karpenter's event on the pod")
    assert GATE in messages[0]
    time.sleep(12)  # several provisioning passes
    assert nodeclaims_of(cluster, pool) == []
    assert not (pods_of(cluster, pool)[0]["spec"].get("nodeName"))


def register_with_gate(admin: Admin, nodepool: str) -> None:
    """What a kubelet started with `--register-with-taints=gpuguard.io/unverified=:NoSchedule` does, for the
    nodes of `nodepool` (kwok has no kubelet): a MutatingAdmissionPolicy adds the gate to the Node as it is
    created, beside Karpenter's own karpenter.sh/unregistered taint."""
    api: Any = kubernetes.client.AdmissionregistrationV1Api(admin.api)
    name = f"register-with-gate-{nodepool}"
    gate = f'Object.spec.taints{{key: "{GATE}", effect: "NoSchedule"}}'
    api.create_mutating_admission_policy(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE"],
                            "resources": ["nodes"],
                        }
                    ]
                },
                "matchConditions": [
                    {
                        "name": "nodepool",
                        "expression": (
                            f"object.metadata.?labels[?'{NODEPOOL_LABEL}'].orValue('') == '{nodepool}'"
                        ),
                    }
                ],
                "failurePolicy": "Fail",
                "reinvocationPolicy": "Never",
                "mutations": [
                    {
                        "patchType": "JSONPatch",
                        "jsonPatch": {
                            "expression": f'[JSONPatch{{op: "add", path: "/spec/taints/-", value: {gate}}}]'
                        },
                    }
                ],
            },
        }
    )
    api.create_mutating_admission_policy_binding(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {"policyName": name},
        }
    )


def test_a_gate_the_kubelet_adds_without_a_startup_taint_entry_makes_karpenter_launch_node_after_node(
    cluster: Admin,
) -> None:
    """The contrast the startupTaints entry prevents: nodes that register with the gate (the kubelet's
    --register-with-taints) from a NodePool that does not list it. Karpenter believes a gated node can
    never take the pending pod, so it launches another one, which registers gated too, up to the NodePool's
    limit."""
    pool = make_nodepool(cluster, startup_taints=[])
    register_with_gate(cluster, pool)
    make_pods(cluster, pool, 1)

    def over_provisioned() -> list[dict[str, Any]] | None:
        claims = nodeclaims_of(cluster, pool)
        return claims if len(claims) >= 3 else None

    try:
        eventually(over_provisioned, 90, interval=0.5, what="Karpenter launching a 3rd node for one pod")
    except AssertionError:
        print(describe(cluster, pool))
        raise
    assert all(GATE in taint_keys(n) for n in nodes_of(cluster, pool))
    assert not pods_of(cluster, pool)[0]["spec"].get("nodeName")
