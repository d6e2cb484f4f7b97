"""The mock backend and its scenario format (a public contract): every key, every error names the event."""

from __future__ import annotations

import threading

import pytest

from gpuguard.core.errors import ScenarioError
from gpuguard.nvml.mock import MockBackend, load_scenario, parse_scenario
from harness.clock import Clock


def backend(text: str) -> tuple[MockBackend, Clock]:
    clock = Clock(100.0)
    b = MockBackend(parse_scenario(text), clock=clock, start_timer=False)
    b.open(lambda: None)
    return b, clock


def test_gpus_shorthand_makes_indexed_mock_uuids() -> None:
    b, _ = backend("gpus: 3")
    s = b.snapshot()
    assert [(g.index, g.uuid) for g in s.gpus] == [(0, "GPU-mock-0"), (1, "GPU-mock-1"), (2, "GPU-mock-2")]
    assert all(g.ecc_uncorrected == 0 and not g.lost for g in s.gpus)


def test_devices_give_explicit_uuids_and_names() -> None:
    b, _ = backend(
        "devices:\n  - {index: 0, uuid: GPU-aaaa, name: NVIDIA H200}\n  - {index: 1, uuid: GPU-bbbb}\n"
    )
    s = b.snapshot()
    assert [(g.uuid, g.name) for g in s.gpus] == [("GPU-aaaa", "NVIDIA H200"), ("GPU-bbbb", "Mock GPU")]


def test_every_event_key_applies_once_its_time_has_come() -> None:
    b, clock = backend(
        """
devices:
  - {index: 0, uuid: GPU-aaaa}
  - {index: 1, uuid: GPU-bbbb}
events:
  - {at: 2.0, gpu: 1, ecc_uncorrected: 3}
  - {at: 4.0, gpu: 0, xid: 79}
  - {at: 5.0, gpu: 1, lost: true}
  - {at: 6.0, gpu: 1, ecc_uncorrected: 0}
  - {at: 6.5, gpu: 1, lost: false}
  - {at: 7.0, gpu: 1, remove: true}
  - {at: 8.0, gpu: 0, ecc_supported: false}
  - {at: 9.0, gpu: 0, row_remap_failure: true}
  - {at: 9.5, gpu: 0, row_remap_pending: true}
"""
    )

    def at(t: float):  # type: ignore[no-untyped-def]
        clock.t = 100.0 + t
        return b.snapshot()

    assert at(1.9).gpus[1].ecc_uncorrected == 0
    assert at(2.0).gpus[1].ecc_uncorrected == 3
    s = at(4.0)
    assert [(x.gpu_index, x.uuid, x.code) for x in s.xids] == [(0, "GPU-aaaa", 79)]
    assert at(4.5).xids == ()  # delivered once
    s = at(5.0)
    assert s.gpus[1].lost and s.gpus[1].ecc_uncorrected is None
    assert at(6.5).gpus[1].ecc_uncorrected == 0
    assert [g.index for g in at(7.0).gpus] == [0]
    s = at(8.0)
    assert not s.gpus[0].ecc_supported and s.gpus[0].ecc_uncorrected is None
    assert at(9.0).gpus[0].remap_failure is True
    assert at(9.5).gpus[0].remap_pending is True


def test_events_listed_out_of_order_apply_in_time_order() -> None:
    b, clock = backend(
        "gpus: 1\nevents:\n  - {at: 3, gpu: 0, ecc_uncorrected: 0}\n  - {at: 1, gpu: 0, ecc_uncorrected: 5}\n"
    )
    clock.t += 2
    assert b.snapshot().gpus[0].ecc_uncorrected == 5
    clock.t += 2
    assert b.snapshot().gpus[0].ecc_uncorrected == 0


def test_an_xid_wakes_the_agent_at_its_time_not_at_the_next_poll() -> None:
    woke = threading.Event()
    b = MockBackend(parse_scenario("gpus: 1\nevents:\n  - {at: 0.05, gpu: 0, xid: 79}\n"))
    b.open(woke.set)
    try:
        assert woke.wait(2.0)
    finally:
        b.close()


def test_the_embedded_demo_scenario_loads() -> None:
    s = load_scenario(None)
    assert len(s.devices) == 8 and s.events


