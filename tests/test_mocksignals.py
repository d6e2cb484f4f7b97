"""The mock scenario keys of issue 29's signals (docs/scenario.md, a public contract): one scenario per key,
through the mock backend and the policy, and each key's validation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpuguard.core.config import PolicySettings
from gpuguard.core.errors import ScenarioError
from gpuguard.core.model import Verdict
from gpuguard.core.signaltable import SIGNALS
from gpuguard.judge.policy import evaluate
from gpuguard.nvml import mocksignals
from gpuguard.nvml.mock import MockBackend, parse_scenario
from harness.clock import Clock

DOC = Path(__file__).resolve().parent.parent / "docs" / "scenario.md"


def verdicts(text: str, times: list[float], settings: PolicySettings | None = None) -> list[Verdict]:
    """The policy's verdict at each of these scenario times (the clock starts at 0)."""
    clock = Clock(0.0)
    b = MockBackend(parse_scenario(text), clock=clock, start_timer=False)
    b.open(lambda: None)
    out: list[Verdict] = []
    prev = None
    for t in times:
        clock.t = t
        prev = evaluate(b.snapshot(), previous=prev, settings=settings or PolicySettings())
        out.append(prev)
    return out


def state(v: Verdict) -> list[tuple[str, str, str | None]]:
    return [("fault", f.reason, f.uuid) for f in v.faults] + [
        ("degraded", f.reason, f.uuid) for f in v.degraded
    ]


# key: (the event's value, the times to check, what the last check finds, the event that recovers).
CASES: dict[str, tuple[str, list[float], list[tuple[str, str, str | None]], str]] = {
    "fabric_state": ("not_started", [0, 5, 400], [("fault", "fabric-incomplete", "GPU-mock-1")], "completed"),
    "fabric_status": ("UNKNOWN", [0, 5], [("fault", "fabric-status", "GPU-mock-1")], "SUCCESS"),
    "fabric_degraded": ("true", [0, 5], [("degraded", "fabric-degraded", "GPU-mock-1")], "false"),
    "nvlink_down": ("[3, 4]", [0, 5], [("degraded", "nvlink-down", "GPU-mock-1")], "[]"),
    "nvlink_errors": ("7000", [0, 5], [("degraded", "nvlink-errors", "GPU-mock-1")], "0"),
    "pcie_width": ("8", [0, 5], [("degraded", "pcie-width", "GPU-mock-1")], "16"),
    "pcie_replays": ("9", [0, 5], [("degraded", "pcie-replays", "GPU-mock-1")], "0"),
    "retired_pending": ("true", [0, 5], [("degraded", "retired-pending", "GPU-mock-1")], "false"),
    "inforom_valid": ("false", [0, 5], [("degraded", "inforom-invalid", "GPU-mock-1")], "true"),
    "on_bus": ("false", [0, 5], [("fault", "gpu-missing", "GPU-mock-1")], "true"),
}


@pytest.mark.parametrize("key", sorted(CASES))
def test_each_signal_key_trips_its_signal_on_that_gpu_and_its_opposite_clears_it(key: str) -> None:
    value, times, expected, back = CASES[key]
    text = (
        f"gpus: 2\nevents:\n  - {{at: 1, gpu: 1, {key}: {value}}}\n  - {{at: 2000, gpu: 1, {key}: {back}}}\n"
    )
    v = verdicts(text, [*times, 2000, 2400])
    assert state(v[0]) == []
    assert state(v[len(times) - 1]) == expected
    if key == "on_bus":
        # A GPU NVML listed and lost is its own gpu-missing (not also the node's); it stays when it comes
        # back (a reboot clears it), as before issue 29.
        assert [g.uuid for g in v[-1].gpus] == ["GPU-mock-0", "GPU-mock-1"]
    else:
        assert state(v[-1]) == []


def test_row_remap_pending_the_existing_key_is_the_degraded_signal_row_remap_pending() -> None:
    text = (
        "gpus: 1\nevents:\n  - {at: 1, gpu: 0, row_remap_pending: true}\n"
        "  - {at: 9, gpu: 0, row_remap_pending: false}\n"
    )
    v = verdicts(text, [0, 5, 10])
    assert [state(x) for x in v] == [[], [("degraded", "row-remap-pending", "GPU-mock-0")], []]


