"""The health signals judged: one snapshot's readings + the signal table + what the judge remembers ->
faults and `degraded` reasons, per GPU and for the node.

Pure: no I/O, no NVML, no clock (the snapshot's `taken_at` is the time base of every window). What is not
applicable reads None and is never judged; a signal whose read failed this pass (a transient error) keeps its
last judgement: never a fault, never a clear. Baselines ("the first good reading") are SignalMemory's
`first_*`; the agent keeps them across restarts in --state-dir (gpuguard.store.baselines) and hands them back
in the restored verdict, so a restarted agent judges against the same first reading.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gpuguard.core.hardware import pcie_gen_ok
from gpuguard.core.model import (
    GPU_MISSING,
    Fault,
    GpuReading,
    GpuVerdict,
    SignalMemory,
    Snapshot,
    Verdict,
)
from gpuguard.core.signaltable import DEGRADED, FAULT, IGNORE, Expected, Signal, SignalTable
from gpuguard.judge import links
from gpuguard.judge.cadence import Samples, sighted

# nvml.h NVML_GPU_FABRIC_STATE_*.
FABRIC_STATES = {1: "NOT_STARTED", 2: "IN_PROGRESS", 3: "COMPLETED"}
FABRIC_COMPLETED = 3
# nvml.h NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_*: each 2-bit field reads 1 (TRUE) when the condition holds.
FABRIC_HEALTH = (
    ("degraded bandwidth", 0),
    ("route recovery", 2),
    ("route unhealthy", 4),
    ("access timeout", 6),
)
# nvml.h nvmlClocksEventReason* bits.
CLOCK_BITS = {
    "clock-hw-slowdown": (0x08, "HW slowdown"),
    "clock-hw-thermal": (0x40, "HW thermal slowdown"),
    "clock-power-brake": (0x80, "HW power brake slowdown"),
}
_CLOCK_MASK = 0x08 | 0x40 | 0x80
# Which read feeds each signal: the prefix the backend gives a failed read in GpuReading.transient_errors.
SOURCES = {
    "fabric-incomplete": "fabric",
    "fabric-status": "fabric",
    "fabric-degraded": "fabric",
    "nvlink-down": "nvlink",
    "nvlink-errors": "fields",
    "pcie-replays": "fields",
    "pcie-width": "pcie",
    "pcie-width-max": "pcie",
    "pcie-gen": "pcie",
    "clock-hw-slowdown": "clocks",
    "clock-hw-thermal": "clocks",
    "clock-power-brake": "clocks",
    "retired-pages": "retired",
    "retired-pending": "retired",
    "row-remap-pending": "remap",
    "inforom-invalid": "inforom",
}

_ALL_SOURCES = frozenset(SOURCES.values())


@dataclass(frozen=True)
class SignalOutcome:
    gpu_faults: dict[str, tuple[Fault, ...]] = field(default_factory=dict)
    gpu_degraded: dict[str, tuple[Fault, ...]] = field(default_factory=dict)
    node_faults: tuple[Fault, ...] = ()
    node_degraded: tuple[Fault, ...] = ()
    memory: SignalMemory = field(default_factory=SignalMemory)


@dataclass
class _Memory:
    """SignalMemory while one judgement changes it."""

    links: dict[str, frozenset[int]]
    width: dict[str, int]
    gen: dict[str, int]
    counters: dict[str, Samples]
    clocks: dict[str, Samples]
    fabric_since: dict[str, float]
    booted_at: float | None = None  # the snapshot's, not remembered
    interval: float = 0.0  # the policy's --interval, not remembered
    known: frozenset[str] = frozenset()  # the GPUs the previous verdict judged, not remembered
    products: dict[str, Expected] = field(default_factory=dict)  # the table's, by NVML device name
    fabric_runs: dict[str, tuple[float, float, float | None]] = field(default_factory=dict)

    @classmethod
    def of(cls, m: SignalMemory) -> _Memory:
        return cls(
            dict(m.first_links),
            dict(m.first_width),
            dict(m.first_gen),
            dict(m.counters),
            dict(m.clock_samples),
            dict(m.fabric_incomplete_since),
            fabric_runs=dict(m.fabric_runs),
        )

    def keep(self, judged: set[str]) -> None:
        """Drop the windows of GPUs not judged (lost, gone): never judged again, they stay pending."""
        self.counters = {k: v for k, v in self.counters.items() if k.rsplit("/", 1)[0] in judged}
        self.clocks = {u: v for u, v in self.clocks.items() if u in judged}
        self.fabric_since = {u: v for u, v in self.fabric_since.items() if u in judged}
        self.fabric_runs = {u: v for u, v in self.fabric_runs.items() if u in judged}

    def frozen(self, previous: SignalMemory) -> SignalMemory:
        m = SignalMemory(
            first_links=tuple(self.links.items()),
            first_width=tuple(self.width.items()),
            first_gen=tuple(self.gen.items()),
            counters=tuple(self.counters.items()),
            clock_samples=tuple(self.clocks.items()),
            fabric_incomplete_since=tuple(self.fabric_since.items()),
            fabric_runs=tuple(self.fabric_runs.items()),
        )
        return previous if m == previous else m  # a steady node keeps one object


def judge(snapshot: Snapshot, *, previous: Verdict, table: SignalTable, interval: float) -> SignalOutcome:
    """Judge every signal of every GPU the snapshot read, and the PCI bus against NVML."""
    mem = _Memory.of(previous.signal_memory)
    mem.booted_at, mem.interval = snapshot.booted_at, interval
    prev_by_uuid = {g.uuid: g for g in previous.gpus}
    mem.known = frozenset(prev_by_uuid)
    mem.products = table.products
    faults: dict[str, tuple[Fault, ...]] = {}
    degraded: dict[str, tuple[Fault, ...]] = {}
    for g in snapshot.gpus:
        if g.lost:
            continue
        found = _gpu(g, mem, table, snapshot.taken_at, prev_by_uuid.get(g.uuid))
        faults[g.uuid] = tuple(f for level, f in found if level == FAULT)
        degraded[g.uuid] = tuple(f for level, f in found if level == DEGRADED)
    mem.keep({g.uuid for g in snapshot.gpus if not g.lost})  # baselines stay: the file drops gone GPUs
    bus = table["gpu-missing"]
    node = _bus_only(snapshot, previous)
    return SignalOutcome(
        gpu_faults=faults,
        gpu_degraded=degraded,
        node_faults=node if bus.level == FAULT else (),
        node_degraded=node if bus.level == DEGRADED else (),
        memory=mem.frozen(previous.signal_memory),
    )


def _bus_only(snapshot: Snapshot, previous: Verdict) -> tuple[Fault, ...]:
    """NVIDIA GPUs on the PCI bus that NVML does not list, as one node fault (its key is the node's). GPUs
    NVML listed before and lost are gpu-missing of their own already: only a surplus is new."""
    listed = {g.uuid for g in snapshot.gpus}
    gone = sum(1 for _, uuid, _ in previous.known if uuid not in listed)
    if len(snapshot.bus_only) <= gone:
        return ()
    addresses = ", ".join(snapshot.bus_only)
    count = len(snapshot.bus_only)
    what = (
        f"an NVIDIA GPU at PCI {addresses} is"
        if count == 1
        else f"{count} NVIDIA GPUs at PCI {addresses} are"
    )
    return (Fault(GPU_MISSING, f"{what} on the PCI bus but absent from NVML"),)


def _gpu(
    g: GpuReading, mem: _Memory, table: SignalTable, now: float, prev: GpuVerdict | None
) -> list[tuple[str, Fault]]:
    failed = frozenset(e.split(":", 1)[0] for e in g.transient_errors)
    if g.unresponsive is not None or g.unreadable:
        # The values are the last ones read (a call in flight, or nothing answered): no reading this pass.
        failed = _ALL_SOURCES
    found: list[tuple[str, Fault]] = []
    rules, clock_window = _plan(table)
    if "clocks" not in failed:
        _clock_sample(g, mem, now, clock_window)
    for s, rule, source in rules:
        if failed and source in failed:
            # No reading this pass: the last judgement stands (and the memory is left as it was).
            found.extend((s.level, f) for f in _last(prev, s.name))
            continue
        detail = rule(g, s, mem, now)
        if detail:
            where = f"(GPU {g.index}, {g.uuid})"
            found.append((s.level, Fault(s.name, f"{detail} {where}", uuid=g.uuid, gpu_index=g.index)))
    return found


Rule = Callable[["GpuReading", Signal, "_Memory", float], str]
# The table's judged signals (rules, sources) and longest clock window: once per table, not per GPU and check.
_PLANS: dict[int, tuple[SignalTable, tuple[tuple[Signal, Rule, str], ...], float]] = {}


def _plan(table: SignalTable) -> tuple[tuple[tuple[Signal, Rule, str], ...], float]:
    cached = _PLANS.get(id(table))
    if cached is None or cached[0] is not table:
        # A signal the table ignores is not judged at all (nor its baseline kept).
        rules = tuple(
            (s, _RULES[s.name], SOURCES[s.name]) for s in table if s.name in _RULES and s.level != IGNORE
        )
        window = max(table[name].window_s for name in CLOCK_BITS)
        if len(_PLANS) > 64:
            _PLANS.clear()  # tables come from the settings: a handful per process
        cached = _PLANS[id(table)] = (table, rules, window)
    return cached[1], cached[2]


def _last(prev: GpuVerdict | None, name: str) -> tuple[Fault, ...]:
    if prev is None:
        return ()
    return tuple(f for f in prev.faults + prev.degraded if f.reason == name)


def _fabric_incomplete(g: GpuReading, s: Signal, mem: _Memory, now: float) -> str:
    state = g.signals.fabric_state
    if state is None or state not in FABRIC_STATES:
        mem.fabric_since.pop(g.uuid, None)
        mem.fabric_runs.pop(g.uuid, None)
        return ""
    run, start = mem.fabric_runs.get(g.uuid), mem.fabric_since.get(g.uuid)
    if state == FABRIC_COMPLETED:
        if run is not None and start is not None:
            # Held across a flap: the time incomplete so far is kept until the fabric stays COMPLETED for a
            # whole grace (a probe IN_PROGRESS 90% of the time in stints shorter than the grace faults).
            spent, last, ok_since = run
            if ok_since is None:
                spent, ok_since = spent + now - last, now
            if now - ok_since < s.window_s:
                mem.fabric_runs[g.uuid] = (spent, now, ok_since)
                return ""
        mem.fabric_since.pop(g.uuid, None)
        mem.fabric_runs.pop(g.uuid, None)
        return ""
    # A fresh run: none yet, or the fabric read COMPLETED a whole grace since the last reading.
    if run is None or start is None or (run[2] is not None and now - run[2] >= s.window_s):
        # From the host's boot for a GPU new to this judge (a late agent, `check`: no second grace), else from
        # this reading: a GPU re-registering (a GPU reset, a Fabric Manager restart) gets its whole grace.
        boot = mem.booted_at
        start = boot if boot is not None and boot < now and g.uuid not in mem.known else now
        mem.fabric_since[g.uuid] = start
        spent = now - start
    else:
        spent, last, ok_since = run
        spent += now - last if ok_since is None else 0.0  # the time since the last reading, as it read
    mem.fabric_runs[g.uuid] = (spent, now, None)
    if spent < s.window_s:
        return ""
    after = "the host booted" if start == mem.booted_at else "it was first read so"
    flaps = "" if spent >= now - start - 1e-9 else f", {spent:.0f} s of it incomplete across flaps"
    return (
        f"the GPU fabric probe is {FABRIC_STATES[state]} {now - start:.0f} s after {after}{flaps} "
        f"(grace {s.window_s:.0f} s): Fabric Manager has not registered the GPU, CUDA answers 'system not "
        "yet initialized'"
    )


def _fabric_status(g: GpuReading, s: Signal, mem: _Memory, now: float) -> str:
    status = g.signals.fabric_status
    if g.signals.fabric_state != FABRIC_COMPLETED or status in (None, "SUCCESS"):
        return ""
    return f"the GPU fabric registration completed with status {status}"


def _fabric_degraded(g: GpuReading, s: Signal, mem: _Memory, now: float) -> str:
    mask = g.signals.fabric_health
    if g.signals.fabric_state != FABRIC_COMPLETED or mask is None:
        return ""
    bad = [name for name, shift in FABRIC_HEALTH if (mask >> shift) & 0x3 == 1]
    return f"the GPU fabric health mask reads {', '.join(bad)}" if bad else ""


def _nvlink_down(g: GpuReading, s: Signal, mem: _Memory, now: float) -> str:
    trained = g.signals.fabric_state in (None, FABRIC_COMPLETED)
    return links.nvlink_down(g, s, mem.links, mem.products.get(g.name), trained=trained)


def _counter(key: str, value: int | None, s: Signal, mem: _Memory, now: float) -> int | None:
    """The counter's increase over the last window_s, from its change points (time, total): a steady
    counter stores nothing new. A counter that went down (a driver reload) starts again."""
    if value is None:
        return None
    samples = mem.counters.get(key, ())
    if samples and value < samples[-1][1]:
        samples = ()
    if not samples or samples[-1][1] != value:
        samples += ((now, value),)
    cut = now - s.window_s
    first = 0
    for i, (t, _) in enumerate(samples):
        if t > cut:
            break
        first = i  # the last change at or before the window's start: the value the window starts from
    samples = samples[first:]
    mem.counters[key] = samples
    return value - samples[0][1]


def _nvlink_errors(g: GpuReading, s: Signal, mem: _Memory, now: float) -> str:
    added = _counter(f"{g.uuid}/nvlink", g.signals.nvlink_errors, s, mem, now)
    if added is None or added <= s.threshold:
        return ""
    return f"{added} NVLink CRC/replay/recovery errors within {s.window_s:.0f} s (limit {s.threshold:g})"


def _pcie_replays(g: GpuReading, s: Signal, mem: _Memory, now: float) -> str:
    added = _counter(f"{g.uuid}/pcie", g.signals.pcie_replays, s, mem, now)
    if added is None or added <= s.threshold:
        return ""
    return f"{added} PCIe replays within {s.window_s:.0f} s (limit {s.threshold:g})"


def _pcie_width(g: GpuReading, s: Signal, mem: _Memory, now: float) -> str:
    return links.pcie_width(g, s, mem.width, mem.products.get(g.name))


def _pcie_width_max(g: GpuReading, s: Signal, mem: _Memory, now: float) -> str:
    width, top = g.signals.pcie_width, g.signals.pcie_max_width
    if width is None or top is None or width >= top - s.threshold:
        return ""
    return f"PCIe link width x{width}, the device's maximum is x{top}"


def _pcie_gen(g: GpuReading, s: Signal, mem: _Memory, now: float) -> str:
    gen = g.signals.pcie_gen
    if not gen or not pcie_gen_ok(gen):  # None, 0, or none a link can have: no reading, as a width of 0
        return ""
    first = mem.gen.setdefault(g.uuid, gen)
    if gen >= first - s.threshold:
        return ""
    return f"PCIe link generation {gen}, {first} at the first reading"


def _clock(g: GpuReading, s: Signal, mem: _Memory, now: float) -> str:
    if g.uuid not in mem.clocks:
        return ""
    bit, what = CLOCK_BITS[s.name]
    seen = sum(1 for t, m in mem.clocks.get(g.uuid, ()) if m & bit and t > now - s.window_s)
    if seen <= s.threshold:
        return ""
    at = f"--interval {mem.interval:g}"
    return f"{what} in {seen} checks at {at} within {s.window_s:.0f} s (limit {s.threshold:g})"


def _clock_sample(g: GpuReading, mem: _Memory, now: float, keep_s: float) -> None:
    """One sample per sighting of a HW clock event (cadence.sighted), kept for the longest clock window."""
    samples = mem.clocks.get(g.uuid, ())
    mask = g.signals.clock_events
    if mask is not None and mask & _CLOCK_MASK:
        samples = sighted(samples, now, mask, mem.interval)
    if samples and samples[0][0] <= now - keep_s:
        samples = tuple(x for x in samples if x[0] > now - keep_s)
    if samples:
        mem.clocks[g.uuid] = samples
    else:
        mem.clocks.pop(g.uuid, None)


def _retired_pages(g: GpuReading, s: Signal, mem: _Memory, now: float) -> str:
    count = g.retired_pages
    if count is None or count < max(s.threshold, 1):
        return ""
    return f"{count} pages retired, NVIDIA's limit is {s.threshold:g}"


def _retired_pending(g: GpuReading, s: Signal, mem: _Memory, now: float) -> str:
    return "pages are pending retirement (a GPU reset or reboot retires them)" if g.retired_pending else ""


def _remap_pending(g: GpuReading, s: Signal, mem: _Memory, now: float) -> str:
    return "a row remap is pending (the next GPU reset applies it)" if g.remap_pending else ""


def _inforom(g: GpuReading, s: Signal, mem: _Memory, now: float) -> str:
    invalid = g.signals.inforom_valid is False
    return "the InfoROM is corrupted (nvmlDeviceValidateInforom: CORRUPTED_INFOROM)" if invalid else ""


_RULES: dict[str, Callable[[GpuReading, Signal, _Memory, float], str]] = {
    "fabric-incomplete": _fabric_incomplete,
    "fabric-status": _fabric_status,
    "fabric-degraded": _fabric_degraded,
    "nvlink-down": _nvlink_down,
    "nvlink-errors": _nvlink_errors,
    "pcie-width": _pcie_width,
    "pcie-width-max": _pcie_width_max,
    "pcie-gen": _pcie_gen,
    "pcie-replays": _pcie_replays,
    "clock-hw-slowdown": _clock,
    "clock-hw-thermal": _clock,
    "clock-power-brake": _clock,
    "retired-pages": _retired_pages,
    "retired-pending": _retired_pending,
    "row-remap-pending": _remap_pending,
    "inforom-invalid": _inforom,
}
