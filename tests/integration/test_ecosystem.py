"""Fitting the ecosystem on the real kube-apiserver: the GPUHealthy node condition, the startup gate
for new nodes (timed), /metrics, and `gpuguard status`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from harness.kube import GPUS_OK, ROOT, Admin, eventually
from tests.integration.fixtures import (  # noqa: F401
    ECC,
    LABEL,
    RESYNC,
    admin,
    labels,
    remove_our_taint,
    start_agent,
)

pytestmark = pytest.mark.timeout(180)
GATE = {"key": "gpuguard.io/unverified", "effect": "NoSchedule"}


def condition(admin: Admin, node: str) -> dict[str, Any] | None:
    conds = admin.node(node).get("status", {}).get("conditions") or []
    return next((c for c in conds if c["type"] == "GPUHealthy"), None)


def test_the_gpu_healthy_condition_tells_the_story_on_the_node(admin: Admin, start_agent: Any) -> None:
    agent, node, state = start_agent()
    c = eventually(lambda: condition(admin, node), 10, what="GPUHealthy condition")
    assert (c["status"], c["reason"]) == ("True", "GPUsHealthy")
    state.write_text(GPUS_OK + "xid 1 79\n")
    c = eventually(lambda: (x := condition(admin, node)) and x["status"] == "False" and x, 10, what="False")
    assert c["reason"] == "GPUFault"
    assert c["message"] == "xid-79: GPU has fallen off the bus (GPU 1, GPU-it-1) (1 of 2 GPUs unhealthy)"
    assert c["lastTransitionTime"]
    assert [e for e in agent.lines if e.get("event") == "node.condition_failed"] == []


def test_the_startup_gate_is_lifted_after_the_first_healthy_check_within_two_seconds(
    admin: Admin, start_agent: Any
) -> None:
    agent, node, _ = start_agent(taints=[GATE])

    # start_agent returns once /readyz is 200: the first check and reconcile are done.
    def gate_gone() -> bool:
        return not any(t["key"] == GATE["key"] for t in admin.node(node)["spec"].get("taints") or [])

    eventually(gate_gone, 10, interval=0.01, what="gate removal")
    took = time.monotonic() - agent.started_at
    print(f"startup gate removed {took:.2f}s after the agent process started")
    assert took < 2.0, f"{took:.2f}s"
    assert admin.our_taint(node) is None


def test_a_broken_gpu_adds_the_unhealthy_taint_and_keeps_the_startup_gate(
    admin: Admin, start_agent: Any, tmp_path: Any
) -> None:
    node = f"gpu-gate-{int(time.time() * 1000) % 100000}"
    admin.make_node(node, taints=[GATE])
    state = tmp_path / "gate.state"
    state.write_text(GPUS_OK.replace("GPU-it-1", "GPU-it-1 lost=1"))
    start_agent(node=node, state=state)
    keys = [t["key"] for t in admin.node(node)["spec"]["taints"]]
    assert "gpuguard.io/unverified" in keys  # never verified: the gate stays (see docs/design.md)
    assert admin.tainted_for(node) == "gpu-lost"


# A review of the agent on a cluster, defect 8.
def test_defect_08_a_never_verified_node_stays_gated_when_the_budget_is_spent(
    admin: Admin, start_agent: Any, tmp_path: Path
) -> None:
    gate = {"key": "gpuguard.io/unverified", "effect": "NoSchedule"}
    state = tmp_path / "gated.state"
    state.write_text(ECC)  # the first check already finds the fault
    _, node, _ = start_agent(state=state, taints=[gate], args=("--max-quarantined", "0"))
    taint = eventually(lambda: admin.our_taint(node), 10, what="taint")
    assert taint["effect"] == "PreferNoSchedule" and labels(admin, node)[LABEL] == "deferred"
    assert gate in admin.node(node)["spec"]["taints"]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_metrics_show_every_documented_series_and_change_on_a_fault(admin: Admin, start_agent: Any) -> None:
    agent, node, state = start_agent()
    before = scrape(agent.port)
    for name in [
        "gpuguard_gpu_healthy",
        "gpuguard_gpu_ecc_uncorrected_volatile",
        "gpuguard_node_quarantined",
        "gpuguard_check_duration_seconds_bucket",
        "gpuguard_api_requests_total",
        "gpuguard_last_check_timestamp_seconds",
        "gpuguard_build_info",
    ]:
        assert name in before, name
    assert sample(before, "gpuguard_gpu_healthy", gpu="1", uuid="GPU-it-1") == 1.0
    assert sample(before, "gpuguard_node_quarantined") == 0.0
    assert sample(before, "gpuguard_api_requests_total", verb="get", code="200") == 1.0
    state.write_text(GPUS_OK.replace("GPU-it-1", "GPU-it-1 ecc=4") + "xid 0 13\nxid 1 48\n")
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    time.sleep(0.5)
    after = scrape(agent.port)
    assert sample(after, "gpuguard_gpu_healthy", gpu="1", uuid="GPU-it-1") == 0.0
    assert sample(after, "gpuguard_gpu_ecc_uncorrected_volatile", gpu="1", uuid="GPU-it-1") == 4.0
    assert sample(after, "gpuguard_xid_events_total", xid="13", ignored="true") == 1.0
    assert sample(after, "gpuguard_xid_events_total", xid="48", ignored="false") == 1.0
    assert sample(after, "gpuguard_node_quarantined") == 1.0
    assert (sample(after, "gpuguard_api_requests_total", verb="patch", code="200") or 0) >= 1
    assert "gpuguard_api_retries_total" in after


def _quarantined_metric(port: int) -> float:
    # The real agent's gauge: dry_run="false" (a dry run exports dry_run="true").
    gauge = 'gpuguard_node_quarantined{dry_run="false"} '
    line = next(x for x in scrape(port).splitlines() if x.startswith(gauge))
    return float(line.split()[1])


# A review of the agent on a cluster, defect 9.
def test_defect_09_healthz_and_metrics_follow_an_operators_override(admin: Admin, start_agent: Any) -> None:
    agent, node, state = start_agent(env=RESYNC)
    state.write_text(ECC)
    eventually(lambda: agent.healthz()[1]["tainted"], 10, what="tainted on /healthz")
    eventually(lambda: _quarantined_metric(agent.port) == 1, 5, what="gpuguard_node_quarantined 1")
    remove_our_taint(admin, node)
    eventually(lambda: agent.healthz()[1]["tainted"] is False, 5, what="/healthz after the override")
    eventually(lambda: _quarantined_metric(agent.port) == 0, 5, what="gpuguard_node_quarantined 0")


def test_gpuguard_status_lists_the_quarantined_nodes(
    admin: Admin, control_plane: Any, start_agent: Any
) -> None:
    _, node, state = start_agent()
    state.write_text(GPUS_OK.replace("GPU-it-0", "GPU-it-0 ecc=2"))
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuguard",
            "status",
            "--kubeconfig",
            str(control_plane.kubeconfig_path),
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    row = next(x for x in json.loads(r.stdout)["rows"] if x["node"] == node)
    assert row["state"] == "quarantined" and row["reason"] == "ecc" and row["cordoned_by_gpuguard"] is True
    assert row["faults"] == ["ecc/GPU-it-0"] and row["since"]
    table = subprocess.run(
        [sys.executable, "-m", "gpuguard", "status", "--kubeconfig", str(control_plane.kubeconfig_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert table.returncode == 0 and node in table.stdout and "NODE" in table.stdout
