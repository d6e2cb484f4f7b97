"""The clock signals' windows fitted to --interval (gpuguard.judge.cadence), and the judge over them."""

from __future__ import annotations

from dataclasses import replace

from gpuguard.core.config import PolicySettings
from gpuguard.core.model import GpuReading, SignalReadings, Snapshot, Verdict
from gpuguard.core.signaltable import SIGNALS
from gpuguard.judge.cadence import fitted, sighted
from gpuguard.judge.policy import evaluate


def storm(settings: PolicySettings, interval: float, checks: int) -> list[bool]:
    """A power brake read at every check: whether the signal is degraded after each."""
    v: Verdict | None = None
    out = []
    for i in range(checks):
        g = GpuReading(index=0, uuid="GPU-0", signals=SignalReadings(clock_events=0x80))
        at = Snapshot(gpus=(g,), taken_at=i * interval)
        v = evaluate(at, previous=v, settings=replace(settings, interval=interval))
        out.append(any(f.reason == "clock-power-brake" for f in v.degraded))
    return out


def test_a_power_brake_storm_at_interval_60_is_never_seen_with_the_shipped_window() -> None:
    """The defect: 5 checks within 300 s at most, never more than the threshold of 5."""
    assert not any(storm(PolicySettings(), 60, 30))


def test_at_interval_60_the_clock_windows_widen_to_hold_six_checks_and_the_storm_is_seen() -> None:
    table, widened = fitted(SIGNALS, 60)
    assert widened == {"clock-hw-slowdown": 360, "clock-hw-thermal": 360, "clock-power-brake": 360}
    assert table["clock-power-brake"].window_s == 360 and table["clock-power-brake"].threshold == 5
    assert storm(PolicySettings(signals=table), 60, 8) == [False] * 5 + [True] * 3


def test_a_window_that_holds_enough_checks_and_an_ignored_signal_are_left_as_they_are() -> None:
    assert fitted(SIGNALS, 3) == (SIGNALS, {})
    assert fitted(SIGNALS, 50)[1] == {}  # 6 checks within 300 s
    off = SIGNALS.changed("clock-hw-thermal", {"level": "ignore"}, where="t")
    table, widened = fitted(off, 120)
    assert "clock-hw-thermal" not in widened and table["clock-hw-thermal"].window_s == 300
    assert widened["clock-hw-slowdown"] == 720


def test_a_sub_interval_hw_slowdown_read_by_seven_event_checks_counts_once_and_degrades_nothing() -> None:
    """Xids wake 7 checks within 0.6 s while the HW slowdown bit is set for that moment: polling at
    --interval 3 would have read it once at most, so it counts once, not "7 checks within 300 s"."""
    v: Verdict | None = None
    for i in range(7):
        g = GpuReading(index=0, uuid="GPU-0", signals=SignalReadings(clock_events=0x08))
        v = evaluate(Snapshot(gpus=(g,), taken_at=0.1 * i), previous=v, settings=PolicySettings())
        assert v.degraded == (), i
    assert v is not None and len(v.signal_memory.clock_samples[0][1]) == 1


def test_event_checks_between_polls_add_no_sighting_to_a_storm_polling_sees() -> None:
    """A power brake read at every poll and at three Xid-driven checks after each: the polls' count."""
    v: Verdict | None = None
    seen = []
    for poll in range(8):
        for extra in (0.0, 0.2, 0.9, 2.5):
            g = GpuReading(index=0, uuid="GPU-0", signals=SignalReadings(clock_events=0x80))
            v = evaluate(
                Snapshot(gpus=(g,), taken_at=poll * 3 + extra), previous=v, settings=PolicySettings()
            )
        seen.append(v is not None and any(f.reason == "clock-power-brake" for f in v.degraded))
    assert seen == [False] * 5 + [True] * 3  # more than 5 sightings within 300 s: the sixth poll's
    assert v is not None and "in 8 checks at --interval 3 within 300 s" in v.degraded[0].detail


def test_a_check_within_a_sighting_adds_its_events_and_one_an_interval_later_less_1_us_begins_the_next() -> (
    None
):
    assert sighted((), 0.0, 1, 3.0) == ((0.0, 1),)
    assert sighted(((0.0, 1),), 1.0, 2, 3.0) == ((0.0, 3),)
    assert sighted(((0.0, 1),), 3.0 - 1e-6, 2, 3.0) == ((0.0, 1), (3.0 - 1e-6, 2))


def test_an_ignored_first_clock_signal_still_leaves_the_others_widened() -> None:
    table = SIGNALS.changed("clock-hw-slowdown", {"level": "ignore"}, where="test")
    assert fitted(table, 60)[1] == {"clock-hw-thermal": 360, "clock-power-brake": 360}
