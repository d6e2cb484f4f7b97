"""The pure parts of a repair: which faults a reset remedies (data), the request and record annotations read
as untrusted text, the agent's request and hold, the executor's ladder, the proof and the pace's bucket."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gpuguard.core import remedies
from gpuguard.core.errors import ConflictError, PermanentApiError
from gpuguard.core.model import REPAIR_HELD, Fault, GpuQuarantine, GpuVerdict, Verdict
from gpuguard.core.remedies import REMEDIES
from gpuguard.core.xids import CATALOG
from gpuguard.nvml.base import GpuAfterReset
from gpuguard.quarantine.node.view import LABEL_QUARANTINED, NodeView, Taint
from gpuguard.quarantine.record import ANN_FAULTS, TAINT_KEY
from gpuguard.quarantine.repair import asking
from gpuguard.quarantine.repair.bucket import Bucket, take
from gpuguard.quarantine.repair.ladder import decide
from gpuguard.quarantine.repair.pace import ANN_AT, ANN_TOKENS, LeasePace
from gpuguard.quarantine.repair.proof import proof_failures
from gpuguard.quarantine.repair.values import (
    ANN_REQUEST,
    ANN_STATE,
    MAX_GPUS,
    REQUEST_TTL_S,
    Record,
    Request,
    parse_record,
    parse_request,
    stamp,
)

NOW = datetime(2026, 12, 6, 4, 0, 0, tzinfo=UTC)
UUID = "GPU-it-3"
DAY = 86400.0


def at(seconds: float) -> datetime:
    return NOW + timedelta(seconds=seconds)


# -- which faults a reset remedies -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reason", "recovery_field", "remedied"),
    [
        ("recovery-gpu-reset", True, True),
        ("recovery-drain-and-reset", True, True),
        ("reset-required", False, True),
        ("recovery-node-reboot", True, False),
        ("xid-95", True, CATALOG.bucket(95) == "RESET_GPU"),
        ("xid-95", False, False),  # without the recovery field only a reboot clears the Xid
        ("xid-79", True, False),  # fallen off the bus: CONTACT_SUPPORT
        ("sxid-12", True, False),
        ("row-remap", True, False),  # a failed remap is a replacement, not a reset
        ("ecc", True, False),
    ],
)
def test_a_reset_remedies_only_the_faults_the_table_names(
    reason: str, recovery_field: bool, remedied: bool
) -> None:
    assert REMEDIES.remedies(reason, recovery_field=recovery_field) is remedied


def test_the_shipped_data_names_the_reset_remedied_reasons_and_the_reset_gpu_bucket() -> None:
    """Read afresh (the module reads it once, at import): the data file the executor's decisions rest on."""
    assert remedies.load() == remedies.ResetRemedies(
        reasons=frozenset({"recovery-gpu-reset", "recovery-drain-and-reset", "reset-required"}),
        xid_buckets=frozenset({"RESET_GPU"}),
    )


def test_every_reset_gpu_bucket_xid_of_the_catalog_is_remedied_by_a_reset() -> None:
    codes = [c for c, e in CATALOG.entries.items() if e.immediate_action == "RESET_GPU"]
    assert codes and all(REMEDIES.remedies(f"xid-{c}", recovery_field=True) for c in codes)


# -- the annotations, read as untrusted text ---------------------------------------------------------------


