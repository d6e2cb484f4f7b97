"""gpuguard's DeviceTaintRules of every node kept in memory off the fault's path, as
`budgetwatch.WatchedBudget` keeps the quarantined nodes (`listwatch.ListWatch`: a list, then a watch resumed
from its resourceVersion).

The per-GPU quarantine's budget reads every gpuguard rule: whether one more GPU fits
(`gpu.budget.RuleBudget.room`, before the create) and the order checks after it. Listed, that was a list
before the rule (in the fault's path), one right after it and one 10 s later; from this watch it is none.
Until the watch is established, and while it is broken, the source's list answers (never blind). The rules
are few (one per faulty GPU), so the watch carries one small event per rule written or deleted. It starts only
on a node whose slices publish GPUs (no rule can be made elsewhere), on the version its source found served.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import structlog

from gpuguard.kube import client as kubeclient
from gpuguard.kube import devicerules
from gpuguard.kube.listwatch import ListWatch
from gpuguard.quarantine.gpu.rules import LIST_PAGE, DeviceRule, trim_rule
from gpuguard.quarantine.gpu.writers import EVERY_NODE

log = structlog.get_logger(__name__)

_BROKEN = (
    "lost the watch of the DeviceTaintRules; reconnecting. Meanwhile a GPU fault lists the rules for the "
    "budget itself: no quarantine is delayed"
)


class WatchedRules:
    """`all_rules()` from memory once the watch is established; `fallback` (the source's list) before.
    `path`: the rules' collection path once the source has found which version the API server serves, None
    before (or where none is served: nothing to watch, the fallback answers)."""

    def __init__(
        self,
        node: str,
        *,
        api: kubeclient.Client,
        fallback: Callable[[], list[DeviceRule]],
        path: Callable[[], str | None],
        timeout: float = 10.0,
    ) -> None:
        self._node = node
        self._fallback = fallback
        self._path = path
        self._watched = ListWatch(
            api,
            selector=EVERY_NODE,
            what="device taint rules",
            timeout=timeout,
            keep=trim_rule,
            page=LIST_PAGE,
            max_item=devicerules.MAX_RULE_BYTES,
        )
        # Each item converted once: an event replaces an item whole.
        self._rules: dict[str, tuple[dict[str, Any], DeviceRule]] = {}
        self._stop = threading.Event()
        self._found = threading.Event()
        self._thread: threading.Thread | None = None

    def all_rules(self) -> list[DeviceRule]:
        synced, items = self._watched.snapshot()
        if not synced:
            return self._fallback()
        out, known = [], self._rules
        fresh: dict[str, tuple[dict[str, Any], DeviceRule]] = {}
        for item in items:
            name = str(item["metadata"]["name"])
            hit = known.get(name)
            rule = hit[1] if hit is not None and hit[0] is item else DeviceRule.from_api(item)
            fresh[name] = (item, rule)
            out.append(rule)
        self._rules = fresh
        return out

    @property
    def synced(self) -> bool:
        return self._watched.synced

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="gpuguard-rules-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the thread at its next event or wait (a daemon thread: never blocks exit)."""
        self._stop.set()
        self._found.set()

    def found(self) -> None:
        """This node publishes GPUs in its ResourceSlices, read with its rules (the agent's first reconcile;
        `DeviceQuarantine.on_devices`): the watch starts, on the version that read found served."""
        self._found.set()

    def _loop(self) -> None:
        # Gated by `found`: no GPUs of this node in the slices yet, or no version serving the rules, is
        # nothing to watch (no request, no wake-up of ours) until a read finds them (or stop()). While the
        # watch is broken the source's lists answer (ListWatch.run).
        node = self._node
        self._watched.run(
            self._path,
            stop=self._stop,
            gate=self._found,
            watching=lambda: log.info("device.watching", node=node, rules=self._watched.count()),
            broken=lambda exc: log.warning("device.watch_broken", node=node, error=str(exc), note=_BROKEN),
        )
