"""A GPU judged at first sight: `nvlink-down` and `pcie-width` compare every reading with what the GPU's
product has (the signal table's `expected`, by NVML device name), not only with a first reading a one-shot
`gpuguard check` never had. Table-driven through the policy, then --signals-config's `expected`, then the CLI
on the mock backend and on the fake NVML library; and what one pass cannot see (rates) stays unseen."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gpuguard.core.config import PolicySettings
from gpuguard.core.errors import ConfigError
from gpuguard.core.model import GpuReading, SignalReadings, Snapshot, Verdict
from gpuguard.core.signalconfig import parse
from gpuguard.core.signaltable import SIGNALS
from gpuguard.judge.policy import evaluate
from tests.test_cli import run, write
from tests.test_nvml_backend import check

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-40GB"
ALL_18 = frozenset(range(18))
DEFAULT = PolicySettings()


def first_sight(name: str, settings: PolicySettings = DEFAULT, /, **values: object) -> Verdict:
    """One pass with no previous verdict: what `gpuguard check` judges."""
    g = GpuReading(index=0, uuid="GPU-0", name=name, signals=SignalReadings(**values))  # type: ignore[arg-type]
    return evaluate(Snapshot(gpus=(g,), taken_at=0.0), previous=None, settings=settings)


def degraded(v: Verdict) -> dict[str, str]:
    return {f.reason: f.detail for f in v.degraded}


# (product, readings, the signal it degrades or "", words its detail holds)
CASES = [
    (
        H100,
        {"nvlink_active": ALL_18 - {3, 4}},
        "nvlink-down",
        "NVLink links active: 16, 18 expected for " + H100,
    ),
    (H100, {"nvlink_active": ALL_18 - {3, 4}}, "nvlink-down", "(inactive: 3, 4)"),
    (H100, {"nvlink_active": frozenset(), "nvlink_links": 18}, "nvlink-down", "active: 0, 18 expected"),
    (H100, {"nvlink_active": ALL_18, "pcie_width": 8}, "pcie-width", f"x8, x16 expected for {H100}"),
    (H100, {"nvlink_active": ALL_18, "pcie_width": 16}, "", ""),
    (A100, {"nvlink_active": frozenset(range(12)), "pcie_width": 16}, "", ""),
    (A100, {"nvlink_active": frozenset(range(11))}, "nvlink-down", f"11, 12 expected for {A100}"),
    # A product not in the table: the baseline alone, and a first reading is no change.
    ("NVIDIA Fake GPU", {"nvlink_active": ALL_18 - {3, 4}, "pcie_width": 8}, "", ""),
    ("", {"nvlink_active": frozenset({0}), "pcie_width": 1}, "", ""),
    # Not applicable, or no reading of a link: never judged.
    (H100, {}, "", ""),
    (H100, {"nvlink_active": frozenset({40}), "pcie_width": 0xFFFFFFFF}, "", ""),
    # Links still training with the fabric: fabric-incomplete speaks for them, not nvlink-down.
    (H100, {"nvlink_active": frozenset(), "fabric_state": 2}, "", ""),
    (
        H100,
        {"nvlink_active": ALL_18 - {3}, "fabric_state": 3, "fabric_status": "SUCCESS"},
        "nvlink-down",
        "17",
    ),
]


@pytest.mark.parametrize(("product", "values", "signal", "words"), CASES)
def test_first_sight_compares_with_what_the_product_has(
    product: str, values: dict[str, object], signal: str, words: str
) -> None:
    v = first_sight(product, **values)
    found = degraded(v)
    assert set(found) == ({signal} if signal else set()), found
    if signal:
        assert words in found[signal] and found[signal].endswith("(GPU 0, GPU-0)")
        assert v.healthy  # degraded: shown, never a fault


def test_the_threshold_still_applies_and_the_level_is_the_signals() -> None:
    tolerant = SIGNALS.changed("nvlink-down", {"threshold": 2}, where="test")
    assert degraded(first_sight(H100, PolicySettings(signals=tolerant), nvlink_active=ALL_18 - {3, 4})) == {}
    fault = SIGNALS.changed("pcie-width", {"level": "fault"}, where="test")
    v = first_sight(H100, PolicySettings(signals=fault), pcie_width=8)
    assert [f.reason for f in v.faults] == ["pcie-width"] and not v.healthy


def test_watch_says_the_same_as_check_and_still_keeps_the_baseline() -> None:
    """The same reading gives the same detail in a pass with a history as at first sight; a product with
    no expectation keeps its baseline rule."""
    settings = PolicySettings()
    g = GpuReading(
        index=0, uuid="GPU-0", name=H100, signals=SignalReadings(nvlink_active=ALL_18, pcie_width=16)
    )
    prev = evaluate(Snapshot(gpus=(g,), taken_at=0.0), previous=None, settings=settings)
    bad = replace(g, signals=SignalReadings(nvlink_active=ALL_18 - {5}, pcie_width=8))
    later = evaluate(Snapshot(gpus=(bad,), taken_at=60.0), previous=prev, settings=settings)
    assert degraded(later) == degraded(first_sight(H100, nvlink_active=ALL_18 - {5}, pcie_width=8))
    other = replace(g, name="NVIDIA Fake GPU")
    prev = evaluate(Snapshot(gpus=(other,), taken_at=0.0), previous=None, settings=settings)
    bad = replace(other, signals=bad.signals)
    later = evaluate(Snapshot(gpus=(bad,), taken_at=60.0), previous=prev, settings=settings)
    assert degraded(later)["nvlink-down"].startswith("NVLink link 5 inactive, of 18 active at the best")


def test_every_shipped_product_names_its_source() -> None:
    assert {H100, "NVIDIA A100-SXM4-80GB", A100} <= set(SIGNALS.products)
    for product, e in SIGNALS.products.items():
        assert "NVIDIA" in e.source and e.nvlink_links > 0 and e.pcie_width == 16, product


CONFIG = f"""
expected:
  NVIDIA H200: {{nvlink_links: 18, pcie_width: 16}}
  {A100}: null