def test_a_request_round_trips_in_the_exact_shape_the_admission_policy_matches() -> None:
    value = Request(UUID, "gpu-a", at(600)).value()
    assert value == '{"deadline":"2026-12-06T04:10:00Z","owner":"gpu-a","uuid":"GPU-it-3"}'
    assert parse_request(value, node="gpu-a", now=NOW) == (Request(UUID, "gpu-a", at(600)), "ok")


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (None, "none"),
        ("not json", "unreadable"),
        ('{"uuid":"GPU-it-3","owner":"gpu-a"}', "unreadable"),
        ('{"deadline":"2026-12-06T04:10:00Z","owner":"gpu-a","uuid":"../etc"}', "unreadable"),
        ('{"deadline":"2026-12-06T04:10:00Z","owner":"gpu-a","uuid":"GPU-it-3","x":1}', "unreadable"),
        ('{"deadline":"2026-12-06T04:10:00Z","owner":"gpu-b","uuid":"GPU-it-3"}', "not-this-node"),
        ('{"deadline":"2026-12-06T03:59:59Z","owner":"gpu-a","uuid":"GPU-it-3"}', "expired"),
        ('{"deadline":"2026-12-07T04:00:00Z","owner":"gpu-a","uuid":"GPU-it-3"}', "deadline-too-far"),
    ],
)
def test_a_request_not_in_gpuguards_shape_for_this_node_and_in_time_is_none(
    value: str | None, why: str
) -> None:
    assert parse_request(value, node="gpu-a", now=NOW) == (None, why)


def test_the_record_keeps_each_gpus_phase_and_resets_and_drops_what_is_not_gpuguards() -> None:
    record = (
        Record()
        .step(UUID, "resetting", at=NOW, boot="b0")
        .step(UUID, "proven", at=at(5), boot="b0", reset=True)
    )
    again = parse_record(record.value())
    assert again == record and again.get(UUID) is not None and again.get(UUID).resets == (at(5),)  # type: ignore[union-attr]
    forged = json.loads(record.value()) | {
        "x": {"phase": "proven"},
        "GPU-9": {"phase": "nonsense", "at": stamp(NOW), "boot": "b"},
    }
    assert set(parse_record(json.dumps(forged)).entries) == {UUID}
    assert parse_record("][").entries == {} and parse_record(None).entries == {}


def test_the_record_holds_a_gpu_only_in_the_boot_its_phase_was_written_in() -> None:
    record = Record().step(UUID, "reboot-requested", at=NOW, boot="b0")
    assert record.held("b0") == {UUID} and record.held("b1") == frozenset()
    assert Record().step(UUID, "proven", at=NOW, boot="b0").held("b0") == frozenset()


def test_the_record_is_bounded_to_its_most_recent_gpus() -> None:
    record = Record()
    for i in range(MAX_GPUS + 5):
        record = record.step(f"GPU-{i}", "proven", at=at(i), boot="b")
    assert len(record.entries) == MAX_GPUS and "GPU-0" not in record.entries


# -- the agent's side --------------------------------------------------------------------------------------


def gpu(index: int, *reasons: str, action: int | None = 1) -> GpuVerdict:
    uuid = f"GPU-it-{index}"
    return GpuVerdict(
        index, uuid, faults=tuple(Fault(r, "x", uuid, index) for r in reasons), recovery_action=action
    )


def verdict(*gpus: GpuVerdict) -> Verdict:
    return Verdict(gpus=gpus)


def node(**annotations: str) -> NodeView:
    return NodeView(name="gpu-a", resource_version="1", boot_id="b0", annotations=annotations)


def test_the_agent_asks_for_a_gpu_whose_faults_a_reset_remedies_once_its_quarantine_is_in_place() -> None:
    v = verdict(gpu(0), gpu(3, "recovery-gpu-reset", "xid-95"))
    assert asking.ask(node(), v, in_place=set(), now=NOW) is None  # not yet held out: nothing asked
    change = asking.ask(node(), v, in_place={"GPU-it-3"}, now=NOW)
    assert change is not None and change.action == "repair-request"
    asked = parse_request(change.annotations[ANN_REQUEST], node="gpu-a", now=NOW)[0]
    assert asked == Request("GPU-it-3", "gpu-a", at(REQUEST_TTL_S))


