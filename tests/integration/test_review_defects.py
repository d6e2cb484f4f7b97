"""The defects a review of the node side's state machine found (issue 12) that are about what lands on the
Node, one test each, named after its number, against the real kube-apiserver: the agent as the DaemonSet's
ServiceAccount, on pynvml and the fake NVML library (item 10 drives the loop in-process to flip NVML 40
times). The others are in tests/test_review_defects.py.

GPUGUARD_NODE_RESYNC (how soon the agent sees what others changed on its node) is passed as an environment
variable, not a flag, so that the same test runs against a version without the setting and fails there for
the defect's own reason."""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gpuguard.agent import Agent as LoopAgent
from gpuguard.config import NodeSettings, PolicySettings, QuarantineLimit
from gpuguard.kube import client as kubeclient
from gpuguard.model import GpuReading, Snapshot
from gpuguard.nvml.base import Wakeup, wait_for
from gpuguard.quarantine.node.writers import KubeNodeWriter
from gpuguard.quarantine.reconciler import NodeReconciler
from tests.integration.fixtures import USER_AGENT, admin, start_agent  # noqa: F401
from tests.integration.kube import GPUS_OK, TAINT_KEY, Admin, eventually

pytestmark = pytest.mark.timeout(120)

RESYNC = {"GPUGUARD_NODE_RESYNC": "0.3"}
ECC = GPUS_OK.replace("GPU-it-0", "GPU-it-0 ecc=2")
LABEL = "gpuguard.io/quarantined"


def labels(admin: Admin, node: str) -> dict[str, str]:
    return admin.node(node)["metadata"].get("labels") or {}


def annotations_of(admin: Admin, node: str) -> dict[str, str]:
    return admin.node(node)["metadata"].get("annotations") or {}


def remove_our_taint(admin: Admin, node: str) -> None:
    admin.update_node(
        node,
        lambda n: {"spec": {"taints": [t for t in n["spec"].get("taints") or [] if t["key"] != TAINT_KEY]}},
    )


def unique(prefix: str) -> str:
    return f"{prefix}-{time.monotonic_ns() % 10**9}"


def test_defect_01_operator_removed_taint_does_not_spend_budget(admin: Admin, start_agent: Any) -> None:
    _, node, state = start_agent(env=RESYNC)
    state.write_text(ECC)
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    assert labels(admin, node)[LABEL] == "true"
    remove_our_taint(admin, node)
    # The label is what the budget counts (and what `gpuguard status` lists): it goes with the taint.
    eventually(lambda: LABEL not in labels(admin, node), 5, what="the budget's label removed")
    assert annotations_of(admin, node)["gpuguard.io/faults"] == "ecc/GPU-it-0"  # the same fault: no new taint
    time.sleep(1.0)
    assert admin.our_taint(node) is None and LABEL not in labels(admin, node)


def test_defect_02_the_same_fault_in_a_new_boot_taints_again(admin: Admin, start_agent: Any) -> None:
    agent, node, state = start_agent(boot_id="boot-a", env=RESYNC)
    state.write_text(GPUS_OK + "xid 0 79\n")
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    remove_our_taint(admin, node)
    time.sleep(1.0)
    assert admin.our_taint(node) is None  # overridden for this boot
    agent.stop()
    # The node reboots, and Xid 79 comes again on the same GPU, before anything could recover the node
    # (the driver delivers an Xid only to a process registered for it: written once the agent is up).
    admin.set_boot_id(node, "boot-b")
    state.write_text(GPUS_OK)
    slow = ("--recover-after", "50")
    start_agent(node=node, state=state, host_boot_id="host-boot-2", env=RESYNC, args=slow)
    state.write_text(GPUS_OK + "xid 0 79\n")
    taint = eventually(lambda: admin.our_taint(node), 10, what="taint in the new boot")
    assert taint["value"] == "xid-79"
    assert annotations_of(admin, node)["gpuguard.io/boot-id"] == "boot-b"


def test_defect_03_a_fault_that_recurs_after_a_reboot_records_the_new_boot(
    admin: Admin, start_agent: Any
) -> None:
    agent, node, state = start_agent(boot_id="boot-a")
    state.write_text(GPUS_OK + "xid 0 79\n")
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    agent.stop()
    # The node reboots; the Xid recurs before anything could recover the node (the driver delivers it only
    # to a registered process: written once the new agent is up).
    admin.set_boot_id(node, "boot-b")
    state.write_text(GPUS_OK)
    slow = ("--recover-after", "50")
    again, _, _ = start_agent(node=node, state=state, host_boot_id="host-boot-2", args=slow)
    state.write_text(GPUS_OK + "xid 0 79\n")
    eventually(
        lambda: annotations_of(admin, node).get("gpuguard.io/boot-id") == "boot-b",
        10,
        what="the new boot recorded",
    )
    again.stop()
    # An agent restart without durable state: the driver does not replay the Xid, the GPUs read healthy,
    # the boot is the same. Nothing proves the fault gone.
    state.write_text(GPUS_OK)
    start_agent(node=node, state=state, host_boot_id="host-boot-2", args=("--state-dir", ""))
    time.sleep(2.0)  # 10 intervals, 5x --recover-after
    assert admin.our_taint(node) is not None


