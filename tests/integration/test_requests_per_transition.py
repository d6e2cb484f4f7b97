"""Issue 15, point 2: a fault transition costs at most three API requests, the node patch, the GPUHealthy
condition and the Event, counted at the real API server (its audit log), on the way in and on the way out,
with a quarantine budget in force. Before the budget moved off the fault's path it cost five: the budget's
list, the patch, the condition, the Event, and the order check's list."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from gpuguard.core.config import NodeSettings, PolicySettings, QuarantineLimit
from gpuguard.core.model import GpuReading, Snapshot
from gpuguard.kube import client as kubeclient
from gpuguard.nvml.base import Wakeup, wait_for
from gpuguard.quarantine.node.writers import KubeNodeWriter
from gpuguard.quarantine.reconciler import NodeReconciler
from gpuguard.runtime.agent import Agent as LoopAgent
from harness.dra import gpu_uuid, nvidia_slice
from harness.kube import GPU_NODE_LABELS, GPUS_OK, Admin, eventually
from tests.integration.fixtures import USER_AGENT, admin, start_agent, unique  # noqa: F401

pytestmark = pytest.mark.timeout(120)

THE_THREE = Counter({"patch nodes": 1, "patch nodes/status": 1, "create events": 1})


def requests_since(control_plane: Any, since: int) -> Counter[str]:
    """The agent's requests since audit line `since`, as "verb resource[/subresource]"; its long-running watch
    left out (one per agent, not per transition: it ends and starts again every 5 minutes)."""
    out: Counter[str] = Counter()
    for e in control_plane.audit_events(USER_AGENT, since_line=since, stage="ResponseComplete"):
        if e["verb"] == "watch":
            continue
        ref = e.get("objectRef", {})
        sub = f"/{ref['subresource']}" if ref.get("subresource") else ""
        out[f"{e['verb']} {ref.get('resource')}{sub}"] += 1
    return out


def transition(
    admin: Admin, control_plane: Any, node: str, state: Any, content: str, *, tainted: bool, reason: str
) -> Counter[str]:
    """Write `content` to the fake NVML state, wait for the taint (or its absence), the condition and three
    requests (the Event is written last), give the agent a second more (an order check would run then), and
    return its requests."""
    since = control_plane.audit_line_count()
    state.write_text(content)
    eventually(lambda: (admin.our_taint(node) is not None) == tainted or None, 10, what="the taint")
    want = "False" if tainted else "True"
    wait_condition(admin, node, want)
    eventually(
        lambda: sum(requests_since(control_plane, since).values()) >= 3 or None,
        10,
        what=f"the {reason} Event (written last)",
    )
    time.sleep(1.0)
    got = requests_since(control_plane, since)
    print(f"{reason}: {dict(got)}")  # a failed comparison shows the whole count
    return got


def wait_condition(admin: Admin, node: str, status: str) -> None:
    eventually(
        lambda: (
            any(
                c["type"] == "GPUHealthy" and c["status"] == status
                for c in admin.node(node)["status"].get("conditions") or []
            )
            or None
        ),
        10,
        what=f"the condition GPUHealthy={status}",
    )


def watching(agent: Any) -> bool:
    return any(line.get("event") == "fleet.watching" for line in agent.lines)


def test_a_fault_and_its_recovery_cost_three_requests_each_under_a_count_budget(
    admin: Admin, control_plane: Any, start_agent: Any
) -> None:
    agent, node, state = start_agent(args=("--max-quarantined", "1000"))
    eventually(lambda: watching(agent) or None, 10, what="the budget's watch")
    faulty = GPUS_OK.replace("GPU-it-1", "GPU-it-1 ecc=2")
    assert (
        transition(admin, control_plane, node, state, faulty, tainted=True, reason="GPUUnhealthy")
        == THE_THREE
    )
    assert (
        transition(admin, control_plane, node, state, GPUS_OK, tainted=False, reason="GPURecovered")
        == THE_THREE
    )


def pool_agent(start_agent: Any, *, spread: str) -> tuple[Any, str, Any]:
    """An agent whose percentage budget counts only its own node (a pool of one, so nothing else counts)."""
    pool = f"requests-{uuid.uuid4().hex[:8]}"
    labels = {**GPU_NODE_LABELS, "gpuguard-test/pool": pool}
    args = (
        *("--max-quarantined", "50%", "--gpu-node-selector", f"gpuguard-test/pool={pool}"),
        *("--flap-window", "0", "--budget-count-spread", spread),
    )
    agent, node, state = start_agent(args=args, labels=labels)
    eventually(lambda: watching(agent) or None, 10, what="the budget's watch")
    return agent, node, state


def test_under_a_percentage_budget_faults_cost_three_requests_once_the_gpu_nodes_are_counted(
    admin: Admin, control_plane: Any, start_agent: Any
) -> None:
    agent, node, state = pool_agent(start_agent, spread="0")
    eventually(
        lambda: any(line.get("event") == "fleet.gpu_nodes_counted" for line in agent.lines) or None,
        10,
        what="the first count",
    )
    faulty = GPUS_OK.replace("GPU-it-1", "GPU-it-1 ecc=2")
    for content, tainted, reason in ((faulty, True, "GPUUnhealthy"), (GPUS_OK, False, "GPURecovered")) * 2:
        assert (
            transition(admin, control_plane, node, state, content, tainted=tainted, reason=reason)
            == THE_THREE
        )


def test_before_the_first_count_a_fault_with_nothing_quarantined_needs_no_list(
    admin: Admin, control_plane: Any, start_agent: Any
) -> None:
    """The GPU nodes are at least this one: 50% of at least one node is room for one, without a list."""
    agent, node, state = pool_agent(start_agent, spread="3600")
    faulty = GPUS_OK.replace("GPU-it-1", "GPU-it-1 ecc=2")
    assert (
        transition(admin, control_plane, node, state, faulty, tainted=True, reason="GPUUnhealthy")
        == THE_THREE
    )
    assert not any(line.get("event") == "fleet.gpu_nodes_counted" for line in agent.lines)


def test_a_gpu_fault_held_by_a_device_taint_rule_and_its_recovery_cost_two_requests_each(
    admin: Admin, control_plane: Any, start_agent: Any, tmp_path: Path
) -> None:
    """The per-GPU quarantine (issue 17) under the same bound: the rule (create, or delete on recovery) in
    place of the node patch, and the condition; no Event (the node's Events are about the node taint), and
    no list: the budget's rules come from a watch (quarantine/gpu/watch.py). A count budget in force (the
    rule's share). Before the watch: a list before the create, one after it and one 10 s later."""
    node = f"requests-dra-{uuid.uuid4().hex[:8]}"
    admin.make_node(node)
    custom: Any = kubernetes.client.CustomObjectsApi(admin.api)
    custom.create_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", nvidia_slice(node))
    ok = "".join(f"gpu {i} uuid={gpu_uuid(node, i)}\n" for i in range(8))
    state = tmp_path / "gpus.state"
    state.write_text(ok)
    agent, _, _ = start_agent(node=node, state=state, args=("--max-quarantined", "1000"))
    eventually(lambda: watching(agent) or None, 10, what="the budget's watch")
    eventually(
        lambda: any(line.get("event") == "device.watching" for line in agent.lines) or None,
        10,
        what="the rules' watch",
    )
    rule = f"gpuguard.{node}.gpu-1"

    def rule_there() -> bool:
        return any(i["metadata"]["name"] == rule for i in rules(custom, node))

    def step(content: str, *, there: bool, want: str, reason: str) -> None:
        since = control_plane.audit_line_count()
        state.write_text(content)
        eventually(lambda: rule_there() == there or None, 10, what=f"the rule, {reason}")
        wait_condition(admin, node, want)
        eventually(
            lambda: sum(requests_since(control_plane, since).values()) >= 2 or None,
            10,
            what="the rule's and the condition's requests",
        )
        time.sleep(1.0)  # an order check that listed would come now
        got = requests_since(control_plane, since)
        print(f"{reason}: {dict(got)}")
        rule_verb = "create devicetaintrules" if there else "delete devicetaintrules"
        assert got == Counter({rule_verb: 1, "patch nodes/status": 1}), reason
        assert admin.our_taint(node) is None

    step(ok.replace("-1\n", "-1 ecc=2\n"), there=True, want="False", reason="GPUUnhealthy")
    step(ok, there=False, want="True", reason="GPURecovered")


def rules(custom: Any, node: str) -> list[dict[str, Any]]:
    resp = custom.list_cluster_custom_object(
        "resource.k8s.io", "v1", "devicetaintrules", label_selector=f"gpuguard.io/node={node}"
    )
    return list(resp.get("items") or [])


# -- issue 12's review, defect 10: a flapping GPU ----------------------------------------------------------


class _FlippingNvml:
    """A backend whose NVML init fails on every other snapshot (a flaky driver)."""

    def __init__(self) -> None:
        self.n = 0

    def open(self, wakeup: Wakeup) -> None:
        pass

    def close(self) -> None:
        pass

    def wait(self, until: float, wake: threading.Event) -> None:
        wait_for(until, wake)

    def snapshot(self) -> Snapshot:
        self.n += 1
        if self.n % 2 == 0:
            return Snapshot(init_error="DRIVER_NOT_LOADED")
        return Snapshot(gpus=(GpuReading(index=0, uuid="GPU-flip-0"),))


def test_defect_10_a_flapping_gpu_costs_condition_writes_per_episode_not_per_flip(
    admin: Admin, control_plane: Any
) -> None:
    node = unique("gpu-flap")
    admin.make_node(node)
    settings = NodeSettings(name=node, max_quarantined=QuarantineLimit.parse("100%"))
    writer = KubeNodeWriter(node, api=kubeclient.load(str(control_plane.kubeconfig_path)))
    reconciler = NodeReconciler(writer, settings)
    loop = LoopAgent(
        backend=_FlippingNvml(),
        reconciler=reconciler,
        policy=PolicySettings(),
        interval=1.0,
        node_name=node,
        flap_window=600.0,
    )
    since = control_plane.audit_line_count()
    for _ in range(80):  # 40 NVML init failures, each followed by a healthy read
        loop.check_once()
        reconciler.reconcile_now()
    events = control_plane.audit_events(USER_AGENT, since_line=since, stage="ResponseComplete")
    status_writes = [
        e
        for e in events
        if e["verb"] == "patch"
        and e.get("objectRef", {}).get("subresource") == "status"
        and e.get("objectRef", {}).get("name") == node
    ]
    print(f"40 NVML init flips: {len(status_writes)} GPUHealthy condition writes")
    assert len(status_writes) <= 4, len(status_writes)
    assert admin.our_taint(node) is not None  # the quarantine is held too
