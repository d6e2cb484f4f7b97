"""NvmlBackend: NVML's init and inventory, and the poll (`snapshot()`) that reads every GPU and hands over
the Xids the event path (gpuguard.nvml.real.events) recorded since the last one.

A GPU is known only by its UUID (one NVML cannot identify is reported as unidentified, never under a made-up
name); an init that fails half way is shut down and retried; each GPU's reading says whether its Xids are
watched.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pynvml
import structlog

from gpuguard.core.model import Snapshot
from gpuguard.nvml.base import Wakeup, wait_for
from gpuguard.nvml.real.common import XID_RECOVERY_ACTION, Device, error_name, handle_key, text
from gpuguard.nvml.real.deadline import (
    CALL_DEADLINE_S,
    INIT_DEADLINE_S,
    NODE,
    Abandoned,
    Hang,
    Pass,
    Runner,
)
from gpuguard.nvml.real.events import EventPath
from gpuguard.nvml.real.inventory import UNPLACED, enumerate_gpus
from gpuguard.nvml.real.pcibus import PCI_ROOT, PciBus
from gpuguard.nvml.real.readings import last_reading, read, unresponsive

log = structlog.get_logger(__name__)


class NvmlBackend:
    """Backend on the real NVML library. Every NVML call runs on the reading thread (`deadline.Runner`) or
    the event thread, never on the caller's; our own state is under a lock."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        deadline: float = CALL_DEADLINE_S,
        init_deadline: float = INIT_DEADLINE_S,
        pci_root: str | None = PCI_ROOT,
    ) -> None:
        self._lock = threading.Lock()
        self._initialized = False
        self._driver: str | None = None
        self._count = 0
        self._devices: list[Device] = []
        self._unidentified: list[tuple[int, str]] = []
        self._by_uuid: dict[str, Device] = {}
        self._by_handle: dict[int, Device] = {}
        # The previous pass's snapshot, returned again while nothing it holds changed.
        self._last: Snapshot | None = None
        self._clock = clock
        self._bus = PciBus(pci_root)  # gpu-missing: GPUs on the PCI bus that NVML does not list
        self._runner = Runner(
            deadline=deadline, init_deadline=init_deadline, clock=clock, discarded=self._discarded
        )
        # The event thread's heartbeat is six call deadlines (30 s by default): a wait that has not come back
        # within two of those is stuck (nvml.real.events). Each beat is a wake-up of two threads (the waiter,
        # the watchdog), so it is not shorter: an idle agent's CPU goal (docs/performance.md).
        self._events = EventPath(
            devices=lambda: self._devices,
            attribute=self._attribute,
            clock=clock,
            hung=self._hung_handles,
            heartbeat=6 * deadline,
        )
        self._wakeup: Wakeup = lambda: None
        # What the reading thread read while the caller waited (wait()), handed over by the next snapshot().
        self._ready: Snapshot | Hang | Exception | None = None

    @property
    def longest_wait(self) -> float:
        """The longest snapshot() waits on one NVML call before it reports the call as hung."""
        return self._runner.longest

    # -- Backend protocol ---------------------------------------------------------------------------------

    def open(self, wakeup: Wakeup) -> None:
        self._wakeup = wakeup
        self._events.wakeup = wakeup
        self._events.prepare()

    def wait(self, until: float, wake: threading.Event) -> None:
        """The next pass runs on the reading thread at `until` (or at once on `wake`): the reading thread
        keeps that plan from pass to pass, so an idle poll is one wake-up of it and one of the caller."""
        if self._runner.hung(NODE) is not None:
            wait_for(until, wake, self._clock)  # a node-wide call hangs: no pass until it returns
            return
        try:
            self._ready = self._runner.next(self._read_pass, at=until, early=wake)
        except Exception as exc:  # the pass's own failure: raised by the snapshot() that hands it over
            self._ready = exc

    def snapshot(self) -> Snapshot:
        ready, self._ready = self._ready, None
        if isinstance(ready, Exception):
            raise ready
        node = self._runner.hung(NODE)
        if node is None or ready is not None:
            result = ready if ready is not None else self._runner.run(self._read_pass)
            if isinstance(result, Snapshot):
                return result
            if result.key != NODE:
                self._wakeup()  # read the other GPUs again at once, without the one that hangs
            node = self._runner.hung(NODE)
        return self._hung_snapshot(node)

    def close(self) -> None:
        self._events.watchdog.stop()
        if self._runner.hangs():
            # A call is still in flight: nvml.h defines no shutdown under it; the process's exit ends it.
            self._events.stop_thread()
            log.warning("nvml.shutdown_skipped", why="an NVML call has not returned")
            return
        if not isinstance(self._runner.run(self._close), Hang):  # a Hang is logged; the exit ends it
            self._runner.stop()

    # -- on the reading thread ----------------------------------------------------------------------------

    def _read_pass(self, p: Pass) -> Snapshot:
        if not self._initialized:
            err = self._try_init(p)
            if err is not None:
                return Snapshot(init_error=err, stuck_calls=self._stuck())
        p.at("nvmlDeviceGetCount")
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as exc:
            # One failed count is not a fault: the last readings, the error, and the policy counts the
            # checks it keeps failing (nvml-init after a few in a row).
            log.warning("nvml.device_count_failed", error=error_name(exc), retry="next check")
            return self._hung_snapshot(None, node_error=f"nvmlDeviceGetCount:{error_name(exc)}")
        p.at("nvmlEventSetFree")
        self._events.rebuild_if_asked()
        hung = self._hung_by_uuid()
        if (
            count != self._count
            or self._moved(p, hung)
            or self._unidentified
            or any([d.enumeration_error and not d.lost_at_enumeration for d in self._devices])
        ):
            self._enumerate(count, p)
        self._events.ensure(p)
        hung = self._hung_by_uuid()
        now = self._clock()
        for x in self._events.take_xids(keep=True):
            if x.code == XID_RECOVERY_ACTION and x.uuid in self._by_uuid:
                self._by_uuid[x.uuid].recovery_probe_at = now  # the driver announces an action: read it
        # Whether every registered GPU is watched now: asked once per pass, not once per GPU.
        watched = self._events.all_watched()
        gpus = tuple(
            [
                unresponsive(d, hung[d.uuid], self._events.watch_state(d))
                if d.uuid in hung
                else read(d, True, "", p, now)
                if watched and d.registered
                else read(d, *self._events.watch_state(d), p, now)
                for d in self._devices
            ]
        )
        # Taken only now: a pass given up at its deadline must leave them to the check that reports the hang.
        if p.abandoned:
            raise Abandoned
        xids = self._events.take_xids()
        unidentified = tuple(self._unidentified)
        stuck = self._stuck()
        # A GPU NVML counts but cannot identify has a fault of its own: the bus is compared only without.
        bus_only = () if unidentified else self._bus.absent(now, [d.pci_bus_id for d in self._devices])
        last = self._last
        if (
            last is not None
            and not xids
            and not last.xids
            and last.driver_version == self._driver
            and last.unidentified == unidentified
            and last.unresponsive is None
            and last.stuck_calls == stuck
            and last.gpus == gpus
            and last.bus_only == bus_only
        ):
            # Every GPU read the same as at the previous pass (the same reading objects: the tuples compare
            # by identity first) and no Xid came: the same snapshot, so the agent's remembered evaluation
            # applies without comparing fields.
            return last
        self._last = Snapshot(
            gpus=gpus,
            xids=xids,
            driver_version=self._driver,
            unidentified=unidentified,
            stuck_calls=stuck,
            bus_only=bus_only,
            taken_at=now,
        )
        return self._last

    def _moved(self, p: Pass, hung: dict[str, Hang]) -> bool:
        """Whether any GPU's handle answers another UUID than it was enumerated with (a reorder, a swap, a
        re-plug): then the pass enumerates again before it records a reading, so no reading, Xid or loss is
        ever put on another GPU's UUID. One UUID read per GPU and pass."""
        for d in self._devices:
            if d.lost_at_enumeration or d.enumeration_error or d.handle is None or d.uuid in hung:
                continue
            p.at("nvmlDeviceGetUUID", d.uuid, d.index)
            try:
                uuid = text(pynvml.nvmlDeviceGetUUID(d.handle))
            except pynvml.NVMLError:
                continue  # the reading says why (lost, an error)
            if uuid != d.uuid:
                log.warning("nvml.gpu_moved", gpu=d.index, uuid=d.uuid, now=uuid, action="enumerate again")
                return True
        return False

    def _close(self, p: Pass) -> bool:
        p.at("stop the event thread", slow=True)  # no NVML call: bounded by events.STOP_TIMEOUT_S
        stopped = self._events.stop_thread()
        if not self._initialized:
            return True
        self._initialized = False
        if not stopped:
            # A thread may still wait on the set: nvml.h defines neither a free nor a shutdown under it, so
            # both are left to the process's exit.
            self._events.abandon_set()
            return True
        p.at("nvmlEventSetFree")
        self._events.free_set()
        p.at("nvmlShutdown")
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("nvml.shutdown_failed", error=error_name(exc))
        return True

    # -- what hangs ---------------------------------------------------------------------------------------

    def _discarded(self, result: object) -> None:
        if isinstance(result, Snapshot) and result.xids:
            self._events.put_back(result.xids)

    def _stuck(self) -> tuple[str, ...]:
        hangs, events = self._runner.hangs(), self._events.stuck_calls()
        if not hangs and not events:
            return ()
        return tuple(sorted([h.detail for h in hangs] + events))

    def _hung_by_uuid(self) -> dict[str, Hang]:
        hangs = self._runner.hangs()
        return {h.uuid: h for h in hangs if h.uuid} if hangs else {}

    def _hung_handles(self) -> set[int]:
        """Handles of GPUs with a call in flight: the event thread does not call into them."""
        hung = self._hung_by_uuid()
        return {handle_key(d.handle) for d in self._devices if d.uuid in hung and d.handle is not None}

    def _hung_snapshot(self, node: Hang | None, *, node_error: str | None = None) -> Snapshot:
        """A pass that did not finish: the last readings, the GPU (or the node) that hangs, the Xids."""
        hung = self._hung_by_uuid()
        gpus = tuple(
            unresponsive(d, hung[d.uuid], self._events.watch_state(d))
            if d.uuid in hung
            else last_reading(d, self._events.watch_state(d))
            for d in self._devices
        )
        known = {d.index for d in self._devices} | {i for i, _ in self._unidentified}
        # An index whose enumeration hung in this very pass, before the inventory was stored.
        pending = [
            (h.index, f"{h.call}:UNRESPONSIVE")
            for h in self._runner.hangs()
            if h.key[0] == "index" and h.index is not None and h.index not in known
        ]
        return Snapshot(
            gpus=gpus,
            xids=self._events.take_xids(),
            driver_version=self._driver,
            unidentified=(*self._unidentified, *pending),
            unresponsive=node.detail if node is not None else None,
            stuck_calls=self._stuck(),
            node_error=node_error,
            bus_only=self._last.bus_only if self._last is not None else (),
        )

    # -- init and inventory -------------------------------------------------------------------------------

    def _try_init(self, p: Pass) -> str | None:
        """Initialise NVML; return the NVML error name on failure (a reading, not an exception).

        An init that succeeds but whose next calls fail is undone (nvmlShutdown) and reported the same way,
        so the next pass starts over instead of running without an event set.
        """
        p.at("nvmlInit", slow=True)
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            return error_name(exc)
        try:
            p.at("nvmlSystemGetDriverVersion")
            self._driver = text(pynvml.nvmlSystemGetDriverVersion())
            p.at("nvmlDeviceGetCount")
            count = int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as exc:
            log.warning("nvml.init_incomplete", error=error_name(exc), retry="next check")
            try:
                p.at("nvmlShutdown")
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as shut:
                log.debug("nvml.shutdown_failed", error=error_name(shut))
            return error_name(exc)
        self._initialized = True
        self._enumerate(count, p)
        self._events.ensure(p)
        log.info("nvml.initialized", driver=self._driver, gpus=count)
        return None

    def _attribute(self, uuid: str | None, handle: Any) -> Device | None:
        with self._lock:
            return self._by_uuid.get(uuid) if uuid else self._by_handle.get(handle_key(handle))

    def _enumerate(self, count: int, p: Pass) -> None:
        devices, unidentified, settled = enumerate_gpus(
            count,
            p,
            known=self._devices,
            changed=count != self._count,
            hung=lambda i: self._runner.hung(("index", str(i))),
        )
        for i, error in unidentified:
            if (i, error) not in self._unidentified:
                log.warning("nvml.gpu_unidentified", gpu=i, error=error, xid_watched=False)
        with self._lock:
            # Not settled (the count changed, an index not identified): the next pass enumerates again.
            self._count = count if settled else -1
            self._devices = devices
            self._unidentified = unidentified
            self._by_uuid = {d.uuid: d for d in devices}
            # An event's handle names the GPU identified at it, never one kept unread after the count changed.
            self._by_handle = {
                handle_key(d.handle): d
                for d in sorted(devices, key=lambda d: not d.enumeration_error)
                if d.handle is not None and d.enumeration_error != UNPLACED
            }
