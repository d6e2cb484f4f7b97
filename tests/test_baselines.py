"""The signals' first-good baselines across agent restarts (gpuguard/store/baselines.py): saved only when one
changes, durably, bounded; a corrupt or foreign file moved aside with a log line; a restarted agent, through
the real pynvml and the fake library, still reports the link that went down under the agent before it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from gpuguard.core.model import SignalMemory
from gpuguard.store import retry
from gpuguard.store.baselines import FILE_NAME, BaselineStore, baselines
from gpuguard.store.limits import BASELINES_MAX_BYTES as MAX_BYTES
from gpuguard.store.limits import BASELINES_MAX_GPUS as MAX_GPUS
from harness.clock import Clock
from harness.synctrace import trace_syncs
from tests.test_nvml_backend import ROOT, env

MEMORY = SignalMemory(
    first_links=(("GPU-a", frozenset({0, 1, 2, 3})), ("GPU-b", frozenset({0, 1}))),
    first_width=(("GPU-a", 16), ("GPU-b", 8)),
    first_gen=(("GPU-a", 4),),
    # The rate windows are never kept.
    counters=(("GPU-a/nvlink", ((1.0, 5),)),),
    clock_samples=(("GPU-a", ((1.0, 0x80),)),),
    fabric_incomplete_since=(("GPU-a", 3.0),),
)
BOTH = {"GPU-a", "GPU-b"}


def _fields(m: SignalMemory) -> dict[str, Any]:
    return {"first_links": m.first_links, "first_width": m.first_width, "first_gen": m.first_gen}


def test_saved_baselines_load_back_without_the_windows(tmp_path: Path) -> None:
    BaselineStore(tmp_path).save(MEMORY, BOTH)
    loaded = BaselineStore(tmp_path).load()
    assert loaded == SignalMemory(
        first_links=MEMORY.first_links, first_width=MEMORY.first_width, first_gen=MEMORY.first_gen
    )
    assert not loaded.counters and not loaded.clock_samples and not loaded.fabric_incomplete_since


def test_the_file_is_written_only_when_a_baseline_changes(tmp_path: Path) -> None:
    store = BaselineStore(tmp_path)
    store.save(MEMORY, BOTH)
    path = tmp_path / FILE_NAME
    first = path.stat().st_mtime_ns
    os.utime(path, ns=(1, 1))
    # New windows, same baselines: not written again.
    windows = (("GPU-a/pcie", ((2.0, 1),)),)
    store.save(SignalMemory(**_fields(MEMORY), counters=windows), BOTH)
    assert path.stat().st_mtime_ns == 1 != first
    store.save(SignalMemory(first_width=(("GPU-a", 16),)), BOTH)
    assert path.stat().st_mtime_ns != 1
    assert BaselineStore(tmp_path).load() == SignalMemory(first_width=(("GPU-a", 16),))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temp file left behind


def test_a_gpu_nvml_no_longer_lists_is_dropped_and_nothing_listed_writes_nothing(tmp_path: Path) -> None:
    store = BaselineStore(tmp_path)
    store.save(MEMORY, set())  # NVML not up: no GPU's baseline dropped, nothing written
    assert not (tmp_path / FILE_NAME).exists()
    store.save(MEMORY, {"GPU-b"})
    assert BaselineStore(tmp_path).load() == baselines(MEMORY, {"GPU-b"})
    assert dict(BaselineStore(tmp_path).load().first_width) == {"GPU-b": 8}


def _doc(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"kind": "gpuguard-signal-baselines", "version": 1, "backend": "nvml", "gpus": [
        {"uuid": "GPU-a", "links": [0, 1], "width": 16, "gen": None}]}  # fmt: skip
    doc.update(over)
    return doc


def _gpu(**over: Any) -> dict[str, Any]:
    return {"uuid": "GPU-a", "links": [0, 1], "width": 16, "gen": 4, **over}


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"{not json", "JSONDecodeError"),
        (json.dumps([1, 2]).encode(), "not a gpuguard signal baselines file"),
        (json.dumps({"kind": "gpuguard-state", "version": 1}).encode(), "not a gpuguard signal"),
        (json.dumps(_doc(version=2)).encode(), "unsupported version 2"),
        (json.dumps(_doc(gpus={"GPU-a": 1})).encode(), "gpus must be a list"),
        (json.dumps(_doc(gpus=[_gpu(uuid=f"GPU-{i}") for i in range(MAX_GPUS + 1)])).encode(), "at most 256"),
        (b"[" * 100_000 + b"]" * 100_000, "RecursionError"),
        (b" " * (MAX_BYTES + 1), "more than the 256 KiB allowed"),
    ],
)
def test_a_corrupt_or_foreign_file_is_moved_aside_with_a_log_line_never_a_crash(
    tmp_path: Path, content: bytes, why: str
) -> None:
    path = tmp_path / FILE_NAME
    path.write_bytes(content)
    with capture_logs() as logs:
        loaded = BaselineStore(tmp_path).load()
    assert loaded == SignalMemory()
    assert not path.exists()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(f"{FILE_NAME}.corrupt-")]
    assert len(aside) == 1 and aside[0].read_bytes() == content
    (line,) = [e for e in logs if e["event"] == "baselines.corrupt"]
    assert why in line["error"], line
    # The next save writes a good file again.
    BaselineStore(tmp_path).save(MEMORY, BOTH)
    assert BaselineStore(tmp_path).load().first_width == MEMORY.first_width


def test_a_file_of_another_backend_is_not_loaded(tmp_path: Path) -> None:
    BaselineStore(tmp_path, backend="mock").save(MEMORY, BOTH)
    with capture_logs() as logs:
        assert BaselineStore(tmp_path).load() == SignalMemory()
    assert [e["event"] for e in logs] == ["baselines.other_backend_discarded"]


def test_a_failed_write_is_retried_with_backoff_and_the_baselines_are_kept_when_the_disk_recovers(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    clock = Clock()
    store = BaselineStore(blocker / "state", clock=clock)  # a directory under a file: writes fail
    with capture_logs() as logs:
        store.save(MEMORY, BOTH)
        blocker.unlink()
        store.save(MEMORY, BOTH)  # the same memory object, within the backoff: not tried
        clock.t += retry.FIRST_S
        store.save(MEMORY, BOTH)  # the same memory object, now due: written
    assert [e["event"] for e in logs] == ["baselines.unavailable", "baselines.resumed", "baselines.saved"]
    assert BaselineStore(blocker / "state").load() == baselines(MEMORY, BOTH)


# -- an agent restart through the real pynvml and the fake library -------------------------------------------

_AGENT = r"""
import json, sys
from gpuguard.runtime.agent import Agent
from gpuguard.store.baselines import BaselineStore
from gpuguard.core.config import NodeSettings, PolicySettings
from gpuguard.nvml.real import NvmlBackend
from gpuguard.quarantine.node.view import NodeView
from gpuguard.quarantine.node.writers import DryRunNodeWriter
from gpuguard.quarantine.reconciler import NodeReconciler

