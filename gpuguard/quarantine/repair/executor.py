"""The repair executor: on its own node only, for the request the agent wrote, climbs the ladder (reset ->
node reboot -> needs-repair) one GPU at a time (docs/design.md, "Repair").

A reset is: the GPU's pods evicted through the Eviction API (PodDisruptionBudgets hold), idle proven twice
(no container holds it, as the kubelet's PodResources says, and no process uses it, as NVML says), the reset
command, then the proof (the same UUID, recovery action NONE, nothing pending, the validation command);
only then is the GPU let go (its record says `proven`, and the agent's quarantine lifts by its own
evidence). A failed step keeps the GPU out and asks for a node reboot. Each step is a log line, a metric,
an Event on the node and the record on the node (`gpuguard.io/repair-state`), which is the ladder's memory.

Every dependency is a seam, so tests drive it with fakes; `gpuguard.runtime.repairroot` wires the real ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import structlog

from gpuguard.core.repairconfig import RepairSettings, argv
from gpuguard.nvml.base import GpuAfterReset
from gpuguard.quarantine.repair.ladder import Step, decide
from gpuguard.quarantine.repair.proof import proof_failures
from gpuguard.quarantine.repair.values import (
    ANN_REQUEST,
    ANN_STATE,
    ANN_VETO,
    DRAINING,
    FAILED,
    IDLE,
    NEEDS_REPAIR,
    PROVEN,
    REBOOT,
    RESETTING,
    VALIDATING,
    Record,
    Request,
    parse_record,
    parse_request,
)

log = structlog.get_logger(__name__)


class NodeApi(Protocol):
    """This node on the API server."""

    def read(self) -> Mapping[str, Any]: ...

    def annotate(self, annotations: Mapping[str, str | None]) -> None: ...

    def event(self, type: str, reason: str, message: str) -> None: ...


class Idler(Protocol):
    """The pods on this node that hold a GPU (the kubelet's PodResources) and their eviction."""

    def holders(self, uuid: str) -> tuple[str, ...]: ...

    def evict(self, uuid: str) -> None: ...


class GpuReads(Protocol):
    """NVML's answers (gpuguard.nvml.real.repairreads.RepairReads)."""

    def index_of(self, uuid: str) -> int | None: ...

    def processes(self, index: int) -> tuple[int, ...]: ...

    def after_reset(self, index: int) -> GpuAfterReset: ...


class Commands(Protocol):
    def run(self, argv: Sequence[str], timeout: float) -> tuple[int, str]: ...


class Reboot(Protocol):
    """The cluster's reboot manager (kured's sentinel)."""

    def request(self, why: str) -> None: ...


class Pace(Protocol):
    """The cluster-wide pace (a Lease's token bucket)."""

    def take(self) -> bool: ...


class StepFailed(Exception):
    """A step of the reset did not hold; the message says which and why."""


class Executor:
    def __init__(
        self,
        settings: RepairSettings,
        *,
        node: NodeApi,
        idler: Idler,
        gpus: GpuReads,
        commands: Commands,
        reboot: Reboot,
        pace: Pace,
        count: Callable[[str, str], None] = lambda step, result: None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """`count(step, result)`: gpuguard_repair_steps_total."""
        self._s = settings
        self._node, self._idler, self._gpus = node, idler, gpus
        self._commands, self._reboot, self._pace = commands, reboot, pace
        self._count, self._now, self._sleep = count, now, sleep
        self._told: set[tuple[str, str]] = set()  # (uuid, what) logged once
        self._record = Record()
        self._boot = ""

    def run(self, stop: threading.Event) -> None:
        log.info("repair.started", node=self._s.node, mode=self._s.mode)
        while not stop.is_set():
            try:
                self.tick()
            except Exception:  # a bug or an outage must not end the executor: logged, tried again
                log.exception("repair.tick_error", node=self._s.node)
            stop.wait(self._s.poll_s)

    def tick(self) -> str:
        """One look at the node and at most one step of the ladder; what was done (for tests)."""
        if self._s.mode == "off":
            return "off"
        obj = self._node.read()
        meta = obj.get("metadata") or {}
        ann: Mapping[str, str] = meta.get("annotations") or {}
        self._boot = str(((obj.get("status") or {}).get("nodeInfo") or {}).get("bootID", ""))
        now = self._now()
        request, why = parse_request(ann.get(ANN_REQUEST), node=self._s.node, now=now)
        if request is None and why != "none" and self._once(str(ann.get(ANN_REQUEST)), why):
            log.warning(
                "repair.request_ignored", node=self._s.node, why=why, value=str(ann.get(ANN_REQUEST))[:200]
            )
        self._record = parse_record(ann.get(ANN_STATE))
        step = decide(
            request, self._record, boot=self._boot, now=now, window_s=self._s.window_s, vetoed=ANN_VETO in ann
        )
        if request is None or step.action in ("none", "wait"):
            return step.action
        if step.action == "veto":
            if self._once(request.uuid, "veto"):
                log.warning(
                    "repair.vetoed", node=self._s.node, uuid=request.uuid, veto=ann.get(ANN_VETO, "")[:200]
                )
                self._count("veto", "skipped")
                if self._s.mode == "on":
                    self._node.event(
                        "Normal", "GPURepairVetoed", f"repair of GPU {request.uuid} vetoed: {ANN_VETO}"
                    )
            return "veto"
        if self._s.mode == "dry-run":
            if self._once(request.uuid, f"dry-run:{step.action}"):
                log.info(
                    "repair.dry_run", node=self._s.node, uuid=request.uuid, action=step.action, why=step.why
                )
                self._count(step.action, "dry-run")
            return f"dry-run:{step.action}"
        return self._act(request, step)

    def _act(self, request: Request, step: Step) -> str:
        uuid = request.uuid
        if step.action == "reset":
            if not self._pace.take():
                if self._once(uuid, "paced"):
                    log.info(
                        "repair.paced", node=self._s.node, uuid=uuid, note="the cluster's reset rate is spent"
                    )
                self._count("reset", "paced")
                return "paced"
            self._told.discard((uuid, "paced"))
            try:
                self._reset(request)
            except StepFailed as exc:
                self._fail(uuid, str(exc))
                return self._climb(uuid, "reset-failed", str(exc))
            return "reset"
        if step.action == "reboot":
            return self._climb(uuid, step.why, step.why)
        self._write(
            uuid, NEEDS_REPAIR, step.why
        )  # needs-repair: the agent's repeat-offender hold does the rest
        self._count("needs-repair", "held")
        log.warning("repair.needs_repair", node=self._s.node, uuid=uuid, why=step.why)
        self._node.event(
            "Warning",
            "GPUNeedsRepair",
            f"GPU {uuid} faulted again after a reset and a reboot within {self._s.window_s:.0f} s: "
            "held for repair",
        )
        return "needs-repair"

    def _reset(self, request: Request) -> None:
        uuid, node = request.uuid, self._s.node
        index = self._gpus.index_of(uuid)
        if index is None:
            raise StepFailed(f"NVML lists no GPU {uuid}")
        self._write(uuid, DRAINING, "")
        log.warning("repair.draining", node=node, uuid=uuid, gpu=index)
        self._node.event(
            "Normal", "GPURepairStarted", f"resetting GPU {index} ({uuid}): evicting its pods first"
        )
        deadline = min(request.deadline, self._now() + timedelta(seconds=self._s.drain_timeout_s))
        while (busy := self._busy(uuid, index)) and self._now() < deadline:
            if busy[0]:
                self._idler.evict(uuid)
            self._sleep(min(2.0, self._s.idle_gap_s))
        if busy:
            raise StepFailed(f"not idle by its deadline: {self._say(busy)}")
        self._write(uuid, IDLE, "")
        self._sleep(self._s.idle_gap_s)
        if busy := self._busy(uuid, index):  # the second proof: nothing came back meanwhile
            raise StepFailed(f"not idle at the second look: {self._say(busy)}")
        self._count("idle", "proven")
        self._write(uuid, RESETTING, "")
        log.warning("repair.resetting", node=node, uuid=uuid, gpu=index)
        code, out = self._commands.run(
            argv(self._s.reset_command, index=index, uuid=uuid), self._s.command_timeout_s
        )
        self._write(uuid, VALIDATING, "", reset=True)
        if code != 0:
            self._count("reset", "failed")
            raise StepFailed(f"the reset command exited {code}: {out[-300:]}")
        self._count("reset", "done")
        self._prove(uuid, index)
        self._write(uuid, PROVEN, "")
        self._count("proof", "proven")
        log.warning("repair.proven", node=node, uuid=uuid, gpu=index)
        self._node.event(
            "Normal", "GPURepaired", f"GPU {index} ({uuid}) reset and proven healthy: back in service"
        )

    def _prove(self, uuid: str, index: int) -> None:
        deadline = self._now() + timedelta(seconds=self._s.proof_timeout_s)
        while True:
            try:
                why = proof_failures(self._gpus.after_reset(index), uuid)
            except Exception as exc:  # NVML not answering right after a reset: the same as not proven yet
                why = (str(exc),)
            if not why:
                break
            if self._now() >= deadline:
                self._count("proof", "failed")
                raise StepFailed(f"not healthy after the reset: {'; '.join(why)}")
            self._sleep(1.0)
        if self._s.validate_command:
            code, out = self._commands.run(
                argv(self._s.validate_command, index=index, uuid=uuid), self._s.command_timeout_s
            )
            if code != 0:
                self._count("proof", "failed")
                raise StepFailed(f"the validation command exited {code}: {out[-300:]}")

    def _busy(self, uuid: str, index: int) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
        pods, procs = self._idler.holders(uuid), self._gpus.processes(index)
        return (pods, procs) if pods or procs else None

    @staticmethod
    def _say(busy: tuple[tuple[str, ...], tuple[int, ...]] | None) -> str:
        pods, procs = busy or ((), ())
        return f"pods {', '.join(pods) or 'none'}; processes {', '.join(map(str, procs)) or 'none'}"

    def _fail(self, uuid: str, why: str) -> None:
        self._write(uuid, FAILED, why)
        log.warning("repair.kept_out", node=self._s.node, uuid=uuid, why=why)
        self._node.event("Warning", "GPURepairFailed", f"GPU {uuid} kept out of service: {why}")

    def _climb(self, uuid: str, why: str, detail: str) -> str:
        """The next rung after a reset: a reboot of the node, through the cluster's reboot manager."""
        self._reboot.request(f"gpuguard: GPU {uuid}: {detail}")
        self._write(uuid, REBOOT, why)
        self._count("reboot", "requested")
        log.warning("repair.reboot_requested", node=self._s.node, uuid=uuid, why=why, detail=detail[:300])
        self._node.event("Warning", "GPURebootRequested", f"node reboot requested for GPU {uuid}: {detail}")
        return "reboot"

    def _write(self, uuid: str, phase: str, why: str, *, reset: bool = False) -> None:
        self._record = self._record.step(uuid, phase, at=self._now(), boot=self._boot, why=why, reset=reset)
        self._node.annotate({ANN_STATE: self._record.value()})

    def _once(self, key: str, what: str) -> bool:
        if (key, what) in self._told:
            return False
        self._told.add((key, what))
        return True
