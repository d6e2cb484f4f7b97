"""Repeat offenders through the reconciler (gpuguard/quarantine/repeat/offenders.py, repair.py, release.py): a
GPU whose Xid returns after reboots is held, not released by the next reboot, marked for repair, and released
only by an operator's annotation the agent validates; only gpuguard's marks are ever removed."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from gpuguard.cli.report import status_table
from gpuguard.core.config import NodeSettings, PolicySettings
from gpuguard.core.metrics import Metrics
from gpuguard.core.model import Fault, GpuReading, Snapshot, Verdict, XidEvent
from gpuguard.judge.policy import evaluate
from gpuguard.quarantine.gpu.quarantine import DeviceQuarantine
from gpuguard.quarantine.node.budget import QuarantineBudget
from gpuguard.quarantine.node.view import (
    ANN_REPAIR_PLACED,
    ANN_REPEAT_OFFENDERS,
    LABEL_NEEDS_REPAIR,
    LABEL_QUARANTINED,
    EventSpec,
    NodeChange,
    NodeView,
)
from gpuguard.quarantine.reconciler import NodeReconciler
from gpuguard.quarantine.repeat.escalation import Limits
from gpuguard.quarantine.repeat.marks import marks, with_marks
from gpuguard.quarantine.repeat.offenders import RepeatOffenders
from gpuguard.quarantine.repeat.release import ANN_RELEASE, ReleaseRequest, annotation, parse
from gpuguard.store.history import HistoryStore
from gpuguard.store.state import StateStore
from harness.clock import Clock
from harness.dra import gpu_uuid, nvidia_slice
from harness.fakes import FakeDeviceSource, FakeNodeWriter
from harness.judging import hand_over

SETTINGS = NodeSettings(name="gpu-1", retry_max_wait=0.01, recover_after=3)
DAY = 86400.0
T0 = 1_800_000_000.0
GPUS = (GpuReading(index=0, uuid="GPU-0"), GpuReading(index=1, uuid="GPU-1"))
HEALTHY = evaluate(Snapshot(gpus=GPUS), previous=None, settings=PolicySettings())
XID = evaluate(
    Snapshot(gpus=GPUS, xids=(XidEvent(0, "GPU-0", 79),)), previous=None, settings=PolicySettings()
)


class Node:
    """One node across reboots: an agent (a reconciler with its history in `state`) per boot."""

    def __init__(self, state: Path, *, limit: int = 3) -> None:
        self.writer = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="boot-0"))
        self.state = state
        self.limit = limit
        self.now = T0
        self.metrics = Metrics(CollectorRegistry())
        self.agent = self._agent()

    def _agent(self) -> NodeReconciler:
        repeat = RepeatOffenders(
            HistoryStore(self.state),
            Limits(limit=self.limit),
            recover_after=SETTINGS.recover_after,
            wall=lambda: self.now,
        )
        budget = QuarantineBudget(self.writer, SETTINGS)
        return NodeReconciler(self.writer, SETTINGS, budget=budget, repeat=repeat, metrics=self.metrics)

    def check(self, verdict: Verdict, streak: int) -> None:
        hand_over(self.agent, verdict, streak)
        self.agent.reconcile_now()

    def reboot(self, boot_id: str, *, days: float = 1.0) -> None:
        """The node reboots: a new bootID, a new agent, healthy GPUs for --recover-after checks."""
        self.now += days * DAY
        self.writer.edit(boot_id=boot_id)
        self.agent = self._agent()
        for streak in range(SETTINGS.recover_after + 1):
            self.check(HEALTHY, streak)

    @property
    def tainted_for(self) -> str | None:
        """The most severe recorded reason while our taint is on (the taint itself carries no value)."""
        node = self.writer.node
        return node.record.primary_reason if node.our_taint is not None else None

    @property
    def held(self) -> dict[str, int]:
        assert self.agent.repeat is not None
        return self.agent.repeat.held


def test_a_gpu_whose_xid_returns_after_two_reboots_is_held_and_not_released_by_the_next_reboot(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path)
    node.check(XID, 0)
    for boot in ("boot-1", "boot-2"):
        node.reboot(boot)
        assert node.writer.node.our_taint is None  # released by the reboot, as always
        node.check(XID, 0)
    assert node.held == {} and node.agent.repeat is not None and node.agent.repeat.settling
    node.now += Limits().at_once_s  # the third episode counts once no other GPU joined it at once
    node.check(XID, 0)
    assert node.held == {"GPU-0": 3}
    assert node.tainted_for == "repeat-offender"
    n = node.writer.node
    assert n.labels[LABEL_NEEDS_REPAIR] == "true" and n.annotations[ANN_REPAIR_PLACED] == "true"
    assert json.loads(n.annotations[ANN_REPEAT_OFFENDERS]) == {"GPU-0": 3}
    assert "GPURepeatOffender" in [e.reason for e in node.writer.events]
    assert node.writer.conditions[-1]["reason"] == "GPURepeatOffender"
    assert "repeat-offender" in node.writer.conditions[-1]["message"]
    value = node.metrics.registry.get_sample_value(
        "gpuguard_gpu_repeat_offender", {"gpu": "0", "uuid": "GPU-0"}
    )
    assert value == 3
    node.reboot("boot-3")  # a new agent, its history read from the disk
    assert node.held == {"GPU-0": 3}
    assert node.tainted_for == "repeat-offender" and node.writer.node.labels[LABEL_NEEDS_REPAIR] == "true"
    assert node.writer.node.annotations["gpuguard.io/boot-id"] == "boot-3"


def test_a_gpu_that_faults_once_per_week_is_never_held(tmp_path: Path) -> None:
    node = Node(tmp_path)
    for week in range(6):
        node.check(XID, 0)
        assert node.tainted_for == "xid-79"
        node.reboot(f"boot-{week + 1}", days=7)
    assert node.held == {} and node.writer.node.our_taint is None
    assert LABEL_NEEDS_REPAIR not in node.writer.node.labels
    assert "GPURepeatOffender" not in [e.reason for e in node.writer.events]


def test_limit_zero_holds_nothing(tmp_path: Path) -> None:
    node = Node(tmp_path, limit=0)
    node.check(XID, 0)
    for boot in ("boot-1", "boot-2", "boot-3"):
        node.reboot(boot)
        node.check(XID, 0)
    node.reboot("boot-4")
    assert node.held == {} and node.writer.node.our_taint is None


def held_node(tmp_path: Path) -> Node:
    node = Node(tmp_path)
    node.check(XID, 0)
    for boot in ("boot-1", "boot-2"):
        node.reboot(boot)
        node.check(XID, 0)
    node.reboot("boot-3")
    assert node.held == {"GPU-0": 3}
    return node


def release(node: Node, gpu: str = "GPU-0", *, at: str = "2027-01-15T08:00:00Z", by: str = "alice") -> None:
    text = json.dumps({"gpu": gpu, "by": by, "at": at})
    node.writer.edit(annotations={**node.writer.node.annotations, ANN_RELEASE: text})
    node.agent._node = None  # the agent's next re-read (--node-resync) sees it
    node.check(HEALTHY, SETTINGS.recover_after + 5)


def test_an_operators_release_lifts_the_hold_and_only_gpuguards_marks(tmp_path: Path) -> None:
    node = held_node(tmp_path)
    node.now = T0 + 10 * DAY
    with capture_logs() as logs:
        release(node, at="2027-01-24T08:00:00Z")
    assert [e["by"] for e in logs if e["event"] == "repeat.released"] == ["alice"]
    assert node.held == {}
    n = node.writer.node
    assert n.our_taint is None  # nothing else kept it: the node is back in service
    assert LABEL_NEEDS_REPAIR not in n.labels
    assert not {ANN_RELEASE, ANN_REPEAT_OFFENDERS, ANN_REPAIR_PLACED} & set(n.annotations)
    history = HistoryStore(tmp_path).load()["GPU-0"]
    assert history.releases[-1].by == "alice" and history.escalated is None
    assert (
        node.metrics.registry.get_sample_value("gpuguard_gpu_repeat_offender", {"gpu": "0", "uuid": "GPU-0"})
        is None
    )


def test_an_operators_own_needs_repair_label_is_never_removed(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.writer.edit(labels={LABEL_NEEDS_REPAIR: "true"})  # an operator's, before any hold
    node.check(XID, 0)
    for boot in ("boot-1", "boot-2", "boot-3"):
        node.reboot(boot)
        if boot != "boot-3":
            node.check(XID, 0)
    assert node.held == {"GPU-0": 3} and ANN_REPAIR_PLACED not in node.writer.node.annotations
    node.now = T0 + 10 * DAY
    release(node, gpu="*", at="2027-01-24T08:00:00Z")
    assert node.held == {} and node.writer.node.labels[LABEL_NEEDS_REPAIR] == "true"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("not json", "not JSON"),
        ('{"gpu": "GPU-0", "by": "alice"}', "exactly"),
        ('{"gpu": "GPU-0", "by": "alice", "at": "2027-01-24T08:00:00Z", "x": 1}', "exactly"),
        ('{"gpu": "GPU 0; rm -rf", "by": "alice", "at": "2027-01-24T08:00:00Z"}', "UUID"),
        ('{"gpu": "GPU-0", "by": "", "at": "2027-01-24T08:00:00Z"}', "printable"),
        ('{"gpu": "GPU-0", "by": "alice", "at": "tomorrow"}', "time"),
        ('{"gpu": "GPU-0", "by": "alice", "at": "2030-01-01T00:00:00Z"}', "future"),
        ('{"gpu": "GPU-0", "by": "' + "x" * 600 + '", "at": "2027-01-24T08:00:00Z"}', "bytes"),
    ],
)
def test_a_release_the_agent_cannot_trust_is_refused_logged_and_removed(
    tmp_path: Path, text: str, why: str
) -> None:
    node = held_node(tmp_path)
    node.now = T0 + 10 * DAY  # 2027-01-25T08:00Z
    node.writer.edit(annotations={**node.writer.node.annotations, ANN_RELEASE: text})
    node.agent._node = None
    with capture_logs() as logs:
        node.check(HEALTHY, SETTINGS.recover_after + 5)
    refused = [e for e in logs if e["event"] == "repeat.release_refused"]
    assert len(refused) == 1 and why in refused[0]["error"], logs
    assert node.held == {"GPU-0": 3} and node.tainted_for == "repeat-offender"
    assert ANN_RELEASE not in node.writer.node.annotations  # refused once, not at every check


def _padded(doc: dict[str, str], size: int) -> str:
    """`doc` as JSON padded with spaces to exactly `size` bytes."""
    text = json.dumps(doc)
    return text[:-1] + " " * (size - len(text)) + "}"


NOW = datetime(2027, 1, 25, 8, 0, 0, tzinfo=UTC).timestamp()
AT = "2027-01-25T07:55:00Z"  # five minutes before NOW: the release an operator just wrote


@pytest.mark.parametrize(
    ("text", "accepted"),
    [
        (json.dumps({"gpu": "GPU-0", "by": "alice", "at": AT}), True),
        (json.dumps({"gpu": "GPU-0", "by": "alice", "at": "2027-01-25T08:05:00Z"}), True),  # 300 s ahead
        (json.dumps({"gpu": "GPU-0", "by": "alice", "at": "2027-01-25T08:05:01Z"}), False),  # 301 s ahead
        (json.dumps({"gpu": "GPU-0", "by": "x" * 64, "at": AT}), True),
        (json.dumps({"gpu": "GPU-0", "by": "x" * 65, "at": AT}), False),
        (_padded({"gpu": "GPU-0", "by": "alice", "at": AT}, 512), True),
        (_padded({"gpu": "GPU-0", "by": "alice", "at": AT}, 513), False),
        (json.dumps({"gpu": "*", "by": "alice", "at": AT}), True),
    ],
    ids=[
        "stamped 5 minutes ago",
        "300 s ahead",
        "301 s ahead",
        "a 64-character name",
        "a 65-character name",
        "512 bytes",
        "513 bytes",
        "every held GPU",
    ],
)
def test_a_release_is_accepted_up_to_5_minutes_ahead_64_characters_of_name_and_512_bytes(
    text: str, accepted: bool
) -> None:
    if accepted:
        request = parse(text, now=NOW)
        assert request.by in ("alice", "x" * 64) and request.at <= NOW + 300
    else:
        with pytest.raises(ValueError):
            parse(text, now=NOW)


def test_the_annotation_gpuguard_release_writes_is_one_the_agent_accepts() -> None:
    at = datetime(2027, 1, 25, 9, 55, 0, tzinfo=timezone(timedelta(hours=2)))  # the operator's local time
    text = annotation("GPU-0", by="alice", at=at)
    assert json.loads(text) == {"at": "2027-01-25T07:55:00Z", "by": "alice", "gpu": "GPU-0"}
    assert text.index('"at"') < text.index('"by"') < text.index('"gpu"')  # sorted: one text for one release
    assert parse(text, now=at.timestamp()) == ReleaseRequest(gpu="GPU-0", by="alice", at=at.timestamp())


def test_an_escalation_past_the_budget_still_counts_as_a_quarantined_node(tmp_path: Path) -> None:
    node = held_node(tmp_path)
    assert node.writer.node.fully_quarantined  # the label the budget counts


def test_status_shows_the_repeat_offenders_and_says_when_they_spend_the_budget() -> None:

    base = {
        "since": "2026-12-05T08:00:00Z",
        "cordoned_by_gpuguard": True,
        "unschedulable": True,
        "faults": ["repeat-offender/GPU-0"],
        "detail": "repeat-offender: 3 fault episodes",
    }
    rows = [
        {
            **base,
            "node": "a",
            "state": "quarantined",
            "reason": "repeat-offender",
            "repeat_offenders": {"GPU-0": 3},
        },
        {**base, "node": "b", "state": "quarantined", "reason": "ecc", "repeat_offenders": {}},
        {**base, "node": "c", "device": "gpu-1", "state": "gpu-quarantined", "reason": "repeat-offender"},
    ]
    lines = status_table(rows).splitlines()
    assert "REPEAT-OFFENDERS" in lines[0]
    assert "GPU-0=3" in lines[1] and " held " in lines[3]
    assert lines[-1].startswith("1 of 2 fully quarantined nodes are held as repeat offenders")
    assert "budget" in lines[-1]
    assert "repeat offenders" not in status_table(rows[1:2])


def test_a_release_is_on_disk_before_the_write_that_removes_its_annotation(tmp_path: Path) -> None:
    """An agent killed between the two must not hold the GPU again after its restart."""
    node = held_node(tmp_path)
    node.now = T0 + 10 * DAY
    seen: list[object] = []
    patch = node.writer.patch

    def spy(n: NodeView, change: Any) -> NodeView:
        if change.annotations.get(ANN_RELEASE, "") is None:
            seen.append(HistoryStore(tmp_path).load()["GPU-0"].escalated)
        return patch(n, change)

    node.writer.patch = spy  # type: ignore[method-assign,assignment]
    release(node, at="2027-01-24T08:00:00Z")
    assert seen == [None]


def test_on_a_dra_node_the_held_gpus_rule_says_repeat_offender_and_stays_across_reboots(
    tmp_path: Path,
) -> None:
    """The per-GPU quarantine: the GPU's own DeviceTaintRule is what holds it; the node stays in service and
    carries only the repair marks."""
    node_name = "gpu-node-1"
    uuids = [gpu_uuid(node_name, i) for i in range(8)]
    gpus = tuple(GpuReading(index=i, uuid=u) for i, u in enumerate(uuids))
    healthy = evaluate(Snapshot(gpus=gpus), previous=None, settings=PolicySettings())
    xid = evaluate(
        Snapshot(gpus=gpus, xids=(XidEvent(3, uuids[3], 79),)), previous=None, settings=PolicySettings()
    )
    settings = NodeSettings(name=node_name, retry_max_wait=0.01, recover_after=2)
    writer = FakeNodeWriter(NodeView(name=node_name, resource_version="1", boot_id="boot-0"))
    source = FakeDeviceSource([nvidia_slice(node_name)])
    now = [T0]

    def agent() -> NodeReconciler:
        clock = Clock()
        devices = DeviceQuarantine(source, settings, clock=clock)
        repeat = RepeatOffenders(HistoryStore(tmp_path), Limits(), recover_after=2, wall=lambda: now[0])
        return NodeReconciler(writer, settings, devices=devices, clock=clock, repeat=repeat)

    r = agent()
    for boot in ("boot-1", "boot-2", "boot-3"):
        hand_over(r, xid, 0)
        r.reconcile_now()
        now[0] += DAY
        writer.edit(boot_id=boot)
        r = agent()
        for streak in range(4):
            hand_over(r, healthy, streak)
            r.reconcile_now()
    (rule,) = source.store.values()
    assert "repeat-offender/" in rule["metadata"]["annotations"]["gpuguard.io/faults"]
    assert rule["metadata"]["annotations"]["gpuguard.io/boot-id"] == "boot-3"
    assert writer.node.our_taint is None and not writer.node.unschedulable
    assert writer.node.labels[LABEL_NEEDS_REPAIR] == "true"
    assert json.loads(writer.node.annotations[ANN_REPEAT_OFFENDERS]) == {uuids[3]: 3}


def test_a_taint_removed_from_a_held_node_is_put_back(tmp_path: Path) -> None:
    """A held node's taint taken off (by a stolen agent token, which the policy lets remove its own node's
    gpuguard.io/ taints, or by a stray `kubectl taint ... -`) is no override: only `gpuguard release` ends a
    hold, so the next check puts the taint back, with the needs-repair label still there. Before, the agent
    took it for an operator's override and left the GPU in service for the rest of the boot."""
    node = held_node(tmp_path)
    (ours,) = [t for t in node.writer.node.taints if t.key == "gpuguard.io/gpu-unhealthy"]
    node.writer.edit(taints=tuple(t for t in node.writer.node.taints if t != ours))
    node.agent._node = None  # the agent's next re-read (--node-resync) sees it
    for streak in range(SETTINGS.recover_after + 5):
        node.check(HEALTHY, SETTINGS.recover_after + 5 + streak)
    assert node.tainted_for == "repeat-offender"  # put back in this boot
    assert node.held == {"GPU-0": 3}
    assert node.writer.node.labels[LABEL_NEEDS_REPAIR] == "true"
    assert node.writer.node.labels[LABEL_QUARANTINED] == "true"


