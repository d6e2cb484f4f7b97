"""The mock backend: a scenario file drives what the GPUs report, so the whole agent runs with no GPU.

The scenario format is a public contract (tests outside the project use it): see docs/scenario.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, TypeGuard

from gpuguard.core import files
from gpuguard.core.errors import ScenarioError
from gpuguard.core.model import GpuReading, SignalReadings, Snapshot, XidEvent
from gpuguard.nvml import mocksignals
from gpuguard.nvml.base import Wakeup, wait_for
from gpuguard.nvml.kmsg.records import driver_record, nvml_pci_address

DEFAULT_SCENARIO = "demo.yaml"

_DEVICE_KEYS = {"index", "uuid", "name", "pci_bus_id"}
# Event actions and the type each takes.
_ACTIONS: dict[str, type] = {
    "ecc_uncorrected": int,
    "xid": int,
    "kernel_xid": int,
    "lost": bool,
    "remove": bool,
    "ecc_supported": bool,
    "row_remap_failure": bool,
    "row_remap_pending": bool,
}
# An Xid the driver raises: NVML's event and the kernel's line (`xid`), or the line alone (`kernel_xid`).
_XIDS = ("xid", "kernel_xid")
_MAX_GPUS = 1024
# A scenario of 1,024 GPUs and tens of thousands of events fits; /dev/zero or a stray log file does not.
MAX_BYTES = 4 * files.MIB


@dataclass(frozen=True)
class ScenarioEvent:
    at: float
    gpu: int
    actions: tuple[tuple[str, mocksignals.Value], ...]


@dataclass(frozen=True)
class Scenario:
    devices: tuple[GpuReading, ...]
    events: tuple[ScenarioEvent, ...]
    kernel_log: bool = False
    """The mock's driver writes its kernel log, a fresh file at --kernel-log (docs/scenario.md)."""


def load_scenario(path: str | Path | None) -> Scenario:
    """Read and validate a scenario file (None: the embedded demo). Raises ScenarioError, one line."""
    if path is None:
        text = resources.files("gpuguard.nvml.examples").joinpath(DEFAULT_SCENARIO).read_text("utf-8")
        return parse_scenario(text, source=f"<embedded {DEFAULT_SCENARIO}>")
    text = files.read_text(path, limit=MAX_BYTES, what="scenario", error=ScenarioError)
    return parse_scenario(text, source=str(path))


def parse_scenario(text: str, *, source: str = "<scenario>") -> Scenario:
    doc = files.parse_yaml(text, what=f"scenario {source}", error=ScenarioError)
    if not isinstance(doc, dict):
        raise ScenarioError(f"scenario {source}: expected a mapping with 'gpus' or 'devices'")
    unknown = set(doc) - {"gpus", "devices", "events", "kernel_log"}
    if unknown:
        raise ScenarioError(f"scenario {source}: unknown key {_names(unknown)}")
    devices = _parse_devices(doc, source)
    indices = {d.index for d in devices}
    raw_events = doc.get("events") or []
    if not isinstance(raw_events, list):
        raise ScenarioError(f"scenario {source}: 'events' must be a list")
    events = [_parse_event(i, e, indices, source) for i, e in enumerate(raw_events)]
    events.sort(key=lambda e: e.at)  # stable: same-time events keep file order
    kernel_log = doc.get("kernel_log", False)
    if not isinstance(kernel_log, bool):
        raise ScenarioError(f"scenario {source}: 'kernel_log' must be true or false")
    return Scenario(devices=devices, events=tuple(events), kernel_log=kernel_log)


def _parse_devices(doc: Mapping[str, Any], source: str) -> tuple[GpuReading, ...]:
    if ("gpus" in doc) == ("devices" in doc):
        raise ScenarioError(f"scenario {source}: give exactly one of 'gpus' or 'devices'")
    if "gpus" in doc:
        n = doc["gpus"]
        if not _is_int(n) or not 0 <= n <= _MAX_GPUS:
            raise ScenarioError(f"scenario {source}: 'gpus' must be an integer 0..{_MAX_GPUS}")
        return tuple(_default_device(i) for i in range(n))
    raw = doc["devices"]
    if not isinstance(raw, list) or len(raw) > _MAX_GPUS:
        raise ScenarioError(f"scenario {source}: 'devices' must be a list of at most {_MAX_GPUS}")
    devices: list[GpuReading] = []
    for pos, d in enumerate(raw):
        where = f"scenario {source}: devices[{pos}]"
        if not isinstance(d, dict):
            raise ScenarioError(f"{where}: expected a mapping like {{index: 0, uuid: GPU-...}}")
        unknown = set(d) - _DEVICE_KEYS
        if unknown:
            raise ScenarioError(f"{where}: unknown key {_names(unknown)}")
        index = d.get("index")
        if not _is_int(index) or index < 0:
            raise ScenarioError(f"{where}: 'index' must be a non-negative integer")
        base = _default_device(index)
        for key in ("uuid", "name", "pci_bus_id"):
            if key in d and (not isinstance(d[key], str) or not d[key] or len(d[key]) > 256):
                raise ScenarioError(f"{where}: '{key}' must be a non-empty string")
        devices.append(
            replace(
                base,
                uuid=d.get("uuid", base.uuid),
                name=d.get("name", base.name),
                pci_bus_id=d.get("pci_bus_id", base.pci_bus_id),
            )
        )
    if len({d.index for d in devices}) != len(devices):
        raise ScenarioError(f"scenario {source}: duplicate device index")
    if len({d.uuid for d in devices}) != len(devices):
        raise ScenarioError(f"scenario {source}: duplicate device uuid")
    return tuple(sorted(devices, key=lambda d: d.index))


