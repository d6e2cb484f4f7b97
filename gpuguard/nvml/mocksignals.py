"""The mock backend's scenario keys for the health signals (docs/scenario.md): their validation and what
each does to a mock GPU's reading.

A mock GPU reads like an HGX GPU at rest: 18 NVLinks active with no errors, a PCIe Gen5 x16 link at its
maximum, no PCIe replays, no clock event, a valid InfoROM, no fabric (a key that sets the fabric brings it).
`on_bus` is not a reading of the GPU: the backend keeps it (false: on the PCI bus, absent from NVML).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TypeGuard

from gpuguard.core.errors import ScenarioError
from gpuguard.core.model import GpuReading, SignalReadings

MOCK_LINKS = 18
FABRIC_STATES = {"not_started": 1, "in_progress": 2, "completed": 3}
# nvml.h NVML_GPU_FABRIC_HEALTH_MASK_*: every field FALSE (2) reads healthy; DEGRADED_BW TRUE (1) degraded.
HEALTHY_MASK = 0b10101010
DEGRADED_BW_MASK = 0b10101001
CLOCK_EVENTS = {"hw_slowdown": 0x08, "hw_thermal": 0x40, "hw_power_brake": 0x80}
PCIE_WIDTHS = (1, 2, 4, 8, 12, 16, 32)
_NVML_RETURN = re.compile(r"^[A-Z][A-Z_]{1,40}$")

KEYS = (
    "fabric_state",
    "fabric_status",
    "fabric_degraded",
    "nvlink_down",
    "nvlink_errors",
    "pcie_width",
    "pcie_gen",
    "pcie_replays",
    "clock_events",
    "retired_pending",
    "inforom_valid",
    "on_bus",
)
_BOOLS = {"fabric_degraded", "retired_pending", "inforom_valid", "on_bus"}
_COUNTS = {"nvlink_errors", "pcie_replays"}

Value = int | bool | str | tuple[int, ...] | tuple[str, ...]

AT_REST = SignalReadings(
    nvlink_active=frozenset(range(MOCK_LINKS)),
    nvlink_links=MOCK_LINKS,
    nvlink_errors=0,
    pcie_width=16,
    pcie_max_width=16,
    pcie_gen=5,
    pcie_max_gen=5,
    pcie_replays=0,
    clock_events=0,
    inforom_valid=True,
)


def parse(key: str, value: object, where: str) -> Value:
    """A validated value for one of KEYS; ScenarioError (one line, names the event) otherwise."""
    if key in _BOOLS:
        if not isinstance(value, bool):
            raise ScenarioError(f"{where}: '{key}' must be true or false")
        return value
    if key in _COUNTS:
        if not _is_int(value) or not 0 <= value <= 2**32 - 1:
            raise ScenarioError(f"{where}: '{key}' must be a count 0..4294967295 (added to the counter)")
        return value
    if key == "fabric_state":
        if not isinstance(value, str) or value not in FABRIC_STATES:
            raise ScenarioError(f"{where}: 'fabric_state' must be one of {', '.join(FABRIC_STATES)}")
        return str(value)
    if key == "fabric_status":
        if not isinstance(value, str) or not _NVML_RETURN.match(value):
            raise ScenarioError(f"{where}: 'fabric_status' must be an NVML return name such as SUCCESS")
        return value
    if key == "nvlink_down":
        if not isinstance(value, list) or not all(_is_int(v) and 0 <= v < MOCK_LINKS for v in value):
            raise ScenarioError(f"{where}: 'nvlink_down' must be a list of link numbers 0..{MOCK_LINKS - 1}")
        return tuple(sorted(set(value)))
    if key == "pcie_width":
        if not _is_int(value) or value not in PCIE_WIDTHS:
            raise ScenarioError(f"{where}: 'pcie_width' must be one of {', '.join(map(str, PCIE_WIDTHS))}")
        return value
    if key == "pcie_gen":
        if not _is_int(value) or not 1 <= value <= 6:
            raise ScenarioError(f"{where}: 'pcie_gen' must be a PCIe generation 1..6")
        return value
    if key == "clock_events":
        if not isinstance(value, list) or not all(isinstance(v, str) and v in CLOCK_EVENTS for v in value):
            raise ScenarioError(
                f"{where}: 'clock_events' must be a list of {', '.join(CLOCK_EVENTS)} ([] for none)"
            )
        return tuple(str(v) for v in value)
    raise ScenarioError(f"{where}: unknown key {key!r}")  # pragma: no cover - KEYS and this agree


def apply(g: GpuReading, key: str, value: Value) -> GpuReading:
    """The GPU's reading once the event applied (on_bus is the backend's, not the reading's)."""
    s = g.signals
    if key == "retired_pending":
        return replace(g, retired_pending=bool(value), retired_pages=g.retired_pages or 0)
    if key == "fabric_state":
        s = replace(_fabric(s), fabric_state=FABRIC_STATES[str(value)])
    elif key == "fabric_status":
        s = replace(_fabric(s), fabric_status=str(value))
    elif key == "fabric_degraded":
        s = replace(_fabric(s), fabric_health=DEGRADED_BW_MASK if value else HEALTHY_MASK)
    elif key == "nvlink_down" and isinstance(value, tuple):
        s = replace(s, nvlink_active=frozenset(range(MOCK_LINKS)) - {int(v) for v in value})
    elif key == "nvlink_errors":
        s = replace(s, nvlink_errors=(s.nvlink_errors or 0) + as_int(value))
    elif key == "pcie_width":
        s = replace(s, pcie_width=as_int(value))
    elif key == "pcie_gen":
        s = replace(s, pcie_gen=as_int(value))
    elif key == "pcie_replays":
        s = replace(s, pcie_replays=(s.pcie_replays or 0) + as_int(value))
    elif key == "clock_events" and isinstance(value, tuple):
        s = replace(s, clock_events=sum(CLOCK_EVENTS[str(v)] for v in value))
    elif key == "inforom_valid":
        s = replace(s, inforom_valid=bool(value))
    return replace(g, signals=s)


def _fabric(s: SignalReadings) -> SignalReadings:
    """A fabric appears completed and healthy the first time a key touches it."""
    if s.fabric_state is not None:
        return s
    return replace(s, fabric_state=3, fabric_status="SUCCESS", fabric_health=HEALTHY_MASK)


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def as_int(v: Value) -> int:
    """An integer value parse() let through (a count, a width, an Xid code)."""
    if not isinstance(v, int):
        raise TypeError(f"not an integer: {v!r}")
    return int(v)