@pytest.mark.parametrize(
    "faulty",
    [
        gpu(3, "recovery-gpu-reset", "ecc"),  # one fault a reset does not remedy
        gpu(3, "recovery-node-reboot"),
        gpu(3, "xid-95", action=None),  # no recovery field: the Xid waits for a reboot anyway
    ],
)
def test_the_agent_asks_nothing_for_a_gpu_with_a_fault_a_reset_does_not_remedy(faulty: GpuVerdict) -> None:
    assert asking.ask(node(), verdict(faulty), in_place={"GPU-it-3"}, now=NOW) is None


def test_the_agent_keeps_a_fresh_request_renews_an_old_one_and_removes_one_no_longer_wanted() -> None:
    v = verdict(gpu(3, "recovery-gpu-reset"))
    fresh = Request(UUID, "gpu-a", at(REQUEST_TTL_S)).value()
    assert asking.ask(node(**{ANN_REQUEST: fresh}), v, in_place={UUID}, now=NOW) is None
    old = Request(UUID, "gpu-a", at(60)).value()
    renewed = asking.ask(node(**{ANN_REQUEST: old}), v, in_place={UUID}, now=NOW)
    assert renewed is not None and renewed.annotations[ANN_REQUEST] == fresh
    gone = asking.ask(node(**{ANN_REQUEST: fresh}), verdict(gpu(3)), in_place={UUID}, now=NOW)
    assert gone is not None and gone.annotations == {ANN_REQUEST: None}


def test_a_gpu_the_executor_holds_is_neither_asked_for_again_nor_let_go() -> None:
    record = Record().step(UUID, "validating", at=NOW, boot="b0", reset=True).value()
    request = Request(UUID, "gpu-a", at(60)).value()
    n = node(**{ANN_STATE: record, ANN_REQUEST: request})
    healthy = verdict(gpu(3, action=0))
    held = asking.hold(n, healthy)
    assert [f.reason for f in held.gpus[0].faults] == [REPAIR_HELD]
    assert asking.ask(n, held, in_place={UUID}, now=NOW) is None  # the request stays while it is under way
    rebooted = NodeView(name="gpu-a", boot_id="b1", annotations=n.annotations)
    assert asking.hold(rebooted, healthy) == healthy


def test_a_request_whose_gpu_waits_for_its_reboot_gives_way_to_the_next_gpu() -> None:
    record = Record().step(UUID, "reboot-requested", at=NOW, boot="b0").value()
    n = node(**{ANN_STATE: record, ANN_REQUEST: Request(UUID, "gpu-a", at(60)).value()})
    v = asking.hold(n, verdict(gpu(3, "recovery-gpu-reset"), gpu(6, "recovery-gpu-reset")))
    change = asking.ask(n, v, in_place={UUID, "GPU-it-6"}, now=NOW)
    assert change is not None
    assert parse_request(change.annotations[ANN_REQUEST], node="gpu-a", now=NOW)[0] == Request(
        "GPU-it-6", "gpu-a", at(REQUEST_TTL_S)
    )


# -- the executor's ladder ---------------------------------------------------------------------------------

REQ = Request(UUID, "gpu-a", at(600))
FRESH = Request(UUID, "gpu-a", at(REQUEST_TTL_S))  # asked now, after the reset a minute ago


def rec(phase: str, *, ago: float = 60, boot: str = "b0", reset: bool = False) -> Record:
    return Record().step(UUID, phase, at=at(-ago), boot=boot, reset=reset)


