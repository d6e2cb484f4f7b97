"""An operator's hold (`gpuguard hold`, gpuguard/quarantine/repeat/hold.py) through the reconciler, and the
GPU history's summary the agent publishes on its node for `gpuguard history` (repeat/published.py): a hold
keeps a healthy GPU quarantined across reboots until a release, is recorded with who placed it, and is refused
(logged, removed) where it names no GPU of the node or escalation is off; the summary stays within its
bytes whatever the history holds, and its reader refuses what the agent would never write."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gpuguard.quarantine.node.view import ANN_REPEAT_OFFENDERS, LABEL_NEEDS_REPAIR, NodeChange, NodeView
from gpuguard.quarantine.repeat import hold, published
from gpuguard.quarantine.repeat.escalation import Limits, held_faults
from gpuguard.quarantine.repeat.marks import marks, with_marks
from gpuguard.quarantine.repeat.release import ReleaseRequest
from gpuguard.store.history import Episode, GpuHistory, HistoryStore, Release
from tests.test_repeat import DAY, HEALTHY, SETTINGS, T0, XID, Node, release


def place(node: Node, gpu: str = "GPU-1", *, by: str = "alice", at: str = "2027-01-15T08:00:00Z") -> None:
    node.writer.edit(
        annotations={
            **node.writer.node.annotations,
            hold.ANN_HOLD: json.dumps({"gpu": gpu, "by": by, "at": at}),
        }
    )
    node.agent._node = None  # the agent's next read of the node sees it
    node.check(HEALTHY, SETTINGS.recover_after + 5)


def test_a_hold_quarantines_a_healthy_gpu_across_reboots_until_a_release(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.now = T0 + 10 * DAY  # 2027-01-25T08:00Z
    node.check(HEALTHY, 0)
    with capture_logs() as logs:
        place(node)
    assert [(e["gpu"], e["by"]) for e in logs if e["event"] == "repeat.held"] == [("GPU-1", "alice")]
    assert node.held == {"GPU-1": 0} and node.tainted_for == "repeat-offender"
    n = node.writer.node
    assert hold.ANN_HOLD not in n.annotations  # handled: removed in the same write
    assert json.loads(n.annotations[ANN_REPEAT_OFFENDERS]) == {"GPU-1": 0}
    assert n.labels[LABEL_NEEDS_REPAIR] == "true"
    saved = HistoryStore(tmp_path).load()["GPU-1"]
    assert saved.held_by == "alice" and saved.escalated == T0 + 10 * DAY
    node.reboot("boot-1")  # a new agent, its history from the disk: still held
    assert node.held == {"GPU-1": 0} and node.tainted_for == "repeat-offender"
    release(node, gpu="GPU-1", at="2027-01-26T08:00:00Z", by="bob")
    assert node.held == {} and node.writer.node.our_taint is None
    saved = HistoryStore(tmp_path).load()["GPU-1"]
    assert saved.held_by is None and saved.releases[-1].by == "bob"


@pytest.mark.parametrize(
    ("gpu", "limit", "why"),
    [
        ("GPU-9", 3, "no GPU GPU-9 on this node (its GPUs: GPU-0, GPU-1)"),
        ("GPU-1", 0, "repeat offenders are off (--repeat-limit 0): nothing is held"),
        ("*", 3, 'a hold of "*" is not one'),
    ],
)
def test_a_hold_the_agent_cannot_honour_is_refused_logged_and_removed(
    tmp_path: Path, gpu: str, limit: int, why: str
) -> None:
    node = Node(tmp_path, limit=limit)
    node.now = T0 + 10 * DAY
    node.check(HEALTHY, 0)
    with capture_logs() as logs:
        place(node, gpu)
    refused = [e for e in logs if e["event"] == "repeat.hold_refused"]
    assert len(refused) == 1 and why in refused[0]["error"], logs
    assert node.held == {} and node.writer.node.our_taint is None
    assert hold.ANN_HOLD not in node.writer.node.annotations  # refused once, not at every check


def test_a_hold_of_a_gpu_already_held_changes_nothing(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.now = T0 + 10 * DAY
    node.check(HEALTHY, 0)
    place(node)
    with capture_logs() as logs:
        place(node, by="bob", at="2027-01-15T09:00:00Z")
    assert [e["event"] for e in logs if e["event"].startswith("repeat.hold")] == ["repeat.hold_already_held"]
    assert HistoryStore(tmp_path).load()["GPU-1"].held_by == "alice"


def test_the_annotation_the_cli_writes_is_the_hold_the_agent_reads() -> None:
    at = datetime(2027, 1, 15, 9, 0, 0, tzinfo=timezone(timedelta(hours=1)))
    text = hold.annotation("GPU-1", by="alice", at=at)
    assert json.loads(text) == {"gpu": "GPU-1", "by": "alice", "at": "2027-01-15T08:00:00Z"}
    assert hold.parse(text, now=at.timestamp()) == ReleaseRequest(gpu="GPU-1", by="alice", at=at.timestamp())


def test_the_held_fault_says_who_held_the_gpu() -> None:
    history = {"GPU-1": GpuHistory(escalated=T0, held_by="alice")}
    verdict = held_faults(HEALTHY, history, Limits())
    (fault,) = [f for f in verdict.faults if f.uuid == "GPU-1"]
    assert fault.reason == "repeat-offender" and "held by alice since 2027-01-15T08:00Z" in fault.message


def test_the_agent_publishes_its_gpu_history_on_the_node(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.check(XID, 0)
    node.reboot("boot-1")
    summary = published.read(node.writer.node.annotations[published.ANN_HISTORY])
    (episode,) = summary.gpus["GPU-0"].episodes
    assert (episode.reasons, episode.first_seen, episode.ended) == ("xid-79", int(T0), "reboot")
    assert summary.gpus["GPU-0"].held_at is None and summary.more == 0


def test_the_summary_stays_within_its_bytes_the_held_gpus_kept_first() -> None:
    big = GpuHistory(
        episodes=tuple(
            Episode(reasons=("x" * 64,) * 3, first_seen=T0 + i, ended="reboot", ended_at=T0 + i + 1)
            for i in range(32)
        ),
        releases=tuple(Release(by="y" * 64, at=T0 + i) for i in range(8)),
    )
    history = {f"GPU-{i:03d}-" + "u" * 80: big for i in range(64)}
    history["GPU-held"] = GpuHistory(episodes=big.episodes[:1], escalated=T0 - DAY, held_by="alice")
    text = published.summary(history)
    assert text is not None and len(text.encode()) <= published.MAX_BYTES
    summary = published.read(text)
    assert "GPU-held" in summary.gpus and summary.gpus["GPU-held"].held_by == "alice"
    assert summary.more == 65 - len(summary.gpus) > 0
    assert all(len(g.episodes) == published.EPISODES for u, g in summary.gpus.items() if u != "GPU-held")
    assert published.summary({}) is None


def _gpu(**over: object) -> str:
    g = {"held": None, "episodes": [], "episodes_total": 0, "releases": [], "releases_total": 0, **over}
    return json.dumps({"v": 1, "gpus": {"GPU-0": g}})


@pytest.mark.parametrize(
    "text",
    [
        "x" * 5000,
        "[]",
        '{"v": 2, "gpus": {}}',
        _gpu(episodes=[["xid-79", -1, None, None]]),
        _gpu(episodes=[["xid-79", 1, "forged", None]]),
        _gpu(episodes=[["xid-79", 1, None, None]] * 5),
        _gpu(held=[1]),
        _gpu(releases=[["\x1b]0;pwned", 1e20]]),
    ],
)
def test_the_reader_refuses_a_summary_the_agent_would_never_write(text: str) -> None:
    with pytest.raises(ValueError, match=r"."):
        published.read(text)


def test_the_summary_rides_on_a_write_that_happens_anyway_never_one_of_its_own() -> None:
    """A per-GPU fault and its recovery cost their DeviceTaintRule's requests only
    (tests/integration/test_requests_per_transition.py): the summary waits for the node's next write."""
    node = NodeView(name="gpu-1", resource_version="1")
    summary = (published.ANN_HISTORY, published.summary({"GPU-0": GpuHistory()}))
    assert marks(node, {}, handled_release=None, published=summary) is None
    change = marks(node, {}, handled_release=None, published=summary, rides=True)
    assert change is not None and change.annotations == {published.ANN_HISTORY: summary[1]}
    held = marks(node, {"GPU-0": 3}, handled_release=None, published=summary)  # a mark's own write
    assert held is not None and published.ANN_HISTORY in held.annotations


