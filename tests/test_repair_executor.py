"""The repair executor against stateful fakes of its seams: the node on the API server, the kubelet and the
evictor, NVML, the reset command, kured's sentinel and the pace. Each test reads as the sentence it names."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from gpuguard.core.repairconfig import RepairSettings
from gpuguard.nvml.base import GpuAfterReset
from gpuguard.quarantine.repair.executor import Executor
from gpuguard.quarantine.repair.values import ANN_REQUEST, ANN_STATE, ANN_VETO, Request, parse_record

UUID = "GPU-it-3"
START = datetime(2026, 12, 6, 4, 0, 0, tzinfo=UTC)


@dataclass
class Clock:
    t: datetime = START

    def now(self) -> datetime:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += timedelta(seconds=seconds)


@dataclass
class FakeNode:
    annotations: dict[str, str] = field(default_factory=dict)
    boot: str = "b0"
    events: list[tuple[str, str]] = field(default_factory=list)
    writes: int = 0

    def read(self) -> Mapping[str, Any]:
        return {
            "metadata": {"annotations": dict(self.annotations)},
            "status": {"nodeInfo": {"bootID": self.boot}},
        }

    def annotate(self, annotations: Mapping[str, str | None]) -> None:
        self.writes += 1
        for k, v in annotations.items():
            if v is None:
                self.annotations.pop(k, None)
            else:
                self.annotations[k] = v

    def event(self, type: str, reason: str, message: str) -> None:
        self.events.append((reason, message))

    def phase(self) -> str | None:
        entry = parse_record(self.annotations.get(ANN_STATE)).get(UUID)
        return None if entry is None else entry.phase


@dataclass
class FakeGpus:
    """GPU 3 with a pod and a process until the pod is evicted; the reset clears its recovery action."""

    pods: list[str] = field(default_factory=lambda: ["ml/llm-3"])
    processes_: tuple[int, ...] = (1000,)
    action: int = 1
    reset_clears: bool = True
    reset_rc: int = 0
    evictions: int = 0
    resets: list[list[str]] = field(default_factory=list)
    comes_back: str = ""  # a pod that lands on the GPU between the two idle proofs

    def holders(self, uuid: str) -> tuple[str, ...]:
        return tuple(self.pods) if uuid == UUID else ()

    def evict(self, uuid: str) -> None:
        self.evictions += 1
        self.pods.clear()
        self.processes_ = ()

    def index_of(self, uuid: str) -> int | None:
        return 3 if uuid == UUID else None

    def processes(self, index: int) -> tuple[int, ...]:
        procs = self.processes_
        if self.comes_back and not self.pods:
            self.pods.append(self.comes_back)
            self.comes_back = ""
        return procs

    def after_reset(self, index: int) -> GpuAfterReset:
        return GpuAfterReset(UUID, self.action, False, None)

    def run(self, argv: Sequence[str], timeout: float) -> tuple[int, str]:
        self.resets.append(list(argv))
        if argv[0] == "validate":
            return 0, "ok"
        if self.reset_clears and self.reset_rc == 0:
            self.action = 0
        return self.reset_rc, "" if self.reset_rc == 0 else "Unable to reset this GPU"


@dataclass
class FakeReboot:
    asked: list[str] = field(default_factory=list)

    def request(self, why: str) -> None:
        self.asked.append(why)


@dataclass
class FakePace:
    tokens: int = 10

    def take(self) -> bool:
        if self.tokens <= 0:
            return False
        self.tokens -= 1
        return True


def make(
    mode: str = "on", **settings: Any
) -> tuple[Executor, FakeNode, FakeGpus, FakeReboot, FakePace, Clock]:
    clock, node, gpus, reboot, pace = Clock(), FakeNode(), FakeGpus(), FakeReboot(), FakePace()
    s = RepairSettings(node="gpu-a", mode=mode, **settings)
    counted: list[tuple[str, str]] = []
    ex = Executor(
        s,
        node=node,
        idler=gpus,
        gpus=gpus,
        commands=gpus,
        reboot=reboot,
        pace=pace,
        count=lambda step, result: counted.append((step, result)),
        now=clock.now,
        sleep=clock.sleep,
    )
    node.annotations[ANN_REQUEST] = Request(UUID, "gpu-a", START + timedelta(hours=1)).value()
    return ex, node, gpus, reboot, pace, clock


def test_a_requested_gpu_is_idled_reset_proven_and_let_go() -> None:
    ex, node, gpus, reboot, _pace, _clock = make()
    assert ex.tick() == "reset"
    assert gpus.evictions == 1 and gpus.resets == [["nvidia-smi", "--gpu-reset", "-i", "3"]]
    assert node.phase() == "proven" and not reboot.asked
    assert [r for r, _ in node.events] == ["GPURepairStarted", "GPURepaired"]
    entry = parse_record(node.annotations[ANN_STATE]).get(UUID)
    assert entry is not None and len(entry.resets) == 1


def test_the_validation_command_runs_after_the_proof() -> None:
    ex, _node, gpus, _reboot, _pace, _clock = make(validate_command="validate {uuid}")
    ex.tick()
    assert gpus.resets[-1] == ["validate", UUID]


def test_a_reset_that_does_not_clear_keeps_the_gpu_out_and_asks_for_a_reboot() -> None:
    ex, node, gpus, reboot, _pace, _clock = make()
    gpus.reset_clears = False
    assert ex.tick() == "reboot"
    assert node.phase() == "reboot-requested" and len(reboot.asked) == 1
    assert "recovery action 1" in reboot.asked[0]
    assert [r for r, _ in node.events][-2:] == ["GPURepairFailed", "GPURebootRequested"]
    assert ex.tick() == "wait"  # the reboot is pending: nothing more in this boot


def test_a_failing_reset_command_asks_for_a_reboot() -> None:
    ex, _node, gpus, reboot, _pace, _clock = make()
    gpus.reset_rc = 255
    assert ex.tick() == "reboot" and "exited 255" in reboot.asked[0]


def test_a_gpu_that_is_not_idle_by_the_deadline_is_not_reset() -> None:
    ex, _node, gpus, reboot, _pace, _clock = make(drain_timeout_s=30)
    gpus.evict = lambda uuid: None  # type: ignore[method-assign] # a PodDisruptionBudget refuses
    assert ex.tick() == "reboot"
    assert gpus.resets == [] and "not idle" in reboot.asked[0]


def test_a_pod_that_lands_between_the_two_idle_proofs_stops_the_reset() -> None:
    ex, _node, gpus, reboot, _pace, _clock = make()
    gpus.comes_back = "ml/late"
    assert ex.tick() == "reboot"
    assert gpus.resets == [] and "second look" in reboot.asked[0]


def test_a_fault_back_within_the_window_after_a_reboot_is_needs_repair() -> None:
    ex, node, gpus, _reboot, _pace, clock = make()
    gpus.reset_clears = False
    ex.tick()
    node.boot = "b1"  # kured rebooted the node; the agent asks again
    clock.sleep(600)
    assert ex.tick() == "needs-repair"
    assert node.phase() == "needs-repair" and node.events[-1][0] == "GPUNeedsRepair"


def test_a_fault_back_within_the_window_after_a_proven_reset_asks_for_a_reboot() -> None:
    ex, node, gpus, _reboot, _pace, clock = make()
    ex.tick()
    assert ex.tick() == "wait"  # the request that was done, until the agent removes it
    clock.sleep(1800)
    node.annotations[ANN_REQUEST] = Request(UUID, "gpu-a", clock.now() + timedelta(hours=1)).value()
    assert ex.tick() == "reboot" and len(gpus.resets) == 1


def test_a_veto_stops_it() -> None:
    ex, node, gpus, _reboot, _pace, _clock = make()
    node.annotations[ANN_VETO] = "maintenance window"
    assert ex.tick() == "veto"
    assert gpus.evictions == 0 and gpus.resets == [] and ANN_STATE not in node.annotations
    assert node.events == [("GPURepairVetoed", f"repair of GPU {UUID} vetoed: {ANN_VETO}")]
    ex.tick()
    assert len(node.events) == 1  # told once


def test_dry_run_changes_nothing() -> None:
    ex, node, gpus, reboot, pace, _clock = make("dry-run")
    before = dict(node.annotations)
    assert ex.tick() == "dry-run:reset"
    assert node.annotations == before and node.writes == 0 and node.events == []
    assert gpus.evictions == 0 and gpus.resets == [] and not reboot.asked and pace.tokens == 10


def test_off_reads_nothing() -> None:
    ex, node, _gpus, _reboot, _pace, _clock = make("off")
    node.read = None  # type: ignore[assignment,method-assign]
    assert ex.tick() == "off"


def test_another_nodes_request_is_not_acted_on() -> None:
    ex, node, gpus, _reboot, _pace, _clock = make()
    node.annotations[ANN_REQUEST] = Request(UUID, "gpu-b", START + timedelta(hours=1)).value()
    assert ex.tick() == "none" and gpus.evictions == 0 and gpus.resets == []


def test_a_spent_pace_waits_and_resets_nothing() -> None:
    ex, node, gpus, _reboot, pace, _clock = make()
    pace.tokens = 0
    assert ex.tick() == "paced" and gpus.evictions == 0 and ANN_STATE not in node.annotations


def test_a_repair_found_under_way_at_start_climbs_to_a_reboot() -> None:
    ex, node, gpus, reboot, _pace, _clock = make()
    node.annotations[ANN_STATE] = json.dumps(
        {UUID: {"phase": "resetting", "at": "2026-12-06T03:59:00Z", "boot": "b0"}}
    )
    assert ex.tick() == "reboot" and gpus.resets == [] and "interrupted" in reboot.asked[0]
