"""API Priority and Fairness under a slow-body flood. One stolen agent token opens FLOOD requests that
announce a large body and send one byte every few seconds: the API server holds a seat of the request's
priority level while it reads a body, and admission (which would refuse the request) comes only after it.
Meanwhile another node's agent token patches its own node PATCHES times, as an agent does when it taints
(LANES at a time), and the answers' latencies are summed up: how many landed, p50 and p99.

Measured on one control plane, for each configuration of gpuguard's FlowSchemas: every request of gpuguard's
ServiceAccount in the one level "gpuguard" (the FlowSchema gpuguard-events deleted: deploy/daemonset.yaml
alone) under a flood of Event POSTs; Events in a level of their own (deploy/flowcontrol-events.yaml) under
the same flood, where every patch must land within 5 s; and what is left, a flood of slow PATCHes of the
attacker's own node, the very requests the level exists for (every agent is the same user: one flow).
Each line is printed with the run's date (docs/security.md).
"""

from __future__ import annotations

import json
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes
import pytest
import yaml

from harness.kube import DEPLOY, GPUS_OK, Admin, agent_as_node, eventually, unique_node
from tests.integration.test_admission import agent_core

pytestmark = pytest.mark.timeout(900)

FLOOD = 600
# `make test` sends one round of LANES patches a configuration (a starved round costs 15 s); security.md's
# figures come from GPUGUARD_APF_PATCHES=50 and GPUGUARD_APF_EXPERIMENT=1 (the reads-apart experiment).
PATCHES = int(os.environ.get("GPUGUARD_APF_PATCHES", "10"))
EXPERIMENT = os.environ.get("GPUGUARD_APF_EXPERIMENT") == "1"
LANES = 10
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
    """FLOOD requests as `token`, each announcing 1 MB and sending a byte every TRICKLE_S seconds until
    closed. Sustained, as an attacker would: a request the API server answers (429 after its queue wait, 504
    at its deadline) is replaced by a new one within a second."""

    def __init__(self, url: str, ctx: ssl.SSLContext, token: str, *, request: str) -> None:
        kind = "application/merge-patch+json" if request.startswith("PATCH") else "application/json"
        where = urlsplit(url)
        self._head = (
            f"{request} HTTP/1.1\r\n"
            f"Host: {where.netloc}\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: {kind}\r\nContent-Length: 1000000\r\nUser-Agent: flood\r\n\r\n{{"
        ).encode()
        self._host, self._port = where.hostname or "127.0.0.1", where.port or 443
        self._ctx = ctx
        self._socks: list[ssl.SSLSocket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, daemon=True)
        self.replaced = 0

    def _connect(self) -> ssl.SSLSocket:
        raw = socket.create_connection((self._host, self._port), timeout=10)
        s = self._ctx.wrap_socket(raw, server_hostname=self._host)
        s.sendall(self._head)
        return s

    def open(self) -> int:
        self._socks = [self._connect() for _ in range(FLOOD)]
        self._thread.start()
        return len(self._socks)

    def _trickle(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.5):
            answered = {s for s in select.select(self._socks, [], [], 0)[0] if _answered(s)}
            trickle = time.monotonic() - last >= TRICKLE_S
            last = time.monotonic() if trickle else last
            kept = []
            for s in self._socks:
                try:
                    if s in answered:
                        raise OSError("answered")
                    if trickle:
                        s.sendall(b" ")
                    kept.append(s)
                except OSError:
                    s.close()
                    try:
                        kept.append(self._connect())
                        self.replaced += 1
                    except OSError:
                        pass
            self._socks = kept

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for s in self._socks:
            s.close()


def _answered(s: ssl.SSLSocket) -> bool:
    """Whether the API server answered (or closed) the request: readable is not enough, TLS 1.3 sends its
    session tickets after the handshake."""
    s.setblocking(False)
    try:
        return len(s.recv(1)) >= 0  # an answer's first byte, or b"": closed
    except ssl.SSLWantReadError:
        return False  # only a session ticket, now read
    except OSError:
        return True
    finally:
        s.settimeout(10)


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
        print(f"flood: {f.replaced} requests replaced after an answer")


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


def own_patches(core: Any, node: str) -> list[tuple[int, float]]:
    """PATCHES own-node patches, LANES at a time: each one's status and seconds."""
    with ThreadPoolExecutor(LANES) as pool:
        return list(pool.map(lambda n: own_patch(core, node, n), range(PATCHES)))