backend = NvmlBackend()
reconciler = NodeReconciler(DryRunNodeWriter(NodeView(name="gpu-1")), NodeSettings(name="gpu-1"))
agent = Agent(backend=backend, reconciler=reconciler, policy=PolicySettings(), interval=0.1,
              node_name="gpu-1", baselines=BaselineStore(sys.argv[1]))
agent.restore()
backend.open(lambda: None)
verdict = agent.check_once()
backend.close()
print(json.dumps({g.uuid: sorted(f.reason for f in g.degraded) for g in verdict.gpus}))
"""

TWO = "gpu 0 uuid=GPU-0a nvlink_links=18{}\ngpu 1 uuid=GPU-0b nvlink_links=18{}\n"


def _agent_life(lib: Path, nvml_state: Path, state_dir: Path) -> dict[str, list[str]]:
    """One agent process from its start to its first check: each GPU's degraded reasons."""
    r = subprocess.run(
        [sys.executable, "-c", _AGENT, str(state_dir)],
        capture_output=True, text=True, timeout=60, env=env(lib, nvml_state), cwd=ROOT, check=False,
    )  # fmt: skip
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    result: dict[str, list[str]] = json.loads(r.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize(
    ("down", "reason"),
    [
        (" nvlink_down=3", "nvlink-down"),  # link 3 of GPU 1 goes down
        (" pcie_width=8", "pcie-width"),  # GPU 1's PCIe link retrains x8
    ],
)
def test_a_restarted_agent_still_reports_a_link_that_went_down_before_it_started(
    fakenvml: Path, tmp_path: Path, down: str, reason: str
) -> None:
    nvml_state, state_dir = tmp_path / "nvml.state", tmp_path / "state"
    nvml_state.write_text(TWO.format("", ""))
    assert _agent_life(fakenvml, nvml_state, state_dir) == {"GPU-0a": [], "GPU-0b": []}
    assert (state_dir / FILE_NAME).is_file()
    # The link goes down while no agent runs (a rollout, an OOM kill), then the agent starts again.
    nvml_state.write_text(TWO.format("", down))
    assert _agent_life(fakenvml, nvml_state, state_dir) == {"GPU-0a": [], "GPU-0b": [reason]}
    # Again: the baseline is the first good reading's, not the degraded one's.
    assert _agent_life(fakenvml, nvml_state, state_dir)["GPU-0b"] == [reason]
    # Without the file an agent takes the degraded reading as its baseline: blind (what the file prevents).
    assert _agent_life(fakenvml, nvml_state, tmp_path / "empty") == {"GPU-0a": [], "GPU-0b": []}


def test_a_write_is_a_synced_temp_file_renamed_then_a_synced_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced = trace_syncs(monkeypatch)
    BaselineStore(tmp_path).save(MEMORY, BOTH)
    tmp = f".{FILE_NAME}-{os.getpid()}.tmp"
    assert synced == [str(tmp_path / tmp), f"rename {tmp} -> {FILE_NAME}", "dir"]


def test_a_dry_run_and_a_run_without_state_dir_keep_baselines_in_memory_only(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    from gpuguard.core.config import Config, NodeSettings
    from gpuguard.runtime.root import build

    for cfg in (
        Config(backend="mock", state_dir=str(tmp_path), node=NodeSettings(name="gpu-1", dry_run=True)),
        Config(backend="mock", node=NodeSettings(name="gpu-1", dry_run=True)),
    ):
        parts = build(cfg, registry=CollectorRegistry())
        assert parts.agent._baselines is None
        parts.agent.run(run_for=0.3)
    assert list(tmp_path.iterdir()) == []


def test_a_link_read_as_x0_or_gen_0_is_no_baseline_so_the_file_stays_loadable(tmp_path: Path) -> None:
    """The judge kept a first width or generation of 0 (a link NVML reads as down or unknown), which the
    file's own check refuses (1 to 64): the next start moved the whole file aside, every GPU's baselines
    lost. A 0 is not judged and not a baseline."""
    from gpuguard.core.config import PolicySettings
    from gpuguard.core.model import GpuReading, SignalReadings, Snapshot
    from gpuguard.judge.policy import evaluate

    gpus = (
        GpuReading(index=0, uuid="GPU-a", signals=SignalReadings(pcie_width=0, pcie_gen=0)),
        GpuReading(index=1, uuid="GPU-b", signals=SignalReadings(pcie_width=16, pcie_gen=4)),
    )
    from gpuguard.core.signaltable import SIGNALS

    judged = PolicySettings(signals=SIGNALS.changed("pcie-gen", {"level": "degraded"}, where="test"))
    v = evaluate(Snapshot(gpus=gpus, taken_at=0), previous=None, settings=judged)
    assert v.healthy and not v.degraded
    BaselineStore(tmp_path).save(v.signal_memory, BOTH)
    loaded = BaselineStore(tmp_path).load()
    assert loaded.first_width == (("GPU-b", 16),) and loaded.first_gen == (("GPU-b", 4),)


@pytest.mark.parametrize(
    ("entry", "kept"),
    [
        (_gpu(uuid="GPU-a", width=8), {}),  # a duplicate UUID: the first entry kept
        (_gpu(uuid=""), {}),
        (_gpu(uuid="G" * 97), {}),
        ({"width": 16}, {}),
        ("GPU-x", {}),
        (_gpu(uuid="GPU-x", links=[0, 36]), {"width": 16, "gen": 4}),
        (_gpu(uuid="GPU-x", links=[True]), {"width": 16, "gen": 4}),
        (_gpu(uuid="GPU-x", links=[]), {"width": 16, "gen": 4}),
        (_gpu(uuid="GPU-x", width=0), {"links": 2, "gen": 4}),
        (_gpu(uuid="GPU-x", width=0xFFFFFFFF), {"links": 2, "gen": 4}),
        (_gpu(uuid="GPU-x", width=64), {"links": 2, "gen": 4}),
        (_gpu(uuid="GPU-x", width=3), {"links": 2, "gen": 4}),
        (_gpu(uuid="GPU-x", width="16"), {"links": 2, "gen": 4}),
        (_gpu(uuid="GPU-x", gen=7), {"links": 2, "width": 16}),
    ],
)
def test_a_bad_baseline_entry_is_dropped_alone_and_every_other_gpus_baselines_load(
    tmp_path: Path, entry: Any, kept: dict[str, int]
) -> None:
    good = _gpu(uuid="GPU-a", links=[0, 1], width=16, gen=4)
    (tmp_path / FILE_NAME).write_text(json.dumps(_doc(gpus=[good, entry])))
    with capture_logs() as logs:
        loaded = BaselineStore(tmp_path).load()
    assert (tmp_path / FILE_NAME).exists()  # not moved aside
    assert [e["event"] for e in logs] == ["baselines.entries_dropped", "baselines.restored"]
    assert ("GPU-a", 16) in loaded.first_width and ("GPU-a", 4) in loaded.first_gen
    x = {
        "links": len(dict(loaded.first_links).get("GPU-x", ())),
        "width": dict(loaded.first_width).get("GPU-x"),
        "gen": dict(loaded.first_gen).get("GPU-x"),
    }
    assert {k: v for k, v in x.items() if v} == kept


@pytest.mark.parametrize("width", [0xFFFFFFFF, 64, 33, 3])
def test_a_pcie_width_no_link_can_have_is_never_a_baseline_so_the_gpu_is_not_degraded_for_ever(
    tmp_path: Path, width: int
) -> None:
    """A first reading of 0xFFFFFFFF lanes became the baseline: every real reading after it was narrower,
    the GPU degraded for ever, and the file then refused, every GPU's baselines lost."""
    from gpuguard.core.config import PolicySettings
    from gpuguard.core.model import GpuReading, SignalReadings, Snapshot
    from gpuguard.judge.policy import evaluate

    def snap(w: int, t: float) -> Snapshot:
        gpus = (
            GpuReading(index=0, uuid="GPU-a", signals=SignalReadings(pcie_width=w, pcie_gen=4)),
            GpuReading(index=1, uuid="GPU-b", signals=SignalReadings(pcie_width=16, pcie_gen=4)),
        )
        return Snapshot(gpus=gpus, taken_at=t)

    settings = PolicySettings()
    v = evaluate(snap(width, 0), previous=None, settings=settings)
    v = evaluate(snap(16, 1), previous=v, settings=settings)
    assert v.healthy and not v.degraded, v.degraded
    assert dict(v.signal_memory.first_width) == {"GPU-a": 16, "GPU-b": 16}
    BaselineStore(tmp_path).save(v.signal_memory, BOTH)
    assert BaselineStore(tmp_path).load().first_width == (("GPU-a", 16), ("GPU-b", 16))
    # A baseline memory holding such a width (an older agent's) is not written: the file stays loadable.
    bad = SignalMemory(first_width=(("GPU-a", width), ("GPU-b", 16)))
    BaselineStore(tmp_path / "x").save(bad, BOTH)
    assert BaselineStore(tmp_path / "x").load().first_width == (("GPU-b", 16),)
