"""The link signals `nvlink-down` and `pcie-width`: each reading against the GPU's first good reading (the
baseline, which this raises) and against what its product has (the signal table's `expected`, by NVML device
name), so a GPU is judged at first sight: in a one-shot `gpuguard check`, on a node never seen.

Pure: the baseline dict is the judge's memory, handed in and changed here; nothing else is kept. Where both
comparisons trip, the product's detail is given: it is the same in `watch` and `check`.
"""

from __future__ import annotations

from gpuguard.core.hardware import nvlink_links_ok, pcie_width_ok
from gpuguard.core.model import GpuReading
from gpuguard.core.signaltable import Expected, Signal


def nvlink_down(
    g: GpuReading, s: Signal, first_links: dict[str, frozenset[int]], want: Expected | None, *, trained: bool
) -> str:
    """`trained`: the GPU's fabric is completed or has none; links still training are not compared with the
    product (fabric-incomplete speaks for them)."""
    active = g.signals.nvlink_active
    if active is None or (active and not nvlink_links_ok(active)):  # a link NVML cannot name: no reading
        return ""
    first = first_links.get(g.uuid)
    if first is None or not active <= first:
        # The first good reading, raised by a link active now that it lacked (a first reading taken while
        # the fabric still trained the links, or with one down): a link active once is one the GPU has.
        if active:
            first_links[g.uuid] = active | (first or frozenset())
        first = first_links.get(g.uuid) if first is not None else None
    if want is not None and trained and want.nvlink_links - len(active) > s.threshold:
        inactive = sorted(set(range(want.nvlink_links)) - active)
        which = f" (inactive: {', '.join(map(str, inactive))})" if inactive else ""
        return f"NVLink links active: {len(active)}, {want.nvlink_links} expected for {g.name}{which}"
    if first is None:
        return ""
    down = sorted(first - active)
    if len(down) <= s.threshold:
        return ""
    links = ", ".join(map(str, down))
    word = "link" if len(down) == 1 else "links"
    return f"NVLink {word} {links} inactive, of {len(first)} active at the best reading"


def pcie_width(g: GpuReading, s: Signal, first_width: dict[str, int], want: Expected | None) -> str:
    width = g.signals.pcie_width
    if not width or not pcie_width_ok(width):  # None, 0, 0xFFFFFFFF...: no reading, never a baseline
        return ""
    first = first_width.get(g.uuid)
    if first is None or width > first:
        # The first reading, raised by a wider one: a first reading of a link already narrow is no baseline.
        first = first_width[g.uuid] = width
    if want is not None and width < want.pcie_width - s.threshold:
        return f"PCIe link width x{width}, x{want.pcie_width} expected for {g.name}"
    if width >= first - s.threshold:
        return ""
    return f"PCIe link width x{width}, x{first} at the best reading"
