"""Issue 29's signals through the policy, table-driven: for every signal clean, its default level, not
applicable (NOT_SUPPORTED reads None), a transient error (the last judgement stands) and recovery; then the
node-wide cases the issue names."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from gpuguard.core.config import PolicySettings
from gpuguard.core.model import GpuReading, SignalReadings, Snapshot, Verdict
from gpuguard.core.signaltable import SIGNALS, SignalTable
from gpuguard.judge.policy import cleared_without_reboot, evaluate
from gpuguard.judge.signals import SOURCES

DEFAULT = PolicySettings()
LINKS = frozenset(range(18))


@dataclass(frozen=True)
class Step:
    t: float
    values: dict[str, object]


def reading(values: dict[str, object], *, index: int = 0, errors: tuple[str, ...] = ()) -> GpuReading:
    gpu_keys = {"retired_pages", "retired_pending", "remap_pending"}
    signal_values = {k: v for k, v in values.items() if k not in gpu_keys}
    gpu_values = {k: v for k, v in values.items() if k in gpu_keys}
    g = GpuReading(index=index, uuid=f"GPU-{index}", signals=SignalReadings(**signal_values))  # type: ignore[arg-type]
    return replace(g, transient_errors=errors, **gpu_values)  # type: ignore[arg-type]


def run(steps: list[Step], settings: PolicySettings = DEFAULT, gpus: int = 1) -> list[Verdict]:
    verdicts: list[Verdict] = []
    prev: Verdict | None = None
    for step in steps:
        snap = Snapshot(gpus=tuple(reading(step.values, index=i) for i in range(gpus)), taken_at=step.t)
        prev = evaluate(snap, previous=prev, settings=settings)
        verdicts.append(prev)
    return verdicts


def found(v: Verdict, name: str) -> str:
    """'fault', 'degraded' or '' for the signal in this verdict."""
    if any(f.reason == name for f in v.faults):
        return "fault"
    if any(f.reason == name for f in v.degraded):
        return "degraded"
    return ""


# Per signal: the clean reading, the steps that make it trip (after a clean first reading at t=0), and the
# reading it recovers with (at t=1000, past every window).
CASES: dict[str, tuple[dict[str, object], list[Step], dict[str, object]]] = {
    "fabric-incomplete": (
        {"fabric_state": 3},
        [Step(10, {"fabric_state": 2}), Step(400, {"fabric_state": 2})],
        {"fabric_state": 3},
    ),
    "fabric-status": (
        {"fabric_state": 3, "fabric_status": "SUCCESS"},
        [Step(10, {"fabric_state": 3, "fabric_status": "UNKNOWN"})],
        {"fabric_state": 3, "fabric_status": "SUCCESS"},
    ),
    "fabric-degraded": (
        {"fabric_state": 3, "fabric_health": 0xAA},
        [Step(10, {"fabric_state": 3, "fabric_health": 0xA9})],
        {"fabric_state": 3, "fabric_health": 0xAA},
    ),
    "nvlink-down": (
        {"nvlink_active": LINKS},
        [Step(10, {"nvlink_active": LINKS - {3}})],
        {"nvlink_active": LINKS},
    ),
    "nvlink-errors": (
        {"nvlink_errors": 0},
        [Step(10, {"nvlink_errors": 6001})],
        {"nvlink_errors": 6001},
    ),
    "pcie-width": ({"pcie_width": 16}, [Step(10, {"pcie_width": 8})], {"pcie_width": 16}),
    "pcie-replays": ({"pcie_replays": 5}, [Step(10, {"pcie_replays": 14})], {"pcie_replays": 14}),
    "clock-hw-slowdown": (
        {"clock_events": 0},
        [Step(t, {"clock_events": 0x08}) for t in range(3, 21, 3)],
        {"clock_events": 0},
    ),
    "clock-hw-thermal": (
        {"clock_events": 0x01},
        [Step(t, {"clock_events": 0x41}) for t in range(3, 21, 3)],
        {"clock_events": 0x01},
    ),
    "clock-power-brake": (
        {"clock_events": 0},
        [Step(t, {"clock_events": 0x80}) for t in range(3, 21, 3)],
        {"clock_events": 0},
    ),
    "retired-pages": ({"retired_pages": 2}, [Step(10, {"retired_pages": 63})], {"retired_pages": 0}),
    "retired-pending": (
        {"retired_pending": False},
        [Step(10, {"retired_pending": True})],
        {"retired_pending": False},
    ),
    "row-remap-pending": (
        {"remap_pending": False},
        [Step(10, {"remap_pending": True})],
        {"remap_pending": False},
    ),
    "inforom-invalid": (
        {"inforom_valid": True},
        [Step(10, {"inforom_valid": False})],
        {"inforom_valid": True},
    ),
    "pcie-width-max": (
        {"pcie_width": 16, "pcie_max_width": 16},
        [Step(10, {"pcie_width": 8, "pcie_max_width": 16})],
        {"pcie_width": 16, "pcie_max_width": 16},
    ),
    "pcie-gen": ({"pcie_gen": 5}, [Step(10, {"pcie_gen": 3})], {"pcie_gen": 5}),
}
# Signals the shipped table ignores: judged once a config gives them a level.
IGNORED = {"pcie-width-max", "pcie-gen"}


def settings_for(name: str) -> tuple[PolicySettings, str]:
    level = SIGNALS.level(name)
    if name in IGNORED:
        table = SIGNALS.changed(name, {"level": "degraded"}, where="test")
        return PolicySettings(signals=table), "degraded"
    return DEFAULT, level


def test_every_gpu_signal_of_the_table_has_a_case_here() -> None:
    assert set(CASES) == set(SIGNALS.names()) - {"gpu-missing"}
    assert set(SOURCES) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_clean_signal_is_neither_fault_nor_degraded(name: str) -> None:
    clean, _, _ = CASES[name]
    settings, _ = settings_for(name)
    v = run([Step(t, clean) for t in (0, 10, 400, 1000)], settings)
    assert [found(x, name) for x in v] == ["", "", "", ""]
    assert v[-1].healthy and not v[-1].degraded


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_tripped_signal_takes_its_level_and_recovers_with_a_clean_reading(name: str) -> None:
    clean, bad, recovered = CASES[name]
    settings, level = settings_for(name)
    v = run([Step(0, clean), *bad, Step(1000, recovered)], settings)
    assert found(v[-2], name) == level, v[-2]
    assert found(v[-1], name) == "", v[-1]
    tripped = next(f for f in v[-2].faults + v[-2].degraded if f.reason == name)
    assert tripped.uuid == "GPU-0" and tripped.detail.endswith("(GPU 0, GPU-0)")
    assert cleared_without_reboot(tripped.key)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_signal_the_table_ignores_is_never_judged(name: str) -> None:
    clean, bad, _ = CASES[name]
    settings = PolicySettings(signals=SIGNALS.changed(name, {"level": "ignore"}, where="test"))
    v = run([Step(0, clean), *bad], settings)
    assert found(v[-1], name) == ""


@pytest.mark.parametrize("name", sorted(CASES))
def test_not_supported_reads_none_and_is_never_a_fault(name: str) -> None:
    settings, _ = settings_for(name)
    v = run([Step(t, {}) for t in (0, 10, 400, 1000)], settings)
    assert all(found(x, name) == "" for x in v)
    assert v[-1].healthy and not v[-1].degraded


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_transient_error_keeps_the_last_judgement_never_a_fault_never_a_clear(name: str) -> None:
    clean, bad, _ = CASES[name]
    settings, level = settings_for(name)
    error = (f"{SOURCES[name]}:UNKNOWN",)
    prev = None
    verdicts = []
    steps = [Step(0, clean), Step(5, clean), *bad]
    for i, step in enumerate(steps):
        # A failed read between the clean start and the trip: no fault from it.
        failing = i == 1
        g = reading({} if failing else step.values, errors=error if failing else ())
        prev = evaluate(Snapshot(gpus=(g,), taken_at=step.t), previous=prev, settings=settings)
        verdicts.append(prev)
    assert found(verdicts[1], name) == ""
    assert found(verdicts[-1], name) == level
    # Tripped, then a failed read: still tripped (not cleared by a reading that did not happen).
    g = reading({}, errors=error)
    after = evaluate(Snapshot(gpus=(g,), taken_at=1000), previous=prev, settings=settings)
    assert found(after, name) == level


def test_a_fabric_that_never_completes_on_an_8_gpu_node_is_a_fault_of_every_gpu_after_the_grace() -> None:
    v = run([Step(t, {"fabric_state": 2}) for t in (0, 100, 299, 300, 3000)], gpus=8)
    assert [len([f for f in x.faults if f.reason == "fabric-incomplete"]) for x in v] == [0, 0, 0, 8, 8]
    assert not v[-1].healthy
    assert "IN_PROGRESS 3000 s after" in v[-1].faults[0].detail


def test_one_nvlink_down_degrades_that_gpu_only() -> None:
    prev = None
    for t, down in ((0, frozenset()), (3, frozenset({7}))):
        gpus = (
            reading({"nvlink_active": LINKS}, index=0),
            reading({"nvlink_active": LINKS - down}, index=1),
        )
        prev = evaluate(Snapshot(gpus=gpus, taken_at=t), previous=prev, settings=DEFAULT)
    assert prev is not None and prev.healthy
    assert [(f.reason, f.uuid) for f in prev.degraded] == [("nvlink-down", "GPU-1")]
    assert (
        prev.gpus[1].degraded[0].detail
        == "NVLink link 7 inactive, of 18 active at the best reading (GPU 1, GPU-1)"
    )


def test_a_power_brake_storm_degrades_and_then_clears_once_its_window_passes() -> None:
    storm = [Step(t, {"clock_events": 0x80}) for t in range(0, 30, 3)]
    calm = [Step(t, {"clock_events": 0}) for t in range(30, 400, 3)]
    v = run(storm + calm)
    levels = [found(x, "clock-power-brake") for x in v]
    assert levels[:6] == [""] * 5 + ["degraded"]  # the sixth sample in 300 s is more than 5
    first_clear = levels.index("", 6)
    assert all(x == "degraded" for x in levels[5:first_clear])
    assert all(x == "" for x in levels[first_clear:])
    # It clears when no more than 5 storm samples are left in the last 300 s: (12, 312] holds t=15..27.
    assert (storm + calm)[first_clear].t == 312
    assert v[-1].signal_memory.clock_samples == ()


def test_a_gpu_on_the_pci_bus_but_absent_from_nvml_is_gpu_missing_at_the_first_check() -> None:
    snap = Snapshot(gpus=(reading({}),), bus_only=("00000000:3B:00.0",), taken_at=0)
    v = evaluate(snap, previous=None, settings=DEFAULT)
    assert [(f.reason, f.uuid) for f in v.node_faults] == [("gpu-missing", None)]
    assert "PCI 00000000:3B:00.0 is on the PCI bus but absent from NVML" in v.node_faults[0].detail
    degraded = PolicySettings(signals=SIGNALS.changed("gpu-missing", {"level": "degraded"}, where="t"))
    v = evaluate(snap, previous=None, settings=degraded)
    assert v.healthy and [f.reason for f in v.node_degraded] == ["gpu-missing"]


def test_a_counter_that_goes_down_starts_again_rather_than_counting_negative() -> None:
    v = run([Step(0, {"pcie_replays": 100}), Step(3, {"pcie_replays": 2}), Step(6, {"pcie_replays": 9})])
    assert [found(x, "pcie-replays") for x in v] == ["", "", ""]


def test_a_counter_rate_counts_within_its_window_not_since_the_start() -> None:
    # 5 replays a minute for 3 minutes: 15 in all, never more than 8 in 60 s.
    v = run([Step(t, {"pcie_replays": t // 12}) for t in range(0, 181, 3)])
    assert all(found(x, "pcie-replays") == "" for x in v)


def test_a_steady_node_keeps_one_signal_memory_object() -> None:
    v = run([Step(t, CASES["nvlink-down"][0] | {"pcie_replays": 4, "pcie_width": 16}) for t in (0, 3, 6)])
    assert v[1].signal_memory is v[2].signal_memory


def test_a_level_and_a_threshold_from_the_table_apply() -> None:
    table: SignalTable = SIGNALS.changed("nvlink-down", {"level": "fault", "threshold": 1}, where="t")
    settings = PolicySettings(signals=table)
    one = run([Step(0, {"nvlink_active": LINKS}), Step(3, {"nvlink_active": LINKS - {1}})], settings)
    two = run([Step(0, {"nvlink_active": LINKS}), Step(3, {"nvlink_active": LINKS - {1, 2}})], settings)
    assert found(one[-1], "nvlink-down") == "" and found(two[-1], "nvlink-down") == "fault"


def test_the_fabrics_grace_runs_from_the_hosts_boot_where_it_is_known() -> None:
    """An agent started on a node whose fabric has been down since boot (or `check`) does not wait out
    another grace; on a node that just booted the grace still runs."""
    incomplete = reading({"fabric_state": 1})
    late = evaluate(Snapshot(gpus=(incomplete,), taken_at=5000, booted_at=0), previous=None, settings=DEFAULT)
    assert [f.reason for f in late.faults] == ["fabric-incomplete"]
    assert "NOT_STARTED 5000 s after the host booted (grace 300 s)" in late.faults[0].detail
    fresh = [Snapshot(gpus=(incomplete,), taken_at=t, booted_at=4950) for t in (5000, 5200, 5250)]
    v = None
    seen = []
    for snap in fresh:
        v = evaluate(snap, previous=v, settings=DEFAULT)
        seen.append(found(v, "fabric-incomplete"))
    assert seen == ["", "", "fault"]


def test_an_unresponsive_gpus_last_values_are_no_reading_a_storm_is_not_counted_on_stale_samples() -> None:
    """A GPU whose call hangs reports its last values: they are not samples of now (a power brake read
    before the hang would otherwise count as a storm), and the last judgement stands."""
    braking = replace(
        reading({"clock_events": 0x80}), unresponsive="nvmlDeviceGetTotalEccErrors has not returned"
    )
    v = evaluate(
        Snapshot(gpus=(reading({"clock_events": 0x80}),), taken_at=0), previous=None, settings=DEFAULT
    )
    for t in range(3, 60, 3):
        v = evaluate(Snapshot(gpus=(braking,), taken_at=t), previous=v, settings=DEFAULT)
    assert found(v, "clock-power-brake") == ""
    assert len(v.signal_memory.clock_samples[0][1]) == 1


def test_a_fabric_incomplete_after_a_completed_reading_gets_its_grace_from_then_not_from_boot() -> None:
    """A GPU reset (the remedy of reset-required) or a Fabric Manager restart re-registers a GPU long after
    boot: its fabric reads IN_PROGRESS for a while. Counted from the boot it would be a fault at once."""
    v = None
    seen = []
    for t, state in ((5000, 3), (5003, 2), (5200, 2), (5310, 2)):
        snap = Snapshot(gpus=(reading({"fabric_state": state}),), taken_at=t, booted_at=0)
        v = evaluate(snap, previous=v, settings=DEFAULT)
        seen.append(found(v, "fabric-incomplete"))
    assert seen == ["", "", "", "fault"]
    assert v is not None and "IN_PROGRESS 307 s after it was first read so" in v.faults[0].detail


def test_a_fabric_in_progress_most_of_the_time_in_stints_shorter_than_the_grace_is_a_fault() -> None:
    """A probe IN_PROGRESS 90% of the time, each stint 27 s and each COMPLETED 3 s: every COMPLETED read
    restarted the grace, so it never faulted. The time incomplete now adds up across the flaps until the
    fabric stays COMPLETED a whole grace (300 s): a fault once 300 s of it were incomplete."""
    v = evaluate(
        Snapshot(gpus=(reading({"fabric_state": 3}),), taken_at=5000, booted_at=0),
        previous=None,
        settings=DEFAULT,
    )
    seen = []  # at the last IN_PROGRESS read of each 30 s cycle
    for k in range(14):
        for t in range(0, 30, 3):
            state = 3 if t == 27 else 2
            snap = Snapshot(gpus=(reading({"fabric_state": state}),), taken_at=5003 + 30 * k + t, booted_at=0)
            v = evaluate(snap, previous=v, settings=DEFAULT)
            if t == 24:
                seen.append(found(v, "fabric-incomplete"))
    assert seen[:10] == [""] * 10 and seen[11:] == ["fault"] * 3
    snap = Snapshot(gpus=(reading({"fabric_state": 2}),), taken_at=5003 + 30 * 14, booted_at=0)
    v = evaluate(snap, previous=v, settings=DEFAULT)
    assert "incomplete across flaps" in v.faults[0].detail


def test_a_fabric_completed_for_a_whole_grace_starts_afresh() -> None:
    v = None
    for t, state in ((5000, 3), (5003, 2), (5200, 3), (5510, 3), (5513, 2), (5700, 2)):
        v = evaluate(
            Snapshot(gpus=(reading({"fabric_state": state}),), taken_at=t, booted_at=0),
            previous=v,
            settings=DEFAULT,
        )
    assert v is not None and found(v, "fabric-incomplete") == ""  # 187 s into a fresh grace


def test_a_baseline_taken_while_degraded_is_raised_by_a_better_reading_so_a_later_drop_is_seen() -> None:
    """An agent that first reads a GPU while its link is narrow (a fresh install on a broken node) or while
    the fabric still trains its NVLinks must not take that as the GPU's good state for ever."""
    width = run([Step(0, {"pcie_width": 8}), Step(30, {"pcie_width": 16}), Step(60, {"pcie_width": 8})])
    assert [found(x, "pcie-width") for x in width] == ["", "", "degraded"]
    assert "x8, x16 at the best reading" in width[-1].degraded[0].detail
    half = LINKS - {3, 4}
    links = run([Step(t, {"nvlink_active": a}) for t, a in ((0, half), (30, LINKS), (60, half))])
    assert [found(x, "nvlink-down") for x in links] == ["", "", "degraded"]
    assert "links 3, 4 inactive, of 18 active" in links[-1].degraded[0].detail


