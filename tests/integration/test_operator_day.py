"""An operator's day on the real API server, with a real agent (the fake NVML library): `gpuguard hold`
puts a healthy GPU under a repeat offender's hold (the agent reads it at its next start, as the command
says), `gpuguard history` shows the hold and then the release from the summary the agent publishes on the
node, and `gpuguard status` counts the GPU nodes with a ready agent and names those without one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuguard.cli.fleet import NAMED
from harness.kube import NAMESPACE, Admin, eventually
from tests.integration.fixtures import RESYNC, admin, annotations_of, start_agent, unique  # noqa: F401

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
UUID = "GPU-it-0"


def gpuguard(control_plane: Any, *args: str, wait: bool = True) -> Any:
    command = [sys.executable, "-m", "gpuguard", *args, "--kubeconfig", str(control_plane.kubeconfig_path)]
    if not wait:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)


def test_hold_holds_a_gpu_through_the_agent_and_history_shows_the_hold_and_the_release(
    admin: Admin, start_agent: Any, control_plane: Any
) -> None:
    agent, node, state = start_agent(env=RESYNC)
    hold = gpuguard(
        control_plane, "hold", "--node", node, "--gpu", UUID, "--by", "it-operator", "--wait", wait=False
    )
    eventually(lambda: "gpuguard.io/hold" in annotations_of(admin, node), 20, what="hold written")
    agent.stop()  # gpuguard holds nothing on the node: its agent reads the hold at its next start
    agent, _, _ = start_agent(node=node, state=state, env=RESYNC)
    out, err = hold.communicate(timeout=90)
    assert hold.returncode == 0, out + err
    assert out.splitlines() == [
        f"{node}: hold of {UUID} by it-operator written; the agent holds it at its next read of the node",
        f"{node}: the agent holds {UUID}",
    ]
    assert f"gpuguard holds nothing on {node}, so its agent does not re-read the node" in err
    eventually(lambda: admin.our_taint(node), 10, what="held")
    assert admin.tainted_for(node) == "repeat-offender"  # the taint carries no value: the record says why
    assert "gpuguard.io/hold" not in annotations_of(admin, node)
    assert [e["by"] for e in agent.events("repeat.held")] == ["it-operator"]

    again = gpuguard(control_plane, "hold", "--node", node, "--gpu", UUID)
    assert again.returncode == 2 and f"{UUID} of {node} is already held" in again.stderr

    history = gpuguard(control_plane, "history", "--node", node)
    assert history.returncode == 0, history.stderr
    assert history.stdout.splitlines()[0] == f"{node}: 1 GPUs with a history, 1 held for repair"
    assert " hold  by it-operator (gpuguard hold); until `gpuguard release`" in history.stdout

    released = gpuguard(control_plane, "release", "--node", node, "--gpu", UUID, "--by", "it-ops", "--wait")
    assert released.returncode == 0, released.stderr
    assert admin.our_taint(node) is None
    shown = json.loads(gpuguard(control_plane, "history", "--node", node, "--gpu", UUID, "-o", "json").stdout)
    gpu = shown["gpus"][UUID]
    assert gpu["held_at"] is None and gpu["releases"][-1][0] == "it-ops"


def test_status_counts_ready_agents_and_names_the_gpu_nodes_without_one(
    admin: Admin, start_agent: Any, control_plane: Any
) -> None:
    _, served, _ = start_agent()
    # The agent runs as a process here: its Pod (made for its token) is marked Ready as a kubelet would.
    admin.core.patch_namespaced_pod_status(
        f"gpuguard-{served}", NAMESPACE, {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    )
    bare = unique("no-agent")
    admin.make_node(bare)  # labelled as a GPU node: the DaemonSet selects it, and no agent runs there
    unlabelled = unique("gpus-unlabelled")
    admin.make_node(unlabelled, labels={})
    admin.core.patch_node_status(unlabelled, {"status": {"capacity": {"nvidia.com/gpu": "8"}}})
    r = gpuguard(control_plane, "status", "-o", "json")
    assert r.returncode == 0, r.stderr
    fleet = json.loads(r.stdout)["fleet"]
    assert bare in fleet["without_agent"] and unlabelled in fleet["without_agent"]
    assert served not in fleet["without_agent"] and fleet["agents_ready"] >= 1
    assert fleet["gpu_nodes"] == fleet["agents_ready"] + len(fleet["without_agent"])
    assert fleet["budget_text"] == "10%"  # deploy/daemonset.yaml's
    table = gpuguard(control_plane, "status")
    assert table.stdout.splitlines()[0] == json.loads(r.stdout)["summary"]
    # The line names the first NAMED of them and counts the rest (the shared API server holds other tests'
    # nodes too).
    line, shown = table.stdout.splitlines()[1], fleet["without_agent"]
    assert line.startswith("GPU nodes without a ready agent: ") and all(n in line for n in shown[:NAMED])
    assert line.endswith(f" and {len(shown) - NAMED} more") if len(shown) > NAMED else bare in line
