"""The degraded level where operators look: /healthz (each GPU's `degraded` beside `reasons`), the
metric gpuguard_gpu_degraded{gpu,uuid,reason}, `gpuguard check` (a DEGRADED column, exit 0 unless
--fail-on-degraded) and `gpuguard status` (a DEGRADED column, degraded nodes and rules listed)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

from gpuguard.cli import cli, report
from gpuguard.core.metrics import Metrics
from gpuguard.core.model import AgentStatus, Fault, GpuVerdict, Verdict
from gpuguard.quarantine.gpu.writers import quarantined_gpus
from gpuguard.quarantine.node.writers import degraded_nodes, quarantined_nodes
from gpuguard.runtime import root as running
from gpuguard.runtime.health import health_body

NVLINK = Fault("nvlink-down", "link 3 inactive", uuid="GPU-1", gpu_index=1)
FABRIC = Fault("fabric-degraded", "bandwidth degraded")
ECC = Fault("ecc", "3 uncorrected volatile ECC errors", uuid="GPU-0", gpu_index=0)


def verdict(*, degraded: bool = True, sick: bool = False) -> Verdict:
    return Verdict(
        gpus=(
            GpuVerdict(index=0, uuid="GPU-0", faults=(ECC,) if sick else ()),
            GpuVerdict(index=1, uuid="GPU-1", degraded=(NVLINK,) if degraded else ()),
        ),
        node_degraded=(FABRIC,) if degraded else (),
    )


def status(v: Verdict) -> AgentStatus:
    return AgentStatus(
        alive=True,
        ready=True,
        node="n",
        verdict=v,
        tainted=False,
        cordoned=False,
        dry_run=False,
        last_check=None,
    )


def test_healthz_lists_each_gpus_degraded_signals_beside_its_reasons_and_the_nodes_own() -> None:
    body = health_body(status(verdict(sick=True)))
    assert body["healthy"] is False  # for the fault, not for the degraded signals
    gpu0, gpu1 = body["gpus"]
    assert gpu0["reasons"] == [ECC.message] and gpu0["degraded"] == []
    assert gpu1["healthy"] is True and gpu1["degraded"] == ["nvlink-down: link 3 inactive"]
    assert body["node_degraded"] == ["fabric-degraded: bandwidth degraded"]
    assert health_body(status(verdict(degraded=True)))["healthy"] is True


def test_the_degraded_metric_has_a_series_per_signal_and_drops_it_when_the_signal_clears() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)

    def value(gpu: str, uuid: str, reason: str) -> float | None:
        return registry.get_sample_value(
            "gpuguard_gpu_degraded", {"gpu": gpu, "uuid": uuid, "reason": reason}
        )

    metrics.observe_check(verdict(), duration=0.001, wall=1.0)
    assert value("1", "GPU-1", "nvlink-down") == 1 and value("", "", "fabric-degraded") == 1
    assert value("0", "GPU-0", "nvlink-down") is None
    metrics.observe_check(verdict(degraded=False), duration=0.001, wall=2.0)
    assert value("1", "GPU-1", "nvlink-down") is None and value("", "", "fabric-degraded") is None


def test_the_check_table_has_a_degraded_column_and_says_how_many_gpus_are_degraded() -> None:
    text = report.verdict_table(verdict())
    header, gpu0, gpu1 = text.splitlines()[:3]
    assert header.split() == ["GPU", "UUID", "NAME", "HEALTHY", "ECC", "DEGRADED", "REASONS"]
    assert gpu1.split()[3:6] == ["yes", "n/a", "nvlink-down"] and gpu0.split()[5] == "-"
    assert "node degraded: fabric-degraded: bandwidth degraded" in text
    assert "GPU 1 degraded: nvlink-down: link 3 inactive" in text
    assert text.splitlines()[-1] == "healthy, 1 GPU degraded"
    assert report.verdict_table(verdict(degraded=False)).splitlines()[-1] == "healthy"
    doc = json.loads(report.verdict_json(verdict()))
    assert doc["gpus"][1]["degraded"] == ["nvlink-down: link 3 inactive"] and doc["node_degraded"]


@pytest.mark.parametrize(
    ("v", "args", "code"),
    [
        (verdict(), (), 0),
        (verdict(), ("--fail-on-degraded",), 1),
        (verdict(degraded=False), ("--fail-on-degraded",), 0),
        (verdict(sick=True), (), 1),
    ],
)
def test_check_exits_0_on_degraded_gpus_unless_told_to_fail(
    monkeypatch: pytest.MonkeyPatch, v: Verdict, args: tuple[str, ...], code: int
) -> None:
    monkeypatch.setattr(
        running, "check_once", lambda cfg, at=None: running.Check(verdict=v, no_library=False)
    )
    result = CliRunner().invoke(cli, ["check", "--backend", "mock", *args], standalone_mode=False)
    assert result.exception is None, result.output
    assert result.return_value == code, result.output
    assert "DEGRADED" in result.output


class NodesApi:
    """The API server's node and rule lists as `gpuguard status` reads them (label selectors)."""

    def __init__(self, nodes: list[dict[str, Any]], rules: list[dict[str, Any]]) -> None:
        self.nodes, self.rules = nodes, rules

    def request(self, method: str, path: str, *, query: dict[str, str] | None = None, **_: Any) -> Any:
        selector = (query or {}).get("labelSelector", "")
        if path.endswith("devicetaintrules"):
            return {"items": self.rules, "metadata": {}}
        key = selector.split("=")[0]
        return {"items": [n for n in self.nodes if key in n["metadata"].get("labels", {})]}