@pytest.mark.parametrize(
    ("request_", "record", "boot", "vetoed", "action", "why"),
    [
        (None, Record(), "b0", False, "none", "no-request"),
        (REQ, Record(), "b0", True, "veto", "vetoed"),
        (REQ, Record(), "b0", False, "reset", "first"),
        (REQ, rec("resetting"), "b0", False, "reboot", "interrupted"),
        (REQ, rec("resetting"), "b1", False, "reset", "rebooted"),
        (REQ, rec("failed"), "b0", False, "reboot", "reset-failed"),
        (REQ, rec("reboot-requested"), "b0", False, "wait", "reboot-pending"),
        (REQ, rec("reboot-requested"), "b1", False, "needs-repair", "returned-after-reboot"),
        (REQ, rec("reboot-requested", ago=2 * DAY), "b1", False, "reset", "window-passed"),
        (REQ, rec("needs-repair"), "b1", False, "wait", "needs-repair"),
        (FRESH, rec("proven", reset=True), "b0", False, "reboot", "returned-after-reset"),
        (
            Request(UUID, "gpu-a", at(-600 + REQUEST_TTL_S)),
            rec("proven", reset=True),
            "b0",
            False,
            "wait",
            "proven",
        ),
        (REQ, rec("proven", ago=2 * DAY, reset=True), "b0", False, "reset", "window-passed"),
        (REQ, rec("vetoed"), "b0", False, "reset", "veto-lifted"),
        (REQ, rec("failed"), "b1", False, "reset", "rebooted"),
        (REQ, rec("needs-repair", ago=2 * DAY), "b1", False, "reset", "window-passed"),
        # At the window's edge exactly: still within it.
        (REQ, rec("reboot-requested", ago=DAY), "b1", False, "needs-repair", "returned-after-reboot"),
        (FRESH, rec("proven", ago=DAY, reset=True), "b0", False, "reboot", "returned-after-reset"),
        # Proven without a reset (the GPU read healthy at once): the window runs from the proof.
        (FRESH, rec("proven"), "b0", False, "reboot", "returned-after-reset"),
        # The request asked at the very reset that proved the GPU is the one that was done.
        (
            Request(UUID, "gpu-a", at(-60 + REQUEST_TTL_S)),
            rec("proven", reset=True),
            "b0",
            False,
            "wait",
            "proven",
        ),
    ],
)
def test_the_ladder(
    *, request_: Request | None, record: Record, boot: str, vetoed: bool, action: str, why: str
) -> None:
    step = decide(request_, record, boot=boot, now=NOW, window_s=DAY, vetoed=vetoed)
    assert (step.action, step.why) == (action, why)


# -- the proof and the pace --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reading", "failures"),
    [
        (GpuAfterReset(UUID, 0, False, None), 0),
        (GpuAfterReset(UUID, None, None, None), 0),
        (GpuAfterReset("GPU-it-4", 0, False, None), 1),
        (GpuAfterReset(UUID, 1, False, None), 1),
        (GpuAfterReset(UUID, 0, True, True), 2),
    ],
)
def test_the_proof_wants_the_same_uuid_no_recovery_action_and_nothing_pending(
    reading: GpuAfterReset, failures: int
) -> None:
    assert len(proof_failures(reading, UUID)) == failures


def test_the_pace_allows_a_burst_then_refills_by_itself_and_a_clock_step_mints_nothing() -> None:
    bucket = Bucket(per_hour=6, burst=2)
    ok1, left = take(bucket, None, None, NOW)
    ok2, left = take(bucket, left, NOW, NOW)
    ok3, left = take(bucket, left, NOW, NOW)
    assert (ok1, ok2, ok3) == (True, True, False)
    assert take(bucket, left, NOW, at(600))[0] is True  # 10 minutes: one reset's worth again
    assert take(bucket, left, at(3600), NOW)[0] is False  # a time ahead of now refills nothing
    assert take(bucket, 99.0, NOW, NOW) == (True, 1.0)  # a forged count is a full bucket, never more


def test_the_pace_refills_per_hour_tokens_an_hour_in_proportion() -> None:
    bucket = Bucket(per_hour=6, burst=2)
    assert take(bucket, 0.0, NOW, at(300)) == (False, 0.5)  # 5 minutes of 6 an hour: half a reset
    assert take(bucket, 0.0, NOW, at(900)) == (True, 0.5)


