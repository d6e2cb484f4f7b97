"""The DaemonSet finds every GPU node: kube-controller-manager's DaemonSet controller, with deploy/'s
DaemonSet (whose node affinity the chart renders the same: tests/test_helm.py), places gpuguard's pod on
kwok nodes labelled as each platform labels its GPU nodes, and on none of the others (a CPU node, an AMD
GPU node, a TPU node); and the budget's selector (GPUGUARD_GPU_NODE_SELECTOR, one ";"-separated
alternative per affinity term) lists the same nodes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import yaml

from gpuguard.kube import client as kubeclient
from gpuguard.kube import nodes
from harness.kube import ROOT, Admin, admin_client, daemon_pod, eventually, make_gpu_node, with_workloads

pytestmark = pytest.mark.timeout(300)

# How each platform labels a GPU node it made (docs/operations.md, "Finding every GPU node").
PLATFORMS = {
    "gpu-operator": {"nvidia.com/gpu.present": "true"},
    "nfd": {"feature.node.kubernetes.io/pci-10de.present": "true"},
    "gke": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
    "aks": {"kubernetes.azure.com/accelerator": "nvidia", "kubernetes.azure.com/agentpool": "gpunp"},
    "karpenter-aws": {
        "karpenter.k8s.aws/instance-gpu-manufacturer": "nvidia",
        "karpenter.k8s.aws/instance-gpu-count": "8",
        "karpenter.sh/nodepool": "gpu",
    },
    "eks-auto-mode": {"eks.amazonaws.com/instance-gpu-manufacturer": "nvidia"},
    "eks-node-group": {"k8s.amazonaws.com/accelerator": "nvidia-h100", "eks.amazonaws.com/nodegroup": "gpu"},
}
# Not GPU nodes: a CPU node, an AMD GPU instance from Karpenter, a GKE TPU node.
OTHERS = {
    "cpu": {"node.kubernetes.io/instance-type": "m7i.2xlarge"},
    "karpenter-amd": {
        "karpenter.k8s.aws/instance-gpu-manufacturer": "amd",
        "karpenter.k8s.aws/instance-gpu-count": "1",
    },
    "gke-tpu": {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice"},
}


@pytest.fixture(scope="module")
def cluster(full_control_plane: Any) -> Iterator[Admin]:
    with admin_client(full_control_plane) as api:
        yield with_workloads(Admin(api))


def _selector() -> str:
    docs = yaml.safe_load_all((ROOT / "deploy/daemonset.yaml").read_text())
    ds = next(d for d in docs if d and d["kind"] == "DaemonSet")
    env = {e["name"]: e.get("value") for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]}
    return str(env["GPUGUARD_GPU_NODE_SELECTOR"])


def test_the_daemon_set_runs_on_every_platforms_gpu_nodes_and_on_no_other_node(
    cluster: Admin, full_control_plane: Any
) -> None:
    gpu = {platform: make_gpu_node(cluster, labels=labels) for platform, labels in PLATFORMS.items()}
    other = {kind: make_gpu_node(cluster, gpus=0, labels=labels) for kind, labels in OTHERS.items()}
    for platform, node in gpu.items():
        eventually(partial(daemon_pod, cluster, node), 60, what=f"gpuguard's pod on the {platform} node")
    time.sleep(3)  # the DaemonSet controller has placed every pod it will (above): none comes later
    pods = cluster.core.list_namespaced_pod("gpuguard").items
    placed = {p.spec.node_name for p in pods}
    assert not placed & set(other.values()), {k: v for k, v in other.items() if v in placed}
    # The budget counts what the DaemonSet runs on: the agent's own list, by its selector, finds these nodes.
    api = kubeclient.load(str(full_control_plane.kubeconfig_path))
    found = nodes.select(api, _selector(), what="GPU nodes", metadata_only=True)
    listed = {i["metadata"]["name"] for i in found}
    assert set(gpu.values()) <= listed and not listed & set(other.values())
