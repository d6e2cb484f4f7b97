"""The per-GPU quarantine's decisions alone (gpuguard.quarantine.gpu.plan), with no source, budget or clock:
the change to a rule already held, when a rule an operator deleted is made again, when a rule is released,
the step back past the budget, and what /healthz shows."""

from __future__ import annotations

from typing import Any

import pytest

from gpuguard.core.config import NodeSettings
from gpuguard.core.model import ECC, REPEAT_OFFENDER, Fault, GpuQuarantine, GpuVerdict, Verdict, xid_reason
from gpuguard.quarantine.gpu import plan
from gpuguard.quarantine.gpu.rules import NONE_EFFECT, DeviceRule, rule_name
from gpuguard.quarantine.record import ANN_BOOT_ID, ANN_DEFERRED, ANN_FAULTS, ANN_REASON, TAINT_KEY

XID = Fault(xid_reason(79), "Xid 79 (GPU has fallen off the bus)", uuid="GPU-1", gpu_index=1)
ECC_FAULT = Fault(ECC, "2 uncorrected ECC errors", uuid="GPU-1", gpu_index=1)
SETTINGS = NodeSettings(name="node-a", recover_after=3)


def rule(*, faults: tuple[Fault, ...] = (XID,), boot: str = "boot-a", **kw: Any) -> DeviceRule:
    base: dict[str, Any] = {
        "name": rule_name("node-a", "gpu-1"),
        "pool": "node-a",
        "device": "gpu-1",
        "effect": "NoSchedule",
        "taint_value": "",
        "resource_version": "7",
        "annotations": {ANN_FAULTS: ",".join(sorted(f.key for f in faults)), ANN_BOOT_ID: boot},
    }
    base.update(kw)
    return DeviceRule(**base)


def test_a_rule_that_already_records_the_faults_and_blocks_as_asked_needs_no_change() -> None:
    assert plan.update(rule(), (XID,), boot_id="boot-a", effect="NoSchedule", lifted=False) is None


def test_a_new_fault_on_a_held_gpu_is_added_to_its_rule_with_its_resource_version() -> None:
    body = plan.update(rule(), (XID, ECC_FAULT), boot_id="boot-a", effect="NoSchedule", lifted=False)
    assert body == {
        "metadata": {
            "annotations": {
                ANN_FAULTS: ",".join(sorted((XID.key, ECC_FAULT.key))),
                ANN_REASON: f"{XID.message}; {ECC_FAULT.message}",
            },
            "resourceVersion": "7",
        }
    }


def test_the_same_fault_after_a_reboot_rewrites_the_rules_record_with_the_new_boot() -> None:
    body = plan.update(rule(), (XID,), boot_id="boot-b", effect="NoSchedule", lifted=False)
    assert body is not None
    assert body["metadata"]["annotations"] == {
        ANN_FAULTS: XID.key,
        ANN_REASON: XID.message,
        ANN_BOOT_ID: "boot-b",
    }


def test_a_deferred_rule_with_room_takes_the_configured_effect_and_drops_its_deferral() -> None:
    deferred = rule(effect=NONE_EFFECT, annotations={ANN_FAULTS: XID.key, ANN_DEFERRED: "budget spent"})
    body = plan.update(deferred, (XID,), boot_id="boot-a", effect="NoExecute", lifted=True)
    assert body == {
        "spec": {"taint": {"key": TAINT_KEY, "effect": "NoExecute"}},
        "metadata": {"annotations": {ANN_DEFERRED: None}, "resourceVersion": "7"},
    }
    assert plan.update(deferred, (XID,), boot_id="boot-a", effect="NoExecute", lifted=False) is None


def test_a_blocking_rule_with_another_effect_than_asked_is_set_right() -> None:
    body = plan.update(rule(effect="NoSchedule"), (XID,), boot_id="boot-a", effect="NoExecute", lifted=False)
    assert body is not None and body["spec"]["taint"]["effect"] == "NoExecute"


def test_a_rule_an_operator_deleted_is_made_again_only_for_a_new_fault() -> None:
    overridden = {"GPU-1": frozenset({XID.key})}
    assert plan.suppressed(overridden, "GPU-1", (XID,))
    assert not plan.suppressed(overridden, "GPU-1", (XID, ECC_FAULT))
    assert not plan.suppressed(overridden, "GPU-2", (XID,))


def test_a_held_gpus_rule_deleted_by_anyone_is_made_again() -> None:
    """A repeat offender's rule is not an operator's override: only a release lifts a hold (a stolen token
    deleted its own held GPU's rule, and the agent never made it again, not even after a restart)."""
    held = Fault(REPEAT_OFFENDER, "3 fault episodes in 7 days", uuid="GPU-1", gpu_index=1)
    overridden = {"GPU-1": frozenset({XID.key, held.key})}
    assert not plan.suppressed(overridden, "GPU-1", (XID, held))
    assert not plan.suppressed(overridden, "GPU-1", (held,))