def test_a_held_gpus_deleted_rule_is_made_again_also_after_a_restart(tmp_path: Path) -> None:
    """The same on a DRA node: a stolen token deleted its own held GPU's rule; the agent recorded an
    operator's override (state.StateStore) and never made it again, not even after a restart. The hold is
    the history's, and only a release ends it."""
    node_name = "gpu-node-1"
    uuids = [gpu_uuid(node_name, i) for i in range(8)]
    gpus = tuple(GpuReading(index=i, uuid=u) for i, u in enumerate(uuids))
    healthy = evaluate(Snapshot(gpus=gpus), previous=None, settings=PolicySettings())
    xid = evaluate(
        Snapshot(gpus=gpus, xids=(XidEvent(3, uuids[3], 79),)), previous=None, settings=PolicySettings()
    )
    settings = NodeSettings(name=node_name, retry_max_wait=0.01, recover_after=2)
    writer = FakeNodeWriter(NodeView(name=node_name, resource_version="1", boot_id="boot-0"))
    source = FakeDeviceSource([nvidia_slice(node_name)])
    now = [T0]

    def agent() -> NodeReconciler:
        clock = Clock()
        memory = StateStore(tmp_path / "state", boot_id=writer.node.boot_id)
        devices = DeviceQuarantine(source, settings, clock=clock, memory=memory)
        repeat = RepeatOffenders(HistoryStore(tmp_path), Limits(), recover_after=2, wall=lambda: now[0])
        return NodeReconciler(writer, settings, devices=devices, clock=clock, repeat=repeat)

    def checks(r: NodeReconciler, n: int = 4) -> None:
        for streak in range(n):
            hand_over(r, healthy, streak)
            r.reconcile_now()

    r = agent()
    for boot in ("boot-1", "boot-2", "boot-3"):
        hand_over(r, xid, 0)
        r.reconcile_now()
        now[0] += DAY
        writer.edit(boot_id=boot)
        r = agent()
        checks(r)
    (name,) = source.store
    assert "repeat-offender/" in source.store[name]["metadata"]["annotations"]["gpuguard.io/faults"]
    source.operator_delete(name)
    checks(r)
    r = agent()  # a restart in the same boot reads the rules again: the deleted one is made again
    checks(r)
    (rule,) = source.store.values()
    assert "repeat-offender/" in rule["metadata"]["annotations"]["gpuguard.io/faults"]
    assert r.repeat is not None and r.repeat.held == {uuids[3]: 3}