nodes:
  - selector: {{pool: single-gpu-vm}}
    expected:
      {H100}: {{nvlink_links: 0}}
"""


def test_signals_config_expected_changes_products_globally_and_per_node_label() -> None:
    c = parse(CONFIG)
    glob = c.table(None)
    assert glob.products["NVIDIA H200"].nvlink_links == 18 and A100 not in glob.products
    assert glob.products[H100] == SIGNALS.products[H100]
    vm = c.table({"pool": "single-gpu-vm"})
    assert (vm.products[H100].nvlink_links, vm.products[H100].pcie_width) == (0, 16)
    no_links = {"nvlink_active": frozenset(), "nvlink_links": 18}
    assert "nvlink-down" in degraded(first_sight(H100, PolicySettings(signals=glob), **no_links))
    assert degraded(first_sight(H100, PolicySettings(signals=vm), **no_links)) == {}
    assert "nvlink-down" in degraded(
        first_sight("NVIDIA H200", PolicySettings(signals=glob), nvlink_active=ALL_18 - {1})
    )
    assert degraded(first_sight(A100, PolicySettings(signals=glob), nvlink_active=frozenset(range(6)))) == {}
    assert SIGNALS.products[A100].nvlink_links == 12  # the shipped table is untouched


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("expected: [1]", "'expected' must map a GPU product name to its values"),
        ("expected: {NVIDIA H200: 18}", "NVIDIA H200: expected a mapping of nvlink_links and/or pcie_width"),
        ("expected: {NVIDIA H200: {links: 18}}", "a mapping of nvlink_links and/or pcie_width, or null"),
        ("expected: {NVIDIA H200: {nvlink_links: 37}}", "NVIDIA H200.nvlink_links must be an integer 0..36"),
        ("expected: {NVIDIA H200: {nvlink_links: true}}", "nvlink_links must be an integer 0..36, not True"),
        ("expected: {NVIDIA H200: {pcie_width: 10}}", "NVIDIA H200.pcie_width must be 0 or one of 1, 2, 4"),
        ("expected: {7: {pcie_width: 16}}", "expected: 7 is not a GPU product name"),
        ("nodes: [{selector: {a: b}, expected: {x: {pcie_width: 3}}}]", "nodes[0]: expected: x.pcie_width"),
        ("nodes: [{selector: {a: b}, expect: {}}]", "nodes[0]: expected a mapping with 'selector'"),
    ],
)
def test_a_bad_expected_section_is_one_clear_line(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse(text, source="--signals-config s.yaml")
    assert message in str(e.value) and str(e.value).startswith("--signals-config s.yaml")
    assert "\n" not in str(e.value)


SCENARIO = f"""
devices:
  - {{index: 0, uuid: GPU-h0, name: {H100}}}
  - {{index: 1, uuid: GPU-h1, name: {H100}}}