def _parse_event(pos: int, e: object, indices: set[int], source: str) -> ScenarioEvent:
    where = f"scenario {source}: events[{pos}]"
    if not isinstance(e, dict):
        raise ScenarioError(f"{where}: expected a mapping like {{at: 2.0, gpu: 0, xid: 79}}")
    where = f"{where} ({_summary(e)})"
    unknown = set(e) - {"at", "gpu"} - set(_ACTIONS) - set(mocksignals.KEYS)
    if unknown:
        raise ScenarioError(f"{where}: unknown key {_names(unknown)}")
    at = e.get("at")
    if isinstance(at, bool) or not isinstance(at, int | float) or not 0 <= at < 1e9:
        raise ScenarioError(f"{where}: 'at' must be a number of seconds >= 0")
    gpu = e.get("gpu")
    if not _is_int(gpu):
        raise ScenarioError(f"{where}: 'gpu' must be a device index")
    if gpu not in indices:
        raise ScenarioError(f"{where}: unknown GPU {gpu}")
    actions: list[tuple[str, mocksignals.Value]] = []
    for key, kind in _ACTIONS.items():
        if key not in e:
            continue
        value = e[key]
        if kind is bool:
            if not isinstance(value, bool):
                raise ScenarioError(f"{where}: '{key}' must be true or false")
            if key == "remove" and not value:
                raise ScenarioError(f"{where}: 'remove' can only be true")
        elif not _is_int(value) or value < 0 or value > 2**32 - 1:
            raise ScenarioError(f"{where}: '{key}' must be an integer 0..4294967295")
        actions.append((key, value))
    actions.extend((k, mocksignals.parse(k, e[k], where)) for k in mocksignals.KEYS if k in e)
    if not actions:
        raise ScenarioError(f"{where}: no action (one of {', '.join((*_ACTIONS, *mocksignals.KEYS))})")
    return ScenarioEvent(at=float(at), gpu=gpu, actions=tuple(actions))


def _default_device(index: int) -> GpuReading:
    return GpuReading(
        index=index,
        uuid=f"GPU-mock-{index}",
        name="Mock GPU",
        pci_bus_id=f"00000000:{index + 1:02X}:00.0",
        signals=mocksignals.AT_REST,
    )


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _names(keys: set[Any]) -> str:
    return ", ".join(repr(str(k)) for k in sorted(keys, key=str))


def _summary(e: Mapping[Any, Any]) -> str:
    parts = [f"{k}: {e[k]!r}" for k in ("at", "gpu") if k in e]
    return ", ".join(parts)[:120] or "no at/gpu"


