"""The health signals as data: the table shipped in gpuguard/core/data/signals.json, loaded and
validated once, and the levels it may give.

Each signal names what it reads, its default level (`fault`: quarantined as today; `degraded`: shown and
scheduled around softly; `ignore`: read, shown, not judged), its threshold and window, and the NVIDIA or
DCGM source of those numbers. gpuguard.core.signalconfig changes levels and numbers from a --signals-config
file; gpuguard.judge.signals applies them. Standard library only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from importlib import resources

from gpuguard.core.errors import ConfigError

FAULT = "fault"
DEGRADED = "degraded"
IGNORE = "ignore"
LEVELS = (FAULT, DEGRADED, IGNORE)
# Windows longer than a day would keep samples for a day per GPU: no signal needs that.
MAX_WINDOW_S = 86400.0


@dataclass(frozen=True)
class Signal:
    name: str
    level: str
    """fault, degraded or ignore."""
    threshold: float
    """What it counts is the signal's `measure` (links, lanes, errors or checks within the window)."""
    window_s: float
    """Seconds over which a rate is counted (or the grace of fabric-incomplete); 0 where unused."""
    measure: str = ""
    reading: str = ""
    """The NVML call or field (or sysfs path) it reads."""
    source: str = ""
    """Where the threshold and the meaning come from (nvml.h, NVIDIA's guides, DCGM's limits)."""
    dcgm: str = ""
    """The DCGM health watch it matches."""
    repeat: bool = True
    """Whether its faults count toward a GPU's repeat limit (gpuguard.quarantine.repeat.counting): false where
    the
    cause is the node's (the fabric, set up by Fabric Manager), not the GPU's hardware."""
    repeat_why: str = ""


@dataclass(frozen=True)
class SignalTable:
    """Every signal by name, in the table's order. Frozen: a change makes a new table (`changed`)."""

    signals: tuple[Signal, ...]

    @cached_property
    def _by_name(self) -> dict[str, Signal]:
        return {s.name: s for s in self.signals}

    def __getitem__(self, name: str) -> Signal:
        return self._by_name[name]

    def __iter__(self) -> Iterator[Signal]:
        return iter(self.signals)

    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.signals)

    def level(self, name: str) -> str:
        return self[name].level

    def changed(self, name: str, changes: Mapping[str, object], *, where: str) -> SignalTable:
        """This table with one signal's level, threshold or window_s changed; ConfigError (one line, names
        `where`) for an unknown signal or a bad value."""
        if name not in self.names():
            raise ConfigError(f"{where}: unknown signal {name!r} (one of {', '.join(self.names())})")
        unknown = set(changes) - {"level", "threshold", "window_s"}
        if unknown:
            raise ConfigError(f"{where}: {name}: unknown key {', '.join(sorted(map(repr, unknown)))}")
        current = self[name]
        level = changes.get("level", current.level)
        threshold = changes.get("threshold", current.threshold)
        window = changes.get("window_s", current.window_s)
        new = replace(
            current,
            level=check_level(level, where=f"{where}: {name}.level"),
            threshold=_number(threshold, where=f"{where}: {name}.threshold", top=1e15),
            window_s=_number(window, where=f"{where}: {name}.window_s", top=MAX_WINDOW_S),
        )
        return SignalTable(tuple(new if s.name == name else s for s in self.signals))


def check_level(value: object, *, where: str) -> str:
    if not isinstance(value, str) or value not in LEVELS:
        raise ConfigError(f"{where} must be one of {', '.join(LEVELS)}, not {value!r}")
    return value


def _number(value: object, *, where: str, top: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= top:
        raise ConfigError(f"{where} must be a number 0..{top:g}, not {value!r}")
    if math.isnan(value):
        raise ConfigError(f"{where} must be a number, not NaN")
    return float(value)


def _flag(value: object, *, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, not {value!r}")
    return value


def load() -> SignalTable:
    """The shipped table, validated (a broken table fails the import, and the tests, not a node)."""
    doc = json.loads(resources.files("gpuguard.core.data").joinpath("signals.json").read_text("utf-8"))
    signals = []
    for e in doc["signals"]:
        where = f"signals.json: {e['name']}"
        signals.append(
            Signal(
                name=str(e["name"]),
                level=check_level(e["level"], where=f"{where}.level"),
                threshold=_number(e["threshold"], where=f"{where}.threshold", top=1e15),
                window_s=_number(e["window_s"], where=f"{where}.window_s", top=MAX_WINDOW_S),
                measure=str(e["measure"]),
                reading=str(e["reading"]),
                source=str(e["source"]),
                dcgm=str(e["dcgm"]),
                repeat=_flag(e.get("repeat", True), where=f"{where}.repeat"),
                repeat_why=str(e.get("repeat_why", "")),
            )
        )
    if len({s.name for s in signals}) != len(signals):
        raise ConfigError("signals.json: duplicate signal name")
    return SignalTable(tuple(signals))


SIGNALS = load()
