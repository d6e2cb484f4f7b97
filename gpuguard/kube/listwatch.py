"""One collection of the API server kept in memory, the way gpuguard's budget reads the fleet: a list, then a
watch from its resourceVersion (with bookmarks, for `kubeclient.WATCH_SECONDS`), resumed from the last
resourceVersion when the server ends it, listed again after 410 Gone, with a backoff after a failure
(`run`, a thread's body). `budgetwatch.WatchedBudget` keeps the quarantined nodes in one,
`gpu.watch.WatchedRules` gpuguard's DeviceTaintRules; each says what to log and, for the rules, when there is
something to watch.

Items are kept by name, as the API server sent them (each event replaces an item whole, so an item object
never changes: callers may remember what they derived from one by identity).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

from gpuguard.core.errors import NodeUpdateError
from gpuguard.kube import client as kubeclient

# After a failed list or watch: waits from 1 s doubling to 60 s (jittered), so that a restarted API server is
# not met by every agent at once.
_BACKOFF_MAX = 60.0


class ListWatch:
    """`selector`: the label selector of both; `accept`: the list's and the watch's Accept headers (a
    metadata-only view, or full objects); `what`: the errors' prefix ("quarantined nodes");
    `changed`: called on this thread after every list and every change a watch delivers."""

    def __init__(
        self,
        api: kubeclient.Client,
        *,
        selector: str,
        what: str,
        accept: tuple[str, str] = ("application/json", "application/json"),
        timeout: float = 10.0,
        changed: Callable[[], None] | None = None,
        keep: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        page: int | None = None,
        max_item: int = kubeclient.MAX_OBJECT,
    ) -> None:
        """`keep`: what of an item is kept (the parts a caller reads, bounded), applied as each arrives;
        `page`: list in pages of that many items (the API server's limit/continue), so that one list of
        a collection others write never sits in memory whole; `max_item`: an item of more bytes is dropped
        as it streams, never held whole, and is absent here as if deleted (`kubeclient.Client.request`)."""
        keep = keep or (lambda item: item)
        self._keep: Callable[[dict[str, Any]], dict[str, Any]] = lambda item: keep(lean(item))
        self._max_item = max_item
        self._page = page
        self._api = api
        self._selector = selector
        self._what = what
        self._accept = accept
        self._timeout = timeout
        self._changed = changed or (lambda: None)
        self._lock = threading.Lock()
        self._items: dict[str, dict[str, Any]] = {}
        self._synced = False
        self._generation = 0

    def snapshot(self) -> tuple[bool, list[dict[str, Any]]]:
        """Whether a watch is established (else the items may be stale or empty), and the items."""
        with self._lock:
            return self._synced, list(self._items.values())

    @property
    def synced(self) -> bool:
        with self._lock:
            return self._synced

    @property
    def generation(self) -> int:
        """Moves with every list and every change a watch delivers."""
        with self._lock:
            return self._generation

    def count(self) -> int:
        with self._lock:
            return len(self._items)

    def broken(self) -> None:
        """The watch failed: not synced until the next one is established."""
        with self._lock:
            self._synced = False

    def list(self, path: str) -> str:
        """List the collection; its resourceVersion, to watch from."""
        items: dict[str, dict[str, Any]] = {}
        query = {"labelSelector": self._selector}
        if self._page is not None:
            query["limit"] = str(self._page)
        rv = ""
        while True:
            doc = self._api.request(
                "GET",
                path,
                query=query,
                accept=self._accept[0],
                timeout=self._timeout,
                what=f"list {self._what}",
                keep=self._keep,
                max_item=self._max_item,
            )
            for i in doc.get("items") or []:
                items[str(i["metadata"]["name"])] = i
            meta = doc.get("metadata") or {}
            rv = rv or str(meta["resourceVersion"])  # every page of one list is at the first page's version
            if self._page is None or not meta.get("continue"):
                break
            query = {**query, "continue": str(meta["continue"])}
        with self._lock:
            self._items = items
            self._generation += 1
        self._changed()
        return rv

    def watch(
        self, path: str, rv: str, *, stop: threading.Event, established: Callable[[], None] = lambda: None
    ) -> str | None:
        """One watch from `rv` until the server ends it (or `stop` is set at an event); the last
        resourceVersion seen, or None when it is too old (410: list again). `established`: called once the
        server has accepted the watch. NodeUpdateError when it fails."""
        seconds = random.randint(*kubeclient.WATCH_SECONDS)  # noqa: S311 - spreads the fleet's re-watches
        query = {
            "watch": "1",
            "labelSelector": self._selector,
            "resourceVersion": rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(seconds),
        }
        events = self._api.watch(
            path,
            query=query,
            accept=self._accept[1],
            timeout=self._timeout,
            idle=seconds + 30,
            what=f"watch {self._what}",
            max_item=self._max_item,
        )
        with self._lock:
            self._synced = True
        established()
        for event in events:
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                code = obj.get("code")
                if code == 410:
                    return None  # too old: the watch cache moved on, list again
                raise NodeUpdateError(f"watch {self._what}: {obj.get('message', obj)!s:.300}", status=code)
            meta = obj.get("metadata") or {}
            rv = str(meta.get("resourceVersion") or rv)
            if kind == "BOOKMARK":
                continue
            name = str(meta.get("name", ""))
            with self._lock:
                if kind in {"DELETED", "DROPPED"}:  # dropped: over max_item, absent as in a list
                    self._items.pop(name, None)
                else:
                    self._items[name] = self._keep(obj)
                self._generation += 1
            self._changed()
            if stop.is_set():
                break
        return rv

    def run(
        self,
        path: Callable[[], str | None],
        *,
        stop: threading.Event,
        watching: Callable[[], None],
        broken: Callable[[NodeUpdateError], None],
        gate: threading.Event | None = None,
        failed: Callable[[NodeUpdateError], None] | None = None,
    ) -> None:
        """A thread's body until `stop` is set: list, then watch and resume from the last resourceVersion,
        listing again after 410. After a failure the collection is not synced (callers answer from their
        lists meanwhile) and the next try waits the backoff. `watching`: called when a watch is established
        at start and after a failure; `broken`: once per failure, until a watch is established again;
        `failed`: at every failed try (the API server's state, gpuguard.quarantine.apistate).

        `gate`, for a collection that may not be served: nothing is listed or watched (no request, no
        wake-up) until it is set; `path()` None (no version serves it) or a 404 clears it, to wait for the
        next set. Without a gate `path()` always names the collection."""
        backoff = 1.0
        rv: str | None = None
        failing, announce = False, True
        while not stop.is_set():
            if gate is not None and not gate.is_set():
                gate.wait()
                continue
            where = path()
            if where is None:
                if gate is not None:
                    gate.clear()
                continue
            tell = announce or failing
            try:
                if rv is None:
                    rv = self.list(where)
                rv = self.watch(where, rv, stop=stop, established=watching if tell else _nothing)
                backoff = 1.0
                failing = announce = False
            except NodeUpdateError as exc:
                self.broken()
                if not failing:
                    failing = True
                    broken(exc)
                if failed is not None:
                    failed(exc)
                if exc.status == 410:
                    rv = None
                elif exc.status == 404 and gate is not None:
                    rv = None
                    gate.clear()  # not served (any more) in this version: wait for the next set
                stop.wait(random.uniform(0.5, 1.0) * backoff)  # noqa: S311 - jitter, not crypto
                backoff = min(backoff * 2, _BACKOFF_MAX)


def _nothing() -> None:
    pass


def lean(item: dict[str, Any]) -> dict[str, Any]:
    """The item without metadata.managedFields, which no reader of gpuguard's needs: dropped as each item
    arrives, before it is kept, so what others write there (the policies bound a token's writes; an
    administrator's are not) never stays in an agent's memory (docs/security.md)."""
    meta = item.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
    return item