class MockBackend:
    """A real Backend implementation driven by a Scenario and a clock (injectable for tests)."""

    def __init__(
        self,
        scenario: Scenario,
        *,
        clock: Callable[[], float] = time.monotonic,
        start_timer: bool = True,
        start_at: float = 0.0,
        kernel_log: MockKernelLog | None = None,
    ) -> None:
        """start_at: the scenario time at open() (`gpuguard check --at`): events up to it are due at once.
        kernel_log: where the scenario's driver logs its Xids (`xid`, `kernel_xid`), as the real one does."""
        self._scenario = scenario
        self._kernel_log = kernel_log
        self._start_at = start_at
        self._clock = clock
        self._start_timer = start_timer
        self._lock = threading.Lock()
        self._gpus: dict[int, GpuReading] = {d.index: d for d in scenario.devices}
        self._pending_xids: list[XidEvent] = []
        # GPUs on the PCI bus that NVML does not list (`on_bus: false`).
        self._off_nvml: set[int] = set()
        self._next_event = 0
        self._t0: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open(self, wakeup: Wakeup) -> None:
        self._t0 = self._clock()
        if self._start_timer and any(k in _XIDS for ev in self._scenario.events for k, _ in ev.actions):
            # Same wake-up path as the nvml backend's event thread: an Xid does not wait for the poll.
            self._thread = threading.Thread(
                target=self._xid_timer, args=(wakeup,), name="gpuguard-mock-xid", daemon=True
            )
            self._thread.start()

    def snapshot(self) -> Snapshot:
        with self._lock:
            self._apply_due()
            xids = tuple(self._pending_xids)
            self._pending_xids.clear()
            gpus = tuple(self._gpus[i] for i in sorted(self._gpus) if i not in self._off_nvml)
            bus_only = tuple(self._gpus[i].pci_bus_id for i in sorted(self._off_nvml) if i in self._gpus)
            taken_at = self._elapsed()
        return Snapshot(
            gpus=tuple(_as_read(g) for g in gpus),
            xids=xids,
            driver_version="mock",
            bus_only=bus_only,
            taken_at=taken_at,
        )

    def wait(self, until: float, wake: threading.Event) -> None:
        wait_for(until, wake, self._clock)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _elapsed(self) -> float:
        if self._t0 is None:
            raise RuntimeError("MockBackend.snapshot() before open()")
        return self._clock() - self._t0 + self._start_at

    def _apply_due(self) -> None:
        now = self._elapsed()
        events = self._scenario.events
        while self._next_event < len(events) and events[self._next_event].at <= now:
            self._apply(events[self._next_event])
            self._next_event += 1

    def _apply(self, ev: ScenarioEvent) -> None:
        g = self._gpus.get(ev.gpu)
        if g is None:  # removed earlier in the scenario: nothing left to change
            return
        for key, value in ev.actions:
            if key in _XIDS:
                code = mocksignals.as_int(value)
                if key == "xid":  # an NVML event; a `kernel_xid` is one NVML's event set missed
                    self._pending_xids.append(XidEvent(gpu_index=g.index, uuid=g.uuid, code=code))
                if self._kernel_log is not None:
                    self._kernel_log.xid(g.pci_bus_id, code)
            elif key == "remove":
                del self._gpus[ev.gpu]
                return
            elif key == "ecc_uncorrected":
                g = replace(g, ecc_uncorrected=mocksignals.as_int(value))
            elif key == "lost":
                g = replace(g, lost=bool(value))
            elif key == "ecc_supported":
                g = replace(g, ecc_supported=bool(value))
            elif key == "row_remap_failure":
                g = replace(g, remap_failure=bool(value))
            elif key == "row_remap_pending":
                g = replace(g, remap_pending=bool(value))
            elif key == "on_bus":
                (self._off_nvml.discard if value else self._off_nvml.add)(ev.gpu)
            elif key in mocksignals.KEYS:
                g = mocksignals.apply(g, key, value)
        self._gpus[ev.gpu] = g

    def _xid_timer(self, wakeup: Wakeup) -> None:
        for ev in self._scenario.events:
            if not any(k in _XIDS for k, _ in ev.actions):
                continue
            delay = ev.at - self._elapsed()
            if delay > 0 and self._stop.wait(delay):
                return
            wakeup()


class MockKernelLog:
    """The scenario driver's kernel log: records in /dev/kmsg's format appended to a stand-in file, made
    afresh when the scenario starts (its node boots then). Never /dev/kmsg or another device: a regular file
    (or none yet) only, else ScenarioError."""

    def __init__(self, path: str) -> None:
        p = Path(path)
        if p.exists() and not p.is_file():
            raise ScenarioError(f"the scenario's kernel log {path}: not a regular file (the mock writes it)")
        try:
            p.write_bytes(b"")
        except OSError as exc:
            raise ScenarioError(f"the scenario's kernel log {path}: {exc.strerror or exc}") from None
        self._path = p
        self._seq = 0

    def xid(self, pci_bus_id: str, code: int) -> None:
        address = nvml_pci_address(pci_bus_id)
        if address is None:
            return
        self._seq += 1
        with self._path.open("ab") as f:
            f.write(driver_record(self._seq, time.monotonic(), address, code))


def _as_read(g: GpuReading) -> GpuReading:
    """What NVML would report for this state: a lost GPU answers nothing, ECC off reads as N/A."""
    if g.lost:
        return replace(
            g, ecc_uncorrected=None, remap_failure=None, remap_pending=None, signals=SignalReadings()
        )
    if not g.ecc_supported:
        return replace(g, ecc_uncorrected=None)
    return g
