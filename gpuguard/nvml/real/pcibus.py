"""NVIDIA GPUs on the PCI bus (sysfs) against the GPUs NVML lists: a GPU the bus has and NVML does not is
`gpu-missing` from the first check, including one absent from boot, which NVML's own count cannot show.

A GPU is an NVIDIA (vendor 0x10de) display controller: class 0x0300 (VGA) or 0x0302 (3D controller, what
data-centre GPUs report). NVSwitches (class 0x0680) are not GPUs. A GPU bound to vfio-pci is passed to a
virtual machine on purpose: not NVML's, not missing; nor is an SR-IOV virtual function (a `physfn` link: the
VFs of a vGPU host). The scan is a few hundred small sysfs reads: done at
the first pass and every SCAN_EVERY_S, not at every poll.
"""

from __future__ import annotations

import os
import re

import structlog

log = structlog.get_logger(__name__)

PCI_ROOT = "/sys/bus/pci/devices"
NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")
SCAN_EVERY_S = 60.0
_ADDRESS = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


def address_key(address: str) -> tuple[int, int, int, int] | None:
    """'0000:3b:00.0' (sysfs) and '00000000:3B:00.0' (NVML's busId) -> the same (domain, bus, device,
    function); None for anything else."""
    m = _ADDRESS.match(address.strip())
    if m is None:
        return None
    domain, bus, device, function = m.groups()
    return int(domain, 16), int(bus, 16), int(device, 16), int(function)


def nvidia_gpus(root: str) -> tuple[str, ...]:
    """The PCI addresses of the NVIDIA GPUs under `root`, sorted; () where it cannot be read."""
    found = []
    try:
        entries = sorted(os.listdir(root))
    except OSError as exc:
        log.warning("pci.scan_failed", root=root, error=str(exc), effect="gpu-missing by the bus not judged")
        return ()
    for name in entries:
        path = os.path.join(root, name)
        if _read(path, "vendor") != NVIDIA_VENDOR or _read(path, "class")[:6] not in GPU_CLASSES:
            continue
        if os.path.basename(os.path.realpath(os.path.join(path, "driver"))) == "vfio-pci":
            continue
        if os.path.lexists(os.path.join(path, "physfn")):
            continue  # an SR-IOV virtual function (vGPU): NVML lists its physical GPU, not it
        found.append(name)
    return tuple(found)


def _read(path: str, name: str) -> str:
    try:
        with open(os.path.join(path, name), encoding="ascii", errors="replace") as f:
            return f.read(32).strip().lower()
    except OSError:
        return ""


class PciBus:
    """The bus as last scanned, and which of its GPUs NVML does not list."""

    def __init__(self, root: str | None = PCI_ROOT) -> None:
        self._root = root
        self._gpus: tuple[str, ...] = ()
        self._next = 0.0
        self._scanned = False

    def absent(self, now: float, nvml_bus_ids: list[str]) -> tuple[str, ...]:
        """The bus's GPUs whose address no NVML bus id names (None root: not judged)."""
        if self._root is None:
            return ()
        if not self._scanned or now >= self._next:
            self._gpus = nvidia_gpus(self._root)
            self._next, self._scanned = now + SCAN_EVERY_S, True
        if not self._gpus:
            return ()
        listed = {address_key(b) for b in nvml_bus_ids}
        return tuple(a for a in self._gpus if address_key(a) not in listed)
