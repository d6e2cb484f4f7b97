"""The agent's peak memory against the worst its neighbours' tokens can leave on the real API server, every
policy applied (deploy/admission-policy*.yaml): RULES DeviceTaintRules of one node, each at the policy's
bounds (16 gpuguard.io/ annotations of 16 KiB together, managedFields of ~8 KiB of field names; CEL sees
one rule, never their count, so RULES is a choice: ten pages of the agent's reads), a quarantined node at
its bounds (16 gpuguard.io/ annotations of 32 KiB, 8 gpuguard.io/ labels, 8 gpuguard.io/ taints, GPUHealthy
and GPUDegraded messages of 32 KiB), and the agent's own node with those two messages and 7 more taints.

A DRA agent started then lists and watches every rule and the quarantined nodes and reads its own node; its
peak resident memory (VmHWM) must stay under the chart's memory limit (values.yaml resources.limits.memory,
128 Mi), where the red team's 100 rules of 1.2 MB took one to 288 MiB (the policies now refuse those: the
agent's bounded reads, gpuguard/kube/bounded.py, are the second line). The figure is printed.

What no policy bounds, an administrator's own writes, is the reads' to bound: ADMIN_RULES rules of 1.2 MB
each (the red team's size, written by an administrator) are dropped as they stream, counted and logged once,
and the agent's peak stays under the limit (the whole page parsed at once went over it).
"""

from __future__ import annotations

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from harness.dra import gpu_uuid, nvidia_slice
from harness.kube import Admin, agent_as_node, eventually, unique_node
from tests.integration.test_admission import agent_core
from tests.integration.test_device_admission import GROUP, PLURAL, VERSION, agent_api, rule
from tests.integration.test_stolen_token import MERGE, admin  # noqa: F401
from tests.integration.test_stolen_token_bounds import bomb

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
RULES = 1000
ADMIN_RULES = 40
KIB = 1024


def chart_limit() -> int:
    values = yaml.safe_load((ROOT / "deploy" / "helm" / "gpuguard" / "values.yaml").read_text())
    text = str(values["resources"]["limits"]["memory"])
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", text).groups()  # type: ignore[union-attr]
    return int(number) * (1024**2 if unit == "Mi" else 1024**3)


def worst_rule(node: str, i: int) -> dict[str, Any]:
    """A rule the device policy accepts, as large as it lets one be."""
    body = rule(node, f"gpu-{i}")
    body["metadata"]["annotations"] |= {f"gpuguard.io/pad-{j:02d}": "p" * 1000 for j in range(15)}
    body["metadata"]["managedFields"] = [bomb(120, api_version=f"{GROUP}/{VERSION}")]
    return body


def condition(kind: str, message: str) -> dict[str, Any]:
    return {"type": kind, "status": "False", "reason": "Pad", "message": message}


def bloat_node(admin: Admin, control_plane: Any, node: str, *, quarantined: bool) -> None:
    """The node at the node policy's bounds, written with its own agent token (what a stolen one can)."""
    core = agent_core(admin, control_plane, node)
    taints = list(admin.node(node)["spec"].get("taints") or [])
    ours = (
        [{"key": "gpuguard.io/gpu-unhealthy", "value": "ecc", "effect": "NoSchedule"}] if quarantined else []
    )
    pads = [
        {"key": f"gpuguard.io/pad-{i}", "value": "x" * 63, "effect": "PreferNoSchedule"} for i in range(7)
    ]
    meta: dict[str, Any] = {}
    if quarantined:
        meta = {
            "labels": {"gpuguard.io/quarantined": "true"}
            | {f"gpuguard.io/pad-{i}": "x" * 63 for i in range(7)},
            "annotations": {f"gpuguard.io/pad-{i:02d}": "a" * 2000 for i in range(16)},
        }
    core.patch_node(
        node, {"metadata": meta, "spec": {"taints": taints + (ours if quarantined else []) + pads}}, **MERGE
    )
    message = "m" * (32 * KIB - 64)
    conditions = [condition("GPUHealthy", message), condition("GPUDegraded", message)]
    core.patch_node_status(node, {"status": {"conditions": conditions}})


def remove(admin: Admin, *nodes: str) -> None:
    """The test's rules and nodes, gone: later tests of a session count every rule and quarantine."""
    custom: Any = kubernetes.client.CustomObjectsApi(admin.api)
    for node in nodes:
        custom.delete_collection_cluster_custom_object(
            GROUP, VERSION, PLURAL, label_selector=f"gpuguard.io/node={node}"
        )
        admin.core.delete_node(node)


