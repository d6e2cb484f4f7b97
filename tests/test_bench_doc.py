"""bench/run.py's docs/performance.md: every section from one run, the fleet's markdown pasted (or a visible
"not run" row), and the sections other commands measure kept verbatim between their markers. The bench
itself needs a control plane and 13 minutes (`make bench`); this tests how its parts are put together."""

from __future__ import annotations

from typing import Any

from bench import run

EARLIER = """# gpuguard performance

old figures, replaced

<!-- kept: fleet -->
## The fleet at 5,000 nodes (`make fleet-bench`)

measured by hand at 09:17
<!-- /kept: fleet -->

<!-- kept: e2e -->
## The burst scale-out, end to end (`make e2e`)

| gpuguard | 0 |
<!-- /kept: e2e -->

## How each figure is measured
"""

STUB_MD = (
    "## The fleet at 5,000 nodes (`make fleet-bench`, 2026-12-03 13:24 UTC)\n\n"
    "| 5,000 nodes start at once, shipped | 5000/5000, HTTP 429: 0 | all reconcile, 0 x 429 | met |\n"
)


def test_the_sections_other_commands_measure_are_found_verbatim_by_name() -> None:
    kept = run.kept_sections(EARLIER)
    assert list(kept) == ["fleet", "e2e"]
    assert kept["e2e"] == "## The burst scale-out, end to end (`make e2e`)\n\n| gpuguard | 0 |"
    assert run.kept_sections(run.wrap("e2e", kept["e2e"])) == {"e2e": kept["e2e"]}


def test_the_fleets_markdown_is_pasted_and_kept_for_the_next_run() -> None:
    fleet = {"nodes": 5000, "rc": 0, "seconds": 1500.0, "markdown": STUB_MD}
    row, text = run.fleet_section(fleet, run.kept_sections(EARLIER), {"mean": 3.0, "max": 9.0})
    assert row[3] == "met" and "1500 s" in row[1]
    assert STUB_MD.splitlines()[-1] in text and "measured by hand" not in text
    assert run.kept_sections(text)["fleet"].startswith("## The fleet at 5,000 nodes (`make fleet-bench`)")
    # Its own heading one level down: one section of that name, with the run's heading under it.
    assert [line for line in text.splitlines() if line.startswith("#")] == [
        "## The fleet at 5,000 nodes (`make fleet-bench`)",
        "### The fleet at 5,000 nodes (`make fleet-bench`, 2026-12-03 13:24 UTC)",
    ]


def test_fleet_nodes_0_is_a_visible_not_run_row_and_the_earlier_section_is_kept_under_a_note() -> None:
    row, text = run.fleet_section({"nodes": 0}, run.kept_sections(EARLIER), None)
    assert row[1] == "not run (FLEET_NODES=0)" and row[3] == "not run"
    assert text.startswith("Not run by this `make bench` (FLEET_NODES=0)")
    assert "measured by hand at 09:17" in run.kept_sections(text)["fleet"]


def test_a_fleet_bench_that_fails_is_missed_not_silently_dropped() -> None:
    row, text = run.fleet_section({"nodes": 5000, "rc": 2, "seconds": 1.0, "markdown": None}, {}, None)
    assert row[3] == "MISSED" and "exited 2" in row[1] and "no build/fleet-bench.md" in row[1]
    assert "failed" in text


def test_a_missed_goal_in_the_fleets_markdown_is_missed_in_the_goals_table() -> None:
    fleet: dict[str, Any] = {
        "nodes": 5000,
        "rc": 0,
        "seconds": 9.0,
        "markdown": STUB_MD + "| x | y | z | MISSED |",
    }
    row, _ = run.fleet_section(fleet, {}, None)
    assert row[3] == "MISSED"


def _lat(device_p99: float | None) -> dict[str, Any]:
    stats = {"n": 50, "p50_ms": 20.0, "p95_ms": 60.0, "p99_ms": 80.0, "max_ms": 90.0}
    lat: dict[str, Any] = {k: dict(stats) for k in ("xid", "floor", "ecc", "baseline_xid", "baseline_ecc")}
    lat["xid"]["p99_ms"] = 200.0
    if device_p99 is not None:
        lat["device"] = {**stats, "nodes": 1, "n": 25, "p99_ms": device_p99}
    return lat


def test_xid_to_device_taint_rule_is_a_row_beside_xid_to_taint_held_to_the_node_taints_50_ms() -> None:
    rows = run._latency_rows(_lat(49.9))
    titles = [r[0] for r in rows]
    device = next(r for r in rows if r[0].startswith("Xid -> DeviceTaintRule visible (watch)"))
    assert (
        titles.index(device[0]) == titles.index(next(t for t in titles if t.startswith("ECC -> taint"))) + 1
    )
    assert "(n=25)" in device[0] and device[1] == "p50 20.0 ms, p95 60.0 ms, p99 49.9 ms"
    assert device[2] == "p99 < 50 ms, as Xid -> taint" and device[3] == "met"
    goal = run._device_goal_rows(_lat(50.0), "load")
    assert goal == [
        (
            "Xid -> DeviceTaintRule visible (1 node, n=25)",
            "p50 20.0 ms, p99 50.0 ms",
            "Xid -> taint p99 200.0 ms",
            "p99 < 50 ms, as Xid -> taint",
            "MISSED",
            "load",
        )
    ]


def test_a_run_without_the_device_phase_renders_the_old_rows_unchanged() -> None:
    assert run._device_goal_rows(_lat(None), "load") == []
    assert len(run._latency_rows(_lat(None))) == len(run._latency_rows(_lat(1.0))) - 1


def test_log_xid_to_taint_is_held_to_twice_nvmls_p99_beside_it() -> None:
    stats = {"n": 20, "p50_ms": 15.0, "p95_ms": 20.0, "p99_ms": 25.0, "max_ms": 25.0}
    row = run.kmsg_taint_row({"kmsg": {**stats, "p99_ms": 50.0}, "nvml": stats})
    assert row[0].startswith("Kernel-log Xid -> taint visible (watch)") and "(n=20)" in row[0]
    assert row[1] == "p50 15.0 ms, p95 20.0 ms, p99 50.0 ms; NVML's: p50 15.0 ms, p95 20.0 ms, p99 25.0 ms"
    assert row[2] == "p99 <= 2x NVML Xid -> taint's" and row[3] == "met"
    assert run.kmsg_taint_row({"kmsg": {**stats, "p99_ms": 50.1}, "nvml": stats})[3] == "MISSED"
