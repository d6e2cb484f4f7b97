"""The /healthz contract (exact keys), /readyz, /metrics, and what the server refuses."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.request
from datetime import UTC, datetime

import pytest
from prometheus_client import CollectorRegistry

from gpuguard import cli
from gpuguard.core.config import PolicySettings, parse_listen
from gpuguard.core.metrics import Metrics
from gpuguard.core.model import AgentStatus, ApiHealth, GpuQuarantine, GpuReading, Snapshot
from gpuguard.judge.policy import evaluate
from gpuguard.runtime.server import HealthServer

SICK = evaluate(
    Snapshot(gpus=(GpuReading(index=0, uuid="GPU-0"), GpuReading(index=1, uuid="GPU-1", ecc_uncorrected=3))),
    previous=None,
    settings=PolicySettings(),
)


class State:
    status = AgentStatus(
        alive=True,
        ready=True,
        node="gpu-1",
        verdict=SICK,
        tainted=True,
        cordoned=True,
        dry_run=False,
        last_check=datetime(2026, 12, 2, 12, 0, 1, tzinfo=UTC),
        gpu_quarantines=(
            GpuQuarantine(
                uuid="GPU-1",
                device="gpu-1",
                rule="gpuguard-gpu-1-gpu-1",
                reason="ecc: 3 uncorrected volatile ECC errors (GPU 1, GPU-1)",
                effect="NoSchedule",
                deferred=False,
            ),
        ),
        device_taint_api="resource.k8s.io/v1",
        api=ApiHealth(
            "unreachable", datetime(2026, 12, 2, 11, 59, 0, tzinfo=UTC), "read node gpu-1: timeout"
        ),
    )


@pytest.fixture
def server():
    registry = CollectorRegistry()
    Metrics(registry)
    s = HealthServer(lambda: State.status, host="127.0.0.1", port=0, registry=registry)
    s.start()
    yield s
    s.stop()


def get(server: HealthServer, path: str, method: str = "GET") -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    c.request(method, path)
    r = c.getresponse()
    return r.status, r.read()


def test_healthz_has_exactly_the_documented_keys(server: HealthServer) -> None:
    code, body = get(server, "/healthz")
    assert code == 200
    assert json.loads(body) == {
        "agent": "ok",
        "node": "gpu-1",
        "healthy": False,
        "node_reasons": [],
        "node_degraded": [],
        "gpus": [
            {
                "index": 0,
                "uuid": "GPU-0",
                "healthy": True,
                "reasons": [],
                "degraded": [],
                "xid_watched": True,
                "row_remap_pending": None,
            },
            {
                "index": 1,
                "uuid": "GPU-1",
                "healthy": False,
                "reasons": ["ecc: 3 uncorrected volatile ECC errors (GPU 1, GPU-1)"],
                "degraded": [],
                "xid_watched": True,
                "row_remap_pending": None,
            },
        ],
        "tainted": True,
        "cordoned": True,
        "gpu_quarantines": [
            {
                "uuid": "GPU-1",
                "device": "gpu-1",
                "rule": "gpuguard-gpu-1-gpu-1",
                "reason": "ecc: 3 uncorrected volatile ECC errors (GPU 1, GPU-1)",
                "effect": "NoSchedule",
                "deferred": False,
            }
        ],
        "device_taint_api": "resource.k8s.io/v1",
        "nvml_stuck_calls": [],
        "api": {"state": "unreachable", "since": "2026-12-02T11:59:00Z", "error": "read node gpu-1: timeout"},
        "dry_run": False,
        "last_check": "2026-12-02T12:00:01Z",
    }


def test_healthz_is_503_stalled_when_the_loop_stopped_checking(server: HealthServer) -> None:
    old = State.status
    State.status = AgentStatus(
        alive=False,
        ready=True,
        node=None,
        verdict=None,
        tainted=False,
        cordoned=False,
        dry_run=True,
        last_check=None,
    )
    try:
        code, body = get(server, "/healthz")
    finally:
        State.status = old
    assert code == 503
    doc = json.loads(body)
    assert doc["agent"] == "stalled" and doc["node"] is None and doc["last_check"] is None
    assert doc["gpus"] == []


def test_a_sick_gpu_does_not_fail_liveness(server: HealthServer) -> None:
    assert get(server, "/healthz")[0] == 200  # SICK verdict, alive loop


def test_readyz_follows_readiness(server: HealthServer) -> None:
    assert get(server, "/readyz")[0] == 200
    old = State.status
    State.status = AgentStatus(**{**old.__dict__, "ready": False})
    try:
        assert get(server, "/readyz")[0] == 503
    finally:
        State.status = old


def test_metrics_are_served_in_prometheus_text_format(server: HealthServer) -> None:
    code, body = get(server, "/metrics")
    assert code == 200 and b"gpuguard_build_info" in body


@pytest.mark.parametrize("path", ["/", "/healthz/../etc/passwd", "/admin", "/metricsx"])
def test_unknown_paths_are_404(server: HealthServer, path: str) -> None:
    assert get(server, path)[0] == 404


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
def test_only_get_and_head_are_allowed(server: HealthServer, method: str) -> None:
    assert get(server, "/healthz", method)[0] == 405


def test_head_has_no_body(server: HealthServer) -> None:
    code, body = get(server, "/healthz", "HEAD")
    assert code == 200 and body == b""


# -- issue 12's review, defect 14: IPv6 --------------------------------------------------------------------

STATUS = AgentStatus(
    alive=True,
    ready=True,
    node="n",
    verdict=None,
    tainted=False,
    cordoned=False,
    dry_run=True,
    last_check=None,
)


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=3) as resp:
        return int(resp.status)


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6(), reason="no IPv6 loopback on this machine")
def test_defect_14_the_server_listens_on_an_ipv6_address() -> None:
    server = HealthServer(lambda: STATUS, **vars(parse_listen("[::1]:0")))
    server.start()
    try:
        assert _get(f"http://[::1]:{server.port}/healthz") == 200
    finally:
        server.stop()


@pytest.mark.skipif(not _has_ipv6(), reason="no IPv6 loopback on this machine")
def test_defect_14_the_default_listen_address_serves_ipv4_and_ipv6_probes() -> None:
    settings = parse_listen(cli.DEFAULT_LISTEN)
    server = HealthServer(lambda: STATUS, host=settings.host, port=0)
    server.start()
    try:
        assert _get(f"http://127.0.0.1:{server.port}/healthz") == 200
        assert _get(f"http://[::1]:{server.port}/healthz") == 200
    finally:
        server.stop()