def test_pcie_gen_is_read_and_shown_but_not_judged_by_default() -> None:
    text = "gpus: 1\nevents:\n  - {at: 1, gpu: 0, pcie_gen: 2}\n"
    assert state(verdicts(text, [0, 5])[-1]) == []
    table = SIGNALS.changed("pcie-gen", {"level": "degraded"}, where="t")
    assert state(verdicts(text, [0, 5], PolicySettings(signals=table))[-1]) == [
        ("degraded", "pcie-gen", "GPU-mock-0")
    ]


def test_clock_events_a_power_brake_storm_degrades_then_clears() -> None:
    text = (
        "gpus: 1\nevents:\n  - {at: 1, gpu: 0, clock_events: [hw_power_brake, hw_thermal]}\n"
        "  - {at: 30, gpu: 0, clock_events: []}\n"
    )
    times = [float(t) for t in range(0, 400, 3)]
    v = verdicts(text, times)
    reasons = [sorted(f.reason for f in x.degraded) for x in v]
    assert reasons[3] == []
    assert ["clock-hw-thermal", "clock-power-brake"] in reasons
    assert reasons[-1] == []


def test_a_gpu_on_the_bus_from_the_start_is_gpu_missing_at_the_first_check() -> None:
    v = verdicts("gpus: 8\nevents:\n  - {at: 0, gpu: 5, on_bus: false}\n", [0])
    assert [(f.reason, f.detail) for f in v[0].node_faults] == [
        ("gpu-missing", "an NVIDIA GPU at PCI 00000000:06:00.0 is on the PCI bus but absent from NVML")
    ]
    assert len(v[0].gpus) == 7


@pytest.mark.parametrize(
    ("event", "message"),
    [
        ("fabric_state: done", "'fabric_state' must be one of not_started, in_progress, completed"),
        # An unhashable value is an error line too, not a TypeError (it was one before the fuzz found it).
        ("fabric_state: [1]", "'fabric_state' must be one of not_started, in_progress, completed"),
        ("clock_events: [{a: 1}]", "'clock_events' must be a list of hw_slowdown, hw_thermal"),
        ("fabric_status: 3", "'fabric_status' must be an NVML return name"),
        ("fabric_degraded: 1", "'fabric_degraded' must be true or false"),
        ("nvlink_down: 3", "'nvlink_down' must be a list of link numbers 0..17"),
        ("nvlink_down: [18]", "'nvlink_down' must be a list of link numbers 0..17"),
        ("nvlink_errors: -1", "'nvlink_errors' must be a count"),
        ("pcie_width: 7", "'pcie_width' must be one of 1, 2, 4, 8, 12, 16, 32"),
        ("pcie_gen: 9", "'pcie_gen' must be a PCIe generation 1..6"),
        ("pcie_replays: true", "'pcie_replays' must be a count"),
        ("clock_events: [sw_power_cap]", "'clock_events' must be a list of hw_slowdown, hw_thermal"),
        ("retired_pending: yes please", "'retired_pending' must be true or false"),
        ("inforom_valid: 0", "'inforom_valid' must be true or false"),
        ("on_bus: null", "'on_bus' must be true or false"),
    ],
)
def test_a_bad_signal_value_is_a_one_line_error_naming_the_event(event: str, message: str) -> None:
    with pytest.raises(ScenarioError) as e:
        parse_scenario(f"gpus: 1\nevents:\n  - {{at: 1, gpu: 0, {event}}}\n")
    assert "events[0] (at: 1, gpu: 0)" in str(e.value) and message in str(e.value)
    assert "\n" not in str(e.value)


def test_every_signal_key_has_a_case_and_is_documented_in_the_scenario_contract() -> None:
    assert set(CASES) | {"pcie_gen", "clock_events"} == set(mocksignals.KEYS)
    doc = DOC.read_text()
    for key in mocksignals.KEYS:
        assert re.search(rf"\b{key}:", doc), key
