"""The evidence kept at detection (gpuguard.store.evidence, gpuguard.runtime.evidence): one bounded record per
fault and degraded mark as first judged, what made it, kept in --state-dir with the oldest dropped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuguard.core.config import Config, NodeSettings
from gpuguard.core.model import PodDevices
from gpuguard.runtime.evidence import EvidenceRecorder, settings_digest
from gpuguard.store import limits
from gpuguard.store.evidence import FILE_NAME, EvidenceStore, bounded, read
from gpuguard.store.state import StateStore
from tests.kmsglog import KernelLog
from tests.test_kernel_log import GPU1_PCI, wired

HUGE = "x" * 100_000


def worst_case() -> dict[str, Any]:
    """A record past every bound: long texts, long lists, deep nesting."""
    deep: Any = HUGE
    for _ in range(10):
        deep = {"k": deep, HUGE: [deep] * 50}
    return {
        "at": "2026-12-06T00:00:00+00:00",
        "key": "xid-79/GPU-" + HUGE,
        "reason": "xid-79",
        "detail": HUGE,
        "kernel": [{"text": HUGE, "seq": i} for i in range(1000)],
        "pods": [f"ns/{HUGE}-{i}" for i in range(1000)],
        "readings": {f"r{i}": HUGE for i in range(1000)},
        "verdict": {"reasons": [HUGE] * 1000},
        "other": deep,
        "more": [HUGE] * 1000,
    }


def size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode())


def test_a_record_past_every_bound_is_kept_within_its_bytes_and_says_what_was_dropped() -> None:
    kept = bounded(worst_case())
    assert size(kept) <= limits.EVIDENCE_MAX_RECORD_BYTES
    assert kept["reason"] == "xid-79" and len(kept["key"]) == limits.EVIDENCE_MAX_TEXT
    assert kept["trimmed"][:4] == ["kernel", "pods", "readings", "verdict"]


def test_a_record_within_its_bounds_is_kept_as_it_is() -> None:
    record = {"key": "ecc/GPU-1", "kernel": [{"text": "t"}], "verdict": {"reasons": ["ecc: 2"]}}
    assert bounded(record) == record


def test_the_file_of_the_most_records_at_their_largest_is_within_its_bound() -> None:
    from gpuguard.store.evidence import KIND, VERSION

    records = [bounded(worst_case())] * limits.EVIDENCE_MAX_RECORDS
    assert size({"kind": KIND, "version": VERSION, "records": records}) <= limits.EVIDENCE_MAX_BYTES


def test_past_the_most_records_the_oldest_are_dropped_and_the_file_reads_back(tmp_path: Path) -> None:
    store = EvidenceStore(tmp_path)
    for i in range(limits.EVIDENCE_MAX_RECORDS + 5):
        store.add({"reason": f"r{i}"})
    records = read(tmp_path / FILE_NAME)
    assert len(records) == limits.EVIDENCE_MAX_RECORDS
    assert [r["reason"] for r in records[:2]] == ["r5", "r6"]
    assert EvidenceStore(tmp_path).load() == records


def test_a_corrupt_file_is_moved_aside_and_a_foreign_record_skipped(tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    path.write_text("{not json")
    store = EvidenceStore(tmp_path)
    assert store.load() == ()
    assert [p.name.startswith(f"{FILE_NAME}.corrupt-") for p in tmp_path.iterdir()] == [True]
    path.write_text(
        json.dumps({"kind": "gpuguard-evidence", "version": 1, "records": [1, "x", {"key": "a"}]})
    )
    assert read(path) == ({"key": "a"},)


def recorder(tmp_path: Path, status: Any, *, boot: str = "boot-1") -> EvidenceRecorder:
    pods = [
        PodDevices("ml", "trainer-0", devices=(("nvidia.com/gpu", "GPU-mock-1"),)),
        PodDevices("ml", "shared-0", devices=(("nvidia.com/gpu", "GPU-mock-1::3"),)),
        PodDevices("ml", "other-0", devices=(("nvidia.com/gpu", "GPU-mock-0"),)),
    ]
    cfg = Config(node=NodeSettings(name="gpu-1"), state_dir=str(tmp_path))
    return EvidenceRecorder(EvidenceStore(tmp_path), cfg, boot_id=boot, status=status, pods=lambda: pods)


def test_a_kernel_log_xid_is_recorded_with_what_made_it(tmp_path: Path) -> None:
    log = KernelLog(tmp_path / "kmsg")
    log.xid(GPU1_PCI, 79, at=5.0)
    agent, backend, _, reconciler, _, _ = wired(log.path, state=StateStore(tmp_path, boot_id="boot-1"))
    rec = recorder(tmp_path, lambda: reconciler.status)
    try:
        verdict = agent.check_once()
    finally:
        backend.close()
    rec.observe(verdict)
    item = rec._queue.get_nowait()
    assert item is not None
    rec.record_now(*item)
    (r,) = read(tmp_path / FILE_NAME)
    assert (r["kind"], r["key"], r["gpu"], r["boot_id"], r["node"]) == (
        "fault", "xid-79/GPU-mock-1", 1, "boot-1", "gpu-1"
    )  # fmt: skip
    assert r["rule"] == {
        "rule": "xid",
        "code": 79,
        "bucket": "RESTART_BM",
        "catalog": "GPU has fallen off the bus",
        "event_by_default": False,
    }
    assert r["xids"] == [
        {
            "code": 79, "source": "kmsg", "sxid": False, "seq": 101, "at": 5.0, "pci": GPU1_PCI, "pid": 1234,
            "process": "python", "text": "GPU has fallen off the bus.",
        }
    ]  # fmt: skip
    assert r["kernel"] == []  # no --kernel-log in this recorder's settings
    assert r["pods"] == ["ml/trainer-0", "ml/shared-0"]
    assert r["readings"]["ecc_uncorrected"] == 0 and r["readings"]["present"] is True
    assert r["verdict"]["reasons"][0].startswith("xid-79: GPU has fallen off the bus (GPU 1, GPU-mock-1")
    assert r["budget"]["max_quarantined"] and r["action"]["quarantine"] == "auto"
    assert r["agent"]["settings_digest"] == settings_digest(
        Config(node=NodeSettings(name="gpu-1"), state_dir=str(tmp_path))
    )


def test_a_mark_is_recorded_once_while_it_holds_and_not_again_after_a_restart_in_the_same_boot(
    tmp_path: Path,
) -> None:
    from gpuguard.core.model import Fault, GpuVerdict, Verdict
    from gpuguard.quarantine.reconciler import NodeStatus

    fault = Fault("xid-79", "GPU has fallen off the bus", uuid="GPU-mock-1", gpu_index=1)
    sick = Verdict(gpus=(GpuVerdict(1, "GPU-mock-1", faults=(fault,)),))
    degraded = Fault("nvlink-errors", "7000 within 60 s", uuid="GPU-mock-0", gpu_index=0)
    slow = Verdict(gpus=(GpuVerdict(0, "GPU-mock-0", degraded=(degraded,)), *sick.gpus))
    rec = recorder(tmp_path, NodeStatus)
    for v in (sick, sick, slow):
        rec.observe(v)
    kinds = []
    while not rec._queue.empty():
        item = rec._queue.get_nowait()
        assert item is not None
        kinds.append([(kind, f.key) for kind, f in item[1]])
        rec.record_now(*item)
    assert kinds == [[("fault", "xid-79/GPU-mock-1")], [("degraded", "nvlink-errors/GPU-mock-0")]]
    again = recorder(tmp_path, NodeStatus)  # a restart: the same boot's records are known
    again.observe(sick)
    assert again._queue.empty()
    rebooted = recorder(tmp_path, NodeStatus, boot="boot-2")
    rebooted.observe(sick)
    assert not rebooted._queue.empty()
    assert [r["kind"] for r in read(tmp_path / FILE_NAME)] == ["fault", "degraded"]


def test_the_unhealthy_events_message_names_each_xids_catalog_bucket_where_it_fits_whole() -> None:
    from gpuguard.core.config import NodeSettings, PolicySettings
    from gpuguard.core.model import GpuReading, Snapshot, XidEvent
    from gpuguard.judge.policy import evaluate
    from gpuguard.quarantine.node.view import NodeView
    from gpuguard.quarantine.reconciler import NodeReconciler
    from harness.fakes import FakeNodeWriter
    from harness.judging import hand_over

    def message(xids: int) -> str:
        gpus = tuple(GpuReading(index=i, uuid=f"GPU-{i}") for i in range(xids))
        events = tuple(XidEvent(gpu_index=i, uuid=f"GPU-{i}", code=79) for i in range(xids))
        sick = evaluate(Snapshot(gpus=gpus, xids=events), previous=None, settings=PolicySettings())
        writer = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b"))
        r = NodeReconciler(writer, NodeSettings(name="gpu-1"))
        hand_over(r, sick, 0)
        r.reconcile_now()
        (event,) = writer.events
        return event.message

    assert (
        message(1)
        == "xid-79: GPU has fallen off the bus (GPU 0, GPU-0) [xid-79: Xid catalog bucket RESTART_BM]"
    )
    crowded = message(24)  # the faults' own words fill the Event's 1 KiB: no room for the rules
    assert "[xid-79" not in crowded and crowded.startswith(
        "xid-79: GPU has fallen off the bus (GPU 0, GPU-0);"
    )
