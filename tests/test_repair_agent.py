"""The agent's side of a repair through the reconciler (node quarantine, fake node writer): the request is
written once the quarantine is in place and only with --repair; the executor's record holds a GPU whatever it
reads until the record lets it go."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

from gpuguard.core.config import NodeSettings, PolicySettings
from gpuguard.core.model import REPAIR_HELD, GpuReading, Snapshot
from gpuguard.judge.policy import evaluate
from gpuguard.quarantine.node.view import NodeView
from gpuguard.quarantine.reconciler import NodeReconciler
from gpuguard.quarantine.repair.values import ANN_REQUEST, ANN_STATE, Record, parse_request
from harness.fakes import FakeNodeWriter
from harness.judging import hand_over

SETTINGS = NodeSettings(name="gpu-1", retry_max_wait=0.01, recover_after=2, repair="on")
GPUS = (
    GpuReading(index=0, uuid="GPU-0", recovery_action=0),
    GpuReading(index=1, uuid="GPU-1", recovery_action=0),
)
HEALTHY = evaluate(Snapshot(gpus=GPUS), previous=None, settings=PolicySettings())
RESET = evaluate(
    Snapshot(gpus=(replace(GPUS[0], recovery_action=1), GPUS[1])), previous=None, settings=PolicySettings()
)


def agent(
    settings: NodeSettings = SETTINGS, annotations: dict[str, str] | None = None
) -> tuple[NodeReconciler, FakeNodeWriter]:
    writer = FakeNodeWriter(
        NodeView(name="gpu-1", resource_version="1", boot_id="boot-0", annotations=annotations or {})
    )
    return NodeReconciler(writer, settings), writer


def check(r: NodeReconciler, verdict: object, streak: int) -> None:
    hand_over(r, verdict, streak)  # type: ignore[arg-type]
    r.reconcile_now()


def test_the_request_follows_the_taint_and_goes_when_the_gpu_is_healthy() -> None:
    r, writer = agent()
    check(r, RESET, 0)
    assert writer.node.our_taint is not None
    value = writer.node.annotations.get(ANN_REQUEST)
    assert value is not None and '"uuid":"GPU-0"' in value and '"owner":"gpu-1"' in value
    assert parse_request(value, node="gpu-1", now=datetime.now(UTC))[1] == "ok"
    for streak in range(3):
        check(r, HEALTHY, streak)
    assert writer.node.our_taint is None and ANN_REQUEST not in writer.node.annotations


def test_without_repair_nothing_is_asked() -> None:
    r, writer = agent(replace(SETTINGS, repair="off"))
    check(r, RESET, 0)
    assert writer.node.our_taint is not None and ANN_REQUEST not in writer.node.annotations


def test_the_executors_record_holds_a_healthy_gpu_until_it_lets_it_go() -> None:
    now = datetime.now(UTC)
    validating = Record().step("GPU-0", "validating", at=now, boot="boot-0", reset=True)
    # --node-resync 0: the node is read again at every reconcile, as it is every 30 s while a quarantine holds
    r, writer = agent(replace(SETTINGS, node_resync=0), {ANN_STATE: validating.value()})
    check(r, RESET, 0)
    for streak in range(4):
        check(r, HEALTHY, streak)
    taint = writer.node.our_taint
    assert taint is not None and REPAIR_HELD in writer.node.annotations.get("gpuguard.io/faults", "")
    writer.edit(
        annotations={
            **writer.node.annotations,
            ANN_STATE: validating.step("GPU-0", "proven", at=now, boot="boot-0").value(),
        }
    )
    for streak in range(4, 8):
        check(r, HEALTHY, streak)
    assert writer.node.our_taint is None
