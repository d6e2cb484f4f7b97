"""The health signals as data: the table shipped in gpuguard/core/data/signals.json, loaded and
validated once, and the levels it may give.

Each signal names what it reads, its default level (`fault`: quarantined as today; `degraded`: shown and
scheduled around softly; `ignore`: read, shown, not judged), its threshold and window, and the NVIDIA or
DCGM source of those numbers. gpuguard.core.signalconfig changes levels and numbers from a --signals-config
file; gpuguard.judge.signals applies them. Its `expected` section holds, per GPU product (the NVML device
name), the NVLink links and PCIe width the product has, each with its NVIDIA source: `nvlink-down` and
`pcie-width` compare every reading with them too, so a GPU is judged at first sight. Standard library only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from importlib import resources

from gpuguard.core.errors import ConfigError
from gpuguard.core.hardware import NVLINK_MAX_LINKS, PCIE_WIDTHS

FAULT = "fault"
DEGRADED = "degraded"
IGNORE = "ignore"
LEVELS = (FAULT, DEGRADED, IGNORE)
# Windows longer than a day would keep samples for a day per GPU: no signal needs that.
MAX_WINDOW_S = 86400.0
# nvml.h NVML_DEVICE_NAME_V2_BUFFER_SIZE: a product name longer than 95 characters is no NVML device name.
MAX_PRODUCT_CHARS = 95
MAX_PRODUCTS = 256


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
class Expected:
    """What a GPU product has when nothing is wrong with it (0: none expected, the baseline alone judges)."""

    nvlink_links: int
    """NVLink links active on a healthy GPU of this product (nvml.h NVML_FI_DEV_NVLINK_LINK_COUNT's links)."""
    pcie_width: int
    """The PCIe link width it trains to (nvmlDeviceGetCurrPcieLinkWidth on a healthy GPU)."""
    source: str = ""
    """Where the numbers come from: NVIDIA's datasheets and docs, or the --signals-config file."""


Products = tuple[tuple[str, Expected], ...]


@dataclass(frozen=True)
class SignalTable:
    """Every signal by name, in the table's order, and what each GPU product is expected to have. Frozen: a
    change makes a new table (`changed`, `expecting`)."""

    signals: tuple[Signal, ...]
    expected: Products = ()

    @cached_property
    def _by_name(self) -> dict[str, Signal]:
        return {s.name: s for s in self.signals}

    @cached_property
    def products(self) -> dict[str, Expected]:
        """The expected values by NVML device name, exactly as nvmlDeviceGetName returns it."""
        return dict(self.expected)

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
        return replace(self, signals=tuple(new if s.name == name else s for s in self.signals))

    def expecting(self, product: object, change: object, *, where: str) -> SignalTable:
        """This table with one product's expected values changed (a mapping of nvlink_links and/or
        pcie_width) or removed (None: its GPUs are judged against their baseline only); ConfigError (one
        line, names `where`) for a bad name or value."""
        if not isinstance(product, str) or not 0 < len(product) <= MAX_PRODUCT_CHARS:
            raise ConfigError(f"{where}: {product!r} is not a GPU product name (as NVML names the device)")
        kept = tuple((p, e) for p, e in self.expected if p != product)
        if change is None:
            return replace(self, expected=kept)
        if not isinstance(change, dict) or not change or set(change) - {"nvlink_links", "pcie_width"}:
            raise ConfigError(
                f"{where}: {product}: expected a mapping of nvlink_links and/or pcie_width, or null"
            )
        current = self.products.get(product, Expected(0, 0))
        new = check_expected({**change, "source": where}, where=f"{where}: {product}", base=current)
        if len(kept) >= MAX_PRODUCTS:
            raise ConfigError(f"{where}: more than {MAX_PRODUCTS} GPU products")
        return replace(self, expected=(*kept, (product, new)))


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


def check_expected(raw: Mapping[str, object], *, where: str, base: Expected | None = None) -> Expected:
    """One product's values, checked: NVLink links 0..36 (nvml.h NVML_NVLINK_MAX_LINKS), a PCIe width a link
    can have (or 0: none expected)."""
    base = base or Expected(0, 0)
    links = raw.get("nvlink_links", base.nvlink_links)
    width = raw.get("pcie_width", base.pcie_width)
    if isinstance(links, bool) or not isinstance(links, int) or not 0 <= links <= NVLINK_MAX_LINKS:
        raise ConfigError(f"{where}.nvlink_links must be an integer 0..{NVLINK_MAX_LINKS}, not {links!r}")
    if isinstance(width, bool) or not isinstance(width, int) or (width and width not in PCIE_WIDTHS):
        widths = ", ".join(map(str, sorted(PCIE_WIDTHS)))
        raise ConfigError(f"{where}.pcie_width must be 0 or one of {widths}, not {width!r}")
    return Expected(nvlink_links=links, pcie_width=width, source=str(raw.get("source", base.source)))


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
    products = []
    for e in doc["expected"]:
        if not str(e["source"]).strip():
            raise ConfigError(f"signals.json: expected {e['product']}: no source")
        products.append(
            (str(e["product"]), check_expected(e, where=f"signals.json: expected {e['product']}"))
        )
    if len({p for p, _ in products}) != len(products):
        raise ConfigError("signals.json: duplicate expected product")
    return SignalTable(tuple(signals), tuple(products))


SIGNALS = load()
