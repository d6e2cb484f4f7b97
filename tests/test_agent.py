"""The loop with the mock backend, driven by an injected clock (no sleeping), and once in real time."""

from __future__ import annotations

import re
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from gpuguard.core.config import NodeSettings, PolicySettings
from gpuguard.core.metrics import Metrics
from gpuguard.nvml.mock import MockBackend, parse_scenario
from gpuguard.quarantine.node.view import NodeView
from gpuguard.quarantine.node.writers import DryRunNodeWriter
from gpuguard.quarantine.reconciler import NodeReconciler
from gpuguard.runtime.agent import Agent
from harness.clock import Clock
from harness.fakes import FakeNodeWriter

SCENARIO = """
gpus: 2
events:
  - {at: 1.0, gpu: 1, xid: 13}
  - {at: 2.0, gpu: 1, ecc_uncorrected: 3}
  - {at: 5.0, gpu: 1, ecc_uncorrected: 0}
"""


def make(text: str = SCENARIO, *, writer: FakeNodeWriter | None = None, interval: float = 1.0):  # type: ignore[no-untyped-def]
    clock = Clock(1000.0)
    backend = MockBackend(parse_scenario(text), clock=clock, start_timer=False)
    backend.open(lambda: None)
    writer = writer or FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b"))
    reconciler = NodeReconciler(writer, NodeSettings(name="gpu-1", recover_after=2))
    metrics = Metrics(CollectorRegistry())
    agent = Agent(
        backend=backend,
        reconciler=reconciler,
        policy=PolicySettings(),
        interval=interval,
        node_name="gpu-1",
        metrics=metrics,
        clock=clock,
    )
    return agent, clock, writer, reconciler, metrics


def step(agent: Agent, reconciler: NodeReconciler, clock: Clock, to: float) -> None:
    clock.t = 1000.0 + to
    agent.check_once()
    reconciler.reconcile_now()


def test_a_steady_node_reuses_its_verdict_and_a_change_is_judged_at_once() -> None:
    """policy.evaluate is pure, so the agent remembers it for the last arguments (an idle node's checks skip
    it); a verdict is reused only for the same snapshot against an equal previous verdict."""
    agent, clock, _writer, r, _metrics = make()
    step(agent, r, clock, 0.0)
    step(agent, r, clock, 0.5)
    steady = agent.status().verdict
    step(agent, r, clock, 0.7)
    assert agent.status().verdict is steady
    step(agent, r, clock, 2.0)  # ECC 3 on GPU 1
    sick = agent.status().verdict
    assert sick is not steady and not sick.healthy
    step(agent, r, clock, 5.0)  # the count is back to 0: the reading equals the steady one again
    assert agent.status().verdict.healthy  # judged against the sick verdict, not reused from before
    assert agent.status().verdict is not steady


def test_a_degraded_signal_counted_over_a_window_clears_as_time_passes_with_readings_unchanged() -> None:
    """A power-brake storm degrades the GPU; once the readings stop changing, only time ends the
    window, so the agent judges again each check while the judge remembers events (not the remembered
    verdict), and goes back to reusing it once nothing is pending."""
    text = (
        "gpus: 1\nevents:\n  - {at: 1, gpu: 0, clock_events: [hw_power_brake]}\n"
        "  - {at: 30, gpu: 0, clock_events: []}\n"
    )
    agent, clock, _writer, r, _metrics = make(text)
    degraded = []
    for t in range(0, 400, 3):
        step(agent, r, clock, float(t))
        degraded.append([f.reason for f in agent.status().verdict.degraded])
    assert ["clock-power-brake"] in degraded
    assert degraded[-1] == [] and not agent.status().verdict.signal_memory.pending
    steady = agent.status().verdict
    step(agent, r, clock, 403.0)
    assert agent.status().verdict is steady


def test_healthy_then_ignored_xid_then_ecc_fault_then_recovery_after_reset() -> None:
    agent, clock, writer, r, metrics = make()
    step(agent, r, clock, 0.0)
    assert agent.status().verdict.healthy and agent.status().ready
    step(agent, r, clock, 1.0)  # Xid 13: ignored
    assert agent.status().verdict.healthy and writer.writes == 0
    step(agent, r, clock, 2.0)  # ECC 3
    s = agent.status()
    assert not s.verdict.healthy and s.tainted and s.cordoned
    assert writer.writes == 1
    step(agent, r, clock, 3.0)
    step(agent, r, clock, 4.0)
    assert writer.writes == 1  # still sick, node already matches
    step(agent, r, clock, 5.0)  # reset: healthy streak 1
    assert agent.status().tainted
    step(agent, r, clock, 6.0)  # streak 2 = --recover-after 2
    s = agent.status()
    assert not s.tainted and not s.cordoned and writer.writes == 2
    assert [e.reason for e in writer.events] == ["GPUUnhealthy", "GPURecovered"]
    text = metrics.registry.get_sample_value(
        "gpuguard_xid_events_total", {"gpu": "1", "uuid": "GPU-mock-1", "xid": "13", "ignored": "true"}
    )
    assert text == 1.0