def test_the_summary_waits_rather_than_make_a_quarantines_write_too_large() -> None:
    """One write carries at most 16 KiB of gpuguard's annotations (validation.check_node_patch refuses more):
    a taint write that already carries nearly that keeps its size, without the summary."""
    node = NodeView(name="gpu-1", resource_version="1")
    summary = (published.ANN_HISTORY, "x" * published.MAX_BYTES)
    mark = marks(node, {}, handled_release=None, published=summary, rides=True)
    big = NodeChange(action="taint", annotations={"gpuguard.io/reason": "r" * (15 * 1024)}, labels={})
    assert published.ANN_HISTORY not in (with_marks(big, mark) or big).annotations
    small = NodeChange(action="taint", annotations={"gpuguard.io/reason": "ecc"}, labels={})
    assert (with_marks(small, mark) or small).annotations[published.ANN_HISTORY] == summary[1]


def test_the_summary_shows_the_last_two_releases_and_counts_them_all() -> None:
    releases = tuple(Release(by=f"op{i}", at=T0 + i) for i in range(5))
    summary = published.read(published.summary({"GPU-0": GpuHistory(releases=releases)}) or "")
    assert summary.gpus["GPU-0"].releases == (("op3", int(T0) + 3), ("op4", int(T0) + 4))
    assert summary.gpus["GPU-0"].releases_total == 5 and summary.more == 0


