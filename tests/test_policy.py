"""The policy, table-driven: every fault kind, every default, the sticky memory, and what is not a fault."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from gpuguard.core.config import DEFAULT_IGNORED_XIDS, PolicySettings
from gpuguard.core.model import Fault, GpuReading, SignalReadings, Snapshot, Verdict, XidEvent
from gpuguard.core.xids import CATALOG
from gpuguard.judge.policy import cleared_without_reboot, evaluate, primary

DEFAULT = PolicySettings()


def gpu(i: int, **kw: object) -> GpuReading:
    return replace(GpuReading(index=i, uuid=f"GPU-{i}"), **kw)  # type: ignore[arg-type]


def snap(*gpus: GpuReading, xids: tuple[XidEvent, ...] = (), init_error: str | None = None) -> Snapshot:
    return Snapshot(gpus=gpus, xids=xids, init_error=init_error)


def reasons(v: Verdict) -> list[str]:
    return [f.reason for f in v.faults]


TWO = (gpu(0), gpu(1))


@pytest.mark.parametrize(
    ("case", "snapshot", "settings", "expected"),
    [
        ("all healthy", snap(*TWO), DEFAULT, []),
        (
            "one uncorrected ECC error is a fault at the default threshold 0",
            snap(gpu(0, ecc_uncorrected=1), gpu(1)),
            DEFAULT,
            ["ecc"],
        ),
        (
            "ECC at the threshold is tolerated",
            snap(gpu(0, ecc_uncorrected=5), gpu(1)),
            PolicySettings(ecc_threshold=5),
            [],
        ),
        (
            "ECC above the threshold is a fault",
            snap(gpu(0, ecc_uncorrected=6), gpu(1)),
            PolicySettings(ecc_threshold=5),
            ["ecc"],
        ),
        (
            "ECC not supported is not applicable, not a fault",
            snap(gpu(0, ecc_supported=False, ecc_uncorrected=None), gpu(1)),
            DEFAULT,
            [],
        ),
        (
            "a fatal Xid is a fault named after its code",
            snap(*TWO, xids=(XidEvent(0, "GPU-0", 79),)),
            DEFAULT,
            ["xid-79"],
        ),
        (
            "an ignored application Xid is not a fault",
            snap(*TWO, xids=(XidEvent(0, "GPU-0", 13),)),
            DEFAULT,
            [],
        ),
        (
            "Xid 109 is a fault although NVIDIA's device plugin ignores it",
            snap(*TWO, xids=(XidEvent(0, "GPU-0", 109),)),
            DEFAULT,
            ["xid-109"],
        ),
        ("an unknown Xid is a fault", snap(*TWO, xids=(XidEvent(1, "GPU-1", 9999),)), DEFAULT, ["xid-9999"]),
        (
            "--ignore-xids replaces the list: 13 becomes a fault",
            snap(*TWO, xids=(XidEvent(0, "GPU-0", 13),)),
            PolicySettings(ignored_xids=frozenset({79})),
            ["xid-13"],
        ),
        (
            "--ignore-xids replaces the list: 79 becomes ignored",
            snap(*TWO, xids=(XidEvent(0, "GPU-0", 79),)),
            PolicySettings(ignored_xids=frozenset({79})),
            [],
        ),
        (
            "a lost GPU is a fault",
            snap(gpu(0, lost=True, ecc_uncorrected=None), gpu(1)),
            DEFAULT,
            ["gpu-lost"],
        ),
        ("a failed row remap is a fault", snap(gpu(0, remap_failure=True), gpu(1)), DEFAULT, ["row-remap"]),
        ("a pending row remap is not a fault", snap(gpu(0, remap_pending=True), gpu(1)), DEFAULT, []),
        (
            "fewer GPUs than --expected-gpus at the first init",
            snap(*TWO),
            PolicySettings(expected_gpus=3),
            ["gpu-missing"],
        ),
        ("more GPUs than --expected-gpus is fine", snap(*TWO), PolicySettings(expected_gpus=1), []),
        ("NVML init failure is a node fault", snap(init_error="DRIVER_NOT_LOADED"), DEFAULT, ["nvml-init"]),
        (
            "NVML init failure with --allow-no-gpu is healthy",
            snap(init_error="LIBRARY_NOT_FOUND"),
            PolicySettings(allow_no_gpu=True),
            [],
        ),
        (
            "a transient query error is not a fault",
            snap(gpu(0, ecc_uncorrected=None, transient_errors=("ecc:TIMEOUT",)), gpu(1)),
            DEFAULT,
            [],
        ),
        ("zero GPUs is gpu-missing, in watch as in check", snap(), DEFAULT, ["gpu-missing"]),
        ("zero GPUs with --allow-no-gpu is healthy", snap(), PolicySettings(allow_no_gpu=True), []),
        (
            "--allow-no-gpu does not cover a broken driver",
            snap(init_error="LIB_RM_VERSION_MISMATCH"),
            PolicySettings(allow_no_gpu=True),
            ["nvml-init"],
        ),
    ],
)
def test_a_single_snapshot_is_judged_as_the_catalog_says(
    case: str, snapshot: Snapshot, settings: PolicySettings, expected: list[str]
) -> None:
    assert reasons(evaluate(snapshot, previous=None, settings=settings)) == expected, case


@pytest.mark.parametrize("code", sorted(DEFAULT_IGNORED_XIDS))
def test_every_default_ignored_xid_leaves_the_gpu_healthy(code: int) -> None:
    """On GPUs whose recovery field reads (NONE): Xid 154 only announces what the field says."""
    read = (gpu(0, recovery_action=0), gpu(1, recovery_action=0))
    v = evaluate(snap(*read, xids=(XidEvent(0, "GPU-0", code),)), previous=None, settings=DEFAULT)
    assert v.healthy
    assert [x.code for x in v.ignored_xids] == [code]


def test_xid_154_on_a_gpu_whose_recovery_field_cannot_be_read_is_a_fault() -> None:
    v = evaluate(snap(*TWO, xids=(XidEvent(0, "GPU-0", 154),)), previous=None, settings=DEFAULT)
    assert reasons(v) == ["xid-154"]


@pytest.mark.parametrize("code", [48, 61, 62, 63 + 1, 74, 79, 95, 109, 119, 120, 1, 200])
def test_xids_outside_the_ignored_list_are_faults(code: int) -> None:
    v = evaluate(snap(*TWO, xids=(XidEvent(1, "GPU-1", code),)), previous=None, settings=DEFAULT)
    assert reasons(v) == [f"xid-{code}"]
    assert v.gpus[1].faults[0].message.startswith(f"xid-{code}: ")


# The Xids the issue found quarantining a node although NVIDIA's catalog files them under RESTART_APP or
# IGNORE: copy engines CE3-CE19, NVDEC1-7, NVJPG0-7, OFA, and the firmware/test/fast-path ones.
RESTART_APP_OR_IGNORE_THAT_WERE_FAULTS = [
    *(70, 71, 72, 75, 76, 77, 85, *range(126, 136)),
    *(82, 83, 84, 86, 88, 89, *range(96, 106), 139),
    *(38, 44, 66, 67, 106, 107, 141),
]


@pytest.mark.parametrize("code", RESTART_APP_OR_IGNORE_THAT_WERE_FAULTS)
def test_an_xid_the_catalog_files_under_restart_app_or_ignore_does_not_quarantine(code: int) -> None:
    assert CATALOG.entries[code].immediate_action in ("RESTART_APP", "IGNORE")
    v = evaluate(snap(*TWO, xids=(XidEvent(0, "GPU-0", code),)), previous=None, settings=DEFAULT)
    assert v.healthy and [x.code for x in v.ignored_xids] == [code]


def test_the_default_is_the_catalogs_event_buckets_plus_the_named_overrides() -> None:
    buckets = {c for c, e in CATALOG.entries.items() if e.immediate_action in ("RESTART_APP", "IGNORE")}
    assert buckets | {45, 154} == DEFAULT_IGNORED_XIDS
    assert set(CATALOG.overrides) == {45, 154}


@pytest.mark.parametrize(("code", "ignored"), [(45, True), (63, True), (92, True), (94, True), (109, False)])
def test_the_issues_fixed_points_keep_their_default(code: int, ignored: bool) -> None:
    assert (code in DEFAULT_IGNORED_XIDS) is ignored


def test_the_catalog_lists_every_code_with_mnemonic_bucket_source_and_date() -> None:
    assert sorted(CATALOG.entries) == list(range(1, 173))
    assert all(e.mnemonic for e in CATALOG.entries.values())
    assert CATALOG.source.startswith("https://docs.nvidia.com/")
    assert CATALOG.taken == "2026-12-03"
    # Only 162-172 lack a bucket on the page; they are faults, as an unlisted code is.
    assert [c for c, e in CATALOG.entries.items() if not e.immediate_action] == list(range(162, 173))
    assert not CATALOG.is_event(163) and not CATALOG.is_event(500)


def test_xid_999_reads_as_an_unknown_xid_and_is_a_fault() -> None:
    v = evaluate(snap(*TWO, xids=(XidEvent(1, "GPU-1", 999),)), previous=None, settings=DEFAULT)
    assert [f.message for f in v.faults] == [
        "xid-999: unknown Xid (NVML reports 999 when the driver does not name the error) (GPU 1, GPU-1)"
    ]


def test_ignore_and_fatal_flags_still_override_the_catalog() -> None:
    settings = replace(DEFAULT, ignored_xids=(DEFAULT_IGNORED_XIDS | {79}) - {70})
    v = evaluate(
        snap(*TWO, xids=(XidEvent(0, "GPU-0", 79), XidEvent(1, "GPU-1", 70))),
        previous=None,
        settings=settings,
    )
    assert reasons(v) == ["xid-70"]


def test_an_xid_stays_a_fault_on_later_checks_because_the_driver_never_repeats_it() -> None:
    first = evaluate(snap(*TWO, xids=(XidEvent(0, "GPU-0", 79),)), previous=None, settings=DEFAULT)
    later = evaluate(snap(*TWO), previous=first, settings=DEFAULT)
    assert reasons(later) == ["xid-79"]
    assert later.fatal_xids == ()  # counted once, when delivered


def test_ecc_is_not_sticky_a_counter_reset_clears_it() -> None:
    bad = evaluate(snap(gpu(0, ecc_uncorrected=3), gpu(1)), previous=None, settings=DEFAULT)
    reset = evaluate(snap(*TWO), previous=bad, settings=DEFAULT)
    assert reasons(bad) == ["ecc"]
    assert reset.healthy


def test_an_unreadable_ecc_counter_keeps_the_last_ecc_judgement_instead_of_flapping() -> None:
    bad = evaluate(snap(gpu(0, ecc_uncorrected=3), gpu(1)), previous=None, settings=DEFAULT)
    unreadable = evaluate(
        snap(gpu(0, ecc_uncorrected=None, transient_errors=("ecc:UNKNOWN",)), gpu(1)),
        previous=bad,
        settings=DEFAULT,
    )
    assert reasons(unreadable) == ["ecc"]


def test_a_lost_gpu_stays_lost_even_if_a_later_read_succeeds() -> None:
    lost = evaluate(snap(gpu(0, lost=True), gpu(1)), previous=None, settings=DEFAULT)
    back = evaluate(snap(*TWO), previous=lost, settings=DEFAULT)
    assert reasons(back) == ["gpu-lost"]


def test_a_gpu_that_disappears_keeps_its_entry_with_gpu_missing() -> None:
    first = evaluate(snap(*TWO), previous=None, settings=DEFAULT)
    gone = evaluate(snap(gpu(0)), previous=first, settings=DEFAULT)
    assert [(g.index, g.uuid, g.present, g.healthy) for g in gone.gpus] == [
        (0, "GPU-0", True, True),
        (1, "GPU-1", False, False),
    ]
    assert gone.gpus[1].faults[0].message.startswith("gpu-missing: ")
    assert gone.node_faults == ()  # accounted for by the GPU's own entry, not twice


def test_expected_gpus_defaults_to_the_count_at_the_first_successful_init() -> None:
    failed = evaluate(snap(init_error="DRIVER_NOT_LOADED"), previous=None, settings=DEFAULT)
    assert failed.expected_gpus is None
    first = evaluate(snap(*TWO), previous=failed, settings=DEFAULT)
    assert first.expected_gpus == 2 and first.healthy


def test_init_failure_after_success_keeps_known_gpus_listed() -> None:
    ok = evaluate(snap(*TWO), previous=None, settings=DEFAULT)
    failed = evaluate(snap(init_error="UNKNOWN"), previous=ok, settings=DEFAULT)
    assert reasons(failed) == ["nvml-init"]
    assert [g.uuid for g in failed.gpus] == ["GPU-0", "GPU-1"]
    assert failed.node_faults[0].message == "nvml-init: NVML initialization failed: UNKNOWN"


def test_an_xid_from_an_unknown_device_is_a_node_fault_not_lost() -> None:
    v = evaluate(snap(*TWO, xids=(XidEvent(-1, "GPU-unknown", 79),)), previous=None, settings=DEFAULT)
    assert reasons(v) == ["xid-79"]
    assert v.node_faults[0].uuid == "GPU-unknown"


def test_the_same_xid_twice_on_one_gpu_is_one_fault() -> None:
    x = XidEvent(0, "GPU-0", 79)
    v = evaluate(snap(*TWO, xids=(x, x)), previous=None, settings=DEFAULT)
    assert reasons(v) == ["xid-79"]


def test_reason_strings_start_with_the_taint_value() -> None:
    v = evaluate(
        snap(gpu(0, ecc_uncorrected=3), gpu(1), xids=(XidEvent(1, "GPU-1", 79),)),
        previous=None,
        settings=DEFAULT,
    )
    assert [f.message for f in v.faults] == [
        "ecc: 3 uncorrected volatile ECC errors (GPU 0, GPU-0)",
        "xid-79: GPU has fallen off the bus (GPU 1, GPU-1)",
    ]


def test_the_primary_reason_is_the_most_severe_fault() -> None:
    v = evaluate(
        snap(gpu(0, ecc_uncorrected=3), gpu(1, lost=True), xids=(XidEvent(0, "GPU-0", 48),)),
        previous=None,
        settings=DEFAULT,
    )
    first = primary(v.faults)
    assert first is not None and first.reason == "gpu-lost"
    assert primary(()) is None


def test_evaluate_is_pure_the_same_inputs_give_the_same_verdict() -> None:
    s = snap(gpu(0, ecc_uncorrected=2), gpu(1), xids=(XidEvent(1, "GPU-1", 79),))
    assert evaluate(s, previous=None, settings=DEFAULT) == evaluate(s, previous=None, settings=DEFAULT)


# -- NVIDIA's recovery action and the reset evidence rule (docs/design.md) ----------------------------------


def run(*snapshots: Snapshot, settings: PolicySettings = DEFAULT) -> list[Verdict]:
    """The snapshots judged one after another, as polls at --interval (taken_at 0, 3, 6, ...)."""
    out: list[Verdict] = []
    for i, s in enumerate(snapshots):
        at = replace(s, taken_at=i * settings.interval)
        out.append(evaluate(at, previous=out[-1] if out else None, settings=settings))
    return out


def act(a: int | None, *xids: XidEvent) -> Snapshot:
    return snap(gpu(0, recovery_action=a), gpu(1, recovery_action=0 if a is not None else None), xids=xids)


X79 = XidEvent(0, "GPU-0", 79)


@pytest.mark.parametrize(
    ("case", "sequence", "expected"),
    [
        ("reset asked with the Xid, then NONE: cleared", [act(1, X79), act(1), act(0)], []),
        ("reset asked at the next check (its event comes later): cleared", [act(0, X79), act(1), act(0)], []),
        ("drain and reset counts as a reset", [act(4, X79), act(0)], []),
        (
            "NONE at the Xid and at the next check: needs a reboot",
            [act(0, X79), act(0), act(1), act(0)],
            ["xid-79"],
        ),
        ("escalation to a reboot unties it", [act(1, X79), act(2), act(0)], ["xid-79"]),
        ("field not supported: present rules", [act(None, X79), act(None)], ["xid-79"]),
        ("a transient unreadable field keeps waiting for NONE", [act(1, X79), act(None), act(0)], []),
    ],
)
def test_an_xid_recorded_while_the_driver_asks_for_a_reset_clears_when_the_action_is_none_again(
    case: str, sequence: list[Snapshot], expected: list[str]
) -> None:
    last = run(*sequence)[-1]
    assert reasons(last) == expected, case
    assert ("xid-79/GPU-0" in last.reset_cleared) == (not expected), case


def test_the_recovery_action_is_a_fault_that_follows_the_reading() -> None:
    v = run(act(2), act(0))
    assert [f.message for f in v[0].faults] == [
        "recovery-node-reboot: the driver asks for NODE_REBOOT (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION=2) "
        "(GPU 0, GPU-0)"
    ]
    assert v[1].healthy


def test_the_same_xid_after_a_reset_needs_its_own_evidence() -> None:
    v = run(act(1, X79), act(0), act(0, X79), act(0))
    assert reasons(v[-1]) == ["xid-79"]
    assert "xid-79/GPU-0" not in v[-1].reset_cleared


@pytest.mark.parametrize(
    ("key", "cleared", "expected"),
    [
        ("ecc/GPU-0", frozenset(), True),
        ("recovery-gpu-reset/GPU-0", frozenset(), True),
        ("reset-required/GPU-0", frozenset(), True),
        ("gpu-unreadable/node", frozenset(), True),
        ("xid-79/GPU-0", frozenset(), False),
        ("xid-79/GPU-0", frozenset({"xid-79/GPU-0"}), True),
        ("gpu-lost/GPU-0", frozenset({"xid-79/GPU-0"}), False),
    ],
)
def test_which_recorded_faults_clear_without_a_reboot(
    key: str, cleared: frozenset[str], expected: bool
) -> None:
    assert cleared_without_reboot(key, cleared) is expected


def test_an_unreadable_gpu_is_a_fault_after_the_bounded_number_of_checks() -> None:
    bad = gpu(1, unreadable=True, ecc_uncorrected=None, transient_errors=("ecc:UNKNOWN", "remap:UNKNOWN"))
    v = run(*(snap(gpu(0), bad) for _ in range(3)), snap(gpu(0), gpu(1)))
    assert [reasons(x) for x in v] == [[], [], ["gpu-unreadable"], []]


def test_an_unidentified_gpu_never_enters_the_inventory() -> None:
    s = Snapshot(gpus=(gpu(0),), unidentified=((1, "uuid:UNKNOWN"),))
    v = run(s, s, s, snap(gpu(0), gpu(1)))
    assert [g.uuid for g in v[0].gpus] == ["GPU-0"]
    assert [reasons(x) for x in v] == [[], [], ["gpu-unreadable"], []]
    assert [g.uuid for g in v[-1].gpus] == ["GPU-0", "GPU-1"]


# -- severity across GPUs: which fault's reason becomes the taint value ------------------------------------


def _missing_gpu_1_with(*others: GpuReading, xids: tuple[XidEvent, ...] = ()) -> Verdict:
    """GPU-1 known from a first check, gone at the second; `others` read at the second."""
    first = evaluate(snap(gpu(0), gpu(1), gpu(2)), previous=None, settings=DEFAULT)
    return evaluate(snap(*others, xids=xids), previous=first, settings=DEFAULT)


@pytest.mark.parametrize(
    ("case", "judge", "taint_value"),
    [
        (
            "an Xid on GPU 1 outranks ECC on GPU 0",
            lambda: evaluate(
                snap(gpu(0, ecc_uncorrected=3), gpu(1), xids=(XidEvent(1, "GPU-1", 79),)),
                previous=None,
                settings=DEFAULT,
            ),
            "xid-79",
        ),
        (
            "a missing GPU 1 outranks an Xid on GPU 0",
            lambda: _missing_gpu_1_with(gpu(0), gpu(2), xids=(XidEvent(0, "GPU-0", 79),)),
            "gpu-missing",
        ),
        (
            "a missing GPU 1 outranks an Xid on GPU 2",
            lambda: _missing_gpu_1_with(gpu(0), gpu(2), xids=(XidEvent(2, "GPU-2", 79),)),
            "gpu-missing",
        ),
        (
            "ECC on GPU 1 outranks a failed row remap on GPU 0",
            lambda: evaluate(
                snap(gpu(0, remap_failure=True), gpu(1, ecc_uncorrected=1)), previous=None, settings=DEFAULT
            ),
            "ecc",
        ),
        (
            "a lost GPU 1 outranks everything on GPU 0",
            lambda: evaluate(
                snap(gpu(0, ecc_uncorrected=1, remap_failure=True), gpu(1, lost=True), xids=(X79,)),
                previous=None,
                settings=DEFAULT,
            ),
            "gpu-lost",
        ),
        (
            "NVML that does not start outranks the sticky faults it keeps",
            lambda: evaluate(
                snap(init_error="DRIVER_NOT_LOADED"),
                previous=evaluate(snap(gpu(0, lost=True), gpu(1)), previous=None, settings=DEFAULT),
                settings=DEFAULT,
            ),
            "nvml-init",
        ),
        (
            "of two faults of one severity, the lower GPU index: RESET_REQUIRED on GPU 0, unreadable GPU 1",
            lambda: evaluate(
                snap(gpu(0, transient_errors=("ecc:RESET_REQUIRED",)), gpu(1)),
                previous=None,
                settings=replace(DEFAULT, unreadable_after=1),
            ),
            "reset-required",
        ),
    ],
)
def test_the_most_severe_fault_sets_the_taint_value_whichever_gpu_it_is_on(
    case: str, judge: Callable[[], Verdict], taint_value: str
) -> None:
    v = judge()  # judged in the test, not at collection: `make mutation` must see the code under test
    first = primary(v.faults)
    assert first is not None and first.reason == taint_value, case
    assert v.faults and all(f.reason for f in v.faults)


@pytest.mark.parametrize(
    ("faults", "first"),
    [
        # One severity (2): the lower GPU index wins, the node's (no index) before any GPU's.
        (("gpu-unreadable", 1, "reset-required", 0), "reset-required"),
        (("reset-required", 1, "gpu-missing", None), "gpu-missing"),
        # One severity and one index: the reason's name decides, so every agent picks the same one.
        (("reset-required", 0, "gpu-missing", 0), "gpu-missing"),
        (("xid-79", 0, "xid-48", 0), "xid-48"),
        # The ranking itself, the less severe on the lower index.
        (("ecc", 0, "xid-79", 3), "xid-79"),
        (("row-remap", 0, "ecc", 3), "ecc"),
        (("xid-79", 0, "reset-required", 3), "reset-required"),
        (("gpu-missing", 0, "gpu-lost", 3), "gpu-lost"),
        (("gpu-lost", 0, "nvml-init", None), "nvml-init"),
        (("xid-79", 0, "gpu-unreadable", 1), "gpu-unreadable"),
        (("gpu-unreadable", 0, "reset-required", None), "reset-required"),
        # A held repeat offender's taint says why it stays, whatever else its GPU or the node reads.
        (("gpu-lost", 0, "repeat-offender", 3), "repeat-offender"),
        (("nvml-init", None, "repeat-offender", 5), "repeat-offender"),
    ],
)
def test_the_primary_fault_is_ranked_by_severity_then_gpu_index_then_reason(
    faults: tuple[str, int | None, str, int | None], first: str
) -> None:
    a, ai, b, bi = faults
    fs = (Fault(a, "d", gpu_index=ai), Fault(b, "d", gpu_index=bi))
    assert primary(fs) == primary(fs[::-1])
    chosen = primary(fs)
    assert chosen is not None and chosen.reason == first


# -- policy edges -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "reason"), [("handle:GPU_IS_LOST", "gpu-lost"), ("uuid:RESET_REQUIRED", "reset-required")]
)
def test_an_unidentified_gpu_that_answers_lost_or_reset_required_is_a_node_fault_at_the_first_check(
    error: str, reason: str
) -> None:
    v = evaluate(Snapshot(gpus=(gpu(0),), unidentified=((1, error),)), previous=None, settings=DEFAULT)
    assert [(f.reason, f.uuid, f.gpu_index) for f in v.node_faults] == [(reason, None, 1)]
    assert v.node_faults[0].detail == f"NVML counts GPU 1 but cannot identify it ({error})"
    # The same answer at the next check is the same fault, not a second one.
    again = evaluate(Snapshot(gpus=(gpu(0),), unidentified=((1, error),)), previous=v, settings=DEFAULT)
    assert [f.reason for f in again.node_faults] == [reason]


def test_an_unidentified_gpu_with_another_error_is_unreadable_only_after_the_bounded_number_of_checks() -> (
    None
):
    s = Snapshot(gpus=(gpu(0),), unidentified=((1, "uuid:UNKNOWN"),))
    first, second, third = run(s, s, s, settings=replace(DEFAULT, unreadable_after=2))
    assert [f.reason for f in first.node_faults] == []
    assert [(f.reason, f.gpu_index) for f in second.node_faults] == [("gpu-unreadable", 1)]
    assert "for 3.0 s, 2 checks at --interval 3 (uuid:UNKNOWN)" in second.node_faults[0].detail
    assert [f.reason for f in third.node_faults] == ["gpu-unreadable"]
    assert dict(third.unidentified_since) == {1: 0.0}


@pytest.mark.parametrize(
    ("case", "second", "expected"),
    [
        (
            "a transient error keeps the last action",
            gpu(0, transient_errors=("recovery:UNKNOWN",)),
            ["recovery-node-reboot"],
        ),
        (
            "an unreadable GPU keeps the last action",
            gpu(0, unreadable=True, ecc_uncorrected=None),
            ["recovery-node-reboot"],
        ),
        ("no action and no error: the field is gone", gpu(0), []),
        ("NONE read again clears it", gpu(0, recovery_action=0, transient_errors=("ecc:UNKNOWN",)), []),
    ],
)
def test_the_last_recovery_action_is_kept_only_while_transient_errors_hide_the_field(
    case: str, second: GpuReading, expected: list[str]
) -> None:
    v = run(snap(gpu(0, recovery_action=2), gpu(1)), snap(second, gpu(1)))
    assert reasons(v[-1]) == expected, case
    assert v[-1].gpus[0].recovery_action == (2 if expected else second.recovery_action), case


def test_an_xid_on_a_key_that_is_already_sticky_is_not_new_evidence_for_a_reset() -> None:
    """The Xid, NONE twice (it needs a reboot now); the driver reports it again with a reset asked, then NONE:
    the repeat is the same recorded fault, so the reset does not clear it."""
    v = run(act(0, X79), act(0), act(1, X79), act(0))
    assert reasons(v[-1]) == ["xid-79"]
    assert "xid-79/GPU-0" not in v[-1].reset_cleared
    assert v[2].reset_clearable == frozenset()


def test_a_reset_clears_an_xid_that_was_pending_when_the_reset_came_at_the_next_check() -> None:
    v = run(act(0, X79), act(4), act(0))
    assert v[0].reset_pending == (("xid-79/GPU-0", 0.0),)
    assert v[1].reset_clearable == frozenset({"xid-79/GPU-0"}) and v[1].reset_pending == ()
    assert reasons(v[-1]) == [] and v[-1].reset_cleared == frozenset({"xid-79/GPU-0"})


def test_an_xid_with_none_asked_waits_for_the_next_poll_not_the_next_event_check_to_be_tied_to_a_reset() -> (
    None
):
    """Xid 79 while the action reads NONE; two ignored Xid 13s wake checks 0.1 s and 0.2 s later (NONE still:
    the driver has not raised the action yet), it asks for a reset at 0.5 s, reads NONE again after: the
    reset cleared it, as it would have with polls alone (the Xid, then the reset at the poll 3 s later)."""
    x13 = XidEvent(1, "GPU-1", 13)
    checks = [
        (0.0, act(0, X79)),
        (0.1, act(0, x13)),
        (0.2, act(0, x13)),
        (0.5, act(1)),
        (3.0, act(1)),
        (6.0, act(0)),
    ]
    v: list[Verdict] = []
    for at, s in checks:
        v.append(evaluate(replace(s, taken_at=at), previous=v[-1] if v else None, settings=DEFAULT))
    assert reasons(v[-1]) == [] and v[-1].reset_cleared == frozenset({"xid-79/GPU-0"})
    # Polls alone: NONE at the Xid and at the next poll, so the reset after it is not this Xid's.
    assert reasons(run(act(0, X79), act(0), act(1), act(0))[-1]) == ["xid-79"]


def test_a_gpu_missing_in_the_middle_of_the_inventory_keeps_its_place_and_is_not_counted_twice() -> None:
    v = run(snap(gpu(0), gpu(1), gpu(2)), snap(gpu(0), gpu(2)))
    last = v[-1]
    assert [(g.uuid, g.present, [f.reason for f in g.faults]) for g in last.gpus] == [
        ("GPU-0", True, []),
        ("GPU-1", False, ["gpu-missing"]),
        ("GPU-2", True, []),
    ]
    assert last.gpus[1].xid_watched is False and last.gpus[1].xid_watch_note == "gpu not visible"
    assert last.node_faults == ()  # the shortfall is the missing GPU itself, not a second fault
    assert last.expected_gpus == 3


def test_fewer_gpus_than_expected_and_none_known_missing_is_one_node_fault() -> None:
    v = evaluate(snap(gpu(0)), previous=None, settings=replace(DEFAULT, expected_gpus=2))
    assert [(f.reason, f.detail) for f in v.node_faults] == [
        ("gpu-missing", "expected 2 GPUs, NVML reports 1")
    ]
    assert evaluate(snap(gpu(0), gpu(1)), previous=None, settings=replace(DEFAULT, expected_gpus=2)).healthy


def test_every_gpu_judged_after_an_nvml_init_failure_is_not_present_and_keeps_its_sticky_faults() -> None:
    v = run(snap(gpu(0), gpu(1, lost=True)), snap(init_error="DRIVER_NOT_LOADED"))
    after = v[-1]
    assert [(g.uuid, g.present) for g in after.gpus] == [("GPU-0", False), ("GPU-1", False)]
    assert [f.reason for f in after.gpus[1].faults] == ["gpu-lost"] and after.gpus[0].faults == ()
    assert [f.reason for f in after.node_faults] == ["nvml-init"]
    assert after.node_faults[0].detail == "NVML initialization failed: DRIVER_NOT_LOADED"
    assert after.fatal_xids == () and after.ignored_xids == ()
    quiet = evaluate(
        snap(init_error="DRIVER_NOT_LOADED"), previous=v[0], settings=replace(DEFAULT, allow_no_gpu=True)
    )
    assert quiet.node_faults == () and [g.present for g in quiet.gpus] == [False, False]


def test_two_unidentified_gpus_with_the_same_answer_are_one_node_fault() -> None:
    lost = Snapshot(gpus=(gpu(0),), unidentified=((1, "handle:GPU_IS_LOST"), (2, "handle:GPU_IS_LOST")))
    assert [f.reason for f in evaluate(lost, previous=None, settings=DEFAULT).node_faults] == ["gpu-lost"]
    unknown = Snapshot(gpus=(gpu(0),), unidentified=((1, "uuid:UNKNOWN"), (2, "uuid:UNKNOWN")))
    v = run(unknown, unknown, unknown)
    assert [f.reason for f in v[-1].node_faults] == ["gpu-unreadable"]


def test_an_unidentified_gpu_counts_among_the_gpus_nvml_reports() -> None:
    s = Snapshot(gpus=(gpu(0),), unidentified=((1, "uuid:UNKNOWN"),))
    v = evaluate(s, previous=None, settings=replace(DEFAULT, expected_gpus=2))
    assert v.node_faults == () and v.expected_gpus == 2


def test_a_known_gpu_gone_and_one_more_short_of_the_expected_count_are_two_faults() -> None:
    settings = replace(DEFAULT, expected_gpus=4)
    first = evaluate(snap(gpu(0), gpu(1), gpu(2)), previous=None, settings=settings)
    assert [f.detail for f in first.node_faults] == ["expected 4 GPUs, NVML reports 3"]
    second = evaluate(snap(gpu(0), gpu(2)), previous=first, settings=settings)
    assert [f.detail for f in second.node_faults] == ["expected 4 GPUs, NVML reports 2"]
    assert [f.reason for f in second.gpus[1].faults] == ["gpu-missing"]


def test_a_gpu_keeps_the_name_it_had_when_a_later_reading_has_none() -> None:
    v = run(snap(gpu(0, name="NVIDIA H100")), snap(gpu(0, name="")), snap(gpu(0, name="NVIDIA H200")))
    assert [x.gpus[0].name for x in v] == ["NVIDIA H100", "NVIDIA H100", "NVIDIA H200"]


def test_the_unreadable_streak_starts_over_after_a_check_that_read_the_gpu() -> None:
    bad = gpu(0, unreadable=True, ecc_uncorrected=None)
    v = run(snap(bad), snap(gpu(0)), snap(bad), snap(bad), settings=replace(DEFAULT, unreadable_after=2))
    assert [x.unreadable_since for x in v] == [(("GPU-0", 0.0),), (), (("GPU-0", 6.0),), (("GPU-0", 6.0),)]
    assert [reasons(x) for x in v] == [[], [], [], ["gpu-unreadable"]]


@pytest.mark.parametrize(
    ("errors", "shown"),
    [((), "(no answer)"), (("remap:UNKNOWN", "ecc:UNKNOWN"), "(ecc:UNKNOWN, remap:UNKNOWN)")],
)
def test_an_unreadable_gpus_fault_names_the_errors_or_says_no_answer(
    errors: tuple[str, ...], shown: str
) -> None:
    bad = gpu(0, unreadable=True, ecc_uncorrected=None, transient_errors=errors)
    (fault,) = evaluate(snap(bad), previous=None, settings=replace(DEFAULT, unreadable_after=1)).faults
    assert fault.detail == f"every NVML query failed in this check {shown} (GPU 0, GPU-0)"


def test_a_lost_gpu_is_neither_reset_required_nor_unreadable_nor_an_ecc_fault() -> None:
    lost = gpu(0, lost=True, ecc_uncorrected=5, unreadable=True, transient_errors=("ecc:RESET_REQUIRED",))
    v = evaluate(snap(lost), previous=None, settings=replace(DEFAULT, unreadable_after=1))
    assert reasons(v) == ["gpu-lost"]


def test_an_xid_in_a_mig_instance_names_the_gpu_and_compute_instance() -> None:
    x = XidEvent(0, "GPU-0", 79, gpu_instance=1, compute_instance=2)
    (fault,) = evaluate(snap(gpu(0), xids=(x,)), previous=None, settings=DEFAULT).faults
    assert fault.detail == "GPU has fallen off the bus (GPU 0, GPU-0, MIG GPU instance 1, compute instance 2)"
    unattributed = evaluate(snap(gpu(0), xids=(XidEvent(None, None, 79),)), previous=None, settings=DEFAULT)
    assert unattributed.node_faults[0].detail == "GPU has fallen off the bus (GPU not identified by NVML)"


def test_a_reset_clearable_xid_whose_fault_is_gone_is_forgotten() -> None:
    """The rule keeps only keys of faults still recorded: a clearable key without its fault is dropped."""
    prev = Verdict(reset_clearable=frozenset({"xid-79/GPU-9"}))
    v = evaluate(act(1), previous=prev, settings=DEFAULT)
    assert v.reset_clearable == frozenset()


# -- retired pages, calls past their deadline, node-wide query errors ----------------------------------------


@pytest.mark.parametrize(
    ("count", "pending", "fault", "degraded"),
    [
        (None, None, None, None),
        (0, False, None, None),
        (62, False, None, None),
        (63, False, "63 pages retired, NVIDIA's limit is 63", None),
        (None, True, None, "pages are pending retirement (a GPU reset or reboot retires them)"),
        (
            64,
            True,
            "64 pages retired, NVIDIA's limit is 63",
            "pages are pending retirement (a GPU reset or reboot retires them)",
        ),
    ],
)
def test_63_retired_pages_are_the_fault_retired_pages_pending_pages_degrade_and_fewer_are_only_shown(
    count: int | None, pending: bool | None, fault: str | None, degraded: str | None
) -> None:
    v = evaluate(
        snap(gpu(0), gpu(1, retired_pages=count, retired_pending=pending)), previous=None, settings=DEFAULT
    )
    assert v.gpus[1].retired_pages == count
    expected = [] if fault is None else [("retired-pages", f"{fault} (GPU 1, GPU-1)", "GPU-1", 1)]
    assert [(f.reason, f.detail, f.uuid, f.gpu_index) for f in v.faults] == expected
    soft = [] if degraded is None else [("retired-pending", f"{degraded} (GPU 1, GPU-1)", "GPU-1", 1)]
    assert [(f.reason, f.detail, f.uuid, f.gpu_index) for f in v.degraded] == soft


def test_retired_pages_follow_the_reading_pending_pages_a_reset_retired_are_no_longer_degraded() -> None:
    v = run(
        snap(gpu(0, retired_pages=2, retired_pending=True)),
        snap(gpu(0, retired_pages=3, retired_pending=False)),
    )
    assert [[f.reason for f in x.degraded] for x in v] == [["retired-pending"], []]
    assert [reasons(x) for x in v] == [[], []]
    assert v[-1].gpus[0].retired_pages == 3


@pytest.mark.parametrize(
    ("faults", "first"),
    [
        # Retired pages rank with a failed row remap, below ECC: the index, then the name decides.
        (("retired-pages", 0, "ecc", 3), "ecc"),
        (("row-remap", 0, "retired-pages", 1), "row-remap"),
        (("retired-pages", 0, "row-remap", 1), "retired-pages"),
        (("retired-pages", 0, "xid-79", 3), "xid-79"),
        # A call past its deadline: NVML's as NVML that does not start, a GPU's as a lost GPU.
        (("gpu-lost", None, "nvml-unresponsive", None), "nvml-unresponsive"),
        (("nvml-unresponsive", None, "nvml-init", None), "nvml-init"),
        (("gpu-missing", 0, "gpu-unresponsive", 3), "gpu-unresponsive"),
        (("gpu-unresponsive", 0, "gpu-lost", 0), "gpu-lost"),
        (("gpu-unresponsive", 0, "gpu-lost", 1), "gpu-unresponsive"),
    ],
)
def test_retired_pages_and_unresponsive_calls_rank_where_the_design_puts_them(
    faults: tuple[str, int | None, str, int | None], first: str
) -> None:
    a, ai, b, bi = faults
    fs = (Fault(a, "d", gpu_index=ai), Fault(b, "d", gpu_index=bi))
    assert primary(fs) == primary(fs[::-1])
    chosen = primary(fs)
    assert chosen is not None and chosen.reason == first


def test_a_gpu_whose_call_hangs_is_gpu_unresponsive_until_its_reading_answers() -> None:
    hung = gpu(1, unresponsive="nvmlDeviceGetEccMode has not returned within 5 s")
    v = run(snap(gpu(0), hung), snap(gpu(0), hung), snap(gpu(0), gpu(1)))
    assert [(f.reason, f.detail, f.uuid) for f in v[0].faults] == [
        ("gpu-unresponsive", "nvmlDeviceGetEccMode has not returned within 5 s", "GPU-1")
    ]
    assert [reasons(x) for x in v] == [["gpu-unresponsive"], ["gpu-unresponsive"], []]


def test_an_unidentified_gpu_whose_call_hangs_is_unresponsive_and_never_also_unreadable() -> None:
    """Checks past --unreadable-after: the hung GPU stays gpu-unresponsive only, and the GPU listed after it
    is still judged (a lost one at once)."""
    s = Snapshot(
        gpus=(gpu(0),), unidentified=((1, "nvmlDeviceGetUUID:UNRESPONSIVE"), (2, "handle:GPU_IS_LOST"))
    )
    v = run(s, s, s, s)
    assert [(f.reason, f.gpu_index) for f in v[-1].node_faults] == [("gpu-unresponsive", 1), ("gpu-lost", 2)]
    assert v[-1].node_faults[0].detail == "nvmlDeviceGetUUID has not returned (GPU 1, not identified)"


def test_a_pass_with_a_call_in_flight_fixes_no_expected_count_and_makes_no_zero_gpu_fault() -> None:
    stuck = Snapshot(gpus=(gpu(0),), stuck_calls=("nvmlDeviceGetHandleByIndex(1)",))
    v = run(stuck, snap(gpu(0), gpu(1)))
    assert v[0].expected_gpus is None and v[0].healthy
    assert v[1].expected_gpus == 2 and v[1].healthy
    set_by_flag = evaluate(stuck, previous=None, settings=replace(DEFAULT, expected_gpus=2))
    assert set_by_flag.expected_gpus == 2
    assert [f.detail for f in set_by_flag.node_faults] == ["expected 2 GPUs, NVML reports 1"]
    nothing_yet = Snapshot(stuck_calls=("nvmlDeviceGetCount",))
    assert evaluate(nothing_yet, previous=None, settings=DEFAULT).node_faults == ()


def test_nvml_unresponsive_with_no_gpu_read_yet_is_that_fault_not_also_gpu_missing() -> None:
    s = Snapshot(unresponsive="nvmlDeviceGetCount has not returned within 10 s")
    v = evaluate(s, previous=None, settings=DEFAULT)
    assert [(f.reason, f.detail) for f in v.node_faults] == [
        ("nvml-unresponsive", "nvmlDeviceGetCount has not returned within 10 s")
    ]


def test_a_node_wide_query_that_fails_is_nvml_init_only_after_the_bounded_number_of_checks_in_a_row() -> None:
    settings = replace(DEFAULT, unreadable_after=2)
    failing = Snapshot(gpus=(gpu(0),), node_error="nvmlDeviceGetCount:UNKNOWN")
    v = run(failing, failing, snap(gpu(0)), failing, settings=settings)
    assert [x.node_error_since for x in v] == [0.0, 0.0, None, 9.0]
    assert [[f.detail for f in x.node_faults] for x in v] == [
        [],
        ["nvmlDeviceGetCount failed for 3.0 s, 2 checks at --interval 3 (UNKNOWN)"],
        [],
        [],
    ]
    assert [f.reason for f in v[1].node_faults] == ["nvml-init"]
    # Before any GPU was read, a failing count is no "NVML reports no GPUs" either.
    first = evaluate(Snapshot(node_error="nvmlDeviceGetCount:UNKNOWN"), previous=None, settings=settings)
    assert first.node_faults == ()


def test_an_unattributed_xid_stays_a_node_fault_while_nvml_does_not_start() -> None:
    v = run(snap(gpu(0), xids=(XidEvent(None, None, 79),)), snap(init_error="UNKNOWN"))
    assert [f.reason for f in v[-1].node_faults] == ["nvml-init", "xid-79"]
    assert v[-1].gpus[0].faults == ()


@pytest.mark.parametrize(
    ("case", "xid", "readings", "fatal"),
    [
        (
            "Xid 154 NVML could not attribute is the only word of the action",
            XidEvent(None, None, 154),
            (0, 0),
            True,
        ),
        ("Xid 154 on a GPU whose field cannot be read", XidEvent(1, "GPU-1", 154), (0, None), True),
        (
            "Xid 154 on a GPU whose field reads is what the field says",
            XidEvent(1, "GPU-1", 154),
            (None, 0),
            False,
        ),
        (
            "another ignored Xid on a GPU whose field cannot be read",
            XidEvent(1, "GPU-1", 13),
            (0, None),
            False,
        ),
    ],
)
def test_xid_154_is_a_fault_only_where_no_recovery_field_reads(
    case: str, xid: XidEvent, readings: tuple[int | None, int | None], fatal: bool
) -> None:
    gpus = (gpu(0, recovery_action=readings[0]), gpu(1, recovery_action=readings[1]))
    v = evaluate(snap(*gpus, xids=(xid,)), previous=None, settings=DEFAULT)
    assert (v.fatal_xids, v.ignored_xids) == (((xid,), ()) if fatal else ((), (xid,))), case
    assert reasons(v) == ([f"xid-{xid.code}"] if fatal else []), case


def test_an_unidentified_gpu_once_lost_stays_lost_when_it_answers_and_reset_required_does_not() -> None:
    lost = Snapshot(gpus=(gpu(0),), unidentified=((1, "handle:GPU_IS_LOST"),))
    v = run(lost, snap(gpu(0), gpu(1)))
    assert [(f.reason, f.uuid, f.gpu_index) for f in v[-1].node_faults] == [("gpu-lost", None, 1)]
    reset = Snapshot(gpus=(gpu(0),), unidentified=((1, "uuid:RESET_REQUIRED"),))
    v = run(reset, snap(gpu(0), gpu(1)))
    assert [reasons(x) for x in v] == [["reset-required"], []]


def test_no_gpu_at_all_short_of_the_expected_count_is_one_gpu_missing_fault_not_two() -> None:
    v = evaluate(snap(), previous=None, settings=replace(DEFAULT, expected_gpus=2))
    assert [(f.reason, f.detail) for f in v.node_faults] == [
        ("gpu-missing", "expected 2 GPUs, NVML reports 0")
    ]


@pytest.mark.parametrize(
    ("count", "text"), [(1, "1 uncorrected volatile ECC error "), (2, "2 uncorrected volatile ECC errors ")]
)
def test_the_ecc_faults_detail_counts_one_error_in_the_singular(count: int, text: str) -> None:
    v = evaluate(
        Snapshot(gpus=(GpuReading(index=0, uuid="GPU-0", ecc_uncorrected=count),)),
        previous=None,
        settings=PolicySettings(),
    )
    assert v.faults[0].message == f"ecc: {text}(GPU 0, GPU-0)"


def test_an_xid_from_the_kernel_log_while_nvml_is_down_is_a_sticky_fault_of_its_gpu() -> None:
    """NVML down, the kernel log still speaks: a fatal Xid of a known GPU is judged as ever and stays after
    NVML comes back (the driver does not repeat it)."""
    v = run(
        snap(*TWO),
        snap(init_error="UNKNOWN", xids=(XidEvent(1, "GPU-1", 79),)),
        snap(*TWO),
    )
    down, back = v[1], v[2]
    assert [f.reason for f in down.gpus[1].faults] == ["xid-79"] and down.gpus[0].faults == ()
    assert [f.reason for f in back.gpus[1].faults] == ["xid-79"] and back.gpus[0].faults == ()


def test_a_gpus_pcie_link_is_its_generation_and_width_when_both_are_read() -> None:
    v = evaluate(
        snap(
            gpu(0, signals=SignalReadings(pcie_gen=4, pcie_width=16)),
            gpu(1, signals=SignalReadings(pcie_gen=4)),
            gpu(2, signals=SignalReadings(pcie_width=8)),
            gpu(3),
        ),
        previous=None,
        settings=DEFAULT,
    )
    assert [g.pcie_link for g in v.gpus] == [(4, 16), None, None, None]
