"""Stateful fakes with inject_* / assert_* helpers (preferred over patching)."""

from __future__ import annotations

import copy
import itertools
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from gpuguard.core.config import QuarantineLimit
from gpuguard.core.errors import ConflictError, NodeUpdateError
from gpuguard.quarantine.budget import Budget
from gpuguard.quarantine.gpu.rules import DeviceRule
from gpuguard.quarantine.node.view import LABEL_QUARANTINED, EventSpec, NodeChange, NodeView, apply_change
from gpuguard.quarantine.record import ANN_SINCE


class FakeNodeWriter:
    """Behaves like the API server for one Node: resourceVersion preconditions, injected failures."""

    def __init__(self, node: NodeView) -> None:
        self.node = node
        self.reads = 0
        self.reserved_reads = 0  # reads that reserved the next write's rate-limit token
        self.patches: list[NodeChange] = []
        self.patch_attempts = 0  # patches sent, refused or not
        self.events: list[EventSpec] = []
        self._read_errors: deque[NodeUpdateError] = deque()
        self._patch_errors: deque[NodeUpdateError] = deque()
        self._lock = threading.Lock()
        self.quarantine_budget: Budget | None = None
        self.budget_lists = 0
        self.order: list[tuple[str, str]] = []  # (since, name) of the other fully quarantined nodes
        self.order_lists = 0
        self.order_error: NodeUpdateError | None = None
        self.generation = 0
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

    def read(self, *, reserve_write: bool = False) -> NodeView:
        with self._lock:
            self.reads += 1
            self.reserved_reads += reserve_write
            if self._read_errors:
                raise self._read_errors.popleft()
            return self.node

    def patch(self, node: NodeView, change: NodeChange) -> NodeView:
        with self._lock:
            self.patch_attempts += 1
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

    def budget(self, spec: QuarantineLimit, *, exclude: str) -> Budget | None:
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

    def changes(self) -> int:
        """0, as the API server's lists; a test sets `generation` to act as a watch kept in memory."""
        return self.generation

    def set_condition(self, node: NodeView, condition: Mapping[str, str]) -> NodeView:
        with self._lock:
            self.conditions.append(dict(condition))
            field = "degraded_condition" if condition["type"] == "GPUDegraded" else "gpu_condition"
            fields = {**self.node.__dict__, field: condition["status"]}
            if field == "gpu_condition":
                fields["gpu_condition_message"] = condition["message"]
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


class FakeDeviceSource:
    """Behaves like the API server for one node's ResourceSlices and DeviceTaintRules (resourceVersion
    preconditions on patch and delete, 409 on a name taken, injected failures); `operator_delete` removes a
    rule behind the agent's back. `for_node` is another node's agent on the same API server (one store of
    rules, that node's slices and rules)."""

    def __init__(self, slices: list[dict[str, Any]] | None = None, *, node: str | None = None) -> None:
        self.slice_items = slices
        self.node = node
        self.store: dict[str, dict[str, Any]] = {}
        self.other_rules: list[DeviceRule] = []
        # Set: all_rules answers this instead (a list that raced the other agents' writes of a burst).
        self.lagging: list[DeviceRule] | None = None
        self.slice_error: NodeUpdateError | None = None
        self.calls: list[str] = []
        self._errors: deque[NodeUpdateError] = deque()
        self._versions = itertools.count(1)

    def for_node(self, node: str, slices: list[dict[str, Any]]) -> FakeDeviceSource:
        """The same API server as another node's agent sees it: the rules shared, its own slices."""
        other = FakeDeviceSource(slices, node=node)
        other.store, other.other_rules, other._versions = self.store, self.other_rules, self._versions
        return other

    def inject_error(self, *errors: NodeUpdateError) -> None:
        """The next writes (create, patch, delete) fail with these errors, in order."""
        self._errors.extend(errors)

    def operator_delete(self, name: str) -> None:
        del self.store[name]

    def slices(self) -> list[dict[str, Any]] | None:
        self.calls.append("slices")
        if self.slice_error is not None:
            raise self.slice_error
        return self.slice_items

    def rules(self) -> list[DeviceRule]:
        self.calls.append("rules")
        return [
            DeviceRule.from_api(d)
            for d in self.store.values()
            if self.node is None or d["metadata"]["labels"].get("gpuguard.io/node") == self.node
        ]

    def all_rules(self) -> list[DeviceRule]:
        self.calls.append("all_rules")
        if self.lagging is not None:
            return list(self.lagging)
        return [*self.other_rules, *(DeviceRule.from_api(d) for d in self.store.values())]

    def get(self, name: str) -> DeviceRule | None:
        self.calls.append("get")
        doc = self.store.get(name)
        return DeviceRule.from_api(doc) if doc is not None else None

    def _bump(self, doc: dict[str, Any]) -> DeviceRule:
        doc["metadata"]["resourceVersion"] = str(next(self._versions))
        self.store[doc["metadata"]["name"]] = doc
        return DeviceRule.from_api(doc)

    def _fail(self) -> None:
        if self._errors:
            raise self._errors.popleft()

    def create(self, body: Mapping[str, Any]) -> DeviceRule:
        self.calls.append("create")
        self._fail()
        doc = copy.deepcopy(dict(body))
        if doc["metadata"]["name"] in self.store:
            raise ConflictError("exists")
        doc["metadata"]["uid"] = f"uid-{doc['metadata']['name']}"
        return self._bump(doc)

    def patch(self, rule: DeviceRule, body: Mapping[str, Any]) -> DeviceRule:
        self.calls.append("patch")
        self._fail()
        doc = copy.deepcopy(self.store[rule.name])
        if body["metadata"]["resourceVersion"] != doc["metadata"]["resourceVersion"]:
            raise ConflictError("resourceVersion mismatch")
        for k, v in body["metadata"].get("annotations", {}).items():
            if v is None:
                doc["metadata"]["annotations"].pop(k, None)
            else:
                doc["metadata"]["annotations"][k] = v
        if "spec" in body:
            doc["spec"]["taint"] = body["spec"]["taint"]
        return self._bump(doc)

    def delete(self, rule: DeviceRule) -> None:
        self.calls.append("delete")
        self._fail()
        doc = self.store[rule.name]
        if rule.resource_version != doc["metadata"]["resourceVersion"]:
            raise ConflictError("resourceVersion mismatch")
        del self.store[rule.name]


def self_signed_pem(name: str = "gpuguard-test") -> tuple[bytes, bytes]:
    """A throwaway self-signed certificate and its key, both PEM: it serves as a CA file and as a client
    certificate with its key (the kubeconfig loader now checks that these load)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem
