"""What an agent reads from other nodes: every agent trusts other nodes' gpuguard.io/ keys for the quarantine
budget and the quarantine order, and `gpuguard status` prints them. A stolen agent token can write its own
node's keys (docs/security.md), so each claim is validated before it counts, and nothing the API holds reaches
an operator's terminal as a control character.

The writer and `gpuguard status` run against a small HTTP stand-in for the API server that answers every
node list with the nodes a test puts there (label selectors honoured), through gpuguard's own client."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, ClassVar

import pytest
import structlog
import yaml

from gpuguard.core.config import QuarantineLimit
from gpuguard.kube import client as kubeclient
from gpuguard.kube import kubeconfig as kc
from gpuguard.quarantine.budget import SINCE_SKEW
from gpuguard.quarantine.node.budget import OtherNodes, quarantine_entry, quarantine_rank
from gpuguard.quarantine.node.writers import KubeNodeWriter
from harness.fakes import http_server
from tests.test_cli import run

ROOT = Path(__file__).resolve().parents[1]
NOW = datetime(2026, 6, 1, 12, 0, 0, tzinfo=UTC)
CREATED = "2026-01-01T00:00:00Z"
QUARANTINED = {"gpuguard.io/quarantined": "true", "nvidia.com/gpu.present": "true"}


def node(
    name: str, since: Any, *, created: str | None = CREATED, labels: dict[str, str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": QUARANTINED if labels is None else labels}
    if since is not None:
        meta["annotations"] = {"gpuguard.io/since": since}
    if created is not None:
        meta["creationTimestamp"] = created
    return {"metadata": meta}


class Nodes(BaseHTTPRequestHandler):
    """GET /api/v1/nodes?labelSelector=k,k2=v,...: the nodes in `items` whose labels match every term."""

    items: ClassVar[list[dict[str, Any]]] = []

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        selector = urllib.parse.parse_qs(url.query).get("labelSelector", [""])[0]
        wanted = [term.partition("=") for term in selector.split(",") if term]

        def matches(item: dict[str, Any]) -> bool:
            labels = item["metadata"].get("labels") or {}
            return all(key in labels and (not value or labels[key] == value) for key, _, value in wanted)

        body = json.dumps({"items": [i for i in type(self).items if matches(i)]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api_server() -> Iterator[str]:
    Nodes.items = []
    with http_server(Nodes) as url:
        yield url


def writer(server: str) -> KubeNodeWriter:
    client = kubeclient.Client(kc.Credentials(server=server), user_agent="t")
    return KubeNodeWriter("me", api=client, others=OtherNodes(clock=lambda: NOW))


# -- the claim, pure -----------------------------------------------------------------------------------------


def test_a_well_formed_claim_counts_with_its_since_and_name() -> None:
    assert quarantine_entry(node("a", "2026-05-31T10:00:00Z")["metadata"], now=NOW) == (
        "2026-05-31T10:00:00Z",
        "a",
    )
    # The node's creation second itself, and a clock a little ahead of ours, are fine.
    assert quarantine_entry(node("b", CREATED)["metadata"], now=NOW) == (CREATED, "b")
    ahead = (NOW + SINCE_SKEW).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert quarantine_entry(node("c", ahead)["metadata"], now=NOW) == (ahead, "c")


@pytest.mark.parametrize(
    ("since", "why"),
    [
        ("0000-01-01T00:00:00Z", "not a valid time"),  # year 0 does not exist
        ("1970-01-01T00:00:00Z", "before the node was created"),
        ("2025-12-31T23:59:59Z", "before the node was created"),
        ("2026-06-01T12:05:01Z", "in the future"),
        ("9999-12-31T23:59:59Z", "in the future"),
        ("2026-02-30T00:00:00Z", "not a valid time"),
        ("2026-05-31 10:00:00", "not an RFC 3339 UTC time"),
        ("2026-05-31T10:00:00+02:00", "not an RFC 3339 UTC time"),
        (" 2026-05-31T10:00:00Z", "not an RFC 3339 UTC time"),
        ("", "not an RFC 3339 UTC time"),
        (None, "not an RFC 3339 UTC time"),
        (12, "not an RFC 3339 UTC time"),
    ],
    ids=repr,
)
def test_a_malformed_or_impossible_since_does_not_count(since: Any, why: str) -> None:
    reason = quarantine_entry(node("x", since)["metadata"], now=NOW)
    assert isinstance(reason, str) and why in reason, reason


def test_a_node_without_the_quarantined_label_does_not_count() -> None:
    meta = node("x", "2026-05-31T10:00:00Z", labels={"gpuguard.io/quarantined": "deferred"})["metadata"]
    assert quarantine_entry(meta, now=NOW) == "not labelled quarantined=true"


# -- the attack, through the writer --------------------------------------------------------------------------


def test_a_valid_claim_is_validated_once_per_item_and_an_ignored_one_again_at_every_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watched budget hands over the same item objects until the watch replaces one: a fault's budget
    check validates only what changed. A claim ahead of the clock is not remembered: it counts once the
    clock has caught up with it."""
    import gpuguard.quarantine.node.budget as budget_module

    calls: list[str] = []
    real = budget_module.quarantine_entry

    def counting(meta: Any, *, now: datetime) -> Any:
        calls.append(str(meta.get("name")))
        return real(meta, now=now)

    monkeypatch.setattr(budget_module, "quarantine_entry", counting)
    clock = [NOW]
    others = OtherNodes(clock=lambda: clock[0])
    ahead = (NOW + SINCE_SKEW * 2).strftime("%Y-%m-%dT%H:%M:%SZ")
    items = [node("a", "2026-05-31T10:00:00Z"), node("b", "2026-05-31T11:00:00Z"), node("c", ahead)]
    assert others.quarantined(items) == [("2026-05-31T10:00:00Z", "a"), ("2026-05-31T11:00:00Z", "b")]
    assert calls == ["a", "b", "c"]
    calls.clear()
    items[1] = node("b", "2026-05-31T09:00:00Z")  # the watch delivered a change: a new object
    assert others.quarantined(items) == [("2026-05-31T10:00:00Z", "a"), ("2026-05-31T09:00:00Z", "b")]
    assert calls == ["b", "c"]
    calls.clear()
    clock[0] = NOW + SINCE_SKEW * 3
    assert others.quarantined(items)[-1] == (ahead, "c")
    assert calls == ["c"]
    calls.clear()
    assert others.quarantined(items[:1]) == [("2026-05-31T10:00:00Z", "a")]  # b and c left the list
    assert others.quarantined([dict(items[1])]) == [("2026-05-31T09:00:00Z", "b")]  # equal but new: again
    assert calls == ["b"]


def test_a_node_claiming_since_year_zero_does_not_rank_first_in_the_quarantine_order(api_server: str) -> None:
    """The reported attack: since=0000-01-01T00:00:00Z put the forger ahead of every real quarantine for ever,
    so a node that faulted within the budget found itself past the limit and yielded."""
    Nodes.items = [node("forger", "0000-01-01T00:00:00Z"), node("early", "2026-05-31T09:00:00Z")]
    order = writer(api_server).quarantine_order()
    assert order == [("2026-05-31T09:00:00Z", "early")]
    me = ("2026-05-31T11:00:00Z", "me")
    assert quarantine_rank(order, me) == 1  # only the real one ahead: with --max-quarantined 2, no yield


def test_forged_claims_do_not_spend_the_quarantine_budget(api_server: str) -> None:
    Nodes.items = [
        node("forger", "0000-01-01T00:00:00Z"),
        node("liar", "2099-01-01T00:00:00Z"),
        node("garbled", "\x1b[2J"),
        node("real", "2026-05-31T09:00:00Z"),
        *(node(f"gpu-{i}", None, labels={"nvidia.com/gpu.present": "true"}) for i in range(6)),
    ]
    w = writer(api_server)
    # A percentage: all 10 GPU nodes (and this one) are the fleet, but only one quarantine is real.
    budget = w.budget(QuarantineLimit.parse("20%"), exclude="me")
    assert budget is not None and (budget.gpu_nodes, budget.quarantined, budget.limit) == (11, 1, 3)
    # A count: the quarantined nodes' list, the same rule.
    budget = w.budget(QuarantineLimit.parse("2"), exclude="me")
    assert budget is not None and budget.quarantined == 1 and budget.has_room


def test_an_ignored_claim_is_logged_once_per_node_and_reason(api_server: str) -> None:
    Nodes.items = [node("forger", "0000-01-01T00:00:00Z"), node("garbled", "x\x1b]0;owned\x07")]
    w = writer(api_server)
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            w.quarantine_order()
            w.budget(QuarantineLimit.parse("50%"), exclude="me")
    ignored = [e for e in logs if e["event"] == "node.claim_ignored"]
    assert sorted(e["other_node"] for e in ignored) == ["forger", "garbled"]
    assert all(e["log_level"] == "warning" for e in ignored)
    assert not any("\x1b" in e["reason"] or "\x07" in e["reason"] for e in ignored), ignored
    # A new lie of the same node is news.
    Nodes.items = [node("forger", "2099-01-01T00:00:00Z")]
    with structlog.testing.capture_logs() as logs:
        w.quarantine_order()
    assert [e["other_node"] for e in logs if e["event"] == "node.claim_ignored"] == ["forger"]


# -- gpuguard status -----------------------------------------------------------------------------------------


def _status(server: str, tmp_path: Path, *args: str) -> str:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    result = run("status", "--kubeconfig", str(kubeconfig), *args, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


HOSTILE = node("evil", "2026-05-31T10:00:00Z\x1b[2J\x1b]0;owned\x07\u202e\x9b31m")
HOSTILE["metadata"]["annotations"]["gpuguard.io/reason"] = "ecc\nFAKE ROW\r"
HOSTILE["metadata"]["annotations"]["gpuguard.io/faults"] = "ecc/GPU-\x1b[1m"


def _controls(text: str) -> list[str]:
    return [ch for ch in text if ch != "\n" and (ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0 or ch == "\u202e")]


def test_status_as_a_table_prints_no_control_character_from_the_api(api_server: str, tmp_path: Path) -> None:
    Nodes.items = [HOSTILE]
    out = _status(api_server, tmp_path)
    assert not _controls(out), _controls(out)
    assert len(out.splitlines()) == 3, out  # the fleet's summary, the header and one row: no injected line
    assert "2026-05-31T10:00:00Z\\x1b[2J\\x1b]0;owned\\x07\\u202e\\x9b31m" in out  # shown, harmless
    assert "ecc/GPU-_[1m" in out  # fault keys are sanitised when read (validation.fault_key)


def test_status_as_json_holds_no_control_character_from_the_api(api_server: str, tmp_path: Path) -> None:
    Nodes.items = [HOSTILE]
    out = _status(api_server, tmp_path, "-o", "json")
    (row,) = json.loads(out)["rows"]
    for value in (row["since"], row["detail"], *row["faults"]):
        assert not _controls(value), value  # even after `jq -r`
    assert row["detail"] == "ecc\\nFAKE ROW\\r"
