"""The budget's inputs kept current off the fault's path, so that a fault costs only its own writes:

- the fully quarantined GPU nodes: a metadata-only list and watch of the nodes labelled
  gpuguard.io/quarantined=true (PartialObjectMetadata: no specs, no statuses). Only those few nodes match the
  selector, so the watch is silent while the fleet is healthy and carries one small event per quarantine;
- the number of GPU nodes, for a percentage budget only: a metadata list of the GPU nodes in the background,
  the first at a random moment of the agent's first hour (--budget-count-spread), then about every
  COUNT_REFRESH seconds (an hour, jittered) or one second per GPU node, whichever is longer (so the fleet as
  a whole lists about once a second at most, whatever its size: a list's cost grows with the fleet, and so
  do the agents).

`WatchedBudget` answers the `BudgetSource` seam from memory. Until the watch is established, or while it
is broken, it asks its fallback (`writers.KubeNodeWriter`: the lists in the path, as before), so it is never
blind. Before the first count, a fault's room is proven without it where it can be (the GPU nodes are at
least the quarantined ones and this one: with nothing quarantined, always); where it cannot, the fallback's
list decides, in the path, as before: exact at once, never a guess. The design, the alternatives and their
measured cost on the API server: docs/design.md ("The budget off the fault's path").
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import structlog

from gpuguard.core.config import NodeSettings, QuarantineLimit
from gpuguard.core.errors import NodeUpdateError, TransientApiError
from gpuguard.kube import client as kubeclient
from gpuguard.kube import nodes
from gpuguard.kube.listwatch import ListWatch
from gpuguard.quarantine.apistate import ApiState
from gpuguard.quarantine.budget import Budget
from gpuguard.quarantine.node.budget import BudgetSource, OtherNodes
from gpuguard.quarantine.node.view import LABEL_QUARANTINED
from gpuguard.quarantine.node.writers import DryRunNodeWriter, KubeNodeWriter

log = structlog.get_logger(__name__)

# The GPU-node count: refreshed once an hour (x 0.8-1.2, so agents started together drift apart), or one
# second per GPU node when the fleet is larger (see the module's docstring). A fleet changes size by
# autoscaling: a limit computed from a count up to an hour old is off by the nodes that joined or left since,
# times the percentage.
COUNT_REFRESH = 3600.0
COUNT_SECONDS_PER_NODE = 1.0


class WatchedBudget:
    """The `BudgetSource` of a real cluster: the budget from memory, kept current by a watch and a
    background count. `start()` starts its two daemon threads; `stop()` ends them."""

    def __init__(
        self,
        node: str,
        spec: QuarantineLimit,
        *,
        api: kubeclient.Client,
        fallback: BudgetSource,
        gpu_node_selector: str,
        others: OtherNodes | None = None,
        timeout: float = 10.0,
        first_count: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        api_state: ApiState | None = None,
    ) -> None:
        """`api_state`: told when the watch fails and when it is up again, so that an idle node's /healthz
        and log show an API outage too (nothing else of an idle node talks to the API server)."""
        self._node = node
        self._api_state = api_state
        self._spec = spec
        self._api = api
        self._fallback = fallback
        self._gpu_nodes = gpu_node_selector
        # One watch takes one selector: with alternatives (";"), every node labelled quarantined is watched
        # (only gpuguard labels a node so, and it runs only on GPU nodes), never fewer than the budget's.
        quarantined = f"{LABEL_QUARANTINED}=true"
        self._selector = (
            quarantined if ";" in gpu_node_selector else nodes.within(quarantined, gpu_node_selector)
        )
        self._others = others or OtherNodes()
        self._timeout = timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._watched = ListWatch(
            api,
            selector=self._selector,
            what="quarantined nodes",
            accept=nodes.METADATA_ONLY,
            timeout=timeout,
            changed=self._validate,
        )
        self._count_changes = 0  # moves when the GPU-node count changes (`changes()`)
        # The GPU nodes (this node counted), and when they were counted; None before the first count.
        self._total: tuple[int, float] | None = None
        self._first_count = first_count
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- BudgetSource ------------------------------------------------------------------------------------

    def budget(self, spec: QuarantineLimit, *, exclude: str) -> Budget | None:
        """From memory; from the fallback's list while the watch is not synced or nothing is counted yet."""
        synced = self._watched.synced
        with self._lock:
            total = self._total
        if not synced:
            return self._fallback.budget(spec, exclude=exclude)
        quarantined = sum(1 for _, name in self.quarantine_order() if name != exclude)
        if spec.count is not None:
            return Budget(quarantined=quarantined, limit=spec.count)
        if total is None:
            # Not counted yet (the agent's first hour). The GPU nodes are at least the quarantined ones
            # and this one, so the limit is at least that share of them: room proven without a list
            # (always in a fleet with nothing quarantined). Otherwise the fallback's list, as before.
            floor = spec.of(quarantined + 1)
            if quarantined < floor:
                return Budget(quarantined=quarantined, limit=floor, gpu_nodes=quarantined + 1)
            budget = self._fallback.budget(spec, exclude=exclude)
            if budget is not None and budget.gpu_nodes is not None:
                self._counted(budget.gpu_nodes)
            return budget
        return Budget(quarantined=quarantined, limit=spec.of(total[0]), gpu_nodes=total[0])

    def quarantine_order(self) -> list[tuple[str, str]]:
        """(since, name) of the fully quarantined GPU nodes, each claim validated (`OtherNodes`)."""
        synced, items = self._watched.snapshot()
        if not synced:
            return self._fallback.quarantine_order()
        return self._others.quarantined(items)

    def changes(self) -> int:
        """Moves with every change the watch delivers (and every re-list): the order is checked again."""
        with self._lock:
            return self._watched.generation + self._count_changes

    # -- the threads -------------------------------------------------------------------------------------

    @property
    def synced(self) -> bool:
        return self._watched.synced

    @property
    def gpu_nodes(self) -> int | None:
        with self._lock:
            return self._total[0] if self._total else None

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._watch_loop, name="gpuguard-budget-watch", daemon=True)]
        if self._spec.percent is not None:
            self._threads.append(
                threading.Thread(target=self._count_loop, name="gpuguard-budget-count", daemon=True)
            )
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Ends the count at once and the watch at its next event (daemon threads: never blocks exit)."""
        self._stop.set()
        self._wake.set()

    def _watch_loop(self) -> None:
        self._watched.run(
            lambda: nodes.COLLECTION,
            stop=self._stop,
            watching=self._watching,
            broken=self._broken,
            failed=self._failed,
        )

    def _failed(self, exc: NodeUpdateError) -> None:
        if self._api_state is not None and isinstance(exc, TransientApiError):
            self._api_state.unreachable(exc)

    def _watching(self) -> None:
        """`fleet.watching` once a watch is established at start, and after a broken one."""
        if self._api_state is not None:
            self._api_state.answered()
        log.info(
            "fleet.watching", node=self._node, selector=self._selector, quarantined=self._watched.count()
        )

    def _broken(self, exc: NodeUpdateError) -> None:
        # The fallback's lists until the watch is back (ListWatch.run).
        log.warning(
            "fleet.watch_broken",
            node=self._node,
            error=str(exc),
            note="lost the watch of other nodes' quarantines; reconnecting. Meanwhile a fault reads the "
            "budget from the API server itself (one list): no quarantine is delayed",
        )

    def _validate(self) -> None:
        """Validate the claims now, on the watch's thread: `OtherNodes` remembers the valid ones by item, so
        the budget check in a fault's path finds them validated (only what changed since costs anything)."""
        _, items = self._watched.snapshot()
        self._others.quarantined(items)

    def _count_loop(self) -> None:
        delay = random.uniform(0, self._first_count)  # noqa: S311 - spread over the fleet's start, not crypto
        while True:
            self._wake.wait(delay)
            if self._stop.is_set():
                return
            with self._lock:
                total = self._total
            period = _period(total[0] if total else 0)
            if total is not None and self._clock() - total[1] < period * 0.9:
                delay = total[1] + period - self._clock()
                continue
            try:
                self._counted(self._count())
                delay = _period(self.gpu_nodes or 0) * random.uniform(0.8, 1.2)  # noqa: S311
            except NodeUpdateError as exc:
                log.warning("fleet.count_failed", node=self._node, error=str(exc))
                delay = random.uniform(30, 60)  # noqa: S311

    def _count(self) -> int:
        items = nodes.select(
            self._api, self._gpu_nodes, what="count GPU nodes", metadata_only=True, timeout=self._timeout
        )
        names = {str(i["metadata"]["name"]) for i in items}
        return len(names) if self._node in names else len(names) + 1

    def _counted(self, total: int) -> None:
        with self._lock:
            changed = self._total is None or self._total[0] != total
            self._total = (total, self._clock())
            if changed:
                self._count_changes += 1
        if changed:
            log.info("fleet.gpu_nodes_counted", node=self._node, gpu_nodes=total)


def watched(
    settings: NodeSettings, writer: KubeNodeWriter | DryRunNodeWriter, api_state: ApiState | None = None
) -> WatchedBudget | None:
    """The watched budget for a writer to the API server with a budget to keep (not "100%"); else None:
    the writer is the source (a dry run has no fleet; an unlimited budget is never read)."""
    if not isinstance(writer, KubeNodeWriter) or settings.max_quarantined.unlimited:
        return None
    assert settings.name is not None  # validated: a writer to the API server has a node
    return WatchedBudget(
        settings.name,
        settings.max_quarantined,
        api=writer.api,
        fallback=writer,
        gpu_node_selector=settings.gpu_node_selector,
        others=writer.others,
        timeout=settings.api_timeout,
        first_count=settings.budget_count_spread,
        api_state=api_state,
    )


def _period(gpu_nodes: int) -> float:
    return max(COUNT_REFRESH, gpu_nodes * COUNT_SECONDS_PER_NODE)