events:
  - {{at: 0, gpu: 1, nvlink_down: [3, 4]}}
"""


def test_check_on_a_new_node_with_links_down_fails_on_degraded_at_first_sight(tmp_path: Path) -> None:
    """The scale-out preflight: links 3 and 4 down since the node came up, one pass, no baseline."""
    r = run("check", "--backend", "mock", "--scenario", write(tmp_path, SCENARIO), "--fail-on-degraded")
    assert r.returncode == 1, r.stdout + r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line[:1].isdigit()}
    column = {gpu: row[row.index("yes") + 2] for gpu, row in rows.items()}  # DEGRADED, after HEALTHY ECC
    assert column == {"0": "-", "1": "nvlink-down"}, r.stdout
    assert f"16, 18 expected for {H100} (inactive: 3, 4)" in r.stdout
    assert run("check", "--backend", "mock", "--scenario", write(tmp_path, SCENARIO)).returncode == 0


def test_check_does_not_list_a_rate_from_one_reading_unless_its_threshold_is_0(tmp_path: Path) -> None:
    """A power brake read at the instant of the check is one sample: not a storm (more than 5 within
    300 s) until --signals-config sets the threshold to 0; an error counter read once has risen by nothing."""
    scenario = write(
        tmp_path,
        f"{SCENARIO.split('events:', maxsplit=1)[0]}events:\n"
        "  - {at: 0, gpu: 0, clock_events: [hw_power_brake]}\n  - {at: 0, gpu: 0, nvlink_errors: 100000}\n",
    )
    r = run("check", "--backend", "mock", "--scenario", scenario, "--fail-on-degraded", "-o", "json")
    assert r.returncode == 0, r.stdout + r.stderr
    config = tmp_path / "signals.yaml"
    config.write_text("signals: {clock-power-brake: {threshold: 0}, nvlink-errors: {threshold: 0}}\n")
    r = run(
        "check", "--backend", "mock", "--scenario", scenario, "--signals-config", str(config), "-o", "json"
    )
    assert '"clock-power-brake: HW power brake slowdown in 1 checks' in r.stdout, r.stdout
    assert "nvlink-errors" not in r.stdout


def test_check_through_pynvml_and_the_fake_library_sees_a_narrow_link_and_links_down(
    fakenvml: Path, tmp_path: Path
) -> None:
    state = tmp_path / "nvml.state"
    state.write_text(
        f'gpu 0 uuid=GPU-0a name="{H100}" nvlink_links=18 nvlink_down=3,4\n'
        f'gpu 1 uuid=GPU-0b name="{H100}" nvlink_links=18 pcie_width=8\n'
        'gpu 2 uuid=GPU-0c name="NVIDIA Fake GPU" nvlink_links=18 nvlink_down=3 pcie_width=8\n'
    )
    code, doc, _ = check(fakenvml, state, "--fail-on-degraded")
    assert code == 1, doc
    by_uuid = {g["uuid"]: g["degraded"] for g in doc["gpus"]}
    assert [r.split(":")[0] for r in by_uuid["GPU-0a"]] == ["nvlink-down"], doc
    assert f"16, 18 expected for {H100} (inactive: 3, 4)" in by_uuid["GPU-0a"][0]
    assert by_uuid["GPU-0b"] == [f"pcie-width: PCIe link width x8, x16 expected for {H100} (GPU 1, GPU-0b)"]
    assert by_uuid["GPU-0c"] == []  # a product the table does not name: its first reading is its baseline
