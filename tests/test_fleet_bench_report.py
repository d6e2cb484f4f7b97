"""The fleet bench's markdown section (bench/fleet_scale.py --markdown): each figure beside its goal, and a
goal that was not reached reads MISSED."""

from __future__ import annotations

import copy
from typing import Any

from bench.fleet_scale import render_markdown


def _phase(**over: Any) -> dict[str, Any]:
    p = {
        "nodes": 5000,
        "reconciled": 5000,
        "not_idle": 0,
        "all_reconciled_s": 31.2,
        "http_429": 0,
        "node_writes": 5000,
        "redundant_writes": 0,
        "requests": {"get 200": 5000, "patch status 200": 5000},
        "simulator": {"count 200": 40},
        "apiserver_cpu_s": 50.0,
        "apiserver_cores": 1.2,
        "wall_s": 40.0,
        "apiserver_peak_rss_mb": 2100.0,
        "load1_mean": 9.0,
        "load1_max": 12.0,
    }
    p.update(over)
    return p


RESULT: dict[str, Any] = {
    "nodes": 5000,
    "processes": 8,
    "cpus": 2,
    "started": "2026-12-03 12:00 UTC",
    "kube_version": "v1.37.2",
    "setup_s": 150.0,
    "wall_s": 900.0,
    "configs": {
        "shipped": {
            "flowschema": True,
            "options": {"jitter": 30.0, "qps": 5.0, "burst": 20},
            "start": _phase(),
            "restart": _phase(node_writes=0),
        }
    },
    "burst": {
        "faulty": 500,
        "budget": "5%",
        "limit": 250,
        "config": "shipped",
        "last_taint_visible_s": 20.5,
        "first_taint_visible_s": 0.4,
        "hard_tainted": 250,
        "soft_tainted": 250,
        "untainted": 0,
        "http_429": 0,
        "apiserver_cpu_s": 90.0,
        "apiserver_cores": 1.5,
        "apiserver_peak_rss_mb": 2500.0,
        "load1_mean": 10.0,
        "load1_max": 14.0,
    },
}


def test_a_run_that_met_every_goal_reads_met_with_its_figures_load_and_duration() -> None:
    md = render_markdown(RESULT)
    assert md.startswith("## The fleet at 5,000 nodes (`make fleet-bench`, 2026-12-03 12:00 UTC)")
    assert "MISSED" not in md
    assert md.count("| met |") == 3
    assert "took 900.0 s" in md
    assert "load mean 9.0, max 12.0" in md
    assert "last taint visible 20.5 s" in md
    assert "Simulated:" in md


def test_a_429_at_start_reads_missed() -> None:
    r = copy.deepcopy(RESULT)
    r["configs"]["shipped"]["start"]["http_429"] = 3
    md = render_markdown(r)
    start = next(line for line in md.splitlines() if line.startswith("| shipped start"))
    assert start.endswith("| **MISSED** |")


def test_a_write_to_a_node_that_already_matched_reads_missed() -> None:
    r = copy.deepcopy(RESULT)
    r["configs"]["shipped"]["restart"]["redundant_writes"] = 1
    assert "| **MISSED** |" in render_markdown(r)


def test_a_burst_past_the_budget_or_with_an_untainted_node_reads_missed() -> None:
    for over in ({"hard_tainted": 251, "soft_tainted": 249}, {"untainted": 1, "soft_tainted": 249}):
        r = copy.deepcopy(RESULT)
        r["burst"].update(over)
        burst = next(line for line in render_markdown(r).splitlines() if line.startswith("| burst"))
        assert burst.endswith("| **MISSED** |")