def summary(what: str, answers: list[tuple[int, float]]) -> str:
    """One line: the run's date, how many landed, p50 and p99 of all answers, the statuses seen."""
    seconds = sorted(s for _, s in answers)
    p50, p99 = seconds[len(seconds) // 2], seconds[min(len(seconds) - 1, int(len(seconds) * 0.99))]
    statuses = ", ".join(
        f"{c}: {sum(1 for a, _ in answers if a == c)}" for c in sorted({a for a, _ in answers})
    )
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    landed = sum(1 for a, _ in answers if a == 200)
    return f"{day} {what}: {landed}/{len(answers)} landed, p50 {p50:.2f} s, p99 {p99:.2f} s ({statuses})"


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
            before = own_patches(core, victim)
    finally:
        schemas.create_flow_schema(json.loads(json.dumps(file_doc)))
    print(summary("one level, a flood of slow Event POSTs", before))
    time.sleep(2.0)  # the flood's requests end as their connections close

    # After: Events in a level of their own.
    eventually(
        lambda: event_level(admin, control_plane, attacker) == EVENTS_SCHEMA,
        30,
        interval=0.5,
        what="own level",
    )
    with flood(admin, control_plane, attacker):
        after = own_patches(core, victim)
        # The flood did fill its own level: an honest Event waits or is turned away meanwhile.
        started = time.monotonic()
        try:
            event_level(admin, control_plane, victim)
            event_status = 201
        except kubernetes.client.exceptions.ApiException as exc:
            event_status = int(exc.status or 0)
        event_s = time.monotonic() - started
    print(summary("Events' own level, a flood of slow Event POSTs", after))
    print(f"an honest Event during that flood: {event_status} after {event_s:.1f} s")
    assert event_status == 429 or event_s > 2.0, "the flood did not fill the Events' level: nothing measured"
    assert all(status == 200 and seconds < 5.0 for status, seconds in after), after
    time.sleep(2.0)

    # What is left, measured: the same flood of slow PATCHes of the token's own node, the request the level
    # "gpuguard" exists for (docs/security.md).
    with flood(admin, control_plane, attacker, request=f"PATCH /api/v1/nodes/{attacker}"):
        left = own_patches(core, victim)
    print(summary("Events' own level, a flood of slow PATCHes of the attacker's own node", left))


# An experiment, not shipped (docs/security.md): the agents' reads (get, list, watch: no body to trickle) in a
# priority level of their own, so that the read before each write does not wait behind the flood too.
READS = "gpuguard-reads-experiment"
READS_LEVEL: dict[str, Any] = {
    "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
    "kind": "PriorityLevelConfiguration",
    "metadata": {"name": READS},
    "spec": {
        "type": "Limited",
        "limited": {
            "nominalConcurrencyShares": 10,
            "lendablePercent": 50,
            "limitResponse": {
                "type": "Queue",
                "queuing": {"queues": 64, "handSize": 8, "queueLengthLimit": 640},
            },
        },
    },
}
AGENTS = {"name": "gpuguard", "namespace": "gpuguard"}
READS_SCHEMA: dict[str, Any] = {
    "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
    "kind": "FlowSchema",
    "metadata": {"name": READS},
    "spec": {
        "priorityLevelConfiguration": {"name": READS},
        "matchingPrecedence": 995,
        "distinguisherMethod": {"type": "ByUser"},
        "rules": [
            {
                "subjects": [
                    {
                        "kind": "ServiceAccount",
                        "serviceAccount": {"name": "gpuguard", "namespace": "gpuguard"},
                    }
                ],
                "resourceRules": [
                    {
                        "verbs": ["get", "list", "watch"],
                        "apiGroups": ["*"],
                        "resources": ["*"],
                        "clusterScope": True,
                        "namespaces": ["*"],
                    }
                ],
            }
        ],
    },
}


def taint_under_flood(admin: Admin, control_plane: Any, fakenvml: Path, tmp_path: Path) -> float:
    """Seconds from an ECC error to the victim agent's taint while the flood holds."""
    attacker, victim = unique_node(admin, "flood"), unique_node(admin, "flood")
    state = tmp_path / f"{victim}.state"
    state.write_text(GPUS_OK)
    args = ("--max-quarantined", "100%")
    agent = agent_as_node(admin, control_plane, victim, state=state, lib=fakenvml, args=args).start()
    try:
        eventually(agent.ready, 30, what="agent /readyz")
        with flood(admin, control_plane, attacker, request=f"PATCH /api/v1/nodes/{attacker}"):
            started = time.monotonic()
            state.write_text(GPUS_OK.replace("GPU-it-0", "GPU-it-0 ecc=2"))
            eventually(lambda: admin.our_taint(victim), 300, interval=0.2, what="the victim's taint")
            return time.monotonic() - started
    finally:
        agent.stop()


def test_under_a_sustained_flood_of_slow_patches_a_real_agents_fault_taint_lands_by_its_retries(
    admin: Admin, control_plane: Any, fakenvml: Path, tmp_path: Path
) -> None:
    """What is left, as the fleet lives it: the agent of another node sees an ECC error while one token keeps
    600 slow PATCHes of its own node open; its taint lands through its own retries (each try, the read of
    the node and its patch, waits in the level's queue), not at once. Then the same with the agents' reads
    in a level of their own (an experiment). Each time is printed with the run's date (docs/security.md)."""
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    took = taint_under_flood(admin, control_plane, fakenvml, tmp_path)
    print(f"{day} a real agent's fault taint under the flood, one level: landed after {took:.1f} s")
    assert took < 300
    if not EXPERIMENT:
        return
    schemas: Any = kubernetes.client.FlowcontrolApiserverV1Api(admin.api)
    schemas.create_priority_level_configuration(READS_LEVEL)
    schemas.create_flow_schema(READS_SCHEMA)
    try:
        time.sleep(2.0)  # the API server's APF controller picks the new schema up
        apart = taint_under_flood(admin, control_plane, fakenvml, tmp_path)
    finally:
        schemas.delete_flow_schema(READS)
        schemas.delete_priority_level_configuration(READS)
    print(f"{day} a real agent's fault taint under the flood, reads apart: landed after {apart:.1f} s")
    assert apart < 300
