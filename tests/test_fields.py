"""nvmlDeviceGetFieldValues' array read field by field (gpuguard/nvml/real/fields.py): each field's own
nvmlReturn and value type, and values no count can have."""

from __future__ import annotations

import struct

import pynvml
import pytest

from gpuguard.nvml.real.fields import FI_NVLINK_LINK_COUNT, FI_PCIE_REPLAY_COUNTER, LAYOUT, read_fields


def answer(monkeypatch: pytest.MonkeyPatch, *rows: tuple[int, int, int, bytes]) -> None:
    """The library's answer: (fieldId, valueType, nvmlReturn, the value's 8 bytes) per field."""
    data = b"".join(LAYOUT.pack(fid, 0, 0, 0, kind, ret, raw) for fid, kind, ret, raw in rows)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetFieldValues", lambda handle, ids: data)


def test_each_field_reads_by_its_own_type_and_its_own_error(monkeypatch: pytest.MonkeyPatch) -> None:
    answer(
        monkeypatch,
        (FI_NVLINK_LINK_COUNT, 1, 0, struct.pack("=Q", 18)),
        (FI_PCIE_REPLAY_COUNTER, 3, 999, struct.pack("=Q", 7)),  # its own error: the value is no value
    )
    assert read_fields(None, (FI_NVLINK_LINK_COUNT, FI_PCIE_REPLAY_COUNTER)) == {
        FI_NVLINK_LINK_COUNT: (18, ""),
        FI_PCIE_REPLAY_COUNTER: (None, "UNKNOWN"),
    }


@pytest.mark.parametrize(
    ("kind", "raw"),
    [(0, struct.pack("=d", float("nan"))), (0, struct.pack("=d", float("inf"))), (4, struct.pack("=q", -3))],
    ids=["nan", "inf", "negative"],
)
def test_a_value_no_count_can_have_is_that_fields_error_not_a_failed_pass(
    monkeypatch: pytest.MonkeyPatch, kind: int, raw: bytes
) -> None:
    """A NaN double raised ValueError out of the pass: every pass failed (check.failed with a traceback),
    the whole node unread until kubelet restarted the agent, into the same failure."""
    links = (FI_NVLINK_LINK_COUNT, 1, 0, struct.pack("=Q", 4))
    answer(monkeypatch, (FI_PCIE_REPLAY_COUNTER, kind, 0, raw), links)
    assert read_fields(None, (FI_PCIE_REPLAY_COUNTER, FI_NVLINK_LINK_COUNT)) == {
        FI_PCIE_REPLAY_COUNTER: (None, "INVALID_VALUE"),
        FI_NVLINK_LINK_COUNT: (4, ""),
    }