def test_defect_04_the_budget_counts_the_gpu_nodes_of_the_selector(admin: Admin, start_agent: Any) -> None:
    pool = unique("pool")
    provider = {"example.com/accelerator": pool}  # no nvidia.com/gpu.present label
    kw: dict[str, Any] = {
        "labels": provider,
        "args": ("--max-quarantined", "50%"),  # 1 of these 2 nodes
        "env": {"GPUGUARD_GPU_NODE_SELECTOR": f"example.com/accelerator={pool}"},
    }
    _, node_a, state_a = start_agent(**kw)
    _, node_b, state_b = start_agent(**kw)
    state_a.write_text(ECC)
    assert eventually(lambda: admin.our_taint(node_a), 10, what="A quarantined")["effect"] == "NoSchedule"
    # Other tests leave quarantined nodes behind, outside this pool: A's order check must not count them.
    time.sleep(1.0)
    assert labels(admin, node_a)[LABEL] == "true"
    state_b.write_text(ECC)
    taint_b = eventually(lambda: admin.our_taint(node_b), 10, what="B tainted")
    assert taint_b["effect"] == "PreferNoSchedule"
    assert labels(admin, node_b)[LABEL] == "deferred"
    assert not admin.node(node_b)["spec"].get("unschedulable")


def test_defect_06_recovery_never_lifts_an_admins_later_cordon(admin: Admin, start_agent: Any) -> None:
    _, node, state = start_agent(env=RESYNC)
    state.write_text(ECC)
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    assert admin.node(node)["spec"]["unschedulable"] is True
    admin.update_node(node, lambda n: {"spec": {"unschedulable": False}})  # the admin uncordons
    time.sleep(1.0)  # a few of the agent's re-reads
    admin.update_node(node, lambda n: {"spec": {"unschedulable": True}})  # and cordons for maintenance
    state.write_text(GPUS_OK)  # the ECC counter is reset
    eventually(lambda: admin.our_taint(node) is None, 10, what="recovery")
    assert admin.node(node)["spec"].get("unschedulable") is True, "the admin's maintenance cordon was lifted"


def test_defect_07_a_gpu_unhealthy_taint_gpuguard_did_not_place_is_left_alone(
    admin: Admin, start_agent: Any
) -> None:
    manual = {"key": TAINT_KEY, "value": "manual", "effect": "NoSchedule"}
    agent, node, _ = start_agent(taints=[manual])
    time.sleep(2.0)  # 10 healthy checks, 5x --recover-after
    assert admin.our_taint(node) == manual
    assert agent.healthz()[1]["tainted"] is False  # not gpuguard's quarantine


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


def test_defect_09_a_boot_id_the_kubelet_posts_late_still_lets_the_node_recover(
    admin: Admin, start_agent: Any
) -> None:
    agent, node, state = start_agent(boot_id="boot-a", env=RESYNC)
    state.write_text(GPUS_OK + "xid 0 79\n")
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    agent.stop()
    # The node reboots; the new agent reads the node before the kubelet has posted the new bootID.
    state.write_text(GPUS_OK)
    start_agent(node=node, state=state, host_boot_id="host-boot-2", env=RESYNC)
    time.sleep(1.0)
    assert admin.our_taint(node) is not None  # no proof of a reboot yet
    admin.set_boot_id(node, "boot-b")
    eventually(lambda: admin.our_taint(node) is None, 10, what="recovery once the new bootID is posted")


def _quarantined_metric(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as r:
        text = r.read().decode()
    # The real agent's gauge: dry_run="false" (a dry run exports dry_run="true").
    line = next(x for x in text.splitlines() if x.startswith('gpuguard_node_quarantined{dry_run="false"} '))
    return float(line.split()[1])


def test_defect_09_healthz_and_metrics_follow_an_operators_override(admin: Admin, start_agent: Any) -> None:
    agent, node, state = start_agent(env=RESYNC)
    state.write_text(ECC)
    eventually(lambda: agent.healthz()[1]["tainted"], 10, what="tainted on /healthz")
    eventually(lambda: _quarantined_metric(agent.port) == 1, 5, what="gpuguard_node_quarantined 1")
    remove_our_taint(admin, node)
    eventually(lambda: agent.healthz()[1]["tainted"] is False, 5, what="/healthz after the override")
    eventually(lambda: _quarantined_metric(agent.port) == 0, 5, what="gpuguard_node_quarantined 0")


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
