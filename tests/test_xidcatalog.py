"""gpuguard.core.xids: the catalog file as loaded, which Xids its buckets make events, and what it says
about a code (the reason's wording and the bucket in the logs)."""

from __future__ import annotations

import pytest

from gpuguard.core.xids import CATALOG, EVENT_BUCKETS, UNKNOWN_XID, load


def test_the_catalog_file_loads_into_the_catalog_the_policy_uses() -> None:
    fresh = load()
    assert fresh == CATALOG
    assert fresh.entries[79].mnemonic == "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS"
    assert fresh.entries[79].immediate_action == "RESTART_BM"
    assert fresh.entries[79].description == "GPU has fallen off the bus"
    assert set(fresh.overrides) == {45, 154} and fresh.overrides[45].startswith("Bucket WORKFLOW_XID_45")


@pytest.mark.parametrize(
    ("code", "event"),
    [
        (13, True),  # RESTART_APP
        (43, True),  # IGNORE
        (45, True),  # an override, its bucket WORKFLOW_XID_45
        (154, True),  # an override, its bucket XID_154
        (48, False),  # WORKFLOW_XID_48
        (79, False),  # RESTART_BM
        (163, False),  # listed without a bucket
        (500, False),  # not listed
        (UNKNOWN_XID, False),
    ],
)
def test_an_xid_is_an_event_by_its_bucket_or_an_override_and_a_fault_otherwise(
    code: int, event: bool
) -> None:
    assert CATALOG.is_event(code) is event


def test_the_default_ignored_xids_are_exactly_the_event_buckets_and_the_overrides() -> None:
    events = {c for c, e in CATALOG.entries.items() if e.immediate_action in EVENT_BUCKETS}
    assert CATALOG.default_ignored() == frozenset(events | set(CATALOG.overrides))
    assert {"RESTART_APP", "IGNORE"} == EVENT_BUCKETS


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (79, "GPU has fallen off the bus"),
        (
            1,
            "ROBUST_CHANNEL_FIFO_ERROR_FIFO_METHOD",
        ),  # the catalog's description is "Unused": the mnemonic says more
        (500, "not in NVIDIA's Xid catalog of 2026-12-03"),
        (UNKNOWN_XID, "unknown Xid (NVML reports 999 when the driver does not name the error)"),
    ],
)
def test_an_xid_is_described_by_the_catalog_or_said_to_be_unlisted(code: int, text: str) -> None:
    assert CATALOG.describe(code) == text


@pytest.mark.parametrize(("code", "bucket"), [(79, "RESTART_BM"), (163, ""), (500, "UNLISTED")])
def test_an_xids_bucket_for_the_logs(code: int, bucket: str) -> None:
    assert CATALOG.bucket(code) == bucket