def test_a_fabric_that_never_completes_over_three_boots_holds_no_gpu(tmp_path: Path) -> None:
    fabric = replace(
        HEALTHY,
        gpus=tuple(
            replace(g, faults=(Fault("fabric-incomplete", "NOT_STARTED", uuid=g.uuid, gpu_index=g.index),))
            for g in HEALTHY.gpus
        ),
    )
    node = Node(tmp_path)
    node.check(fabric, 0)
    for boot in ("boot-1", "boot-2", "boot-3"):
        node.reboot(boot)
        node.check(fabric, 0)
    assert node.held == {} and node.tainted_for == "fabric-incomplete"
    assert LABEL_NEEDS_REPAIR not in node.writer.node.labels
    history = node.agent.repeat.history if node.agent.repeat is not None else {}
    assert len(history["GPU-0"].episodes) == 4  # recorded, not counted


def test_a_release_dated_before_the_gpus_episodes_stays_released_after_the_next_agent_start(
    tmp_path: Path,
) -> None:
    """The annotation's `at` is the releasing machine's clock (or a release written earlier and applied
    late): recorded as is, the episodes after it counted again at the next start and held the GPU again."""
    node = held_node(tmp_path)
    release(node, at="2027-01-14T08:00:00Z")  # a day before the first episode
    assert node.held == {}
    node.reboot("boot-4")  # a new agent: escalation over the history read from the disk
    assert node.held == {}
    assert node.writer.node.our_taint is None


