"""What a GPU's links can report at all: a reading outside these is no reading of a link (a driver's
0xFFFFFFFF for "unknown", a corrupt value), never a baseline nor a file's entry.

PCIe links are x1, x2, x4, x8, x12, x16 or x32 wide (the PCIe base specification; nvml.h's
nvmlDeviceGetCurrPcieLinkWidth reports the lane count) and of generation 1 to 6 (nvml.h's
NVML_PCIE_LINK_MAX_SPEED_* go up to 64000 MB/s, PCIe 6.0); NVLink links are numbered 0 to
NVML_NVLINK_MAX_LINKS - 1 (nvml.h: 36)."""

from __future__ import annotations

from collections.abc import Collection

PCIE_WIDTHS = frozenset({1, 2, 4, 8, 12, 16, 32})
PCIE_MAX_GEN = 6
NVLINK_MAX_LINKS = 36


def pcie_width_ok(width: int) -> bool:
    return width in PCIE_WIDTHS


def pcie_gen_ok(gen: int) -> bool:
    return 1 <= gen <= PCIE_MAX_GEN


def nvlink_links_ok(links: Collection[int]) -> bool:
    """A non-empty set of link numbers NVML can name."""
    return bool(links) and all(0 <= link < NVLINK_MAX_LINKS for link in links)