def test_the_pace_adds_nothing_in_no_time_nor_when_its_time_is_ahead_of_now() -> None:
    bucket = Bucket(per_hour=6, burst=2)
    assert take(bucket, 0.5, NOW, NOW) == (False, 0.5)
    assert take(bucket, 0.5, at(3600), NOW) == (False, 0.5)


class FakeLeases:
    """The API server's Lease collection: optimistic concurrency on resourceVersion, as the real one."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.race: dict[str, str] | None = None  # another executor's write, landing just before ours

    def request(self, method: str, path: str, *, body: Any = None, **_: Any) -> Any:
        if method == "GET":
            if self.lease is None:
                raise PermanentApiError("not found", status=404)
            return json.loads(json.dumps(self.lease))
        if self.race is not None:
            self._store({"metadata": {"name": "x", "namespace": "gpuguard", "annotations": self.race}})
            self.race = None
            raise ConflictError("the object has been modified")
        if method == "PUT" and body["metadata"]["resourceVersion"] != str(self.version):
            raise ConflictError("the object has been modified")
        self._store(body)
        return self.lease

    def _store(self, body: dict[str, Any]) -> None:
        self.version += 1
        self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}


def test_two_executors_cannot_both_take_the_last_token_of_the_lease() -> None:
    fake = FakeLeases()
    pace = LeasePace(lambda: fake, Bucket(per_hour=1, burst=1), namespace="gpuguard", now=lambda: NOW)  # type: ignore[arg-type,return-value]
    fake.race = {ANN_TOKENS: "0.000", ANN_AT: stamp(NOW)}  # another executor took the only token first
    assert pace.take() is False  # re-read after the 409: none left
    assert fake.lease is not None and fake.lease["metadata"]["annotations"][ANN_TOKENS] == "0.000"
    later = LeasePace(lambda: fake, Bucket(per_hour=1, burst=1), namespace="gpuguard", now=lambda: at(3600))  # type: ignore[arg-type,return-value]
    assert later.take() is True and later.take() is False  # an hour refilled exactly one


def test_a_quarantine_is_in_place_when_its_own_rule_blocks_or_the_node_taint_is_on_not_when_deferred() -> (
    None
):
    v = verdict(gpu(0), gpu(3, "recovery-gpu-reset"))

    def rule(uuid: str, deferred: bool) -> GpuQuarantine:
        return GpuQuarantine(
            uuid, "gpu-3", "r", "recovery-gpu-reset", "NoSchedule" if not deferred else "", deferred
        )

    assert asking.in_place(node(), v, [rule("GPU-it-3", False)]) == {"GPU-it-3"}
    assert asking.in_place(node(), v, [rule("GPU-it-3", True)]) == set()  # past the budget: informational
    taint = (Taint(TAINT_KEY, "NoSchedule", "recovery-gpu-reset"),)
    ours = {ANN_FAULTS: "recovery-gpu-reset/GPU-it-3"}
    tainted = NodeView(name="gpu-a", boot_id="b0", taints=taint, annotations=ours)
    assert asking.in_place(tainted, v, []) == {"GPU-it-0", "GPU-it-3"}
    deferred = NodeView(
        name="gpu-a", boot_id="b0", taints=taint, annotations=ours, labels={LABEL_QUARANTINED: "deferred"}
    )
    assert asking.in_place(deferred, v, []) == set()
    theirs = NodeView(name="gpu-a", boot_id="b0", taints=taint)  # our key, no record: someone else's taint
    assert asking.in_place(theirs, v, []) == set()


def test_a_standing_request_keeps_its_gpu_and_is_renewed_once_half_its_time_is_gone() -> None:
    """Two GPUs a reset would remedy: the request stays on the one already asked for (not the first), and
    is written again only when at most half of REQUEST_TTL_S is left."""
    v = verdict(gpu(0, "recovery-gpu-reset"), gpu(3, "recovery-gpu-reset"))
    both = {"GPU-it-0", UUID}

    def asked(left: float) -> NodeView:
        return node(**{ANN_REQUEST: Request(UUID, "gpu-a", at(left)).value()})

    assert asking.ask(asked(0.6 * REQUEST_TTL_S), v, in_place=both, now=NOW) is None
    for left in (0.5 * REQUEST_TTL_S, 0.4 * REQUEST_TTL_S):
        change = asking.ask(asked(left), v, in_place=both, now=NOW)
        assert change is not None
        renewed = parse_request(change.annotations[ANN_REQUEST], node="gpu-a", now=NOW)[0]
        assert renewed == Request(UUID, "gpu-a", at(REQUEST_TTL_S))


def test_the_record_is_compact_json_with_sorted_keys_and_a_why_only_where_one_was_given() -> None:
    record = (
        Record()
        .step(UUID, "resetting", at=NOW, boot="b0")
        .step(UUID, "failed", at=at(5), boot="b0", reset=True, why="w" * 250)
        .step("GPU-it-6", "idle", at=NOW, boot="b0")
    )
    assert record.value() == (
        '{"GPU-it-3":{"at":"2026-12-06T04:00:05Z","boot":"b0","phase":"failed",'
        '"resets":["2026-12-06T04:00:05Z"],"why":"' + "w" * 200 + '"},'
        '"GPU-it-6":{"at":"2026-12-06T04:00:00Z","boot":"b0","phase":"idle"}}'
    )


@pytest.mark.parametrize(
    "phase",
    [
        "draining",
        "idle",
        "resetting",
        "validating",
        "proven",
        "failed",
        "reboot-requested",
        "needs-repair",
        "vetoed",
    ],
)
def test_the_record_reads_each_of_the_ladders_nine_phases_by_its_name(phase: str) -> None:
    """The names the admission policy and docs/design.md's state machine use."""
    text = json.dumps({UUID: {"phase": phase, "at": stamp(NOW), "boot": "b0"}})
    entry = parse_record(text).get(UUID)
    assert entry is not None and entry.phase == phase