@pytest.mark.parametrize(
    ("streak", "flapping", "boot", "released"),
    [
        (3, False, "boot-b", True),  # healthy long enough, rebooted
        (2, False, "boot-b", False),  # one check short
        (3, True, "boot-b", False),  # flapping holds it
        (3, False, "boot-a", False),  # an Xid needs a reboot
    ],
)
def test_a_rule_is_released_after_its_gpus_streak_when_the_evidence_is_gone(
    streak: int, flapping: bool, boot: str, released: bool
) -> None:
    got = plan.released(rule(), Verdict(), boot_id=boot, streak=streak, flapping=flapping, settings=SETTINGS)
    assert got is released


def test_no_rule_is_released_with_recovery_off_and_an_ecc_rule_needs_no_reboot() -> None:
    ecc = rule(faults=(ECC_FAULT,))
    assert plan.released(ecc, Verdict(), boot_id="boot-a", streak=3, flapping=False, settings=SETTINGS)
    off = NodeSettings(name="node-a", recover=False)
    assert not plan.released(ecc, Verdict(), boot_id="boot-b", streak=9, flapping=False, settings=off)


def test_a_gpus_own_streak_counts_never_less_than_the_nodes() -> None:
    assert plan.gpu_streak("GPU-1", streak=2, gpu_streaks=None) == 2
    assert plan.gpu_streak("GPU-1", streak=2, gpu_streaks={"GPU-1": 5}) == 5
    assert plan.gpu_streak("GPU-2", streak=2, gpu_streaks={"GPU-1": 5}) == 2
    assert plan.gpu_streak("GPU-2", streak=0, gpu_streaks={"GPU-1": 5}) == 0  # no streak of its own yet


def test_only_the_gpus_with_a_fault_of_their_own_are_wanted() -> None:
    verdict = Verdict(
        gpus=(
            GpuVerdict(index=1, uuid="GPU-1", faults=(XID,)),
            GpuVerdict(index=2, uuid="GPU-2"),
            GpuVerdict(index=3, uuid="GPU-3", faults=(Fault("gpu-lost", "lost", uuid="GPU-3"),)),
        )
    )
    assert plan.wanted(verdict) == {"GPU-1"}


def test_a_step_back_sets_effect_none_and_says_why_on_the_rules_resource_version() -> None:
    assert plan.step_back(rule(), "budget spent") == {
        "metadata": {"annotations": {ANN_DEFERRED: "budget spent"}, "resourceVersion": "7"},
        "spec": {"taint": {"key": TAINT_KEY, "effect": NONE_EFFECT}},
    }


def test_the_rules_held_are_shown_in_device_order() -> None:
    two = rule(name=rule_name("node-a", "gpu-0"), device="gpu-0", effect=NONE_EFFECT)
    assert [q.device for q in plan.quarantined([rule(), two])] == ["gpu-0", "gpu-1"]
    assert plan.quarantined([two])[0] == GpuQuarantine(
        uuid="", device="gpu-0", rule=two.name, reason="", effect=NONE_EFFECT, deferred=False
    )


def test_a_held_repeat_offenders_rule_records_the_hold_and_keeps_a_deferred_rules_effect() -> None:
    held = Fault(REPEAT_OFFENDER, "3 fault episodes (limit 3 in 7 days)", uuid="GPU-1", gpu_index=1)
    assert plan.per_gpu(held)
    body = plan.update(rule(), (held,), boot_id="boot-b", effect="NoSchedule", lifted=False)
    assert body is not None and "spec" not in body
    assert body["metadata"]["annotations"][ANN_BOOT_ID] == "boot-b"
    assert body["metadata"]["annotations"][ANN_FAULTS] == held.key
    deferred = rule(effect=NONE_EFFECT, annotations={ANN_DEFERRED: "budget spent", ANN_FAULTS: XID.key})
    body = plan.update(deferred, (XID, held), boot_id="boot-a", effect="NoSchedule", lifted=False)
    assert body is not None and "spec" not in body
    again = rule(faults=(held,), boot="boot-b")
    assert plan.update(again, (held,), boot_id="boot-b", effect="NoSchedule", lifted=False) is None


@pytest.mark.parametrize("effect", ["NoSchedule", NONE_EFFECT])
def test_a_rule_an_earlier_version_gave_a_value_loses_it_in_one_patch_keeping_its_effect(effect: str) -> None:
    deferred = {ANN_DEFERRED: "budget spent"} if effect == NONE_EFFECT else {}
    old = rule(taint_value="xid-79", effect=effect, annotations={ANN_FAULTS: XID.key, **deferred})
    body = plan.update(old, (XID,), boot_id="boot-a", effect="NoSchedule", lifted=False)
    assert body == {
        "spec": {"taint": {"key": TAINT_KEY, "effect": effect}},
        "metadata": {"annotations": {}, "resourceVersion": "7"},
    }
