"""gpuguard.judge.links: `nvlink-down` and `pcie-width` called directly, each reading against the GPU's best
reading (the baseline dict the judge hands in, raised here) and against what its product has."""

from __future__ import annotations

from dataclasses import replace

from gpuguard.core.model import GpuReading, SignalReadings
from gpuguard.core.signaltable import SIGNALS, Expected
from gpuguard.judge.links import nvlink_down, pcie_width

NVLINK = SIGNALS["nvlink-down"]
WIDTH = SIGNALS["pcie-width"]
H100 = Expected(nvlink_links=18, pcie_width=16)


def links(*active: int) -> GpuReading:
    return GpuReading(0, "GPU-0", name="H100", signals=SignalReadings(nvlink_active=frozenset(active)))


def width(lanes: int | None) -> GpuReading:
    return GpuReading(0, "GPU-0", name="H100", signals=SignalReadings(pcie_width=lanes))


def test_no_reading_of_the_links_is_not_judged_and_is_no_baseline() -> None:
    memory: dict[str, frozenset[int]] = {}
    unread = GpuReading(0, "GPU-0", signals=SignalReadings())
    assert nvlink_down(unread, NVLINK, memory, H100, trained=True) == ""
    assert nvlink_down(links(0, 40), NVLINK, memory, H100, trained=True) == ""  # a link NVML cannot name
    assert memory == {}


def test_the_first_reading_is_the_baseline_and_no_change() -> None:
    memory: dict[str, frozenset[int]] = {}
    assert nvlink_down(links(0, 1, 2, 3), NVLINK, memory, None, trained=True) == ""
    assert memory == {"GPU-0": frozenset({0, 1, 2, 3})}


def test_no_link_active_at_first_sight_is_no_baseline() -> None:
    memory: dict[str, frozenset[int]] = {}
    assert nvlink_down(links(), NVLINK, memory, None, trained=True) == ""
    assert memory == {}


def test_a_link_active_at_the_best_reading_and_inactive_now_is_down() -> None:
    memory = {"GPU-0": frozenset({0, 1, 2, 3})}
    assert nvlink_down(links(0, 1, 3), NVLINK, memory, None, trained=True) == (
        "NVLink link 2 inactive, of 4 active at the best reading"
    )
    assert nvlink_down(links(), NVLINK, memory, None, trained=True) == (
        "NVLink links 0, 1, 2, 3 inactive, of 4 active at the best reading"
    )
    assert memory == {"GPU-0": frozenset({0, 1, 2, 3})}  # a link down lowers no baseline


def test_a_link_active_later_raises_the_baseline() -> None:
    memory = {"GPU-0": frozenset({0, 1})}
    assert nvlink_down(links(0, 1, 2), NVLINK, memory, None, trained=True) == ""
    assert memory == {"GPU-0": frozenset({0, 1, 2})}
    assert nvlink_down(links(1, 2, 3), NVLINK, memory, None, trained=True) == (
        "NVLink link 0 inactive, of 4 active at the best reading"
    )


def test_the_threshold_is_the_links_tolerated_down() -> None:
    tolerant = replace(NVLINK, threshold=1)
    memory = {"GPU-0": frozenset({0, 1, 2, 3})}
    assert nvlink_down(links(0, 1, 2), tolerant, memory, None, trained=True) == ""
    assert nvlink_down(links(0, 1), tolerant, memory, None, trained=True) == (
        "NVLink links 2, 3 inactive, of 4 active at the best reading"
    )


def test_fewer_links_than_the_product_has_are_down_at_first_sight() -> None:
    memory: dict[str, frozenset[int]] = {}
    assert nvlink_down(links(*range(16)), NVLINK, memory, H100, trained=True) == (
        "NVLink links active: 16, 18 expected for H100 (inactive: 16, 17)"
    )
    assert nvlink_down(links(*range(18)), NVLINK, memory, H100, trained=True) == ""


def test_links_still_training_are_not_compared_with_the_product() -> None:
    memory: dict[str, frozenset[int]] = {}
    assert nvlink_down(links(*range(16)), NVLINK, memory, H100, trained=False) == ""


def test_the_products_links_tolerate_the_threshold_too() -> None:
    tolerant = replace(NVLINK, threshold=2)
    assert nvlink_down(links(*range(16)), tolerant, {}, H100, trained=True) == ""
    assert nvlink_down(links(*range(15)), tolerant, {}, H100, trained=True).startswith(
        "NVLink links active: 15, 18 expected"
    )


def test_no_pcie_width_read_is_not_judged_and_is_no_baseline() -> None:
    memory: dict[str, int] = {}
    for unread in (None, 0, 0xFFFFFFFF, 3):
        assert pcie_width(width(unread), WIDTH, memory, H100) == ""
    assert memory == {}


def test_the_first_pcie_width_is_the_baseline_and_a_wider_one_raises_it() -> None:
    memory: dict[str, int] = {}
    assert pcie_width(width(8), WIDTH, memory, None) == ""
    assert memory == {"GPU-0": 8}
    assert pcie_width(width(16), WIDTH, memory, None) == ""
    assert memory == {"GPU-0": 16}
    assert pcie_width(width(16), WIDTH, memory, None) == ""


def test_a_link_narrower_than_its_best_reading_is_degraded() -> None:
    memory = {"GPU-0": 16}
    assert pcie_width(width(8), WIDTH, memory, None) == "PCIe link width x8, x16 at the best reading"
    assert memory == {"GPU-0": 16}
    tolerant = replace(WIDTH, threshold=8)
    assert pcie_width(width(8), tolerant, memory, None) == ""
    assert pcie_width(width(4), tolerant, memory, None) == "PCIe link width x4, x16 at the best reading"


def test_a_link_narrower_than_its_product_is_degraded_at_first_sight() -> None:
    assert pcie_width(width(8), WIDTH, {}, H100) == "PCIe link width x8, x16 expected for H100"
    assert pcie_width(width(16), WIDTH, {}, H100) == ""


def test_the_products_width_tolerates_the_threshold_too() -> None:
    tolerant = replace(WIDTH, threshold=8)
    assert pcie_width(width(8), tolerant, {}, H100) == ""
    assert pcie_width(width(4), tolerant, {}, H100) == "PCIe link width x4, x16 expected for H100"