def test_the_record_reader_cuts_texts_keeps_the_last_four_resets_and_skips_bad_entries_not_the_rest() -> None:
    resets = [stamp(at(i)) for i in range(6)]
    good = {"phase": "proven", "at": stamp(NOW), "boot": "b" * 70, "resets": resets, "why": "y" * 250}
    text = json.dumps({"not-a-uuid": good, "GPU-bad": {"phase": "proven"}, UUID: good})
    entry = parse_record(text).get(UUID)
    assert entry is not None and set(parse_record(text).entries) == {UUID}
    assert (entry.boot, entry.why) == ("b" * 64, "y" * 200)
    assert entry.resets == tuple(at(i) for i in range(4))
    assert parse_record("[]") == Record() and parse_record('"x"') == Record()


def test_a_gpu_keeps_its_last_four_resets_and_the_record_its_last_sixteen_gpus() -> None:
    record = Record()
    for i in range(6):
        record = record.step(UUID, "proven", at=at(i), boot="b0", reset=True)
    assert record.get(UUID).resets == tuple(at(i) for i in range(2, 6))  # type: ignore[union-attr]
    many = {f"GPU-{i}": {"phase": "proven", "at": stamp(NOW), "boot": "b"} for i in range(20)}
    assert set(parse_record(json.dumps(many)).entries) == {f"GPU-{i}" for i in range(16)}


def test_a_request_is_asked_an_hour_before_its_deadline_and_read_up_to_six_hours_ahead() -> None:
    assert Request(UUID, "gpu-a", at(3600)).asked == NOW
    for ahead, why in ((0, "expired"), (6 * 3600, "ok"), (6 * 3600 + 1, "deadline-too-far")):
        value = Request(UUID, "gpu-a", at(ahead)).value()
        assert parse_request(value, node="gpu-a", now=NOW)[1] == why
