"""Issue 29's second level on the real API server, written by the reconciler with the agent's own token
under the enforced admission policy: a degraded node gets the PreferNoSchedule taint, the GPUDegraded
condition, the label and the annotation, stays schedulable, is not counted by the quarantine budget, and
is released once clean for the recovery window."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuguard.config import NodeSettings, QuarantineLimit
from gpuguard.kube import client as kubeclient
from gpuguard.model import Fault, GpuVerdict, Verdict
from gpuguard.quarantine.node.budget import QuarantineBudget
from gpuguard.quarantine.node.writers import KubeNodeWriter
from gpuguard.quarantine.reconciler import NodeReconciler
from harness.kube import Admin, token_kubeconfig
from tests.integration.test_admission import FOREIGN, admin, new_node  # noqa: F401

pytestmark = pytest.mark.timeout(120)

DEGRADED_KEY = "gpuguard.io/gpu-degraded"
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
    r.submit(v, streak)
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
    assert {"key": DEGRADED_KEY, "value": "clock-power-brake", "effect": "PreferNoSchedule"} in [
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
