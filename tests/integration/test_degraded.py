"""The degraded level on the real API server, written by the reconciler with the agent's own token
under the enforced admission policy: a degraded node gets the PreferNoSchedule taint, the GPUDegraded
condition, the label and the annotation, stays schedulable, is not counted by the quarantine budget, and
is released once clean for the recovery window."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from gpuguard.cli.uninstall import clean_node
from gpuguard.core.config import NodeSettings, QuarantineLimit
from gpuguard.core.model import Fault, GpuVerdict, Verdict
from gpuguard.kube import client as kubeclient
from gpuguard.quarantine.gpu.quarantine import DeviceQuarantine
from gpuguard.quarantine.gpu.writers import KubeDeviceSource
from gpuguard.quarantine.node.budget import QuarantineBudget
from gpuguard.quarantine.node.writers import KubeNodeWriter, degraded_nodes
from gpuguard.quarantine.reconciler import NodeReconciler
from harness import controlplane
from harness.dra import DRIVER, gpu_uuid, nvidia_slice
from harness.judging import hand_over
from harness.kube import Admin, enforced_admin, token_client, token_kubeconfig
from tests.integration.test_admission import FOREIGN, admin, new_node  # noqa: F401

pytestmark = pytest.mark.timeout(120)

DEGRADED_KEY = "gpuguard.io/gpu-degraded"
# docs/operations.md, "A degraded GPU".
LIST_DEGRADED = "kubectl get nodes -l gpuguard.io/degraded=true"
NVLINK = Fault("nvlink-down", "link 3 inactive", uuid="GPU-deg-0", gpu_index=0)
POWER = Fault("clock-power-brake", "12 of 20 samples", uuid="GPU-deg-1", gpu_index=1)


def verdict(*degraded: Fault) -> Verdict:
    return Verdict(
        gpus=tuple(
            GpuVerdict(index=i, uuid=f"GPU-deg-{i}", degraded=tuple(f for f in degraded if f.gpu_index == i))
            for i in range(2)
        )
    )


def agent_reconciler(
    admin: Admin, control_plane: Any, node: str, tmp_path: Path, **settings: Any
) -> tuple[NodeReconciler, KubeNodeWriter]:
    """The agent's reconciler and writer, as the DaemonSet's ServiceAccount bound to a Pod on `node`."""
    kubeconfig = token_kubeconfig(
        tmp_path / f"{node}.kubeconfig",
        server=control_plane.url,
        ca_path=control_plane.ca_path,
        token=admin.agent_token(node),
    )
    config = NodeSettings(name=node, max_quarantined=QuarantineLimit.parse("1"), **settings)
    writer = KubeNodeWriter(node, api=kubeclient.load(str(kubeconfig)))
    return NodeReconciler(writer, config, budget=QuarantineBudget(writer, config)), writer


def step(r: NodeReconciler, v: Verdict) -> None:
    streak = 0 if v.faults else 1
    hand_over(r, v, streak)
    r.reconcile_now()
    assert r.api.health.state == "ok", r.api.health


def conditions(n: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {c["type"]: c for c in n.get("status", {}).get("conditions") or []}


def test_a_degraded_node_is_marked_softly_stays_schedulable_outside_the_budget_and_is_released(
    admin: Admin, control_plane: Any, tmp_path: Path
) -> None:
    node = new_node(admin, taints=[FOREIGN])
    r, writer = agent_reconciler(admin, control_plane, node, tmp_path)
    step(r, verdict(NVLINK, POWER))
    n = admin.node(node)
    taints = n["spec"]["taints"]
    assert {"key": DEGRADED_KEY, "value": None, "effect": "PreferNoSchedule"} in [
        {k: t.get(k) for k in ("key", "value", "effect")} for t in taints
    ]
    assert FOREIGN in taints  # carried over as it was
    assert not n["spec"].get("unschedulable")  # never a cordon
    assert n["metadata"]["labels"]["gpuguard.io/degraded"] == "true"
    assert "gpuguard.io/quarantined" not in n["metadata"]["labels"]
    signals = json.loads(n["metadata"]["annotations"]["gpuguard.io/degraded-signals"])
    assert signals == ["clock-power-brake/GPU-deg-1", "nvlink-down/GPU-deg-0"]
    degraded = conditions(n)["GPUDegraded"]
    assert degraded["status"] == "True" and "GPU-deg-0" in degraded["message"]
    assert "GPU-deg-1" in degraded["message"]
    # The budget (the agent's own list of quarantined nodes) does not count it.
    assert node not in [name for _, name in writer.quarantine_order()]
    reasons = [
        e.reason for e in admin.core.list_namespaced_event("default").items if e.involved_object.name == node
    ]
    assert "GPUDegraded" in reasons
    # docs/operations.md's command lists it, with the pinned kubectl.
    bins = controlplane.cached_binaries()
    assert bins is not None and bins.kubectl is not None
    listed = subprocess.run(
        [str(bins.kubectl), *LIST_DEGRADED.split()[1:], "--kubeconfig", str(control_plane.kubeconfig_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert node in listed

    for _ in range(2):  # clean, within the recovery window (3 checks): the marks stay
        step(r, verdict())
    assert any(t["key"] == DEGRADED_KEY for t in admin.node(node)["spec"]["taints"])
    step(r, verdict())
    n = admin.node(node)
    assert FOREIGN in n["spec"]["taints"]
    assert not any(t["key"] == DEGRADED_KEY for t in n["spec"]["taints"])
    assert "gpuguard.io/degraded" not in (n["metadata"].get("labels") or {})
    assert "gpuguard.io/degraded-signals" not in (n["metadata"].get("annotations") or {})
    assert conditions(n)["GPUDegraded"]["status"] == "False"
    reasons = [
        e.reason for e in admin.core.list_namespaced_event("default").items if e.involved_object.name == node
    ]
    assert "GPUDegradedCleared" in reasons


def test_without_the_degraded_taint_the_condition_and_label_still_show_it(
    admin: Admin, control_plane: Any, tmp_path: Path
) -> None:
    node = new_node(admin)
    r, _ = agent_reconciler(admin, control_plane, node, tmp_path, degraded_taint=False)
    step(r, verdict(NVLINK))
    n = admin.node(node)
    assert not any(t["key"] == DEGRADED_KEY for t in n["spec"].get("taints") or [])
    assert n["metadata"]["labels"]["gpuguard.io/degraded"] == "true"
    assert conditions(n)["GPUDegraded"]["status"] == "True"


# -- a DRA node: the GPU's own effect-None DeviceTaintRule ---------------------------------------------------

DEVICE_POLICY = "gpuguard-own-devices-only"


@pytest.fixture(scope="module")
def dra_admin(admin_api: kubernetes.client.ApiClient, control_plane: Any) -> Admin:
    """deploy/ applied and the device policy enforced (probe: a rule for another node's GPU)."""

    def probe(a: Admin) -> Any:
        here, there = new_node(a), new_node(a)
        api = kubernetes.client.CustomObjectsApi(
            token_client(control_plane.url, control_plane.ca_path, a.agent_token(here))
        )
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceTaintRule",
            "metadata": {"name": f"gpuguard-degraded.{there}.gpu-0"},
            "spec": {
                "deviceSelector": {"driver": DRIVER, "pool": there, "device": "gpu-0"},
                "taint": {"key": DEGRADED_KEY, "effect": "None"},
            },
        }
        return lambda: api.create_cluster_custom_object(*RULES, body, dry_run="All")

    return enforced_admin(admin_api, policy=DEVICE_POLICY, probe=probe)


