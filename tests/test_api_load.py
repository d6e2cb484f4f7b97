"""What keeps a fleet of agents gentle on the API server: the start-up jitter (the reconciler's first request
waits, a fault does not), the client-side rate limit (a token bucket in gpuguard.kube.ratelimit) and their
settings.
The fleet itself (5,000 agents against a real API server) is bench/fleet.py; a small version of it runs in
tests/integration/test_fleet.py."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuguard import cli
from gpuguard.core.config import Config, NodeSettings, PolicySettings
from gpuguard.core.errors import ConfigError
from gpuguard.core.model import GpuReading, Snapshot
from gpuguard.judge.policy import evaluate
from gpuguard.kube import client as kubeclient
from gpuguard.kube import kubeconfig
from gpuguard.kube.ratelimit import RateLimiter
from gpuguard.quarantine.node.view import NodeView
from gpuguard.quarantine.node.writers import KubeNodeWriter
from gpuguard.quarantine.reconciler import NodeReconciler
from gpuguard.runtime import root as running
from harness.clock import Clock
from harness.fakes import FakeNodeWriter
from harness.judging import hand_over
from tests.test_kube_client import NODE, Recorder, server  # noqa: F401 - the fixture

SETTINGS = NodeSettings(name="gpu-1", retry_max_wait=0.01)
CONDITION = {"type": "GPUHealthy", "status": "True", "reason": "GPUsHealthy", "message": "ok"}
HEALTHY = evaluate(
    Snapshot(gpus=(GpuReading(index=0, uuid="GPU-0"),)), previous=None, settings=PolicySettings()
)
SICK = evaluate(
    Snapshot(gpus=(GpuReading(index=0, uuid="GPU-0", ecc_uncorrected=2),)),
    previous=None,
    settings=PolicySettings(),
)


@pytest.fixture
def started() -> Iterator[list[NodeReconciler]]:
    """Reconcilers started by a test, stopped after it."""
    out: list[NodeReconciler] = []
    yield out
    for r in out:
        r.stop()


def start(started: list[NodeReconciler], delay: float) -> tuple[FakeNodeWriter, NodeReconciler]:
    writer = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b"))
    r = NodeReconciler(writer, SETTINGS, start_delay=delay)
    started.append(r)
    r.start()
    return writer, r


# -- the start-up jitter ------------------------------------------------------------------------------------


def test_a_healthy_agents_first_request_waits_for_its_start_up_delay(started: list[NodeReconciler]) -> None:
    t0 = time.monotonic()
    writer, r = start(started, 0.4)
    hand_over(r, HEALTHY, 1)
    time.sleep(0.2)
    assert writer.reads == 0 and not r.status.reconciled  # /readyz waits with it
    assert r.wait_idle(5)
    assert writer.reads == 1 and time.monotonic() - t0 >= 0.4


def test_a_fault_at_start_is_written_at_once_whatever_the_delay(started: list[NodeReconciler]) -> None:
    t0 = time.monotonic()
    writer, r = start(started, 60)
    hand_over(r, SICK, 0)
    assert r.wait_idle(5)
    assert writer.writes == 1 and r.status.tainted
    assert time.monotonic() - t0 < 5


def test_a_fault_found_during_the_delay_ends_it(started: list[NodeReconciler]) -> None:
    writer, r = start(started, 60)
    hand_over(r, HEALTHY, 1)
    time.sleep(0.1)
    assert writer.reads == 0
    hand_over(r, SICK, 0)
    assert r.wait_idle(5)
    assert writer.writes == 1 and r.status.tainted


def test_an_agent_stopped_during_the_delay_stops_at_once_without_a_request(
    started: list[NodeReconciler],
) -> None:
    writer, r = start(started, 60)
    hand_over(r, HEALTHY, 1)
    t0 = time.monotonic()
    r.stop(timeout=5)
    assert time.monotonic() - t0 < 1
    assert writer.reads == 0


def test_no_delay_is_the_old_behaviour(started: list[NodeReconciler]) -> None:
    writer, r = start(started, 0)
    hand_over(r, HEALTHY, 1)
    assert r.wait_idle(2) and writer.reads == 1


def _cfg(**node: object) -> Config:
    return Config(node=NodeSettings(name="n", **node))  # type: ignore[arg-type]


def test_the_delay_is_drawn_from_zero_to_the_jitter_on_a_host_that_has_been_up_a_while() -> None:
    draws: list[tuple[float, float]] = []

    def draw(a: float, b: float) -> float:
        draws.append((a, b))
        return 7.5

    assert running.startup_delay(_cfg(startup_jitter=30.0), uptime=86400, draw=draw) == 7.5
    assert draws == [(0.0, 30.0)]


@pytest.mark.parametrize(
    ("node", "uptime"),
    [
        ({"startup_jitter": 30.0}, 120.0),  # a new node (or one just rebooted): the gate waits for it
        ({"startup_jitter": 0.0}, 86400.0),
        ({"startup_jitter": 30.0, "dry_run": True}, 86400.0),
    ],
    ids=["a node that booted two minutes ago", "jitter 0", "a dry run"],
)
def test_no_delay_where_nothing_is_gained_by_one(node: dict[str, object], uptime: float) -> None:
    assert running.startup_delay(_cfg(**node), uptime=uptime, draw=lambda a, b: 1 / 0) == 0.0


def test_an_unreadable_uptime_keeps_the_jitter(tmp_path: Path) -> None:
    assert running.host_uptime(str(tmp_path / "missing")) is None
    (tmp_path / "uptime").write_text("12476.05 10310.25\n")
    assert running.host_uptime(str(tmp_path / "uptime")) == 12476.05
    assert running.startup_delay(_cfg(startup_jitter=5.0), uptime=None, draw=lambda a, b: b) == 5.0


# -- the client-side rate limit -----------------------------------------------------------------------------


def test_the_burst_goes_at_once_then_requests_are_spaced_at_the_rate() -> None:
    t = Clock(100.0)
    limiter = RateLimiter(5, 3, clock=t, sleep=t.sleep)
    waits = [limiter.acquire() for _ in range(5)]
    assert waits[:3] == [0, 0, 0]
    assert waits[3:] == pytest.approx([0.2, 0.2])
    t.t += 10  # idle: the bucket refills, but never past the burst
    assert [limiter.acquire() for _ in range(4)] == pytest.approx([0, 0, 0, 0.2])


def test_concurrent_callers_each_wait_for_their_own_token() -> None:
    limiter = RateLimiter(50, 1)
    done: list[float] = []
    t0 = time.monotonic()

    def one() -> None:
        limiter.acquire()
        done.append(time.monotonic() - t0)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    # 1 at once, then 5 more at 50/s: the last leaves no earlier than 100 ms after the first (later when
    # a thread arrives late, and then the others waited less).
    assert max(done) >= 0.099
    assert 0 < limiter.waited <= 0.02 * (1 + 2 + 3 + 4 + 5) + 1e-6


def test_qps_zero_is_no_limit() -> None:
    t = Clock(100.0)
    limiter = RateLimiter(0, 1, clock=t, sleep=t.sleep)
    assert [limiter.acquire() for _ in range(100)] == [0.0] * 100 and not t.slept


def test_a_read_that_reserves_its_write_pays_for_both_and_the_write_waits_for_nothing(
    server: str,  # noqa: F811
) -> None:
    t = Clock(100.0)
    limiter = RateLimiter(2, 2, clock=t, sleep=t.sleep)
    client = kubeclient.Client(kubeconfig.Credentials(server=server), user_agent="t", rate_limiter=limiter)
    writer = KubeNodeWriter("gpu-1", api=client)
    Recorder.replies = [(200, {}, json.dumps(NODE).encode())] * 5
    node = writer.read(reserve_write=True)
    writer.set_condition(node, CONDITION)
    node = writer.read(reserve_write=True)  # the bucket is empty: waits for 2 tokens at 2/s
    writer.set_condition(node, CONDITION)  # never between its read and its write
    client.request("POST", "/api/v1/namespaces/default/events", body={})
    assert len(Recorder.seen) == 5
    assert t.slept == pytest.approx([1.0, 0.5])


def test_a_write_without_a_reserving_read_pays_its_own_token(server: str) -> None:  # noqa: F811
    """Before, the bucket itself charged a read two tokens and any patch none, whoever sent it: a patch
    loop with no read in it was never held to the rate."""
    t = Clock(100.0)
    limiter = RateLimiter(2, 2, clock=t, sleep=t.sleep)
    client = kubeclient.Client(kubeconfig.Credentials(server=server), user_agent="t", rate_limiter=limiter)
    writer = KubeNodeWriter("gpu-1", api=client)
    Recorder.replies = [(200, {}, json.dumps(NODE).encode())] * 5
    node = writer.read()  # 1 token: reserves nothing
    for _ in range(3):
        node = writer.set_condition(node, CONDITION)
    client.request("GET", "/api/v1/nodes/gpu-1")  # any request: one token
    assert t.slept == pytest.approx([0.5, 0.5, 0.5])


def test_the_reconcilers_reads_reserve_the_write_after_them(started: list[NodeReconciler]) -> None:
    writer, r = start(started, 0)
    hand_over(r, SICK, 0)
    assert r.wait_idle(5)
    assert writer.reads >= 1 and writer.reserved_reads == writer.reads


def test_defect_a_rate_limited_conflict_loop_keeps_its_read_and_write_together() -> None:
    """A 409 loop against a writer at 50 writes/s: a limit that made the write wait after its read let the
    other writer land in between every time (tests/integration/test_agent_cluster.py, concurrent writers)."""
    t = Clock(100.0)
    limiter = RateLimiter(5, 4, clock=t, sleep=t.sleep)
    gaps = []
    for _ in range(10):  # read (reserving its write), then patch: ten rounds of a conflict loop
        limiter.acquire(2.0)
        read_at = t.t
        limiter.acquire(0.0)
        gaps.append(t.t - read_at)
    assert gaps == [0.0] * 10
    assert sum(t.slept) == pytest.approx((20 - 4) / 5)  # the loop as a whole is still held to the rate


# -- settings ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "flag"),
    [
        ({"api_qps": -1.0}, "--api-qps"),
        ({"api_qps": float("nan")}, "--api-qps"),
        ({"api_burst": 0}, "--api-burst"),
        ({"startup_jitter": -1.0}, "--startup-jitter"),
        ({"startup_jitter": float("nan")}, "--startup-jitter"),
    ],
)
def test_a_bad_rate_limit_or_jitter_is_a_config_error_naming_its_flag(
    change: dict[str, float], flag: str
) -> None:
    with pytest.raises(ConfigError, match=flag):
        Config(node=NodeSettings(name="n", **change))  # type: ignore[arg-type]


def test_the_flags_and_their_variables_reach_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Config] = []

    def watch(cfg: Config) -> bool:
        seen.append(cfg)
        return False

    monkeypatch.setattr("gpuguard.runtime.root.watch", watch)
    args = ["watch", "--node", "n", "--backend", "mock", "--api-qps", "2.5", "--startup-jitter", "0"]
    result = CliRunner().invoke(cli.cli, args, env={"GPUGUARD_API_BURST": "7"})
    assert result.exit_code == 0, result.output
    (cfg,) = seen
    assert (cfg.node.api_qps, cfg.node.api_burst, cfg.node.startup_jitter) == (2.5, 7, 0.0)


def test_every_request_of_the_agent_goes_through_its_one_client_and_its_rate_limit(
    tmp_path: Path,
    server: str,  # noqa: F811
) -> None:
    """The composition root builds one API client, with --api-qps/--api-burst, and injects it: the node
    writer, the device source (DeviceTaintRules, ResourceSlices) and the rules' watch share it. Before, the
    device source loaded a second client of its own without a rate limit (and a second connection pool)."""
    from prometheus_client import CollectorRegistry

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "t0k"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    cfg = Config(
        backend="mock",
        node=NodeSettings(name="n", kubeconfig=str(kubeconfig), quarantine="auto", api_qps=3.0, api_burst=7),
    )
    parts = running.build(cfg, registry=CollectorRegistry())
    writer, source, watch = parts.writer, parts.device_source, parts.rules_watch
    assert isinstance(writer, KubeNodeWriter) and source is not None and watch is not None
    assert source.api is writer.api  # type: ignore[union-attr]
    assert watch._watched._api is writer.api  # its ListWatch
    limiter = writer.api.rate_limiter
    assert limiter is not None and (limiter.qps, limiter.burst) == (3.0, 7)
    assert Recorder.seen == []  # built, nothing sent
