"""The budget's watch (gpuguard.quarantine.node.budgetwatch.WatchedBudget) against a real kube-apiserver:
another agent's quarantine is in memory within a second of its write, a step back or a recovery leaves it,
and the GPU-node count comes from one list. Nothing here is a request in the fault's path."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import kubernetes
import pytest

from gpuguard.core.config import QuarantineLimit
from gpuguard.kube import client as kubeclient
from gpuguard.quarantine.budget import Budget
from gpuguard.quarantine.gpu.rules import DeviceRule
from gpuguard.quarantine.gpu.watch import WatchedRules
from gpuguard.quarantine.gpu.writers import KubeDeviceSource
from gpuguard.quarantine.node import budget as budget_module
from gpuguard.quarantine.node.budgetwatch import WatchedBudget
from gpuguard.quarantine.node.writers import KubeNodeWriter
from harness.dra import DRIVER
from harness.kube import GPU_NODE_LABELS, TAINT_KEY, Admin, eventually
from tests.integration.fixtures import admin  # noqa: F401

pytestmark = pytest.mark.timeout(60)
HALF, ONE = QuarantineLimit.parse("50%"), QuarantineLimit.parse("1")


def rfc3339(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def quarantine(admin: Admin, name: str, *, label: str | None, since: str) -> None:
    """What another node's agent writes when it quarantines (label "true") or steps back ("deferred")."""
    admin.patch_node(
        name,
        {
            "metadata": {
                "labels": {"gpuguard.io/quarantined": label},
                "annotations": {"gpuguard.io/since": since if label else None},
            },
            "spec": {
                "taints": [{"key": TAINT_KEY, "value": "xid-79", "effect": "NoSchedule"}] if label else []
            },
        },
    )