def test_the_reader_takes_an_episodes_reasons_up_to_three_of_the_longest_joined() -> None:
    """An episode's reasons are at most three fault keys of 64 characters joined by '+' (194 characters)."""
    longest = "+".join(["x" * 64] * 3)
    got = published.read(_gpu(episodes=[[longest, 1, None, None]]))
    assert got.gpus["GPU-0"].episodes[0].reasons == longest and got.more == 0  # "more" absent: none
    with pytest.raises(ValueError, match="at most 194 characters"):
        published.read(_gpu(episodes=[[longest + "y", 1, None, None]]))


def test_an_empty_history_removes_the_summary_a_node_carries_and_writes_nothing_on_one_without() -> None:
    """published.summary is None for an empty history: the annotation goes, with the node's next write."""
    carrying = NodeView(name="gpu-1", resource_version="1", annotations={published.ANN_HISTORY: "{}"})
    change = marks(carrying, {}, handled_release=None, published=(published.ANN_HISTORY, None), rides=True)
    assert change is not None and change.annotations == {published.ANN_HISTORY: None}
    bare = NodeView(name="gpu-1", resource_version="1")
    assert marks(bare, {}, handled_release=None, published=(published.ANN_HISTORY, None), rides=True) is None


def test_a_summary_of_exactly_4_kib_keeps_every_gpu_and_one_byte_more_leaves_the_last_out() -> None:
    one = GpuHistory(episodes=(Episode(reasons=("xid-79",), first_seen=T0, ended="reboot", ended_at=T0 + 1),))

    def history(gpus: int, pad: int) -> dict[str, GpuHistory]:
        return {f"GPU-{i:03d}" + "p" * (pad if i == 0 else 0): one for i in range(gpus)}

    def size(h: dict[str, GpuHistory]) -> int:
        return len((published.summary(h) or "").encode())

    gpus = 1
    while json.loads(published.summary(history(gpus + 1, 0)) or "")["more"] == 0:  # the most that fit
        gpus += 1
    exact = history(gpus, published.MAX_BYTES - size(history(gpus, 0)))
    assert size(exact) == 4096 and json.loads(published.summary(exact) or "")["more"] == 0
    over = history(gpus, published.MAX_BYTES - size(history(gpus, 0)) + 1)
    assert size(over) < 4096 and json.loads(published.summary(over) or "")["more"] == 1


def test_a_write_of_exactly_16_kib_of_annotations_keeps_the_summary_and_one_byte_more_does_not() -> None:
    node = NodeView(name="gpu-1", resource_version="1")
    mark = marks(node, {}, handled_release=None, published=(published.ANN_HISTORY, "x" * 100), rides=True)
    assert mark is not None
    room = (
        16 * 1024
        - sum(len(k) + len(v or "") for k, v in mark.annotations.items())
        - len("gpuguard.io/reason")
    )
    for extra, kept in ((0, True), (1, False)):
        big = NodeChange(action="taint", annotations={"gpuguard.io/reason": "r" * (room + extra)}, labels={})
        merged = with_marks(big, mark)
        assert merged is not None and (published.ANN_HISTORY in merged.annotations) is kept
