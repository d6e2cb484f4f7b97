"""Stateful fakes with inject_* / assert_* helpers (preferred over patching)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gpuguard.errors import ConflictError, NodeUpdateError
from gpuguard.node.budget import Budget
from gpuguard.node.view import ANN_SINCE, LABEL_QUARANTINED, EventSpec, NodeChange, NodeView, apply_change


class FakeNodeWriter:
    """Behaves like the API server for one Node: resourceVersion preconditions, injected failures."""

    def __init__(self, node: NodeView) -> None:
        self.node = node
        self.reads = 0
        self.patches: list[NodeChange] = []
        self.events: list[EventSpec] = []
        self._read_errors: deque[NodeUpdateError] = deque()
        self._patch_errors: deque[NodeUpdateError] = deque()
        self._lock = threading.Lock()
        self.quarantine_budget: Budget | None = None
        self.budget_lists = 0
        self.order: list[tuple[str, str]] = []  # (since, name) of the other fully quarantined nodes
        self.order_lists = 0
        self.order_error: NodeUpdateError | None = None
        self.conditions: list[dict[str, str]] = []

    def inject_error(self, *errors: NodeUpdateError, on: str = "patch") -> None:
        """The next patches (or reads, with on="read") fail with these errors, in order."""
        (self._read_errors if on == "read" else self._patch_errors).extend(errors)

    def edit(self, **changes: object) -> None:
        """Another writer changes the node (bumps the resourceVersion)."""
        with self._lock:
            fields = {**self.node.__dict__, **changes}
            fields["resource_version"] = str(int(self.node.resource_version) + 1)
            self.node = NodeView(**fields)

    def read(self) -> NodeView:
        with self._lock:
            self.reads += 1
            if self._read_errors:
                raise self._read_errors.popleft()
            return self.node

    def patch(self, node: NodeView, change: NodeChange) -> NodeView:
        with self._lock:
            if self._patch_errors:
                raise self._patch_errors.popleft()
            if node.resource_version != self.node.resource_version:
                raise ConflictError("resourceVersion mismatch")
            self.patches.append(change)
            self.node = apply_change(self.node, change)
            return self.node

    def record_event(self, node: NodeView, event: EventSpec) -> None:
        self.events.append(event)

    @property
    def writes(self) -> int:
        return len(self.patches)

    def budget(self, spec: str, *, exclude: str) -> Budget | None:
        self.budget_lists += 1
        return self.quarantine_budget

    def quarantine_order(self) -> list[tuple[str, str]]:
        self.order_lists += 1
        if self.order_error is not None:
            raise self.order_error
        with self._lock:
            me = self.node
        mine = (
            [(me.annotations.get(ANN_SINCE, ""), me.name)]
            if me.labels.get(LABEL_QUARANTINED) == "true"
            else []
        )
        return [*self.order, *mine]

    def set_condition(self, node: NodeView, condition: Mapping[str, str]) -> NodeView:
        with self._lock:
            self.conditions.append(dict(condition))
            fields = {**self.node.__dict__, "gpu_condition": condition["status"]}
            fields["resource_version"] = str(int(self.node.resource_version) + 1)
            self.node = NodeView(**fields)
            return self.node


@contextmanager
def http_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A stand-in HTTP server on 127.0.0.1 (a free port) answering with `handler` while the block runs; yields
    its URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