def test_a_release_that_names_no_held_gpu_is_logged_as_such_not_as_a_release(tmp_path: Path) -> None:
    """A mistyped UUID: the annotation is handled and removed, so the log is all the operator has; it must
    not say `repeat.released` while the GPU stays held."""
    node = held_node(tmp_path)
    with capture_logs() as logs:
        release(node, gpu="GPU-9")
    events = [e for e in logs if e["event"].startswith("repeat.release")]
    assert [(e["event"], e["held"]) for e in events] == [("repeat.release_matched_none", ["GPU-0"])]
    assert node.held == {"GPU-0": 3}


@pytest.mark.parametrize("step_s", [-3600.0, 3600.0], ids=["an hour back", "an hour forward"])
def test_a_wall_clock_stepped_an_hour_between_boots_changes_no_hold(tmp_path: Path, step_s: float) -> None:
    """Three Xid 79 episodes in three boots twenty minutes apart, the host's clock set an hour back (or
    forward) at the third boot: held all the same (stepped back, the earlier episodes were 'in the future'
    and fell out of the window, so the GPU was never held)."""
    node = Node(tmp_path)
    node.check(XID, 0)
    for boot in ("boot-1", "boot-2"):
        node.reboot(boot, days=20 * 60 / DAY)
        if boot == "boot-2":
            node.now += step_s
        node.check(XID, 0)
    node.now += Limits().at_once_s
    node.check(XID, 0)
    assert node.held == {"GPU-0": 3}


