"""`gpuguard explain` on the node: the evidence kept in --state-dir, as a person reads it and as JSON for a
ticket; the output README.md and docs/design.md show is this test's (tests/integration/test_explain.py runs
it on a node quarantined on the real API server)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path

from gpuguard.core.config import Config, NodeSettings
from gpuguard.core.model import PodDevices
from gpuguard.quarantine.reconciler import NodeStatus
from gpuguard.runtime.evidence import EvidenceRecorder
from gpuguard.store.evidence import FILE_NAME, EvidenceStore
from gpuguard.store.state import StateStore
from tests.kmsglog import KernelLog
from tests.test_cli import ROOT, run
from tests.test_kernel_log import GPU1_PCI, wired

PODS = [PodDevices("ml", "trainer-0", devices=(("nvidia.com/gpu", "GPU-mock-1"),))]


def node_with_evidence(tmp_path: Path) -> Path:
    """A node whose kernel logged an Xid 79 on GPU 1 (read by the agent, recorded with its evidence)."""
    log = KernelLog(tmp_path / "kmsg")
    log.record("nvidia-modeset: Loading NVIDIA Kernel Mode Setting Driver", at=4.0)
    log.xid(GPU1_PCI, 79, at=5.0)
    log.record("NVRM: GPU at PCI:0000:02:00: GPU-mock-1", at=5.0)
    log.record("NVRM: GPU Board Serial Number: 1320123456789", at=5.0)
    state = tmp_path / "state"
    agent, backend, _, _, _, _ = wired(log.path, state=StateStore(state, boot_id="boot-1"))
    try:
        verdict = agent.check_once()
    finally:
        backend.close()
    cfg = Config(node=NodeSettings(name="gpu-1"), state_dir=str(state), kernel_log=str(log.path))
    recorder = EvidenceRecorder(
        EvidenceStore(state),
        cfg,
        boot_id="boot-1",
        status=NodeStatus,
        pods=lambda: PODS,
        wall=lambda: datetime(2026, 12, 6, 3, 51, 2, tzinfo=UTC),
    )
    recorder.observe(verdict)
    item = recorder._queue.get_nowait()
    assert item is not None
    recorder.record_now(*item)
    return state


def shown(text: str) -> str:
    """The output as the docs show it: the settings digest depends on the test's paths."""
    return re.sub(r"settings [0-9a-f]{16}", "settings 5f1c0e9a2b7d4c13", text)


def test_explain_on_the_node_shows_each_fault_with_what_made_it_the_rule_and_what_clears_it(
    tmp_path: Path,
) -> None:
    state = node_with_evidence(tmp_path)
    r = run("explain", "--state-dir", str(state))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    out = shown(r.stdout)
    assert out == EXPECTED.format(source=state / FILE_NAME)
    for doc in ("README.md", "docs/design.md"):
        assert EXPECTED.format(source="/var/lib/gpuguard/evidence.json") in (ROOT / doc).read_text(), doc


EXPECTED = """\
node gpu-1, from {source}

2026-12-06T03:51:02+00:00  fault on GPU 1 GPU-mock-1: xid-79: GPU has fallen off the bus (GPU 1,
  GPU-mock-1, kernel log: pid 1234, process python, GPU has fallen off the bus.)
    rule:     Xid 79 in NVIDIA's catalog: bucket RESTART_BM, GPU has fallen off the bus (a fault by
              default)
    clears:   sticky for this boot: a reboot (a new boot ID) clears it; a GPU reset clears it where
              the driver's recovery action asked for one
    xid:      79 from kmsg: python (pid 1234) GPU has fallen off the bus.
    kernel:   [    4.000000] nvidia-modeset: Loading NVIDIA Kernel Mode Setting Driver
    kernel:   [    5.000000] NVRM: Xid (PCI:0000:02:00): 79, pid=1234, name=python, GPU has fallen
              off the bus.
    kernel:   [    5.000000] NVRM: GPU at PCI:0000:02:00: GPU-mock-1
    kernel:   [    5.000000] NVRM: GPU Board Serial Number: 1320123456789
    readings: name=Mock GPU, present=True, ecc_uncorrected=0, pcie_link=[5, 16], xid_watched=True
    pods:     ml/trainer-0
    action:   quarantine auto, effect NoSchedule
    budget:   --max-quarantined 10%, node deferred: False
    agent:    0.1.0, settings 5f1c0e9a2b7d4c13
"""


def test_explain_json_is_the_timeline_with_each_records_rule_and_what_clears_it(tmp_path: Path) -> None:
    state = node_with_evidence(tmp_path)
    r = run("explain", "--state-dir", str(state), "-o", "json", "--gpu", "1")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    (entry,) = doc["timeline"]
    assert (doc["node"], entry["key"]) == ("gpu-1", "xid-79/GPU-mock-1")
    assert entry["rule"]["bucket"] == "RESTART_BM"
    assert entry["clears"].startswith("sticky for this boot") and entry["pods"] == ["ml/trainer-0"]
    other = run("explain", "--state-dir", str(state), "-o", "json", "--gpu", "GPU-mock-0")
    assert json.loads(other.stdout)["timeline"] == []


def test_explain_without_evidence_says_so_and_an_unreadable_file_is_one_line_exit_2(tmp_path: Path) -> None:
    r = run("explain", "--state-dir", str(tmp_path))
    assert r.returncode == 0
    assert r.stdout == f"node (unnamed), from {tmp_path / FILE_NAME}\nno evidence recorded\n"
    (tmp_path / FILE_NAME).write_text("{not json")
    r = run("explain", "--state-dir", str(tmp_path))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"gpuguard: error: explain: evidence file {tmp_path / FILE_NAME}: not JSON")
