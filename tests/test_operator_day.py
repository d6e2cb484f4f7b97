"""`gpuguard status`, `history` and `hold` against an in-memory API server (the real one:
tests/integration/test_operator_day.py): status's first line sums up the fleet (GPU nodes, ready agents, the
GPU nodes without one, the budget used of its limit, gated, quarantined, degraded, repeat offenders) and the
JSON says the same; history shows a node's published GPU history; hold reads the node before it writes. The
output docs/operations.md and README.md show is this file's, exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from gpuguard.cli import cli
from gpuguard.kube import client as kubeclient
from gpuguard.quarantine.repeat import published
from gpuguard.store.history import Episode, GpuHistory, Release

ROOT = Path(__file__).resolve().parents[1]
GPU = {"nvidia.com/gpu.present": "true"}
T0 = 1_796_212_800  # 2026-12-02T12:00Z
HOUR = 3600


class Creds:
    server = "https://api.example.com"
    insecure = False


class FakeApi:
    """Nodes, gpuguard's DaemonSet and pods, and no DeviceTaintRules, as the commands read them; a node PATCH
    merges its annotations."""

    creds = Creds()

    def __init__(self, nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        self.nodes = {n["metadata"]["name"]: n for n in nodes}
        self.pods = pods
        self.daemonset = next(
            d
            for d in yaml.safe_load_all((ROOT / "deploy" / "daemonset.yaml").read_text())
            if d["kind"] == "DaemonSet"
        )
        self.patches: list[tuple[str, Any]] = []
        self.agent: Any = None  # called with the node's annotations at each read after a write: its agent

    def request(self, method: str, path: str, *, query: Any = None, body: Any = None, **_: Any) -> Any:
        selector = (query or {}).get("labelSelector", "")
        if path == "/apis/apps/v1/daemonsets":
            return {"items": [self.daemonset]}
        if path == "/api/v1/pods":
            return {"items": self.pods}
        if path == "/api/v1/nodes":
            key = selector.split("=")[0]
            return {"items": [n for n in self.nodes.values() if not key or key in n["metadata"]["labels"]]}
        if path.startswith("/api/v1/nodes/"):
            node = self.nodes[path.rsplit("/", 1)[1]]
            if method == "PATCH":
                self.patches.append((node["metadata"]["name"], body))
                node["metadata"]["annotations"].update(body["metadata"]["annotations"])
            elif self.agent is not None and self.patches:
                self.agent(node["metadata"]["annotations"])
            return node
        return {"items": [], "metadata": {}}  # DeviceTaintRules: none


def node(
    name: str,
    labels: dict[str, str] | None = None,
    *,
    annotations: dict[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
    gpus: int = 8,
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": labels or {},
            "annotations": annotations or {},
            "resourceVersion": "7",
        },
        "spec": {"taints": taints or [], "unschedulable": bool(taints and taints[0]["value"] == "ecc")},
        "status": {"capacity": {"nvidia.com/gpu": str(gpus)} if gpus else {}},
    }


def agent_pod(on: str, *, ready: bool = True) -> dict[str, Any]:
    return {
        "metadata": {"name": f"gpuguard-{on}", "labels": {"app.kubernetes.io/name": "gpuguard"}},
        "spec": {"nodeName": on},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


HISTORY = {
    "GPU-5e1c7a2b": GpuHistory(
        episodes=(
            Episode(("xid-79",), T0, "b1", "reboot", T0 + 2 * HOUR),
            Episode(("xid-79",), T0 + 26 * HOUR, "b2", "reboot", T0 + 27 * HOUR),
            Episode(("ecc", "xid-79"), T0 + 49 * HOUR, "b3", None, None),
        ),
        escalated=T0 + 50 * HOUR,
    ),
    "GPU-9f30d4e6": GpuHistory(
        episodes=(Episode(("xid-48",), T0 + 3 * HOUR, "b1", "operator", T0 + 30 * HOUR),),
        releases=(Release("alice", T0 + 30 * HOUR),),
    ),
}


def fleet() -> FakeApi:
    unhealthy = {"key": "gpuguard.io/gpu-unhealthy", "value": "repeat-offender", "effect": "NoSchedule"}
    held = node(
        "gpu-node-2",
        {**GPU, "gpuguard.io/quarantined": "true", "gpuguard.io/needs-repair": "true"},
        annotations={
            "gpuguard.io/since": "2026-12-03T14:00:00Z",
            "gpuguard.io/faults": "repeat-offender/GPU-5e1c7a2b",
            "gpuguard.io/cordoned": "true",
            "gpuguard.io/repeat-offenders": '{"GPU-5e1c7a2b":3}',
            published.ANN_HISTORY: published.summary(HISTORY) or "",
        },
        taints=[unhealthy],
    )
    held["spec"]["unschedulable"] = True
    degraded = node(
        "gpu-node-3",
        {**GPU, "gpuguard.io/degraded": "true"},
        annotations={"gpuguard.io/degraded-signals": '["nvlink-down/GPU-77aa01c3"]'},
        taints=[{"key": "gpuguard.io/gpu-degraded", "value": "nvlink-down", "effect": "PreferNoSchedule"}],
    )
    gated = node(
        "gpu-node-4", GPU, taints=[{"key": "gpuguard.io/unverified", "value": "", "effect": "NoSchedule"}]
    )
    nodes = [
        node("gpu-node-1", GPU),
        held,
        degraded,
        gated,
        node("gpu-node-5", {}),  # GPUs, but not the label the DaemonSet selects: no agent
        node("cpu-node-1", {}, gpus=0),
    ]
    pods = [
        agent_pod("gpu-node-1"),
        agent_pod("gpu-node-2"),
        agent_pod("gpu-node-3"),
        agent_pod("gpu-node-4", ready=False),
    ]
    return FakeApi(nodes, pods)


def run(monkeypatch: pytest.MonkeyPatch, api: FakeApi, *args: str) -> tuple[int, str]:
    monkeypatch.setattr(kubeclient, "load", lambda *a, **kw: api)
    monkeypatch.setenv("USER", "alice")
    result = CliRunner().invoke(cli, list(args), standalone_mode=False)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.return_value, result.output


def shown(page: str, command: str) -> str:
    """The output a page shows for `$ command` in a text block."""
    text = (ROOT / page).read_text()
    block = text.split(f"```text\n$ {command}\n", 1)[1]
    return block.split("```", 1)[0]


def test_status_sums_up_the_fleet_in_its_first_line(monkeypatch: pytest.MonkeyPatch) -> None:
    code, out = run(monkeypatch, fleet(), "status")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == (
        "5 GPU nodes, 3 with a ready agent, 2 without; budget 1 of 1 (--max-quarantined 10%); 1 gated, "
        "1 quarantined, 0 GPUs quarantined alone, 1 degraded, 1 repeat offender"
    )
    assert lines[1] == "GPU nodes without a ready agent: gpu-node-4, gpu-node-5"
    assert lines[2] == "gated (startup taint, not yet checked): gpu-node-4"
    assert "nvlink-down/GPU-77aa01c3" in out  # why the node is degraded: the signal and the GPU
    assert out == shown("docs/operations.md", "gpuguard status")
    assert out == shown("README.md", "gpuguard status")


def test_status_json_says_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    code, out = run(monkeypatch, fleet(), "status", "-o", "json")
    doc = json.loads(out)
    assert code == 0 and doc["summary"] == run(monkeypatch, fleet(), "status")[1].splitlines()[0]
    assert doc["fleet"]["without_agent"] == ["gpu-node-4", "gpu-node-5"]
    assert (doc["fleet"]["budget_used"], doc["fleet"]["budget_limit"]) == (1, 1)
    assert [r["node"] for r in doc["rows"]] == ["gpu-node-2", "gpu-node-3"]


def test_a_daemonset_that_selects_no_node_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    api = fleet()
    api.daemonset["spec"]["template"]["spec"]["nodeSelector"] = {"nvidia.com/gpu.present": "yes"}
    _, out = run(monkeypatch, api, "status")
    assert "the DaemonSet gpuguard/gpuguard selects no node: its agents run nowhere" in out.splitlines()


def test_status_cleans_terminal_escapes_from_what_it_read(monkeypatch: pytest.MonkeyPatch) -> None:
    api = fleet()
    api.daemonset["metadata"]["name"] = "gpuguard\x1b]0;pwned\x07"
    api.daemonset["spec"]["template"]["spec"]["nodeSelector"] = {"x": "y"}
    for args in (("status",), ("status", "-o", "json")):
        _, out = run(monkeypatch, api, *args)
        assert "\x1b" not in out and "\x07" not in out and "pwned" in out


def test_history_shows_each_gpus_episodes_releases_and_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    code, out = run(monkeypatch, fleet(), "history", "--node", "gpu-node-2")
    assert code == 0
    assert out.splitlines()[0] == "gpu-node-2: 2 GPUs with a history, 1 held for repair"
    assert "GPU-5e1c7a2b  2026-12-04T14:00Z  hold     a repeat offender (its fault episodes)" in out
    assert "GPU-9f30d4e6  2026-12-03T18:00Z  release  by alice" in out
    assert out == shown("docs/operations.md", "gpuguard history --node gpu-node-2")
    code, one = run(
        monkeypatch, fleet(), "history", "--node", "gpu-node-2", "--gpu", "GPU-9f30d4e6", "-o", "json"
    )
    assert code == 0 and list(json.loads(one)["gpus"]) == ["GPU-9f30d4e6"]


def test_history_of_a_gpu_without_one_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(Exception, match=r"history: no history of GPU-0 on gpu-node-2 \(GPUs with a history"):
        run(monkeypatch, fleet(), "history", "--node", "gpu-node-2", "--gpu", "GPU-0")


def test_history_refuses_a_summary_gpuguard_never_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    api = fleet()
    api.nodes["gpu-node-1"]["metadata"]["annotations"][published.ANN_HISTORY] = '{"v": 1, "gpus": []}'
    code, out = run(monkeypatch, api, "history", "--node", "gpu-node-1")
    assert code == 1 and "annotation: not a GPU history summary" in out


def test_hold_reads_the_node_then_writes_and_says_when_the_agent_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = fleet()
    code, out = run(
        monkeypatch, api, "hold", "--node", "gpu-node-1", "--gpu", "GPU-1d2e3f40", "--by", "alice"
    )
    assert code == 0
    assert out == shown("docs/operations.md", "gpuguard hold --node gpu-node-1 --gpu GPU-1d2e3f40 --by alice")
    ((name, body),) = api.patches
    assert name == "gpu-node-1" and body["metadata"]["resourceVersion"] == "7"
    assert json.loads(body["metadata"]["annotations"]["gpuguard.io/hold"])["gpu"] == "GPU-1d2e3f40"
    with pytest.raises(Exception, match=r"a hold is already pending on gpu-node-1 .*--force replaces it"):
        run(monkeypatch, api, "hold", "--node", "gpu-node-1", "--gpu", "GPU-1d2e3f40")
    with pytest.raises(Exception, match=r"GPU-5e1c7a2b of gpu-node-2 is already held"):
        run(monkeypatch, api, "hold", "--node", "gpu-node-2", "--gpu", "GPU-5e1c7a2b")
    assert len(api.patches) == 1


def test_hold_wait_says_so_when_the_agent_handled_the_hold_without_holding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = fleet()
    api.agent = lambda a: a.pop("gpuguard.io/hold", None)  # refused: not its GPU
    code, out = run(monkeypatch, api, "hold", "--node", "gpu-node-2", "--gpu", "GPU-0badc0de", "--wait")
    assert code == 1
    assert out.splitlines()[-1] == (
        "gpu-node-2: the agent handled the hold but does not hold GPU-0badc0de (its log says why: "
        "repeat.hold_refused)"
    )

    def holds(annotations: dict[str, str]) -> None:
        annotations.pop("gpuguard.io/hold", None)
        annotations["gpuguard.io/repeat-offenders"] = '{"GPU-5e1c7a2b":3,"GPU-77aa01c3":0}'

    api = fleet()
    api.agent = holds
    code, out = run(monkeypatch, api, "hold", "--node", "gpu-node-2", "--gpu", "GPU-77aa01c3", "--wait")
    assert code == 0 and out.splitlines()[-1] == "gpu-node-2: the agent holds GPU-77aa01c3"


def test_a_refusal_shows_what_the_node_holds_with_terminal_escapes_made_visible(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = fleet()
    api.nodes["gpu-node-1"]["metadata"]["annotations"]["gpuguard.io/hold"] = "\x1b]0;pwned\x07"
    monkeypatch.setattr(kubeclient, "load", lambda *a, **kw: api)
    result = CliRunner().invoke(
        cli, ["hold", "--node", "gpu-node-1", "--gpu", "GPU-1"], standalone_mode=False
    )
    assert str(result.exception) == (
        "hold: a hold is already pending on gpu-node-1 (\\x1b]0;pwned\\x07), not yet handled by its agent; "
        "--force replaces it"
    )
