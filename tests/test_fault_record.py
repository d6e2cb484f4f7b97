"""The fault record both quarantines carry (gpuguard.quarantine.record.FaultRecord): the node taint's
annotations and a DeviceTaintRule's are read the same way, merge new faults the same way, and prove a fault
gone by the same evidence."""

from __future__ import annotations

import pytest

from gpuguard.core.model import ECC, Fault, xid_reason
from gpuguard.quarantine.gpu.rules import DeviceRule
from gpuguard.quarantine.node.view import NodeView
from gpuguard.quarantine.record import ANN_BOOT_ID, ANN_FAULTS, ANN_REASON, FaultRecord, fault_keys

XID = Fault(xid_reason(79), "Xid 79 (GPU has fallen off the bus)", uuid="GPU-1", gpu_index=1)
ECC_FAULT = Fault(ECC, "2 uncorrected ECC errors", uuid="GPU-1", gpu_index=1)
RECORDED = {ANN_FAULTS: f"{XID.key}", ANN_BOOT_ID: "boot-a"}


def test_the_node_and_a_rule_read_the_same_record_from_the_same_annotations() -> None:
    node = NodeView(name="n", annotations=RECORDED, boot_id="boot-b")
    rule = DeviceRule(name="r", pool="n", device="gpu-1", effect="NoSchedule", annotations=RECORDED)
    assert node.record == rule.record == FaultRecord(faults=frozenset({XID.key}), boot_id="boot-a")
    assert node.record_from_earlier_boot and rule.from_earlier_boot("boot-b")
    assert node.current_faults == frozenset() and node.recorded_faults == rule.faults


@pytest.mark.parametrize(
    ("recorded", "now", "earlier"),
    [("boot-a", "boot-a", False), ("boot-a", "boot-b", True), ("", "boot-b", False), ("boot-a", "", False)],
)
def test_a_record_is_from_an_earlier_boot_only_when_both_boots_are_known_and_differ(
    recorded: str, now: str, earlier: bool
) -> None:
    record = FaultRecord(faults=frozenset({XID.key}), boot_id=recorded)
    assert record.from_earlier_boot(now) is earlier
    assert record.current(now) == (frozenset() if earlier else frozenset({XID.key}))


def test_merge_adds_only_new_faults_and_says_nothing_when_none_is_new() -> None:
    record = FaultRecord.read(RECORDED)
    assert record.merge((XID,), boot_id="boot-a") is None
    assert record.new((XID, ECC_FAULT), boot_id="boot-a") == [ECC_FAULT]
    assert record.merge((XID, ECC_FAULT), boot_id="boot-a") == {
        ANN_FAULTS: ",".join(sorted(fault_keys((XID, ECC_FAULT)))),
        ANN_REASON: f"{XID.message}; {ECC_FAULT.message}",
    }


def test_merge_after_a_reboot_replaces_the_record_and_its_boot() -> None:
    """The same fault in a new boot is a new fault: the record is rewritten with the current bootID, so the
    next agent restart cannot prove it gone by the old one."""
    record = FaultRecord.read(RECORDED)
    assert record.merge((XID,), boot_id="boot-b") == {
        ANN_FAULTS: XID.key,
        ANN_REASON: XID.message,
        ANN_BOOT_ID: "boot-b",
    }


def test_evidence_is_gone_by_the_reading_for_ecc_and_only_by_a_reboot_for_an_xid() -> None:
    ecc = FaultRecord(faults=frozenset({ECC_FAULT.key}), boot_id="boot-a")
    xid = FaultRecord(faults=frozenset({XID.key}), boot_id="boot-a")
    assert ecc.evidence_gone("boot-a")
    assert not xid.evidence_gone("boot-a") and xid.evidence_gone("boot-b")
    assert xid.evidence_gone("boot-a", frozenset({XID.key}))  # the driver's GPU reset cleared it
    assert not xid.evidence_gone("")  # the node's bootID unknown: nothing proven
    assert FaultRecord().evidence_gone("boot-a")  # nothing recorded: nothing to wait for