def test_a_release_then_a_wall_clock_stepped_back_an_hour_neither_holds_again_nor_hides_a_new_episode(
    tmp_path: Path,
) -> None:
    """After a release, the host's clock set an hour back: the released episodes stay released (they were
    stamped after the new 'now'), and the three episodes that come after the release hold the GPU again."""
    node = held_node(tmp_path)
    stamp = datetime.fromtimestamp(node.now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    release(node, at=stamp)
    assert node.held == {}
    node.now -= 3600
    node.check(HEALTHY, SETTINGS.recover_after + 6)
    assert node.held == {}
    node.check(XID, 0)
    for boot in ("boot-4", "boot-5"):
        node.reboot(boot, days=10 * 60 / DAY)
        node.check(XID, 0)
    node.now += Limits().at_once_s
    node.check(XID, 0)
    assert node.held == {"GPU-0": 3}


def test_the_repair_marks_list_at_most_16_held_gpus_compactly_by_uuid() -> None:
    held = {f"GPU-{i:02}": 3 for i in range(17)}
    change = marks(NodeView(name="gpu-1"), held, handled_release=None)
    assert change is not None
    listed = change.annotations[ANN_REPEAT_OFFENDERS]
    assert listed == json.dumps({f"GPU-{i:02}": 3 for i in range(16)}).replace(", ", ",").replace(": ", ":")
    assert listed.startswith('{"GPU-00":3,"GPU-01":3,')


def test_the_repair_marks_warn_once_naming_each_newly_held_gpu() -> None:
    node = NodeView(name="gpu-1", annotations={ANN_REPEAT_OFFENDERS: '{"GPU-0":3}'})
    change = marks(node, {"GPU-0": 3, "GPU-1": 4, "GPU-2": 3}, handled_release=None)
    assert change is not None and change.event is not None
    assert (change.event.type, change.event.reason) == ("Warning", "GPURepeatOffender")
    assert "GPU-1 (4 fault episodes), GPU-2 (3 fault episodes);" in change.event.message
    assert "GPU-0" not in change.event.message


def test_marks_already_in_line_need_no_write() -> None:
    node = NodeView(
        name="gpu-1",
        annotations={ANN_REPEAT_OFFENDERS: '{"GPU-0":3}', ANN_REPAIR_PLACED: "true"},
        labels={LABEL_NEEDS_REPAIR: "true"},
    )
    assert marks(node, {"GPU-0": 3}, handled_release=None) is None
    assert marks(NodeView(name="gpu-1"), {}, handled_release=None) is None


def test_only_the_release_the_agent_handled_is_removed_never_a_newer_one() -> None:
    handled = '{"gpu": "*", "by": "alice", "at": "2027-01-24T08:00:00Z"}'
    newer = '{"gpu": "*", "by": "bob", "at": "2027-01-24T09:00:00Z"}'
    assert (
        marks(NodeView(name="gpu-1", annotations={ANN_RELEASE: newer}), {}, handled_release=handled) is None
    )
    change = marks(NodeView(name="gpu-1", annotations={ANN_RELEASE: handled}), {}, handled_release=handled)
    assert change is not None and change.annotations == {ANN_RELEASE: None}


def test_the_marks_event_says_both_when_the_planned_change_has_one_too() -> None:
    taint = NodeChange(action="taint", event=EventSpec("Warning", "GPUUnhealthy", "GPU 0: ecc"))
    mark = NodeChange(
        action="repair", annotations={ANN_REPAIR_PLACED: "true"}, event=EventSpec("Warning", "R", "held")
    )
    both = with_marks(taint, mark)
    assert both is not None and both.event is not None
    assert both.event.message == "held; GPU 0: ecc" and both.action == "taint"
    alone = with_marks(replace(taint, event=None), mark)
    assert alone is not None and alone.event is not None and alone.event.message == "held"
    assert with_marks(taint, replace(mark, event=None)) == replace(taint, annotations=mark.annotations)