def dra_agent(admin: Admin, control_plane: Any, fakenvml: Path, tmp_path: Path, node: str) -> Any:
    """A started agent on `node`, a GPU node whose eight GPUs NVIDIA's DRA driver publishes."""
    kubernetes.client.CustomObjectsApi(admin.api).create_cluster_custom_object(
        GROUP, "v1", "resourceslices", nvidia_slice(node)
    )
    state = tmp_path / "gpus.state"
    state.write_text("".join(f"gpu {i} uuid={gpu_uuid(node, i)}\n" for i in range(8)))
    args = ("--max-quarantined", "50%", "--node-resync", "1")
    return agent_as_node(admin, control_plane, node, state=state, lib=fakenvml, args=args).start()


def peak_rss(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB$", text, re.M).group(1)) * 1024  # type: ignore[union-attr]


def test_the_agents_peak_memory_under_the_worst_accepted_rules_and_nodes_stays_under_the_charts_limit(
    admin: Admin, control_plane: Any, fakenvml: Path, tmp_path: Path
) -> None:
    attacker = unique_node(admin, "bloat")
    api = agent_api(admin, control_plane, attacker)
    with ThreadPoolExecutor(4) as pool:
        made = list(
            pool.map(
                lambda i: (
                    api.create_cluster_custom_object(
                        GROUP, VERSION, PLURAL, worst_rule(attacker, i), _preload_content=False
                    ).status
                ),
                range(RULES),
            )
        )
    assert made == [201] * RULES
    bloat_node(admin, control_plane, attacker, quarantined=True)

    victim = unique_node(admin, "ceiling")
    bloat_node(admin, control_plane, victim, quarantined=False)
    agent = dra_agent(admin, control_plane, fakenvml, tmp_path, victim)
    try:
        eventually(agent.ready, 60, what="agent /readyz")
        watching = eventually(
            lambda: [e for e in agent.events("device.watching") if e["rules"] >= RULES],
            120,
            interval=0.5,
            what=f"the agent's watch of the {RULES} rules",
        )
        fleet = eventually(lambda: agent.events("fleet.watching"), 60, interval=0.5, what="the budget watch")
        peak = peak_rss(agent.pid)
    finally:
        agent.stop()
        remove(admin, attacker, victim)
    limit = chart_limit()
    print(
        f"agent peak RSS {peak / 2**20:.1f} MiB with {watching[0]['rules']} rules and "
        f"{fleet[0]['quarantined']} quarantined nodes in memory; the chart's limit {limit / 2**20:.0f} MiB"
    )
    assert fleet[0]["quarantined"] >= 1
    assert peak < limit, (peak, limit)


def test_rules_no_policy_bounds_are_dropped_as_they_stream_and_the_peak_stays_under_the_limit(
    admin: Admin, control_plane: Any, fakenvml: Path, tmp_path: Path
) -> None:
    owner = unique_node(admin, "admin-rules")
    custom: Any = kubernetes.client.CustomObjectsApi(admin.api)
    for i in range(ADMIN_RULES):
        body = rule(owner, f"gpu-{i}")
        body["metadata"]["managedFields"] = [bomb(20_000, api_version=f"{GROUP}/{VERSION}")]  # 1.2 MB
        custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, body, _preload_content=False)
    victim = unique_node(admin, "ceiling")
    agent = dra_agent(admin, control_plane, fakenvml, tmp_path, victim)
    try:
        eventually(agent.ready, 60, what="agent /readyz")
        eventually(lambda: agent.events("device.watching"), 120, interval=0.5, what="the rules' watch")
        peak = peak_rss(agent.pid)
        print(f"agent peak RSS {peak / 2**20:.1f} MiB with {ADMIN_RULES} rules of 1.2 MB")
        dropped = eventually(lambda: agent.events("kube.object_dropped"), 30, what="kube.object_dropped")
        with urllib.request.urlopen(f"http://127.0.0.1:{agent.port}/metrics", timeout=5) as r:
            metrics = r.read().decode()
    finally:
        agent.stop()
        remove(admin, owner, victim)
    limit = chart_limit()
    assert [(e["read"], e["max_bytes"]) for e in dropped] == [("list device taint rules", 256 * KIB)]
    counted = re.search(
        r'^gpuguard_api_objects_dropped_total\{read="list device taint rules"\} (\S+)$', metrics, re.M
    )
    assert counted is not None and float(counted.group(1)) >= ADMIN_RULES, metrics[-2000:]
    assert peak < limit, (peak, limit)