def test_another_agents_quarantine_reaches_the_budget_by_watch_and_leaves_it_on_a_step_back(
    admin: Admin, control_plane: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    validated: list[tuple[str, str]] = []  # (thread, node) of every claim validation
    real_entry = budget_module.quarantine_entry

    def entry(meta: Any, *, now: Any) -> Any:
        validated.append((threading.current_thread().name, str(meta.get("name"))))
        return real_entry(meta, now=now)

    monkeypatch.setattr(budget_module, "quarantine_entry", entry)
    pool = f"fleet-{uuid.uuid4().hex[:8]}"
    labels = {**GPU_NODE_LABELS, "gpuguard-test/pool": pool}
    me, other, third = (f"{pool}-{i}" for i in range(3))
    for n in (me, other, third):
        admin.make_node(n, labels=labels)
    now = rfc3339(time.time() + 1)  # not before the nodes were created: that claim would be ignored
    selector = f"gpuguard-test/pool={pool}"
    api = kubeclient.load(str(control_plane.kubeconfig_path), user_agent="gpuguard-test/fleet")
    writer = KubeNodeWriter(me, api=api, gpu_node_selector=selector)
    uncounted = WatchedBudget(
        me, HALF, api=api, fallback=writer, gpu_node_selector=selector, first_count=3600
    )
    uncounted.start()
    try:
        eventually(lambda: uncounted.synced or None, 10, what="the watch")
        # Before the first count, with nothing quarantined: room proven without a list (1 of at least 1).
        assert uncounted.budget(HALF, exclude=me) == Budget(quarantined=0, limit=1, gpu_nodes=1)
        assert uncounted.gpu_nodes is None
    finally:
        uncounted.stop()
    fleet = WatchedBudget(me, HALF, api=api, fallback=writer, gpu_node_selector=selector, first_count=0)
    fleet.start()
    try:
        eventually(lambda: fleet.synced or None, 10, what="the watch")
        assert fleet.quarantine_order() == []
        eventually(lambda: fleet.gpu_nodes, 5, what="the first count (spread over 0 s here)")
        assert fleet.gpu_nodes == 3
        before = fleet.changes()
        t0 = time.monotonic()
        quarantine(admin, other, label="true", since=now)
        eventually(lambda: fleet.quarantine_order() or None, 5, what="the other node's quarantine")
        print(f"another node's quarantine in memory after {(time.monotonic() - t0) * 1000:.0f} ms")
        assert fleet.quarantine_order() == [(now, other)]
        assert fleet.changes() != before
        # The claim was validated on the watch's thread as it arrived, not in a fault's budget check.
        assert ("gpuguard-budget-watch", other) in validated
        validated.clear()
        budget = fleet.budget(HALF, exclude=me)
        assert validated == []
        assert budget is not None and (budget.quarantined, budget.limit, budget.gpu_nodes) == (1, 2, 3)
        assert fleet.budget(ONE, exclude=me) is not None and not fleet.budget(ONE, exclude=me).has_room  # type: ignore[union-attr]
        # A forged claim (a since before the node existed) is ignored, as in the lists.
        quarantine(admin, third, label="true", since="0001-01-01T00:00:00Z")
        eventually(lambda: fleet.changes() != before + 1 or None, 5, what="the forged claim's event")
        assert [name for _, name in fleet.quarantine_order()] == [other]
        # Steps back (label "deferred") and recovery (label removed) leave the selection: DELETED events.
        quarantine(admin, other, label="deferred", since=now)
        quarantine(admin, third, label=None, since=now)
        eventually(lambda: fleet.quarantine_order() == [] or None, 5, what="the step back")
    finally:
        fleet.stop()


def test_every_gpuguard_rule_reaches_the_budget_by_watch_and_leaves_it_when_deleted(
    admin: Admin, control_plane: Any
) -> None:
    """quarantine/gpu/watch.py: the per-GPU quarantine's budget reads gpuguard's DeviceTaintRules of every
    node from memory once the source has found where they are served; before that, and never else, it
    lists."""
    api = kubeclient.load(str(control_plane.kubeconfig_path), user_agent="gpuguard-test/rules")
    source = KubeDeviceSource(f"rw-{uuid.uuid4().hex[:8]}", api=api, driver=DRIVER)
    listed: list[int] = []

    def fallback() -> list[DeviceRule]:
        listed.append(1)
        return source.all_rules()

    watched = WatchedRules("me", api=api, fallback=fallback, path=lambda: source.rules_path)
    watched.start()
    try:
        assert watched.all_rules() is not None and listed == [1]  # not synced: the source's list
        time.sleep(0.5)
        assert not watched.synced  # no watch before the node's slices were found to publish GPUs
        watched.found()  # DeviceQuarantine.on_devices, after its first read of the slices and rules
        eventually(lambda: watched.synced or None, 10, what="the rules' watch")
        other = f"rw-other-{uuid.uuid4().hex[:8]}"
        name = f"gpuguard-{other}-gpu-2"
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceTaintRule",
            "metadata": {
                "name": name,
                "labels": {"gpuguard.io/node": other, "app.kubernetes.io/managed-by": "gpuguard"},
                "annotations": {"gpuguard.io/since": rfc3339(time.time())},
            },
            "spec": {
                "deviceSelector": {"driver": DRIVER, "pool": other, "device": "gpu-2"},
                "taint": {"key": TAINT_KEY, "value": "xid-79", "effect": "NoSchedule"},
            },
        }
        custom: Any = kubernetes.client.CustomObjectsApi(admin.api)
        custom.create_cluster_custom_object("resource.k8s.io", "v1", "devicetaintrules", body)
        found = eventually(
            lambda: [r for r in watched.all_rules() if r.name == name] or None, 5, what="the new rule"
        )
        assert (found[0].pool, found[0].device, found[0].effect) == (other, "gpu-2", "NoSchedule")
        custom.delete_cluster_custom_object("resource.k8s.io", "v1", "devicetaintrules", name)
        eventually(lambda: all(r.name != name for r in watched.all_rules()) or None, 5, what="the deletion")
        assert listed == [1]  # from memory since the watch was established
    finally:
        watched.stop()