def test_healthz_turns_stalled_after_three_intervals_without_a_check() -> None:
    agent, clock, _, r, _ = make(interval=1.0)
    step(agent, r, clock, 0.0)
    clock.t += 2.9
    assert agent.status().alive
    clock.t += 0.2
    assert not agent.status().alive


def test_not_ready_before_the_first_check_and_reconcile() -> None:
    agent, *_ = make()
    assert not agent.status().ready


def test_an_xid_wakes_the_loop_long_before_the_next_poll() -> None:
    backend = MockBackend(parse_scenario("gpus: 2\nevents:\n  - {at: 0.3, gpu: 0, xid: 79}\n"))
    writer = DryRunNodeWriter(NodeView(name="n", resource_version="1"))
    reconciler = NodeReconciler(writer, NodeSettings(name="n", dry_run=True))
    agent = Agent(
        backend=backend,
        reconciler=reconciler,
        policy=PolicySettings(),
        interval=30.0,
        node_name="n",
        dry_run=True,
    )
    t = threading.Thread(target=agent.run, daemon=True)
    start = time.monotonic()
    t.start()
    try:
        deadline = start + 5
        while time.monotonic() < deadline and not agent.status().tainted:
            time.sleep(0.01)
        elapsed = time.monotonic() - start
        assert agent.status().tainted, "the Xid never tainted the (dry-run) node"
        assert elapsed < 2.0, f"took {elapsed:.2f}s with a 30 s interval"
    finally:
        agent.stop()
        t.join(5)
    assert not t.is_alive()


def test_a_backend_exception_does_not_kill_the_loop() -> None:
    class Broken(MockBackend):
        calls = 0

        def snapshot(self):
            Broken.calls += 1
            if Broken.calls == 1:
                raise RuntimeError("boom")
            if Broken.calls >= 2:
                agent.stop()  # the loop lived on to a second check: done, however slow the machine
            return super().snapshot()

    backend = Broken(parse_scenario("gpus: 1"))
    reconciler = NodeReconciler(DryRunNodeWriter(NodeView(name="n")), NodeSettings(name="n", dry_run=True))
    agent = Agent(
        backend=backend,
        reconciler=reconciler,
        policy=PolicySettings(),
        interval=0.05,
        node_name="n",
        dry_run=True,
    )
    agent.run(run_for=60)  # a bound only: the second check stops it
    assert Broken.calls >= 2
    assert agent.checks >= 1


def test_a_restarted_agent_restores_the_xid_it_saw_before_it_was_killed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from gpuguard.store.state import StateStore

    scenario = "gpus: 2\nevents:\n  - {at: 1.0, gpu: 1, xid: 79}\n"
    agent, clock, writer, _r, _ = make(scenario)
    agent._state = StateStore(tmp_path, boot_id="boot-1")
    clock.t += 1.0
    agent.check_once()  # sees the Xid and saves it... and is killed before any write
    assert writer.writes == 0
    again, _clock2, writer2, r2, _ = make("gpus: 2")
    again._state = StateStore(tmp_path, boot_id="boot-1")
    again.restore()
    again.check_once()
    r2.reconcile_now()
    assert writer2.node.our_taint is not None and writer2.node.record.primary_reason == "xid-79"


@pytest.mark.parametrize(("flap_window", "writes"), [(600.0, 3), (0.0, 12)])
def test_a_flapping_gpu_costs_one_write_per_episode_not_one_per_flip(flap_window: float, writes: int) -> None:
    # ECC errors for one check, then a reset for three, six times over (six "episodes").
    events = "\n".join(
        f"  - {{at: {4 * k + 1}.0, gpu: 0, ecc_uncorrected: 1}}\n"
        f"  - {{at: {4 * k + 2}.0, gpu: 0, ecc_uncorrected: 0}}"
        for k in range(6)
    )
    agent, clock, writer, r, _ = make(f"gpus: 1\nevents:\n{events}\n")
    agent._flap_window = flap_window
    for t in range(0, 26):
        step(agent, r, clock, float(t))
    # With the window: taint, recover, taint again (the second episode) and then hold -> 3 writes.
    # Without it (--flap-window 0): a taint and a recovery per episode -> 12 writes.
    assert writer.writes == writes


