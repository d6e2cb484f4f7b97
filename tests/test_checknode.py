"""`gpuguard check` and its node (gpuguard/runtime/checknode.py): one read of the Node gives the GPU count it
expects and the labels that select --signals-config's node rules; without the labels, the global part
applies."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gpuguard.core.config import Config, NodeSettings, PolicySettings
from gpuguard.core.errors import TransientApiError
from gpuguard.core.signalconfig import parse
from gpuguard.runtime import checknode
from tests.test_cli import run, write
from tests.test_gpucount import _Api, _node, _NodeServer

H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8"}
RULES = """
signals:
  pcie-replays: {threshold: 16}
nodes:
  - selector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}
    signals:
      fabric-status: {level: ignore}
      retired-pending: {level: fault}
"""


class _CountingApi(_Api):
    def __init__(self, node: object = None, error: Exception | None = None) -> None:
        super().__init__(node, error)
        self.reads = 0

    def request(self, method: str, path: str, **kw: object) -> object:
        self.reads += 1
        return super().request(method, path, **kw)


def _cfg(*, name: str | None = "gpu-1", kubeconfig: str | None = "kc", rules: str = RULES) -> Config:
    config = parse(rules)
    return Config(
        node=NodeSettings(name=name, kubeconfig=kubeconfig, dry_run=name is None),
        policy=PolicySettings(signals=config.table(None)),
        signals_config=config,
    )


@pytest.fixture(autouse=True)
def _whole_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)


def test_one_read_gives_the_count_and_the_node_rules_its_labels_select() -> None:
    api = _CountingApi(_node(H100))
    facts = checknode.read(_cfg(), api=api)
    assert api.reads == 1
    assert facts.expected_gpus == 8
    assert (
        facts.signals.level("fabric-status") == "ignore" and facts.signals.level("retired-pending") == "fault"
    )
    assert facts.signals["pcie-replays"].threshold == 16  # the global part as well


def test_a_node_the_selector_does_not_match_gets_the_global_part_only() -> None:
    facts = checknode.read(_cfg(), api=_Api(_node({"nvidia.com/gpu.product": "NVIDIA-A100"})))
    assert (
        facts.signals.level("fabric-status") == "fault"
        and facts.signals.level("retired-pending") == "degraded"
    )
    assert facts.signals["pcie-replays"].threshold == 16


@pytest.mark.parametrize(
    ("name", "kubeconfig", "api"),
    [
        (None, "kc", _Api(_node(H100))),  # no node name
        ("gpu-1", "kc", _Api(error=TransientApiError("connection refused"))),  # the API does not answer
    ],
)
def test_without_the_labels_the_global_part_applies_and_one_line_says_so(
    name: str | None, kubeconfig: str, api: _Api
) -> None:
    with capture_logs() as logs:
        facts = checknode.read(_cfg(name=name, kubeconfig=kubeconfig), api=api)
    assert facts.signals.level("fabric-status") == "fault" and facts.signals["pcie-replays"].threshold == 16
    assert [e["event"] for e in logs].count("check.signals_global_only") == 1


def test_without_node_rules_or_a_count_to_read_the_node_is_not_read() -> None:
    api = _CountingApi(_node(H100))
    cfg = replace(_cfg(rules="signals: {pcie-replays: {threshold: 16}}"), expected_gpus_label="")
    facts = checknode.read(cfg, api=api)
    assert api.reads == 0 and facts.expected_gpus is None


def test_with_expected_gpus_given_the_node_is_still_read_for_its_rules_and_the_flag_wins() -> None:
    api = _CountingApi(_node(H100))
    cfg = _cfg()
    facts = checknode.read(replace(cfg, policy=replace(cfg.policy, expected_gpus=4)), api=api)
    assert api.reads == 1 and facts.expected_gpus == 4 and facts.signals.level("fabric-status") == "ignore"


# -- the CLI end to end, against an HTTP 'API server' ------------------------------------------------------


def _check(tmp_path: Path, event: str, *args: str) -> subprocess.CompletedProcess[str]:
    scenario = write(tmp_path, f"gpus: 1\nevents:\n  - {{at: 0, gpu: 0, {event}}}\n")
    rules = tmp_path / "signals.yaml"
    rules.write_text(RULES)
    return run(
        "check",
        "--backend",
        "mock",
        "--scenario",
        scenario,
        "--at",
        "5",
        "--signals-config",
        str(rules),
        *args,
    )


@pytest.fixture
def api() -> Iterator[_NodeServer]:
    s = _NodeServer()
    s.nodes["gpu-1"] = _node({**H100, "nvidia.com/gpu.count": "1"})
    yield s
    s.httpd.shutdown()


def test_check_passes_a_fault_signal_the_nodes_rule_ignores_and_fails_it_without_the_labels(
    api: _NodeServer, tmp_path: Path
) -> None:
    kc = api.kubeconfig(tmp_path / "kc")
    r = _check(tmp_path, "fabric_status: UNKNOWN", "--kubeconfig", kc, "--node", "gpu-1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert api.paths == ["/api/v1/nodes/gpu-1"]  # one read, for the count and the rules
    r = _check(tmp_path, "fabric_status: UNKNOWN", "--kubeconfig", kc)  # no node name: the global part
    assert r.returncode == 1 and "fabric-status" in r.stdout
    assert "check.signals_global_only" in r.stderr and "Traceback" not in r.stderr


def test_check_fails_a_degraded_signal_the_nodes_rule_makes_a_fault(api: _NodeServer, tmp_path: Path) -> None:
    kc = api.kubeconfig(tmp_path / "kc")
    r = _check(tmp_path, "retired_pending: true", "--kubeconfig", kc, "--node", "gpu-1")
    assert r.returncode == 1 and "retired-pending" in r.stdout, r.stdout + r.stderr
    api.nodes["gpu-1"] = _node({"nvidia.com/gpu.product": "NVIDIA-A100", "nvidia.com/gpu.count": "1"})
    r = _check(tmp_path, "retired_pending: true", "--kubeconfig", kc, "--node", "gpu-1")
    assert r.returncode == 0, r.stdout + r.stderr
