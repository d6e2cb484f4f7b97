"""API Priority and Fairness under a slow-body flood (issue 25). One stolen agent token opens FLOOD Event
POSTs that announce a large body and send one byte every few seconds: the API server holds a seat of the
request's priority level while it reads a body, and admission (which would refuse the Event) comes only
after it. Meanwhile another node's agent token patches its own node, as an agent does when it taints.

Measured twice on one control plane: with every request of gpuguard's ServiceAccount in the one level
"gpuguard" (the FlowSchema gpuguard-events deleted: deploy/daemonset.yaml alone), then with Events in a level
of their own (deploy/flowcontrol-events.yaml). Both are printed; with the Events' level in place the patch
must answer 200 within 5 s. What is left, a flood of the node writes themselves, is measured and printed
(docs/security.md).
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import kubernetes
import pytest
import yaml

from harness.kube import DEPLOY, Admin, eventually, unique_node
from tests.integration.test_admission import agent_core

pytestmark = pytest.mark.timeout(300)

FLOOD = 600
TRICKLE_S = 4.0
EVENTS_SCHEMA = "gpuguard-events"
MERGE = {"_content_type": "application/merge-patch+json"}


@pytest.fixture(scope="module")
def admin(admin_api: kubernetes.client.ApiClient) -> Admin:
    a = Admin(admin_api)
    created = a.apply_deploy_manifests()
    assert f"FlowSchema/{EVENTS_SCHEMA}" in created, created
    return a


class Flood:
    """FLOOD POSTs of an Event to "default" as `token`, each announcing 1 MB and sending a byte every
    TRICKLE_S seconds until closed."""

    def __init__(self, url: str, ctx: ssl.SSLContext, token: str, *, request: str) -> None:
        self._request = request
        self._where = urlsplit(url)
        self._ctx, self._token = ctx, token
        self._socks: list[ssl.SSLSocket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, daemon=True)

    def open(self) -> int:
        kind = "application/merge-patch+json" if self._request.startswith("PATCH") else "application/json"
        head = (
            f"{self._request} HTTP/1.1\r\n"
            f"Host: {self._where.netloc}\r\nAuthorization: Bearer {self._token}\r\n"
            f"Content-Type: {kind}\r\nContent-Length: 1000000\r\nUser-Agent: flood\r\n\r\n{{"
        ).encode()
        host, port = self._where.hostname or "127.0.0.1", self._where.port or 443
        for _ in range(FLOOD):
            raw = socket.create_connection((host, port), timeout=10)
            s = self._ctx.wrap_socket(raw, server_hostname=host)
            s.sendall(head)
            self._socks.append(s)
        self._thread.start()
        return len(self._socks)

    def _trickle(self) -> None:
        while not self._stop.wait(TRICKLE_S):
            for s in list(self._socks):
                try:
                    s.sendall(b" ")
                except OSError:
                    self._socks.remove(s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for s in self._socks:
            s.close()


EVENTS = "POST /api/v1/namespaces/default/events"


@contextmanager
def flood(admin: Admin, control_plane: Any, node: str, request: str = EVENTS) -> Iterator[Flood]:
    # The CA only: control_plane.ssl_context() carries the admin's client certificate, which the API server
    # would take over the token (and exempt from APF).
    ctx = ssl.create_default_context(cafile=str(control_plane.ca_path))
    f = Flood(control_plane.url, ctx, admin.agent_token(node), request=request)
    try:
        started = time.monotonic()
        opened = f.open()
        verb = request.split(maxsplit=1)[0]
        print(f"flood: {opened} slow {verb}s open in {time.monotonic() - started:.1f} s")
        time.sleep(3.0)  # every one of them has reached its priority level by now
        yield f
    finally:
        f.close()


def own_patch(core: Any, node: str, n: int) -> tuple[int, float]:
    """The victim agent's own-node patch: its status and seconds."""
    started = time.monotonic()
    try:
        core.patch_node(
            node, {"metadata": {"annotations": {"gpuguard.io/probe": str(n)}}}, _request_timeout=40, **MERGE
        )
        status = 200
    except kubernetes.client.exceptions.ApiException as exc:
        status = int(exc.status or 0)
    return status, time.monotonic() - started