def test_ignored_xids_are_logged_once_per_code_and_window_then_counted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gpuguard.runtime.agent import IGNORED_LOG_WINDOW_S

    storm = "gpus: 1\nevents:\n" + "".join("  - {at: 1.0, gpu: 0, xid: 13}\n" for _ in range(50))
    agent, clock, _, reconciler, _ = make(storm)
    step(agent, reconciler, clock, 1.5)
    step(agent, reconciler, clock, 1.5 + IGNORED_LOG_WINDOW_S)
    out = capsys.readouterr().out
    assert len(re.findall(r"\bxid\.ignored\b(?!_)", out)) == 1, out
    assert out.count("xid.ignored_unlogged") == 1 and "count=49" in out


@pytest.mark.parametrize("faults", ['"x"', "[1]", '["xid-79"]', "[[1]]"])
def test_an_agent_whose_state_file_holds_faults_of_the_wrong_type_starts_and_moves_it_aside(  # type: ignore[no-untyped-def]
    tmp_path, faults: str
) -> None:
    """The restore at start raised AttributeError in state.py: in a DaemonSet, a crash loop."""
    from gpuguard.store.state import FILE_NAME, StateStore

    (tmp_path / FILE_NAME).write_text(
        f'{{"kind": "gpuguard-state", "version": 1, "boot_id": "boot-1", "faults": {faults}}}'
    )
    agent, _clock, _writer, r, _ = make("gpus: 2")
    agent._state = StateStore(tmp_path, boot_id="boot-1")
    agent.restore()
    agent.check_once()
    r.reconcile_now()
    assert agent.checks == 1
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == [FILE_NAME, f"{FILE_NAME}.corrupt"]
    assert StateStore(tmp_path, boot_id="boot-1").load() == ()  # and the new file is well-formed


def test_healthz_carries_the_api_state_of_the_reconciler_and_none_in_a_dry_run() -> None:
    from gpuguard.core.errors import TransientApiError

    agent, _clock, _writer, r, _ = make("gpus: 1")
    agent.check_once()
    r.reconcile_now()
    api = agent.status().api
    assert api is not None and api.state == "ok"
    r.api.unreachable(TransientApiError("read node n: timed out"))
    api = agent.status().api
    assert api is not None and (api.state, api.error) == ("unreachable", "read node n: timed out")
    assert api.since is not None
    backend = MockBackend(parse_scenario("gpus: 1"), start_timer=False)
    dry = NodeReconciler(DryRunNodeWriter(NodeView(name="n")), NodeSettings(name="n", dry_run=True))
    dry_agent = Agent(
        backend=backend, reconciler=dry, policy=PolicySettings(), interval=1, node_name="n", dry_run=True
    )
    assert dry_agent.status().api is None


def test_at_interval_60_a_power_brake_storm_degrades_the_gpu_through_a_widened_window() -> None:
    """5 checks within 300 s at most: with the shipped window the storm would never count more than 5."""
    text = "gpus: 1\nevents:\n  - {at: 1, gpu: 0, clock_events: [hw_power_brake]}\n"
    agent, clock, _writer, r, _metrics = make(text, interval=60.0)
    seen = []
    for i in range(8):
        step(agent, r, clock, 1.0 + 60 * i)
        seen.append([f.reason for f in agent.status().verdict.degraded])
    assert seen == [[]] * 5 + [["clock-power-brake"]] * 3


@pytest.mark.parametrize(("flap_window", "most"), [(600.0, 3), (0.0, 20)])
def test_a_flapping_nvlink_link_keeps_the_node_degraded_and_costs_one_write_not_one_per_flip(
    flap_window: float, most: int
) -> None:
    """An NVLink link down for one second, up for one, over and over, with --recover-after 1: the degraded
    level holds its marks while the signal flaps, as the fault level does: marked, cleared, marked again
    (the second episode) and then held, the GPUDegraded condition written as often (each flip cost a patch,
    an Event and a condition write). With --flap-window 0 it follows every flip."""
    events = "\n".join(
        f"  - {{at: {2 * k + 1}.0, gpu: 0, nvlink_down: [3]}}\n"
        f"  - {{at: {2 * k + 2}.0, gpu: 0, nvlink_down: []}}"
        for k in range(10)
    )
    clock = Clock(1000.0)
    backend = MockBackend(parse_scenario(f"gpus: 1\nevents:\n{events}\n"), clock=clock, start_timer=False)
    backend.open(lambda: None)
    writer = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b"))
    r = NodeReconciler(writer, NodeSettings(name="gpu-1", recover_after=1))
    agent = Agent(
        backend=backend,
        reconciler=r,
        policy=PolicySettings(),
        interval=1.0,
        node_name="gpu-1",
        clock=clock,
        flap_window=flap_window,
    )
    for t in range(0, 22):
        step(agent, r, clock, float(t))
    marked = [c for c in writer.patches if c.action in ("degrade", "degrade-clear")]
    assert 1 <= len(marked) <= most, [c.action for c in marked]
    assert len(writer.conditions) <= most + 1, writer.conditions  # + the GPUHealthy condition
    if flap_window:
        assert writer.node.degraded_condition == "True"
