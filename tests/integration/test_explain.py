"""`gpuguard explain` on a node an agent quarantined on the real API server: the agent reads the fake NVML
library and the kernel log's stand-in (which the library writes, as the driver does), keeps the evidence at
detection in its --state-dir, and explain shows it there; from a laptop, `--node` shows what the node carries
(its taint, the fault held with the rule that fired and what would clear it, gpuguard's Event)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.kube import GPUS_OK, Admin, eventually
from tests.integration.fixtures import admin, start_agent  # noqa: F401
from tests.integration.test_operator_commands import gpuguard

pytestmark = pytest.mark.timeout(120)


def test_explain_on_the_node_and_from_the_cluster_of_a_node_quarantined_for_a_kernel_logged_xid(
    admin: Admin, control_plane: Any, start_agent: Any, tmp_path: Path
) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.touch()
    agent, node, state = start_agent(args=("--kernel-log", str(kmsg)), env={"FAKE_NVML_KMSG": str(kmsg)})
    state.write_text(GPUS_OK + "xid 1 79\n")
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    assert admin.tainted_for(node) == "xid-79"  # the taint carries no value: the record says why
    evidence = agent.state_dir / "evidence.json"
    eventually(evidence.exists, 10, what="the evidence file")

    r = gpuguard(control_plane, "explain", "--state-dir", str(agent.state_dir), "-o", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    (entry,) = doc["timeline"]
    assert (doc["node"], entry["kind"], entry["key"], entry["gpu"]) == (node, "fault", "xid-79/GPU-it-1", 1)
    assert entry["rule"]["bucket"] == "RESTART_BM" and entry["clears"].startswith("sticky for this boot")
    assert any("NVRM: Xid (PCI:0000:3c:00): 79" in line for line in entry["kernel"]), entry["kernel"]
    assert entry["pods"] is None  # no kubelet here: unknown, not "none"
    assert entry["budget"]["max_quarantined"] == "100%" and entry["agent"]["settings_digest"]

    r = gpuguard(control_plane, "explain", "--node", node)
    assert r.returncode == 0, r.stderr
    assert f"node {node}, from the API server" in r.stdout
    assert "taints: gpuguard.io/gpu-unhealthy:NoSchedule" in r.stdout
    assert "  xid-79/GPU-it-1\n    rule:     Xid 79 in NVIDIA's catalog: bucket RESTART_BM" in r.stdout
    doc = json.loads(gpuguard(control_plane, "explain", "--node", node, "-o", "json").stdout)
    (held,) = doc["faults"]
    assert (held["key"], held["uuid"], held["rule"]["code"]) == ("xid-79/GPU-it-1", "GPU-it-1", 79)
    assert [e["event"] for e in doc["timeline"]] == ["GPUUnhealthy"], doc["timeline"]
    assert "xid-79" in doc["timeline"][0]["message"]


def test_explain_of_a_node_that_does_not_exist_is_one_line_exit_4(admin: Admin, control_plane: Any) -> None:
    r = gpuguard(control_plane, "explain", "--node", "no-such-node-explained")
    assert r.returncode == 4, r.stdout + r.stderr
    assert len(r.stderr.splitlines()) == 1 and "explain: " in r.stderr, r.stderr