def event_level(admin: Admin, control_plane: Any, node: str) -> str:
    """The FlowSchema an Event POST of gpuguard's ServiceAccount is classified into, by its UID (the API
    server names it in a response header)."""
    core: Any = kubernetes.client.CoreV1Api(
        kubernetes.client.ApiClient(_token_config(control_plane, admin.agent_token(node)))
    )
    body = {
        "metadata": {"name": f"{node}.{time.time_ns():x}", "namespace": "default"},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node},
        "type": "Normal",
        "reason": "Probe",
        "message": "which level",
        "source": {"component": "gpuguard", "host": node},
    }
    resp = core.create_namespaced_event("default", body, dry_run="All", _preload_content=False)
    uid = str(resp.headers.get("X-Kubernetes-PF-FlowSchema-UID", ""))
    schemas: Any = kubernetes.client.FlowcontrolApiserverV1Api(admin.api)
    for schema in schemas.list_flow_schema().items:
        if schema.metadata.uid == uid:
            return str(schema.metadata.name)
    return uid


def _token_config(control_plane: Any, token: str) -> kubernetes.client.Configuration:
    cfg = kubernetes.client.Configuration()
    cfg.host = control_plane.url
    cfg.ssl_ca_cert = str(control_plane.ca_path)
    cfg.api_key = {"authorization": f"Bearer {token}"}
    return cfg


def test_a_slow_body_event_flood_no_longer_holds_the_seats_of_another_nodes_own_patch(
    admin: Admin, control_plane: Any
) -> None:
    attacker, victim = unique_node(admin, "flood"), unique_node(admin, "flood")
    core = agent_core(admin, control_plane, victim)
    assert own_patch(core, victim, 0)[0] == 200
    schemas: Any = kubernetes.client.FlowcontrolApiserverV1Api(admin.api)
    file_doc = next(
        d
        for d in yaml.safe_load_all((DEPLOY / "flowcontrol-events.yaml").read_text())
        if d and d["kind"] == "FlowSchema"
    )

    # Before: one level for everything of gpuguard's.
    schemas.delete_flow_schema(EVENTS_SCHEMA)
    try:
        eventually(
            lambda: event_level(admin, control_plane, attacker) == "gpuguard",
            30,
            interval=0.5,
            what="one level",
        )
        with flood(admin, control_plane, attacker):
            before = own_patch(core, victim, 1)
    finally:
        schemas.create_flow_schema(json.loads(json.dumps(file_doc)))
    print(f"one level: the victim's own-node patch answered {before[0]} after {before[1]:.1f} s")
    time.sleep(2.0)  # the flood's requests end as their connections close

    # After: Events in a level of their own.
    eventually(
        lambda: event_level(admin, control_plane, attacker) == EVENTS_SCHEMA,
        30,
        interval=0.5,
        what="own level",
    )
    with flood(admin, control_plane, attacker):
        after = own_patch(core, victim, 2)
        # The flood did fill its own level: an honest Event waits or is turned away meanwhile.
        started = time.monotonic()
        try:
            event_level(admin, control_plane, victim)
            event_status = 201
        except kubernetes.client.exceptions.ApiException as exc:
            event_status = int(exc.status or 0)
        event_s = time.monotonic() - started
    print(
        f"Events' own level: the victim's own-node patch answered {after[0]} after {after[1]:.2f} s; "
        f"an honest Event during the flood: {event_status} after {event_s:.1f} s"
    )
    assert event_status == 429 or event_s > 2.0, "the flood did not fill the Events' level: nothing measured"
    assert after[0] == 200 and after[1] < 5.0, after
    time.sleep(2.0)

    # What is left, measured: the same flood of slow PATCHes of the token's own node, the request the level
    # "gpuguard" exists for (docs/security.md).
    with flood(admin, control_plane, attacker, request=f"PATCH /api/v1/nodes/{attacker}"):
        left = own_patch(core, victim, 3)
    print(f"slow node PATCHes: the victim's own-node patch answered {left[0]} after {left[1]:.1f} s")