def test_shipped_example_scenarios_load() -> None:
    from pathlib import Path

    files = sorted(Path(__file__).parents[1].joinpath("examples").glob("*.yaml"))
    assert files
    for f in files:
        load_scenario(f)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected a mapping"),
        ("[1, 2]", "expected a mapping"),
        ("gpus: [", "not valid YAML"),
        ("gpus: 2\ncolour: red", "unknown key 'colour'"),
        ("gpus: 2\ndevices: []", "exactly one of"),
        ("events: []", "exactly one of"),
        ("gpus: -1", "'gpus' must be an integer"),
        ("gpus: two", "'gpus' must be an integer"),
        ("gpus: 99999", "'gpus' must be an integer"),
        ("devices: {a: 1}", "'devices' must be a list"),
        ("devices: [5]", "devices[0]: expected a mapping"),
        ("devices:\n  - {index: 0, colour: red}", "devices[0]: unknown key 'colour'"),
        ("devices:\n  - {uuid: GPU-a}", "'index' must be"),
        ("devices:\n  - {index: 0, uuid: 7}", "'uuid' must be a non-empty string"),
        ("devices:\n  - {index: 0}\n  - {index: 0}", "duplicate device index"),
        ("devices:\n  - {index: 0, uuid: A}\n  - {index: 1, uuid: A}", "duplicate device uuid"),
        ("gpus: 1\nevents: {at: 1}", "'events' must be a list"),
        ("gpus: 1\nevents:\n  - 3", "events[0]: expected a mapping"),
        (
            "gpus: 1\nevents:\n  - {at: 1, gpu: 0, xid: 79, colour: red}",
            "events[0] (at: 1, gpu: 0): unknown key 'colour'",
        ),
        ("gpus: 1\nevents:\n  - {gpu: 0, xid: 79}", "events[0] (gpu: 0): 'at' must be"),
        ("gpus: 1\nevents:\n  - {at: -1, gpu: 0, xid: 79}", "'at' must be"),
        ("gpus: 1\nevents:\n  - {at: true, gpu: 0, xid: 79}", "'at' must be"),
        ("gpus: 1\nevents:\n  - {at: 1, xid: 79}", "'gpu' must be a device index"),
        ("gpus: 1\nevents:\n  - {at: 1, gpu: 3, xid: 79}", "events[0] (at: 1, gpu: 3): unknown GPU 3"),
        ("gpus: 1\nevents:\n  - {at: 1, gpu: 0}", "no action"),
        ("gpus: 1\nevents:\n  - {at: 1, gpu: 0, xid: seventy}", "'xid' must be an integer"),
        ("gpus: 1\nevents:\n  - {at: 1, gpu: 0, xid: -4}", "'xid' must be an integer"),
        (
            "gpus: 1\nevents:\n  - {at: 1, gpu: 0, ecc_uncorrected: 1.5}",
            "'ecc_uncorrected' must be an integer",
        ),
        ("gpus: 1\nevents:\n  - {at: 1, gpu: 0, lost: 1}", "'lost' must be true or false"),
        ("gpus: 1\nevents:\n  - {at: 1, gpu: 0, remove: false}", "'remove' can only be true"),
        (
            "gpus: 1\nevents:\n  - {at: 1, gpu: 0, ecc_supported: maybe}",
            "'ecc_supported' must be true or false",
        ),
        (
            "gpus: 1\nevents:\n  - {at: 1, gpu: 0, row_remap_failure: 0}",
            "'row_remap_failure' must be true or false",
        ),
        ("gpus: 1\nevents:\n  - {at: 1, gpu: 0, xid: !!binary aGVsbG8=}", "'xid' must be an integer"),
        ("a: &a [*a, *a]", "unknown key"),
    ],
)
def test_a_malformed_scenario_is_a_one_line_error_naming_the_problem(text: str, message: str) -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario(text, source="s.yaml")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_missing_scenario_file_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ScenarioError, match="no such file"):
        load_scenario(tmp_path / "nope.yaml")


def test_a_binary_scenario_file_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"\xff\xfe\x00\x01garbage")
    with pytest.raises(ScenarioError):
        load_scenario(p)
