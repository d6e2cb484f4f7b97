"""gpuguard.judge.explained: each reason as a person asks about it (the rule that fired and what clears it),
for every kind of reason the agent gives, and the catalog buckets an unhealthy Event names."""

from __future__ import annotations

from gpuguard.core.model import Fault
from gpuguard.core.signaltable import SIGNALS, Signal, SignalTable
from gpuguard.judge.explained import brief, clears, rule

# A table of two signals of its own: one counted over a window, one compared with its baseline.
TABLE = SignalTable(
    (
        Signal("errors", "degraded", 2.5, 60.0, measure="errors within the window", reading="nvmlRead"),
        Signal("width", "fault", 0.0, 0.0, reading="nvmlDeviceGetCurrPcieLinkWidth"),
    )
)


def test_an_xid_is_explained_by_its_catalog_bucket_and_whether_it_is_an_event_by_default() -> None:
    assert rule("xid-79", signals=SIGNALS, ecc_threshold=0) == {
        "rule": "xid",
        "code": 79,
        "bucket": "RESTART_BM",
        "catalog": "GPU has fallen off the bus",
        "event_by_default": False,
    }
    assert rule("xid-13", signals=SIGNALS, ecc_threshold=0)["event_by_default"] is True


def test_an_xid_the_catalog_gives_no_bucket_says_none_given() -> None:
    assert rule("xid-162", signals=SIGNALS, ecc_threshold=0)["bucket"] == "none given"


def test_an_sxid_is_a_fatal_nvswitch_rule_with_its_code() -> None:
    assert rule("sxid-12", signals=SIGNALS, ecc_threshold=0) == {
        "rule": "sxid",
        "code": 12,
        "severity": "Fatal (a Non-fatal SXid is an event)",
    }


def test_a_reason_that_only_looks_like_an_xid_is_its_own_rule() -> None:
    """No digits after the prefix, or no prefix at all: not an Xid (and nothing raises)."""
    assert rule("xid-abc", signals=SIGNALS, ecc_threshold=0) == {"rule": "xid-abc"}
    assert rule("79", signals=SIGNALS, ecc_threshold=0) == {"rule": "79"}
    assert rule("sxid-", signals=SIGNALS, ecc_threshold=0) == {"rule": "sxid-"}


def test_ecc_is_explained_by_the_threshold_in_force() -> None:
    assert rule("ecc", signals=SIGNALS, ecc_threshold=3) == {
        "rule": "ecc",
        "threshold": 3,
        "measure": "volatile uncorrected ECC errors",
    }


def test_a_recovery_action_is_explained_by_the_action_the_driver_asked_for() -> None:
    assert rule("recovery-gpu-reset", signals=SIGNALS, ecc_threshold=0) == {
        "rule": "recovery-action",
        "action": "gpu-reset",
    }


def test_a_signal_is_explained_by_its_level_threshold_window_and_measure() -> None:
    assert rule("errors", signals=TABLE, ecc_threshold=0) == {
        "rule": "signal",
        "signal": "errors",
        "level": "degraded",
        "threshold": 2.5,
        "window_s": 60.0,
        "measure": "errors within the window",
    }


def test_a_signal_without_a_measure_is_explained_by_what_it_reads() -> None:
    assert rule("width", signals=TABLE, ecc_threshold=0)["measure"] == "nvmlDeviceGetCurrPcieLinkWidth"


def test_a_reason_of_no_rule_is_named_alone() -> None:
    assert rule("nvlink-errors", signals=TABLE, ecc_threshold=0) == {"rule": "nvlink-errors"}


def test_the_events_brief_names_each_xid_the_message_names_once_with_its_bucket() -> None:
    xid79 = Fault("xid-79", "GPU has fallen off the bus", uuid="GPU-a", gpu_index=0)
    xid79b = Fault("xid-79", "GPU has fallen off the bus (again)", uuid="GPU-b", gpu_index=1)
    xid162 = Fault("xid-162", "x", uuid="GPU-c", gpu_index=2)
    ecc = Fault("ecc", "3 errors", uuid="GPU-a", gpu_index=0)
    message = f"{xid79.message}; {xid79b.message}; {xid162.message}; {ecc.message}"
    assert brief((xid79, xid79b, xid162, ecc), message) == (
        "xid-79: Xid catalog bucket RESTART_BM; xid-162: Xid catalog bucket none given"
    )


def test_the_events_brief_leaves_out_an_xid_the_message_does_not_name() -> None:
    xid79 = Fault("xid-79", "GPU has fallen off the bus", uuid="GPU-a", gpu_index=0)
    xid48 = Fault("xid-48", "DBE", uuid="GPU-b", gpu_index=1)
    assert brief((xid79, xid48), xid48.message) == "xid-48: Xid catalog bucket WORKFLOW_XID_48"
    assert brief((xid79,), "ecc: 3 errors") == ""
    assert brief((), "") == ""


def test_an_xid_or_sxid_clears_only_with_a_reboot_or_the_reset_its_recovery_action_asked_for() -> None:
    for reason in ("xid-79", "sxid-12"):
        assert clears(reason, signals=SIGNALS) == (
            "sticky for this boot: a reboot (a new boot ID) clears it; a GPU reset clears it where the "
            "driver's recovery action asked for one"
        )


def test_a_recovery_action_clears_when_the_driver_asks_for_none() -> None:
    assert clears("recovery-gpu-reset", signals=SIGNALS) == (
        "the driver's recovery action back to none (after the reset or reboot it asks for)"
    )


def test_a_fault_of_the_agents_own_clears_as_its_table_says() -> None:
    assert clears("gpu-lost", signals=SIGNALS) == "sticky for this boot: a reboot (a new boot ID) clears it"
    assert clears("row-remap", signals=SIGNALS).endswith("; a failed row remap is a repair (RMA) case")
    # Also a signal's name: the agent's own sentence wins.
    assert clears("retired-pages", signals=SIGNALS) == (
        "a reboot with the pages retired, or a repair (RMA) past the limit"
    )


def test_a_windowed_signal_clears_after_a_whole_window_within_its_threshold() -> None:
    assert clears("errors", signals=TABLE) == "the reading back within 2.5 over a whole window of 60 s"


def test_a_signal_without_a_window_clears_when_the_reading_is_back() -> None:
    assert clears("width", signals=TABLE) == (
        "the reading back to what it should be (its baseline or the product's expected value)"
    )


def test_a_reason_of_no_rule_points_to_the_design_doc() -> None:
    assert clears("nvlink-errors", signals=TABLE) == "see docs/design.md for this reason"
