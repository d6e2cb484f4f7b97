"""--signals-config (issue 29): levels, thresholds and windows changed globally and per node label selector;
a bad file is one line and exit 2 at start; the node rules apply once the agent has read its node."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.core.config import NodeSettings, PolicySettings
from gpuguard.core.errors import ConfigError
from gpuguard.core.signalconfig import parse
from gpuguard.core.signaltable import SIGNALS
from gpuguard.nvml.mock import MockBackend, parse_scenario
from gpuguard.quarantine.node.view import NodeView
from gpuguard.quarantine.reconciler import NodeReconciler
from gpuguard.runtime.agent import Agent
from harness.clock import Clock
from harness.fakes import FakeNodeWriter
from tests.test_cli import run, watch_config

GOOD = """
signals:
  pcie-replays: {threshold: 16, window_s: 120}
  clock-power-brake: {level: ignore}
nodes:
  - selector: {nvidia.com/gpu.product: NVIDIA-H100-PCIe}
    signals:
      nvlink-down: {level: ignore}
  - selector: {nvidia.com/gpu.product: NVIDIA-H100-PCIe, pool: strict}
    signals:
      nvlink-down: {level: fault}
"""


def test_the_global_part_applies_everywhere_and_a_rule_only_where_every_label_matches() -> None:
    c = parse(GOOD)
    glob = c.table(None)
    assert (glob["pcie-replays"].threshold, glob["pcie-replays"].window_s) == (16, 120)
    assert glob.level("clock-power-brake") == "ignore" and glob.level("nvlink-down") == "degraded"
    assert c.table({"nvidia.com/gpu.product": "NVIDIA-H200"}) == glob
    assert c.table({"nvidia.com/gpu.product": "NVIDIA-H100-PCIe"}).level("nvlink-down") == "ignore"
    strict = {"nvidia.com/gpu.product": "NVIDIA-H100-PCIe", "pool": "strict"}
    assert c.table(strict).level("nvlink-down") == "fault"  # rules apply in order: the later one wins
    assert c.matching(strict) == (0, 1)
    assert SIGNALS.level("clock-power-brake") == "degraded"  # the shipped table is untouched


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("signals: [", "not valid YAML"),
        ("- 1", "expected a mapping with 'signals', 'expected' and/or 'nodes'"),
        ("signal: {}", "unknown key 'signal'"),
        ("signals: {nvlink-gone: {level: fault}}", "unknown signal 'nvlink-gone'"),
        (
            "signals: {nvlink-down: {level: fatal}}",
            "nvlink-down.level must be one of fault, degraded, ignore",
        ),
        ("signals: {pcie-replays: {threshold: -1}}", "pcie-replays.threshold must be a number"),
        ("signals: {pcie-replays: {threshold: '8'}}", "pcie-replays.threshold must be a number"),
        ("signals: {pcie-replays: {window_s: 1e9}}", "pcie-replays.window_s must be a number 0..86400"),
        ("signals: {pcie-replays: {limit: 3}}", "pcie-replays: unknown key 'limit'"),
        ("signals: {pcie-replays: fault}", "pcie-replays: expected a mapping of level, threshold"),
        ("nodes: {a: b}", "'nodes' must be a list"),
        ("nodes: [{selector: {}, signals: {}}]", "nodes[0]: 'selector' must map node label keys"),
        ("nodes: [{selector: {'bad key!': x}}]", "nodes[0]: selector key 'bad key!' is not a label key"),
        ("nodes: [{selector: {gpus: 8}}]", "selector value 8 of gpus is not a label value"),
        ("nodes: [{selector: {a: b}, signals: {x: {level: fault}}}]", "nodes[0]: unknown signal 'x'"),
    ],
)
def test_a_bad_file_is_one_clear_line_never_a_silent_default(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse(text, source="--signals-config s.yaml")
    assert message in str(e.value) and str(e.value).startswith("--signals-config s.yaml")
    assert "\n" not in str(e.value)


def test_an_empty_file_changes_nothing() -> None:
    assert parse("").table(None) == SIGNALS


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_a_bad_file_stops_the_start_with_exit_2_and_one_line_flag_or_variable(tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.yaml", "signals: {nvlink-down: {level: fatal}}\n")
    r = run("check", "--backend", "mock", "--signals-config", bad)
    assert r.returncode == 2 and "nvlink-down.level must be one of" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run("watch", "--backend", "mock", "--dry-run", env={"GPUGUARD_SIGNALS_CONFIG": bad})
    assert r.returncode == 2 and "nvlink-down.level" in r.stderr, r.stderr
    r = run("check", "--backend", "mock", "--signals-config", str(tmp_path / "none.yaml"))
    assert r.returncode == 2 and "none.yaml" in r.stderr and "Traceback" not in r.stderr


def test_a_level_from_the_file_decides_what_check_fails_on(tmp_path: Path) -> None:
    scenario = write(tmp_path, "s.yaml", "gpus: 1\nevents:\n  - {at: 0, gpu: 0, retired_pending: true}\n")
    r = run("check", "--backend", "mock", "--scenario", scenario)
    assert r.returncode == 0, r.stdout  # degraded by default: not a fault
    strict = write(tmp_path, "strict.yaml", "signals:\n  retired-pending: {level: fault}\n")
    r = run("check", "--backend", "mock", "--scenario", scenario, "--signals-config", strict)
    assert r.returncode == 1 and "retired-pending" in r.stdout, r.stdout


def test_the_file_is_parsed_once_into_the_settings(tmp_path: Path) -> None:
    cfg = watch_config("--backend", "mock", "--dry-run", "--signals-config", write(tmp_path, "g.yaml", GOOD))
    assert cfg.signals_config is not None and len(cfg.signals_config.rules) == 2
    assert cfg.policy.signals.level("clock-power-brake") == "ignore"
    assert watch_config("--backend", "mock", "--dry-run").policy.signals == SIGNALS


def test_the_node_rules_apply_once_the_agent_has_read_its_nodes_labels() -> None:
    clock = Clock(1000.0)
    text = "gpus: 1\nevents:\n  - {at: 1, gpu: 0, nvlink_down: [2]}\n"
    backend = MockBackend(parse_scenario(text), clock=clock, start_timer=False)
    backend.open(lambda: None)
    labels = {"nvidia.com/gpu.product": "NVIDIA-H100-PCIe"}
    writer = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b", labels=labels))
    reconciler = NodeReconciler(writer, NodeSettings(name="gpu-1"))
    config = parse(GOOD)
    agent = Agent(
        backend=backend,
        reconciler=reconciler,
        policy=PolicySettings(signals=config.table(None)),
        interval=1.0,
        node_name="gpu-1",
        clock=clock,
        signal_config=config,
    )
    agent.check_once()
    clock.t += 3
    assert [f.reason for f in agent.check_once().degraded] == ["nvlink-down"]  # before the node is read
    clock.t += 3
    steady = agent.check_once()  # the same readings and verdict: the agent's remembered evaluation
    assert [f.reason for f in steady.degraded] == ["nvlink-down"]
    reconciler.reconcile_now()  # reads the node: its labels select rule 0 (nvlink-down ignored)
    clock.t += 3
    assert agent.check_once().degraded == ()


_WORDS = st.sampled_from(["signals", "nodes", "selector", "level", "threshold", "window_s", *SIGNALS.names()])
_SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
_TREES = st.recursive(
    _SCALARS | _WORDS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(_WORDS | st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_TREES)
def test_any_yaml_is_a_config_or_one_clear_line(tree: object) -> None:
    """Whatever the file holds, the start either has a table or stops with one ConfigError line."""
    try:
        config = parse(yaml.safe_dump(tree), source="--signals-config f.yaml")
    except ConfigError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("--signals-config f.yaml")
        return
    assert config.table(None).names() == SIGNALS.names()
    assert config.table({"a": "b"}).names() == SIGNALS.names()
