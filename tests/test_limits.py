"""gpuguard.store.limits: each kept file's limits, stated once, and the faults the state file keeps within
them (every one within the limit; past it the fatal ones first, then the newest others; texts cut as the
reader cuts them)."""

from __future__ import annotations

import pytest

from gpuguard.core.model import Fault
from gpuguard.store import limits
from gpuguard.store.evidence import bounded
from gpuguard.store.limits import fatal, kept_faults

KIB, MIB = 1024, 1024 * 1024


def ecc(i: int) -> Fault:
    return Fault("ecc", f"{i} errors", uuid=f"GPU-{i:04d}", gpu_index=i)


def xid(i: int) -> Fault:
    return Fault("xid-79", f"fell off the bus {i}", uuid=f"GPU-{i:04d}", gpu_index=i)


@pytest.mark.parametrize(
    ("reason", "is_fatal"),
    [
        ("xid-79", True),
        ("sxid-12028", True),
        ("gpu-lost", True),
        ("gpu-missing", True),
        ("row-remap", True),
        ("ecc", False),
        ("nvlink-down", False),
        ("recovery-gpu-reset", False),
    ],
)
def test_a_fault_is_fatal_when_only_a_reboot_clears_it(reason: str, is_fatal: bool) -> None:
    assert fatal(Fault(reason, "d")) is is_fatal


def test_every_fault_within_the_limit_of_1024_is_kept_in_its_order() -> None:
    faults = [ecc(i) for i in range(1024)]
    assert kept_faults(faults) == tuple(faults)


def test_past_the_limit_every_fatal_fault_is_kept_and_then_the_newest_others_in_their_order() -> None:
    faults = [ecc(0), xid(1), *(ecc(i) for i in range(2, 1030)), xid(1030)]  # 1,031 faults
    kept = kept_faults(faults)
    assert len(kept) == 1024
    assert kept[0] == xid(1) and kept[-1] == xid(1030)
    assert kept[1:-1] == tuple(ecc(i) for i in range(8, 1030))  # the 1,022 newest others


def test_past_the_limit_with_fatal_faults_alone_the_newest_1024_are_kept() -> None:
    faults = [xid(i) for i in range(1100)]
    assert kept_faults(faults) == tuple(faults[-1024:])


def test_a_fault_whose_uuid_is_longer_than_any_gpus_is_not_kept() -> None:
    node = Fault("gpu-missing", "a GPU on the bus NVML does not list")
    at_limit = Fault("ecc", "d", uuid="G" * 128, gpu_index=0)
    past = Fault("ecc", "d", uuid="G" * 129, gpu_index=1)
    assert kept_faults([node, at_limit, past]) == (node, at_limit)


def test_a_faults_texts_are_cut_as_the_reader_cuts_them() -> None:
    long_reason = Fault("r" * 65, "d" * 512, uuid="GPU-1", gpu_index=1)
    long_detail = Fault("r" * 64, "d" * 513, uuid="GPU-1", gpu_index=1)
    cut = Fault("r" * 64, "d" * 512, uuid="GPU-1", gpu_index=1)
    assert kept_faults([long_reason]) == (cut,)
    assert kept_faults([long_detail]) == (cut,)
    assert kept_faults([cut]) == (cut,)


@pytest.mark.parametrize(
    ("limit", "value"),
    [
        # docs/reliability.md and design.md state these: a change is a change to what a file may hold.
        ("STATE_MAX_BYTES", MIB),
        ("STATE_MAX_FAULTS", 1024),
        ("HISTORY_MAX_BYTES", MIB),
        ("HISTORY_MAX_EPISODES", 32),
        ("HISTORY_MAX_RELEASES", 8),
        ("BASELINES_MAX_BYTES", 256 * KIB),
        ("BASELINES_MAX_GPUS", 256),
        ("EVIDENCE_MAX_RECORDS", 64),
        ("EVIDENCE_MAX_RECORD_BYTES", 16 * KIB),
        ("EVIDENCE_MAX_BYTES", 1_052_672),  # 64 records of 16 KiB and 4 KiB for the rest
        # The rest, each sized in limits.py's comments: a file written is never a file refused.
        ("STATE_MAX_RULES", 1024),
        ("STATE_MAX_REASON", 64),
        ("STATE_MAX_DETAIL", 512),
        ("STATE_MAX_UUID", 128),
        ("STATE_MAX_TEXT", 512),
        ("HISTORY_MAX_GPUS", 64),
        ("HISTORY_MAX_REASONS", 3),
        ("HISTORY_MAX_TEXT", 64),
        ("HISTORY_MAX_UUID", 128),
        ("BASELINES_MAX_UUID", 96),
    ],
)
def test_each_kept_files_limit_is_the_one_stated(limit: str, value: int) -> None:
    assert getattr(limits, limit) == value


def test_an_evidence_record_is_cut_to_512_characters_32_items_and_4_levels() -> None:
    record = {
        "detail": "x" * 600,
        "kernel": [f"line {i}" for i in range(40)],
        "verdict": {"a": {"b": {"c": {"d": "deep"}}}},
    }
    kept = bounded(record)
    assert kept["detail"] == "x" * 512
    assert kept["kernel"] == [f"line {i}" for i in range(32)]
    assert kept["verdict"] == {"a": {"b": {"c": None}}}


def test_an_evidence_record_copies_at_most_1024_values() -> None:
    # The record, its "pods", 32 lists of 31 numbers each: 1,026 values, the last two not copied.
    kept = bounded({"pods": [[i] * 31 for i in range(32)], "more": [1]})
    assert kept["pods"][:31] == [[i] * 31 for i in range(31)]
    assert kept["pods"][31] == [31] * 29 + [None, None]
    assert kept["more"] is None