def test_a_lost_gpus_windows_are_dropped_so_time_stops_being_pending_its_baselines_stay() -> None:
    """A GPU lost mid-storm (or with a fabric grace running) is never judged again: windows kept for it
    would keep `pending` true for ever, and the agent would judge every check of a steady node again."""
    busy: dict[str, object] = {"clock_events": 0x80, "fabric_state": 2, "pcie_width": 16, "pcie_replays": 0}
    v = None
    for t, values in ((0, busy), (3, busy | {"pcie_replays": 4})):
        v = evaluate(Snapshot(gpus=(reading(values),), taken_at=t), previous=v, settings=DEFAULT)
    assert v is not None and v.signal_memory.pending
    lost = replace(reading(busy), lost=True)
    for t in (6, 400, 403):
        v = evaluate(Snapshot(gpus=(lost,), taken_at=t), previous=v, settings=DEFAULT)
    assert not v.signal_memory.pending
    assert v.signal_memory.first_width == (("GPU-0", 16),)


# The read whose failure freezes each signal (the backend's prefix in GpuReading.transient_errors).
SOURCE_OF = {
    "fabric-incomplete": "fabric",
    "fabric-status": "fabric",
    "fabric-degraded": "fabric",
    "nvlink-down": "nvlink",
    "nvlink-errors": "fields",
    "pcie-replays": "fields",
    "pcie-width": "pcie",
    "pcie-width-max": "pcie",
    "pcie-gen": "pcie",
    "clock-hw-slowdown": "clocks",
    "clock-hw-thermal": "clocks",
    "clock-power-brake": "clocks",
    "retired-pages": "retired",
    "retired-pending": "retired",
    "row-remap-pending": "remap",
    "inforom-invalid": "inforom",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_failed_read_freezes_the_signals_it_feeds_and_no_other(name: str) -> None:
    clean, bad, recovered = CASES[name]
    settings, level = settings_for(name)
    prev = run([Step(0, clean), *bad], settings)[-1]
    assert found(prev, name) == level
    own = (f"{SOURCE_OF[name]}:UNKNOWN",)
    other = tuple(f"{s}:UNKNOWN" for s in sorted(set(SOURCE_OF.values()) - {SOURCE_OF[name]}))
    frozen = evaluate(
        Snapshot(gpus=(reading({}, errors=own),), taken_at=1000), previous=prev, settings=settings
    )
    assert found(frozen, name) == level
    fresh = reading(recovered, errors=other)
    cleared = evaluate(Snapshot(gpus=(fresh,), taken_at=1000), previous=prev, settings=settings)
    assert found(cleared, name) == ""


@pytest.mark.parametrize(
    ("name", "values", "tripped"),
    [
        ("pcie-replays", [0, 6, 14], False),  # 8 since the sample at the window's start (t=10), not 14
        ("pcie-replays", [0, 0, 8], False),  # exactly the threshold
        ("pcie-replays", [0, 0, 9], True),
        ("nvlink-errors", [0, 0, 6000], False),
    ],
)
def test_a_counter_counts_from_the_sample_at_the_windows_start_and_trips_past_its_threshold(
    name: str, values: list[int], tripped: bool
) -> None:
    field = "pcie_replays" if name == "pcie-replays" else "nvlink_errors"
    v = run([Step(t, {field: n}) for t, n in zip((0, 10, 70), values, strict=True)])
    assert (found(v[-1], name) != "") is tripped


def test_a_lost_gpu_listed_first_leaves_the_next_judged() -> None:
    lost = replace(reading({}, index=0), lost=True)
    narrow = reading({"pcie_width": 8}, index=1)
    prev = evaluate(
        Snapshot(gpus=(lost, reading({"pcie_width": 16}, index=1))), previous=None, settings=DEFAULT
    )
    v = evaluate(Snapshot(gpus=(lost, narrow), taken_at=3), previous=prev, settings=DEFAULT)
    assert [f.uuid for f in v.degraded if f.reason == "pcie-width"] == ["GPU-1"]


def test_gpus_on_the_bus_beyond_those_nvml_lost_are_missing_and_named() -> None:
    two = Snapshot(gpus=(reading({}, index=0), reading({}, index=1)))
    prev = evaluate(two, previous=None, settings=DEFAULT)
    one_lost = Snapshot(gpus=(reading({}, index=0),), bus_only=("0000:19:00.0",), taken_at=3)
    assert evaluate(one_lost, previous=prev, settings=DEFAULT).node_faults == ()  # gpu-missing of its own
    more = Snapshot(gpus=(reading({}, index=0),), bus_only=("0000:19:00.0", "0000:1a:00.0"), taken_at=3)
    (fault,) = evaluate(more, previous=prev, settings=DEFAULT).node_faults
    assert fault.reason == "gpu-missing"
    assert fault.detail.startswith("2 NVIDIA GPUs at PCI 0000:19:00.0, 0000:1a:00.0 are on the PCI bus")
    three = Snapshot(gpus=tuple(reading({}, index=i) for i in range(3)))
    two_lost = replace(more, taken_at=3)
    assert (
        evaluate(
            two_lost, previous=evaluate(three, previous=None, settings=DEFAULT), settings=DEFAULT
        ).node_faults
        == ()
    )


def test_a_fabric_that_completes_for_a_whole_grace_and_falls_back_gets_a_whole_grace_again() -> None:
    v = run([Step(t, {"fabric_state": s}) for t, s in ((0, 2), (100, 3), (450, 2), (700, 2), (800, 2))])
    assert [found(x, "fabric-incomplete") for x in v] == ["", "", "", "", "fault"]


def test_a_fabric_that_completes_for_less_than_a_grace_keeps_the_time_it_was_incomplete() -> None:
    """100 s IN_PROGRESS, 100 s COMPLETED, then IN_PROGRESS again: 350 s of the 450 incomplete by t=450."""
    v = run([Step(t, {"fabric_state": s}) for t, s in ((0, 2), (100, 3), (200, 2), (450, 2), (500, 2))])
    assert [found(x, "fabric-incomplete") for x in v] == ["", "", "", "fault", "fault"]


def test_nvlink_read_as_none_after_a_good_reading_is_no_reading() -> None:
    v = run([Step(0, {"nvlink_active": LINKS}), Step(3, {}), Step(6, {"nvlink_active": LINKS})])
    assert [found(x, "nvlink-down") for x in v] == ["", "", ""]


def test_a_reading_that_raises_the_nvlink_baseline_still_shows_a_link_down() -> None:
    v = run(
        [
            Step(0, {"nvlink_active": frozenset({0, 1, 2, 3})}),
            Step(3, {"nvlink_active": frozenset({0, 1, 2, 4})}),
        ]
    )
    assert found(v[-1], "nvlink-down") == "degraded"
    assert "link 3 inactive, of 5 active" in next(
        f.detail for f in v[-1].degraded if f.reason == "nvlink-down"
    )


@pytest.mark.parametrize(
    ("name", "threshold", "first", "now", "tripped"),
    [
        ("pcie-width", 4, {"pcie_width": 16}, {"pcie_width": 12}, False),
        ("pcie-width", 4, {"pcie_width": 16}, {"pcie_width": 8}, True),
        (
            "pcie-width-max",
            4,
            {"pcie_width": 12, "pcie_max_width": 16},
            {"pcie_width": 12, "pcie_max_width": 16},
            False,
        ),
        (
            "pcie-width-max",
            4,
            {"pcie_width": 8, "pcie_max_width": 16},
            {"pcie_width": 8, "pcie_max_width": 16},
            True,
        ),
        ("pcie-gen", 2, {"pcie_gen": 5}, {"pcie_gen": 3}, False),
        ("pcie-gen", 2, {"pcie_gen": 5}, {"pcie_gen": 2}, True),
    ],
)
def test_a_width_or_generation_threshold_tolerates_that_much_below_its_reference(
    name: str, threshold: int, first: dict[str, object], now: dict[str, object], tripped: bool
) -> None:
    table = SIGNALS.changed(name, {"level": "degraded", "threshold": threshold}, where="test")
    v = run([Step(0, first), Step(3, now)], PolicySettings(signals=table))
    assert (found(v[-1], name) != "") is tripped


def test_retired_pages_with_a_threshold_of_0_trip_at_the_first_page() -> None:
    table = SIGNALS.changed("retired-pages", {"threshold": 0}, where="test")
    v = run([Step(0, {"retired_pages": 0}), Step(3, {"retired_pages": 1})], PolicySettings(signals=table))
    assert [found(x, "retired-pages") for x in v] == ["", "fault"]


@pytest.mark.parametrize(
    ("events", "name", "detail"),
    [
        (0x37 | 0x08, "clock-hw-slowdown", "HW slowdown in 6 checks at --interval 3 within 300 s (limit 5)"),
        (
            0x37 | 0x40,
            "clock-hw-thermal",
            "HW thermal slowdown in 6 checks at --interval 3 within 300 s (limit 5)",
        ),
        (
            0x37 | 0x80,
            "clock-power-brake",
            "HW power brake slowdown in 6 checks at --interval 3 within 300 s (limit 5)",
        ),
    ],
)
def test_each_clock_bit_trips_its_own_signal_alone_whatever_other_bits_read(
    events: int, name: str, detail: str
) -> None:
    v = run([Step(t, {"clock_events": events}) for t in range(3, 21, 3)])[-1]
    tripped = [f for f in v.degraded if f.reason.startswith("clock-")]
    assert [(f.reason, f.detail) for f in tripped] == [(name, f"{detail} (GPU 0, GPU-0)")]


def test_the_fabric_health_mask_names_each_condition_it_reads() -> None:
    v = run([Step(0, {"fabric_state": 3, "fabric_health": 0x55})])[-1]
    (fault,) = [f for f in v.faults + v.degraded if f.reason == "fabric-degraded"]
    assert fault.detail.startswith(
        "the GPU fabric health mask reads degraded bandwidth, route recovery, route unhealthy, access timeout"
    )


def test_the_clock_samples_are_kept_for_the_longest_clock_window_and_each_counts_only_its_own() -> None:
    """Slowdown judged over 600 s, the power brake over 300 s: both read every 60 s."""
    table = SIGNALS.changed("clock-hw-slowdown", {"window_s": 600}, where="test")
    v = run([Step(t, {"clock_events": 0x88}) for t in range(0, 601, 60)], PolicySettings(signals=table))[-1]
    assert found(v, "clock-hw-slowdown") == "degraded"  # 10 sightings within 600 s
    assert found(v, "clock-power-brake") == ""  # 5 within 300 s: the one at 300 s is not within


def test_a_pcie_width_no_link_can_have_is_never_a_baseline() -> None:
    v = run([Step(0, {"pcie_width": 0xFFFFFFFF}), Step(3, {"pcie_width": 16}), Step(6, {"pcie_width": 16})])
    assert [found(x, "pcie-width") for x in v] == ["", "", ""]


def fabric(*steps: tuple[float, int | None]) -> list[Verdict]:
    """The fabric's state read at each time, one GPU, the host booted at 0 s."""
    out: list[Verdict] = []
    for t, state in steps:
        snap = Snapshot(gpus=(reading({"fabric_state": state}),), taken_at=t, booted_at=0)
        out.append(evaluate(snap, previous=out[-1] if out else None, settings=DEFAULT))
    return out


@pytest.mark.parametrize("unknown", [None, 0, 4])
def test_a_fabric_read_as_no_state_it_knows_forgets_its_run_and_starts_a_whole_grace_after(
    unknown: int | None,
) -> None:
    v = fabric((5000, 3), (5003, 2), (5200, 2), (5250, unknown))
    assert found(v[-1], "fabric-incomplete") == "" and not v[-1].pending  # nothing left to time
    v = fabric((5000, 3), (5003, 2), (5200, 2), (5250, unknown), (5260, 2), (5500, 2), (5559, 2), (5561, 2))
    assert [found(x, "fabric-incomplete") for x in v[-3:]] == ["", "", "fault"]


def test_a_fabric_completed_for_exactly_a_grace_is_forgotten_and_falls_back_to_a_whole_grace() -> None:
    """COMPLETED from 5200 s: at 5500 s, a whole grace (300 s) later, the run is forgotten; IN_PROGRESS then
    (not before) starts afresh."""
    v = fabric((5000, 3), (5003, 2), (5200, 3), (5499, 3))
    assert v[-1].pending  # held across a possible flap
    v = fabric((5000, 3), (5003, 2), (5200, 3), (5500, 3))
    assert not v[-1].pending
    v = fabric((5000, 3), (5003, 2), (5200, 3), (5500, 2), (5610, 2), (5801, 2))
    assert [found(x, "fabric-incomplete") for x in v[-2:]] == ["", "fault"]  # from 5500 s


def test_the_time_a_fabric_completed_within_the_grace_is_not_counted_as_incomplete() -> None:
    """IN_PROGRESS 5003-5200 s (197 s), COMPLETED 5200-5210 s, IN_PROGRESS again: 103 s more make 300 s."""
    v = fabric((5000, 3), (5003, 2), (5200, 3), (5210, 2), (5312.5, 2), (5313.5, 2))
    assert [found(x, "fabric-incomplete") for x in v[-2:]] == ["", "fault"]
    detail = v[-1].faults[0].detail
    assert detail.startswith("the GPU fabric probe is IN_PROGRESS 310 s after it was first read so, 300 s")
    assert ", 300 s of it incomplete across flaps (grace 300 s)" in detail


def test_a_fabric_incomplete_without_a_flap_says_no_flap_and_one_completed_half_a_second_says_it() -> None:
    v = fabric((5000, 3), (5003, 2), (5310, 2))
    detail = v[-1].faults[0].detail
    assert detail.startswith(
        "the GPU fabric probe is IN_PROGRESS 307 s after it was first read so (grace 300"
    )
    v = fabric((5000, 3), (5003, 2), (5100, 3), (5100.5, 2), (5310, 2))
    assert ", 306 s of it incomplete across flaps (grace 300 s)" in v[-1].faults[0].detail
