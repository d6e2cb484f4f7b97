"""fleet.WatchedBudget before its watch is established (or while it is broken): never blind, never a guess,
the budget's lists as before. Its watch against a real API server: tests/integration/test_fleet_watch.py."""

from __future__ import annotations

from gpuguard import kubeapi
from gpuguard.node.budget import Budget
from gpuguard.node.fleet import WatchedBudget
from gpuguard.node.view import NodeView
from tests.fakes import FakeNodeWriter


def test_until_the_watch_is_established_the_budget_and_the_order_are_listed_by_the_fallback() -> None:
    fallback = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1"))
    fallback.quarantine_budget = Budget(quarantined=3, limit=3, gpu_nodes=30)
    fallback.order = [("2026-01-01T00:00:00Z", "gpu-0")]
    api = kubeapi.Client(kubeapi.Credentials(server="https://127.0.0.1:9"), user_agent="test")
    fleet = WatchedBudget("gpu-1", "10%", api=api, fallback=fallback, gpu_node_selector="")
    assert not fleet.synced
    assert fleet.budget("10%", exclude="gpu-1") == Budget(quarantined=3, limit=3, gpu_nodes=30)
    assert fleet.quarantine_order() == [("2026-01-01T00:00:00Z", "gpu-0")]
    assert (fallback.budget_lists, fallback.order_lists) == (1, 1)
