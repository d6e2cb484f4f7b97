"""A backend with the kernel log as a second source of Xids: the inner backend's snapshot (NVML, the mock)
with the kernel's Xids added, each Xid once when both sources report it (docs/design.md, "The kernel log").

"The same Xid": the same GPU (the kernel's PCI address through the inventory's PCI bus IDs), the same code,
and times within SAME_XID_WINDOW_S: NVML's event as it arrived against the kernel record's timestamp, or
against when the reader read it live (both on CLOCK_MONOTONIC; the arrival alone survives a drift between the
kernel's clock and the agent's). Whichever source delivers first is judged; the other's is dropped. Each
report matches at most one of the other's."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import structlog

from gpuguard.core.metrics import Metrics
from gpuguard.core.model import XID_SOURCE_KERNEL, GpuReading, Snapshot, XidEvent
from gpuguard.nvml.base import Backend, Wakeup
from gpuguard.nvml.kmsg.reader import KernelLogReader
from gpuguard.nvml.kmsg.records import KernelXid, nvml_pci_address

log = structlog.get_logger(__name__)

SAME_XID_WINDOW_S = 10.0
"""The driver writes the kernel line and posts NVML's event for one Xid in the same call; the event reaches
the agent within its event thread's wake-up (milliseconds) and the record within the reader's. 10 s holds
both with room for a loaded node, and is short against the same Xid raised again (a new fault to count)."""
RECENT_MOST = 1024
"""Reports remembered for matching: an Xid storm costs memory only up to this."""


class KernelLogBackend:
    def __init__(
        self,
        inner: Backend,
        reader: KernelLogReader,
        *,
        judged: Callable[[], int | None] = lambda: None,
        window: float = SAME_XID_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        once: bool = False,
    ) -> None:
        """`judged`: the last kernel-log sequence number judged in this boot (state file), read at start.
        `once`: no thread; each snapshot reads the whole log after the inner one (`gpuguard check`)."""
        self._inner = inner
        self._once = once
        self._reader = reader
        self._judged = judged
        self._window = window
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: list[tuple[KernelXid, float | None]] = []
        self._pci: dict[str, GpuReading] = {}
        # Reports judged lately, per source: (uuid, code, times it may be matched by) for the other source.
        self._nvml: deque[tuple[str | None, int, tuple[float, ...]]] = deque(maxlen=RECENT_MOST)
        self._kernel: deque[tuple[str | None, int, tuple[float, ...]]] = deque(maxlen=RECENT_MOST)
        self._wakeup: Wakeup = lambda: None
        self.duplicates = 0

    @property
    def longest_wait(self) -> float:
        return float(getattr(self._inner, "longest_wait", 0.0))

    def open(self, wakeup: Wakeup) -> None:
        self._wakeup = wakeup
        # The reader first: an NVML that hangs in its open must not keep the kernel's Xids from being read.
        if not self._once:
            self._reader.start(self._arrived, after=self._judged())
        self._inner.open(wakeup)

    def wait(self, until: float, wake: threading.Event) -> None:
        self._inner.wait(until, wake)

    def close(self) -> None:
        self._reader.stop()
        self._inner.close()

    def _arrived(self, xid: KernelXid, arrived: float | None) -> None:
        with self._lock:
            self._pending.append((xid, arrived))
        self._wakeup()

    def snapshot(self) -> Snapshot:
        snap = self._inner.snapshot()
        if self._once:
            self._reader.read_once(self._arrived)  # after the inner one: what its driver logged is in
        for g in snap.gpus:
            if address := nvml_pci_address(g.pci_bus_id):
                self._pci[address] = g  # kept when NVML no longer answers: the map of the last inventory
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending and not snap.xids:
            return snap
        now = self._clock()
        nvml: list[XidEvent] = []
        for x in snap.xids:
            at = x.at if x.at is not None else now
            if self._matched(self._kernel, x.uuid, x.code, (at,)):
                self._dropped(x)
            else:
                nvml.append(x)
                self._nvml.append((x.uuid, x.code, (at,)))
        kernel: list[XidEvent] = []
        for kx, arrived in pending:
            x = self._event(kx, arrived)
            times = (kx.line.at,) if arrived is None else (kx.line.at, arrived)
            if not kx.sxid and self._matched(self._nvml, x.uuid, x.code, times):
                self._dropped(x)
            else:
                kernel.append(x)
                self._kernel.append((x.uuid, x.code, times))
        self._forget(now)
        seq = max(kx.line.seq for kx, _ in pending) if pending else snap.kernel_seq
        if not kernel and len(nvml) == len(snap.xids) and seq == snap.kernel_seq:
            return snap
        return replace(snap, xids=(*nvml, *kernel), kernel_seq=seq)

    def _event(self, kx: KernelXid, arrived: float | None) -> XidEvent:
        g = None if kx.sxid else self._pci.get(kx.line.pci)
        if g is None and not kx.sxid:
            log.warning("kmsg.xid_unattributed", xid=kx.code, pci=kx.line.pci, seq=kx.line.seq)
        return XidEvent(
            gpu_index=g.index if g else None,
            uuid=g.uuid if g else None,
            code=kx.code,
            source=XID_SOURCE_KERNEL,
            kernel=kx.line,
            sxid=kx.sxid,
            at=arrived,
        )

    def _matched(
        self,
        recent: deque[tuple[str | None, int, tuple[float, ...]]],
        uuid: str | None,
        code: int,
        times: tuple[float, ...],
    ) -> bool:
        """Whether the other source reported this Xid: consumed, so that it matches one report only."""
        for i, (u, c, theirs) in enumerate(recent):
            if u == uuid and c == code and any(abs(a - b) <= self._window for a in times for b in theirs):
                del recent[i]
                return True
        return False

    def _dropped(self, x: XidEvent) -> None:
        self.duplicates += 1
        log.info("xid.duplicate", source=x.source, xid=x.code, uuid=x.uuid, gpu=x.gpu_index)

    def _forget(self, now: float) -> None:
        for recent in (self._nvml, self._kernel):
            while recent and max(recent[0][2]) < now - 2 * self._window:
                recent.popleft()


def kernel_log_backend(
    inner: Backend,
    path: str,
    *,
    metrics: Metrics | None,
    judged: Callable[[], int | None],
    once: bool = False,
) -> KernelLogBackend:
    """`inner` with the kernel log at `path` as a second source, its skipped records counted in `metrics`
    (`once`: read whole at each snapshot, on the caller's thread)."""

    def skipped(why: str) -> None:
        log.warning("kmsg.record_skipped", path=path, why=why)
        if metrics is not None:
            metrics.kernel_log_skipped.labels(why).inc()

    return KernelLogBackend(inner, KernelLogReader(path, on_skipped=skipped), judged=judged, once=once)
