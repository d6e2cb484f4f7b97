"""The health signals on the real API server, end to end in one process: a mock scenario's readings, the
agent's judge and its reconciler with the agent's own token under the enforced admission policy. A
power-brake storm marks the node degraded (PreferNoSchedule, never a cordon) and is released once its window
has passed and the node stayed clean for the recovery window; --signals-config's node rules follow the
labels the reconciler reads from the real node."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuguard.core.config import PolicySettings
from gpuguard.core.signalconfig import parse
from gpuguard.nvml.mock import MockBackend, parse_scenario
from gpuguard.runtime.agent import Agent
from harness.clock import Clock
from harness.kube import GPU_NODE_LABELS, Admin
from tests.integration.test_admission import admin, new_node  # noqa: F401
from tests.integration.test_degraded import DEGRADED_KEY, agent_reconciler

pytestmark = pytest.mark.timeout(120)

STORM = """
gpus: 2
events:
  - {at: 10, gpu: 1, clock_events: [hw_power_brake]}
  - {at: 40, gpu: 1, clock_events: []}
"""


def degraded_taint(admin: Admin, node: str) -> str | None:
    """While the degraded taint is on, the first signal the record names (the taint carries no value)."""
    n = admin.node(node)
    taint = next((t for t in n["spec"].get("taints") or [] if t["key"] == DEGRADED_KEY), None)
    if taint is None:
        return None
    assert "value" not in taint, taint
    keys = json.loads((n["metadata"].get("annotations") or {}).get("gpuguard.io/degraded-signals", "[]"))
    return min((str(k).split("/", 1)[0] for k in keys), default="degraded")


def test_a_power_brake_storm_marks_the_node_softly_and_it_is_released_after_the_window(
    admin: Admin, control_plane: Any, tmp_path: Path
) -> None:
    node = new_node(admin)
    reconciler, _writer = agent_reconciler(admin, control_plane, node, tmp_path)
    clock = Clock(0.0)
    backend = MockBackend(parse_scenario(STORM), clock=clock, start_timer=False)
    backend.open(lambda: None)
    agent = Agent(
        backend=backend,
        reconciler=reconciler,
        policy=PolicySettings(),
        interval=3.0,
        node_name=node,
        clock=clock,
    )
    marks: list[str | None] = []
    for t in range(0, 400, 3):
        clock.t = float(t)
        agent.check_once()
        reconciler.reconcile_now()
        if t in (6, 30, 300, 399):
            marks.append(degraded_taint(admin, node))
    n = admin.node(node)
    assert marks[:2] == [None, "clock-power-brake"], marks
    assert marks[-1] is None, marks  # the storm's window passed, then 3 clean checks
    assert not n["spec"].get("unschedulable")
    assert not any(t["key"] == "gpuguard.io/gpu-unhealthy" for t in n["spec"].get("taints") or [])


def test_the_signals_configs_node_rules_follow_the_labels_read_from_the_real_node(
    admin: Admin, control_plane: Any, tmp_path: Path
) -> None:
    """nvlink-down is ignored on nodes labelled as PCIe cards: the agent learns the labels from the
    reconciler's read of its node, then judges by that node's table."""
    config = parse(
        "nodes:\n  - selector: {nvidia.com/gpu.product: NVIDIA-H100-PCIe}\n"
        "    signals: {nvlink-down: {level: ignore}}\n"
    )
    text = "gpus: 1\nevents:\n  - {at: 5, gpu: 0, nvlink_down: [2]}\n"
    results = {}
    for product in ("NVIDIA-H100-PCIe", "NVIDIA-H100-80GB-HBM3"):
        node = new_node(admin, labels={**GPU_NODE_LABELS, "nvidia.com/gpu.product": product})
        reconciler, _ = agent_reconciler(admin, control_plane, node, tmp_path)
        clock = Clock(0.0)
        backend = MockBackend(parse_scenario(text), clock=clock, start_timer=False)
        backend.open(lambda: None)
        agent = Agent(
            backend=backend,
            reconciler=reconciler,
            policy=PolicySettings(signals=config.table(None)),
            interval=3.0,
            node_name=node,
            clock=clock,
            signal_config=config,
        )
        for t in (0.0, 3.0, 6.0, 9.0):
            clock.t = t
            agent.check_once()
            reconciler.reconcile_now()
        results[product] = degraded_taint(admin, node)
    assert results == {"NVIDIA-H100-PCIe": None, "NVIDIA-H100-80GB-HBM3": "nvlink-down"}
