"""gpuguard.core.hardware: what a GPU's links can report at all; anything else is no reading."""

from __future__ import annotations

from gpuguard.core.hardware import NVLINK_MAX_LINKS, nvlink_links_ok, pcie_gen_ok, pcie_width_ok


def test_a_pcie_width_is_one_a_link_can_have() -> None:
    assert [w for w in range(-1, 70) if pcie_width_ok(w)] == [1, 2, 4, 8, 12, 16, 32]
    assert not pcie_width_ok(0xFFFFFFFF)  # the driver's "unknown"


def test_a_pcie_generation_is_one_to_six() -> None:
    assert [g for g in range(-1, 10) if pcie_gen_ok(g)] == [1, 2, 3, 4, 5, 6]


def test_nvlink_links_are_numbered_zero_to_thirty_five() -> None:
    assert NVLINK_MAX_LINKS == 36
    assert nvlink_links_ok({0}) and nvlink_links_ok({35}) and nvlink_links_ok(set(range(36)))
    assert not nvlink_links_ok({36}) and not nvlink_links_ok({-1})


def test_a_link_set_with_one_link_nvml_cannot_name_is_no_reading() -> None:
    assert not nvlink_links_ok({0, 1, 36})
    assert not nvlink_links_ok({-1, 0})


def test_no_links_at_all_is_no_reading() -> None:
    assert not nvlink_links_ok(set())
    assert not nvlink_links_ok(())