RULES = ("resource.k8s.io", "v1", "devicetaintrules")


def test_on_a_dra_node_a_degraded_gpu_gets_an_effect_none_rule_deleted_when_clean(
    dra_admin: Admin, control_plane: Any, tmp_path: Path
) -> None:
    admin = dra_admin
    node = new_node(admin)
    custom: Any = kubernetes.client.CustomObjectsApi(admin.api)
    uuids = [gpu_uuid(node, i) for i in range(8)]
    custom.create_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", nvidia_slice(node))
    api = kubeclient.load(
        str(
            token_kubeconfig(
                tmp_path / f"{node}.kubeconfig",
                server=control_plane.url,
                ca_path=control_plane.ca_path,
                token=admin.agent_token(node),
            )
        )
    )
    config = NodeSettings(name=node, max_quarantined=QuarantineLimit.parse("100%"))
    source = KubeDeviceSource(node, api=api, driver=DRIVER)
    r = NodeReconciler(KubeNodeWriter(node, api=api), config, devices=DeviceQuarantine(source, config))
    sick = Verdict(
        gpus=tuple(
            GpuVerdict(
                index=i,
                uuid=uuids[i],
                degraded=(Fault("nvlink-down", "link 3 inactive", uuid=uuids[i], gpu_index=i),)
                if i == 2
                else (),
            )
            for i in range(8)
        )
    )
    clean = Verdict(gpus=tuple(GpuVerdict(index=i, uuid=uuids[i]) for i in range(8)))

    def ours() -> list[dict[str, Any]]:
        items = custom.list_cluster_custom_object(*RULES, label_selector=f"gpuguard.io/node={node}")["items"]
        return list(items)

    step(r, sick)
    (rule,) = ours()
    assert rule["metadata"]["name"] == f"gpuguard-degraded.{node}.gpu-2"
    taint = {k: v for k, v in rule["spec"]["taint"].items() if k != "timeAdded"}
    assert taint == {"key": DEGRADED_KEY, "effect": "None"}
    assert rule["spec"]["deviceSelector"] == {"driver": DRIVER, "pool": node, "device": "gpu-2"}
    n = admin.node(node)
    assert not any(t["key"] == DEGRADED_KEY for t in n["spec"].get("taints") or [])  # the rule shows it
    assert conditions(n)["GPUDegraded"]["status"] == "True"
    assert not n["spec"].get("unschedulable")
    for _ in range(2):
        step(r, clean)
    assert len(ours()) == 1  # within the recovery window
    step(r, clean)
    assert ours() == []
    assert conditions(admin.node(node))["GPUDegraded"]["status"] == "False"


def test_uninstall_takes_the_degraded_marks_and_condition_off(
    admin: Admin, control_plane: Any, tmp_path: Path
) -> None:
    node = new_node(admin, taints=[FOREIGN])
    r, _ = agent_reconciler(admin, control_plane, node, tmp_path)
    step(r, verdict(NVLINK))
    assert conditions(admin.node(node))["GPUDegraded"]["status"] == "True"
    api = kubeclient.load(str(control_plane.kubeconfig_path))
    (row,) = [r for r in degraded_nodes(api, skip=set()) if r["node"] == node]  # `gpuguard status`
    assert (row["state"], row["reason"], row["degraded"]) == (
        "degraded",
        "nvlink-down",
        ["nvlink-down/GPU-deg-0"],
    )
    plan = clean_node(api, node)
    assert "condition GPUDegraded" in plan.describe() and "taint gpuguard.io/gpu-degraded" in plan.describe()
    n = admin.node(node)
    assert "GPUDegraded" not in conditions(n)
    assert not any(k.startswith("gpuguard.io/") for k in (n["metadata"].get("labels") or {}))
    assert not any(t["key"].startswith("gpuguard.io/") for t in n["spec"].get("taints") or [])
    assert FOREIGN in n["spec"]["taints"]
