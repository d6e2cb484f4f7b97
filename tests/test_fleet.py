"""budgetwatch.WatchedBudget before its watch is established (or while it is broken): never blind, never a
guess, the budget's lists as before. Its watch against a real API server:
tests/integration/test_fleet_watch.py."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any
from unittest import mock

from structlog.testing import capture_logs

from gpuguard.core.config import NodeSettings, QuarantineLimit
from gpuguard.core.errors import TransientApiError
from gpuguard.kube import client as kubeclient
from gpuguard.kube import kubeconfig
from gpuguard.quarantine.apistate import ApiState
from gpuguard.quarantine.budget import Budget
from gpuguard.quarantine.node.budgetwatch import WatchedBudget, watched
from gpuguard.quarantine.node.view import NodeView
from gpuguard.quarantine.node.writers import KubeNodeWriter
from harness.fakes import FakeNodeWriter

TEN_PERCENT = QuarantineLimit.parse("10%")


def test_until_the_watch_is_established_the_budget_and_the_order_are_listed_by_the_fallback() -> None:
    fallback = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1"))
    fallback.quarantine_budget = Budget(quarantined=3, limit=3, gpu_nodes=30)
    fallback.order = [("2026-01-01T00:00:00Z", "gpu-0")]
    api = kubeclient.Client(kubeconfig.Credentials(server="https://127.0.0.1:9"), user_agent="test")
    fleet = WatchedBudget("gpu-1", TEN_PERCENT, api=api, fallback=fallback, gpu_node_selector="")
    assert not fleet.synced
    assert fleet.budget(TEN_PERCENT, exclude="gpu-1") == Budget(quarantined=3, limit=3, gpu_nodes=30)
    assert fleet.quarantine_order() == [("2026-01-01T00:00:00Z", "gpu-0")]
    assert (fallback.budget_lists, fallback.order_lists) == (1, 1)


class _ServerEndsEachWatch(kubeclient.Client):
    """An API server whose watches end at once (as at their timeoutSeconds), with nothing quarantined."""

    def __init__(self, watches: int) -> None:
        super().__init__(kubeconfig.Credentials(server="https://127.0.0.1:9"), user_agent="test")
        self.fleet: WatchedBudget | None = None
        self.lists = 0
        self.watches: list[tuple[int, float]] = []
        self._stop_after = watches

    def request(self, method: str, path: str, **kw: Any) -> Any:
        self.lists += 1
        return {"metadata": {"resourceVersion": "5"}, "items": []}

    def watch(self, path: str, *, query: Mapping[str, str], idle: float = 0, **kw: Any) -> Iterator[Any]:
        self.watches.append((int(query["timeoutSeconds"]), idle))
        if len(self.watches) >= self._stop_after and self.fleet is not None:
            self.fleet.stop()
        return iter(())


def test_the_budget_watch_lasts_about_an_hour_and_resumes_without_listing_again() -> None:
    """Before, the server ended it every 5 minutes: 12 requests an hour on a healthy node."""
    api = _ServerEndsEachWatch(watches=20)
    fallback = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1"))
    fleet = WatchedBudget("gpu-1", TEN_PERCENT, api=api, fallback=fallback, gpu_node_selector="")
    api.fleet = fleet
    fleet._watch_loop()
    assert api.lists == 1  # listed once; every next watch resumes from the last resourceVersion
    seconds = [s for s, _ in api.watches]
    assert all(48 * 60 <= s <= 3600 for s in seconds)
    assert len(set(seconds)) > 1  # drawn per watch: a fleet started together does not re-watch together
    assert all(idle > s for s, idle in api.watches)  # a silent watch is not cut short by the client


def test_a_fleet_of_5000_agents_starting_at_once_lists_the_gpu_nodes_no_faster_than_its_steady_rate() -> None:
    """Every agent's first count is a list of the whole GPU fleet: spread over a minute (the old default),
    5,000 agents put 83 lists of 5,000 nodes a second on the API server (90 ms of its CPU each, measured in
    docs/design.md). The default spread keeps them near the steady rate (one list a second fleet-wide)."""
    import click

    from gpuguard.cli import watch
    from gpuguard.core.config import NodeSettings
    from gpuguard.quarantine.node.budgetwatch import COUNT_SECONDS_PER_NODE

    spread = NodeSettings().budget_count_spread
    assert 5000 / spread <= 2 / COUNT_SECONDS_PER_NODE
    assert isinstance(watch, click.Command)
    option = next(p for p in watch.params if p.name == "budget_count_spread")
    assert option.default == spread


class _ServerDownThenUp(_ServerEndsEachWatch):
    """No answer for the first `down` lists, then an API server whose watches end at once."""

    def __init__(self, down: int) -> None:
        super().__init__(watches=1)
        self.down = down

    def request(self, method: str, path: str, **kw: Any) -> Any:
        if self.lists < self.down:
            self.lists += 1
            raise TransientApiError("list quarantined nodes: connection refused")
        return super().request(method, path, **kw)


def test_an_idle_nodes_budget_watch_tells_the_api_state_of_an_outage_and_its_end() -> None:
    """Nothing else of a healthy node talks to the API server: without this, /healthz said "ok" throughout."""
    api = _ServerDownThenUp(down=3)
    fallback = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1"))
    state = ApiState("gpu-1", outage_every=0.0)
    fleet = WatchedBudget(
        "gpu-1", TEN_PERCENT, api=api, fallback=fallback, gpu_node_selector="", api_state=state
    )
    api.fleet = fleet
    seen: list[str] = []
    with (
        mock.patch.object(fleet._stop, "wait", lambda seconds: seen.append(state.health.state)),
        capture_logs() as logs,
    ):
        fleet._watch_loop()
    assert seen == ["unreachable"] * 3
    assert state.health.state == "ok"
    api_lines = [e["event"] for e in logs if e["event"].startswith("api.")]
    assert api_lines == ["api.unavailable", "api.still_unavailable", "api.still_unavailable", "api.available"]


def test_defect_max_quarantined_100_0_percent_started_watches_for_a_budget_that_never_defers() -> None:
    """Any spelling of 100% is no budget: no watch of other nodes and no count of the GPU nodes to start."""
    api = kubeclient.Client(kubeconfig.Credentials(server="https://127.0.0.1:9"), user_agent="test")
    writer = KubeNodeWriter("gpu-1", api=api)
    for text in ("100%", "100.0%", "100.000%"):
        settings = NodeSettings(name="gpu-1", max_quarantined=QuarantineLimit.parse(text))
        assert watched(settings, writer) is None, text
    assert watched(NodeSettings(name="gpu-1", max_quarantined=QuarantineLimit.parse("99.999%")), writer)