def node(name: str, labels: dict[str, str], annotations: dict[str, str], taints: list[Any]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {"taints": taints},
    }


def test_status_lists_degraded_nodes_and_rules_with_their_signals_in_a_degraded_column() -> None:
    signals = {"gpuguard.io/degraded-signals": '["nvlink-down/GPU-1"]'}
    soft = {"key": "gpuguard.io/gpu-degraded", "value": "nvlink-down", "effect": "PreferNoSchedule"}
    both = node(
        "both",
        {"gpuguard.io/quarantined": "true", "gpuguard.io/degraded": "true"},
        {**signals, "gpuguard.io/faults": "ecc/GPU-0", "gpuguard.io/since": "2026-12-05T08:00:00Z"},
        [{"key": "gpuguard.io/gpu-unhealthy", "value": "ecc", "effect": "NoSchedule"}, soft],
    )
    only = node("only", {"gpuguard.io/degraded": "true"}, signals, [soft])
    theirs = node("theirs", {"gpuguard.io/degraded": "true"}, {}, [])  # no record of ours: not listed
    rule = {
        "metadata": {
            "name": "gpuguard-degraded.dra.gpu-2",
            "labels": {"gpuguard.io/node": "dra", "app.kubernetes.io/managed-by": "gpuguard"},
            "annotations": {"gpuguard.io/faults": "pcie-width/GPU-2", "gpuguard.io/uuid": "GPU-2"},
        },
        "spec": {
            "deviceSelector": {"driver": "gpu.nvidia.com", "pool": "dra", "device": "gpu-2"},
            "taint": {"key": "gpuguard.io/gpu-degraded", "value": "pcie-width", "effect": "None"},
        },
    }
    api: Any = NodesApi([both, only, theirs], [rule])
    quarantined = quarantined_nodes(api)
    rows = [*quarantined, *degraded_nodes(api, skip={r["node"] for r in quarantined}), *quarantined_gpus(api)]
    assert [(r["node"], r["state"], r["degraded"]) for r in rows] == [
        ("both", "quarantined", ["nvlink-down/GPU-1"]),
        ("only", "degraded", ["nvlink-down/GPU-1"]),
        ("dra", "gpu-degraded", ["pcie-width/GPU-2"]),
    ]
    table = report.status_table(rows).splitlines()
    assert table[0].split() == [
        "NODE",
        "STATE",
        "REASON",
        "SINCE",
        "CORDONED",
        "FAULTS",
        "DEGRADED",
        "REPEAT-OFFENDERS",
        "DETAIL",
    ]
    assert table[2].split()[:2] == ["only", "degraded"] and "nvlink-down/GPU-1" in table[2]


@pytest.mark.parametrize(
    ("args", "env", "taint"),
    [
        ((), {}, True),
        (("--no-degraded-taint",), {}, False),
        ((), {"GPUGUARD_NO_DEGRADED_TAINT": "true"}, False),
    ],
)
def test_the_degraded_taint_is_on_by_default_and_a_flag_or_its_variable_turns_it_off(
    monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], env: dict[str, str], taint: bool
) -> None:
    seen: list[bool] = []
    monkeypatch.setattr(running, "watch", lambda cfg: seen.append(cfg.node.degraded_taint))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    result = CliRunner().invoke(
        cli, ["watch", "--dry-run", "--backend", "mock", *args], standalone_mode=False
    )
    assert result.exception is None, result.output
    assert seen == [taint]


def test_a_degraded_nodes_status_reason_is_its_alphabetically_first_recorded_reason() -> None:
    """As the degraded taint's value said before taints lost their values: "pcie-width" before
    "pcie-width-max", although the key "pcie-width-max/GPU-1" sorts before "pcie-width/GPU-1"."""
    signals = {"gpuguard.io/degraded-signals": '["pcie-width/GPU-1", "pcie-width-max/GPU-1"]'}
    soft = {"key": "gpuguard.io/gpu-degraded", "effect": "PreferNoSchedule"}
    api: Any = NodesApi([node("n", {"gpuguard.io/degraded": "true"}, signals, [soft])], [])
    (row,) = degraded_nodes(api, skip=set())
    assert row["reason"] == "pcie-width"
    assert row["degraded"] == ["pcie-width-max/GPU-1", "pcie-width/GPU-1"]
