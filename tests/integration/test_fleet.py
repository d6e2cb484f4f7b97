"""A fleet of agents against the real API server: the manifests' FlowSchema and PriorityLevelConfiguration
are accepted and take every request of gpuguard's ServiceAccount, and a small fleet that starts at one
instant with the shipped settings (start-up jitter, client-side rate limit) reconciles with no HTTP 429 and
no write to a node that already matches. The same at 5,000 nodes, with the 429s of a fleet without them, is
`make fleet-bench` (bench/fleet_scale.py, docs/performance.md)."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import urllib3

from bench.cluster import audit_code, audit_node, audit_time
from bench.fleet import Fleet
from gpuguard.core.config import NodeSettings
from harness.kube import NAMESPACE, Admin, eventually, token_kubeconfig
from tests.integration.fixtures import USER_AGENT, WRITE_VERBS, admin  # noqa: F401

pytestmark = pytest.mark.timeout(300)

FLEET = 60
JITTER = 3.0
SHIPPED = {"jitter": JITTER, "qps": NodeSettings.api_qps, "burst": NodeSettings.api_burst}


def _flow_control(admin: Admin) -> tuple[dict[str, Any], dict[str, Any]]:
    fc: Any = kubernetes.client.FlowcontrolApiserverV1Api(admin.api)
    schema = json.loads(fc.read_flow_schema(NAMESPACE, _preload_content=False).data)
    level = json.loads(fc.read_priority_level_configuration(NAMESPACE, _preload_content=False).data)
    return schema, level


def test_the_api_server_accepts_the_flow_schema_and_its_priority_level(admin: Admin) -> None:
    _, level = _flow_control(admin)
    assert level["spec"]["limited"]["limitResponse"]["type"] == "Queue"

    def settled() -> bool:
        schema, _ = _flow_control(admin)
        conditions = {c["type"]: c["status"] for c in schema.get("status", {}).get("conditions", [])}
        return conditions.get("Dangling") == "False"

    # The API server's APF controller marks a schema whose priority level does not exist "Dangling".
    eventually(settled, 30, interval=0.5, what="FlowSchema gpuguard not dangling")


def test_the_agents_requests_are_classified_into_gpuguards_priority_level(
    admin: Admin, control_plane: Any
) -> None:
    """The API server names the schema and level it chose in every response (X-Kubernetes-PF-*-UID)."""
    schema, level = _flow_control(admin)
    node = f"fleet-classify-{int(time.time() * 1000) % 100000}"
    admin.make_node(node)
    token = admin.agent_token(node)
    pool = urllib3.PoolManager(cert_reqs="CERT_REQUIRED", ca_certs=str(control_plane.ca_path))

    def headers() -> str | None:
        resp = pool.request(
            "GET",
            f"{control_plane.url}/api/v1/nodes/{node}",
            headers={"Authorization": f"Bearer {token}", "User-Agent": USER_AGENT},
        )
        assert resp.status == 200, resp.data
        uid = resp.headers.get("X-Kubernetes-PF-FlowSchema-UID")
        # The controller may still be loading a schema created a moment ago.
        if uid != schema["metadata"]["uid"]:
            return None
        return str(resp.headers.get("X-Kubernetes-PF-PriorityLevel-UID"))

    level_uid = eventually(headers, 30, interval=0.5, what="the agent's request in FlowSchema gpuguard")
    assert level_uid == level["metadata"]["uid"]


@pytest.fixture(scope="module")
def fleet_nodes(
    admin: Admin, control_plane: Any, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("fleet")
    stamp = int(time.time() * 1000) % 100000
    names = [f"fleet-{stamp}-{i:03d}" for i in range(FLEET)]
    kubeconfigs = {}
    for name in names:
        admin.make_node(name, boot_id=None)
        kubeconfigs[name] = token_kubeconfig(
            tmp / f"{name}.kubeconfig",
            server=control_plane.url,
            ca_path=control_plane.ca_path,
            token=admin.agent_token(name),
        )
    return kubeconfigs


def _start(
    control_plane: Any, kubeconfigs: dict[str, Path], workdir: Path
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """Every reconciler started with a healthy verdict at one instant: (their answers, gpuguard's requests
    for these nodes in the audit log, the start's wall-clock time)."""
    fleet = Fleet(kubeconfigs, processes=2, workdir=workdir, options=SHIPPED)
    try:
        fleet.start(timeout=120)
        since = control_plane.audit_line_count()
        wall0 = time.time()
        done = fleet.submit("healthy", at=time.monotonic() + 0.5, streak=1)
    finally:
        fleet.stop()
    events = [
        e
        for e in control_plane.audit_events(USER_AGENT, since, stage="ResponseComplete")
        if audit_node(e) in kubeconfigs
    ]
    return done, events, wall0


def _node_writes(events: list[dict[str, Any]]) -> Counter[str]:
    return Counter(
        audit_node(e)
        for e in events
        if e["verb"] in WRITE_VERBS
        and audit_code(e) < 400
        and (e.get("objectRef") or {}).get("resource") == "nodes"
    )


def test_a_fleet_starting_at_once_reconciles_without_a_429_and_writes_each_node_once_then_never_again(
    control_plane: Any, fleet_nodes: dict[str, Path], tmp_path: Path
) -> None:
    done, events, wall0 = _start(control_plane, fleet_nodes, tmp_path)
    assert sum(d["reconciled"] for d in done) == FLEET
    assert [e for e in events if audit_code(e) == 429] == []
    # New nodes: one read and the GPUHealthy condition each, nothing more.
    assert _node_writes(events) == Counter(dict.fromkeys(fleet_nodes, 1))
    reads = Counter(audit_node(e) for e in events if e["verb"] == "get")
    assert reads == Counter(dict.fromkeys(fleet_nodes, 1))
    # The start-up jitter spread the first requests over its window instead of one instant.
    firsts = sorted(min(audit_time(e) for e in events if audit_node(e) == n) - wall0 for n in fleet_nodes)
    assert firsts[-1] - firsts[0] > JITTER / 2

    # Restarted at once (a DaemonSet rolled everywhere): every node already matches, so not one write.
    done, events, _ = _start(control_plane, fleet_nodes, tmp_path)
    assert sum(d["reconciled"] for d in done) == FLEET
    assert [e for e in events if audit_code(e) == 429] == []
    assert _node_writes(events) == Counter()
    # Reads only: each node's own read, and the budget's watch (its list, its watch, its first count).
    kinds = {f"{e['verb']} {audit_code(e)}" for e in events}
    assert "get 200" in kinds
    assert kinds <= {"get 200", "list 200", "watch 200"}


def test_the_fleets_requests_went_to_gpuguards_priority_level(
    control_plane: Any, fleet_nodes: dict[str, Path]
) -> None:
    """The counters of the API server's APF filter: the agents' requests are dispatched in FlowSchema
    gpuguard, none were rejected there."""
    status, body = control_plane.get("/metrics")
    assert status == 200
    dispatched = rejected = 0.0
    for line in body.splitlines():
        if 'flow_schema="gpuguard"' not in line:
            continue
        if line.startswith("apiserver_flowcontrol_dispatched_requests_total{"):
            dispatched += float(line.rsplit(" ", 1)[1])
        if line.startswith("apiserver_flowcontrol_rejected_requests_total{"):
            rejected += float(line.rsplit(" ", 1)[1])
    assert dispatched >= 3 * FLEET  # two starts: a read each, and the condition once
    assert rejected == 0
