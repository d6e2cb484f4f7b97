"""Reads of the API server bounded in bytes as they stream (gpuguard/kube/bounded.py, the client's request and
watch): a list's item or a watch's event over its cap is dropped unread, counted and logged once, and absent
to the reader; nothing larger than the cap is ever held whole. Against the real API server, with the agent's
peak memory at the chart's limit: tests/integration/test_memory_ceiling.py."""

from __future__ import annotations

import json
import threading
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from gpuguard.core.errors import TransientApiError
from gpuguard.kube import client as kubeclient
from gpuguard.kube import kubeconfig as kc
from gpuguard.kube import nodes
from gpuguard.kube.bounded import Dropped, Lines, Splitter, TooLarge, dropped_event
from gpuguard.kube.listwatch import ListWatch
from harness.fakes import http_server
from tests.test_kube_client import Recorder

MIB = 1024 * 1024


def dumps(doc: object) -> bytes:
    """As the API server writes JSON: compact."""
    return json.dumps(doc, separators=(",", ":")).encode()


def split(doc: bytes, size: int, *, max_item: int = MIB, max_rest: int = MIB) -> tuple[Any, list[Any], int]:
    s = Splitter(max_item=max_item, max_rest=max_rest)
    items = [json.loads(i) for at in range(0, len(doc), size) for i in s.feed(doc[at : at + size])]
    return json.loads(s.end()), items, s.dropped


TRICKY = {
    "kind": "List",
    "metadata": {"continue": 'a"b[{', "resourceVersion": "9"},
    "note": "items",  # "items" as a value, not the key
    "x": [["items"]],
    "items": [
        {"metadata": {"name": "a", "annotations": {"k": 'quote " brace } bracket ] backslash \\ end'}}},
        {"metadata": {"name": "b\\"}, "spec": {"nested": [[{}], {"items": [1, 2]}]}},
        {"metadata": {"name": "\u00e9\u2603"}},
    ],
    "after": {"items": [{"not": "these"}]},
}


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 65536])
def test_a_list_is_cut_into_exactly_its_items_however_its_bytes_arrive(size: int) -> None:
    doc = json.dumps(TRICKY).encode()
    rest, items, dropped = split(doc, size)
    assert items == TRICKY["items"] and dropped == 0
    assert rest == {**TRICKY, "items": []}


def test_a_document_without_items_is_all_rest_and_null_items_stay_null() -> None:
    assert split(b'{"metadata":{"name":"n"},"spec":{}}', 5)[0] == {"metadata": {"name": "n"}, "spec": {}}
    assert split(b'{"items":null,"metadata":{}}', 3)[:2] == ({"items": None, "metadata": {}}, [])


def test_an_item_over_the_cap_is_dropped_and_counted_and_the_others_kept() -> None:
    big = {"metadata": {"name": "big", "managedFields": [{"f": "x" * 5000}]}}
    doc = {"metadata": {}, "items": [{"metadata": {"name": "a"}}, big, {"metadata": {"name": "c"}}]}
    rest, items, dropped = split(json.dumps(doc).encode(), 1000, max_item=4096)
    assert [i["metadata"]["name"] for i in items] == ["a", "c"] and dropped == 1
    assert rest == {"metadata": {}, "items": []}


def test_an_item_over_the_cap_is_never_held_whole() -> None:
    """20 MB of one item in 64 KiB chunks: the splitter holds no more than the cap and a chunk."""
    chunk = b'"' + b"x" * 65534 + b'",'
    s = Splitter(max_item=256 * 1024, max_rest=MIB)
    s.feed(b'{"items":[{"metadata":{"name":"big"},"f":[')
    tracemalloc.start()
    for _ in range(320):
        assert s.feed(chunk) == []
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert s.feed(b'"end"]}]}') == [] and s.dropped == 1
    assert peak < 2 * 256 * 1024, peak  # without the drop: 20 MB


def test_the_rest_of_a_document_over_its_cap_is_too_large() -> None:
    with pytest.raises(TooLarge, match="more than 100 bytes besides the items"):
        split(json.dumps({"metadata": {"x": "y" * 200}, "items": []}).encode(), 50, max_rest=100)


def test_a_watch_line_over_the_cap_is_dropped_unbuffered_and_its_head_names_the_object() -> None:
    big = dumps(
        {"type": "MODIFIED", "object": {"metadata": {"name": "n1", "resourceVersion": "42"}, "x": "y" * 9000}}
    )
    small = b'{"type":"ADDED","object":{"metadata":{"name":"n2"}}}'
    lines = Lines(max_item=4096)
    stream = big + b"\n" + small + b"\n"
    got = [line for at in range(0, len(stream), 1000) for line in lines.feed(stream[at : at + 1000])]
    assert [type(line) for line in got] == [Dropped, bytes] and json.loads(got[1]) == json.loads(small)
    assert len(got[0]) == Lines.HEAD
    assert dropped_event(got[0]) == {
        "type": "DROPPED",
        "object": {"metadata": {"name": "n1", "resourceVersion": "42"}},
    }
    assert dropped_event(b'{"type":"MODIFIED","object":{"kind":"X"') is None


# -- through the client, over HTTP ------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[str]:
    Recorder.seen, Recorder.replies = [], []
    with http_server(Recorder) as url:
        yield url


def item(name: str, pad: int = 0) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": "5", "managedFields": [{"f:x": "m" * pad}]}}


def test_a_list_drops_its_oversized_item_counts_each_and_logs_once(server: str) -> None:
    counted: list[str] = []
    client = kubeclient.Client(kc.Credentials(server=server), user_agent="t", dropped=counted.append)
    doc = {"metadata": {"resourceVersion": "9"}, "items": [item("a"), item("big", 2 * MIB), item("c")]}
    Recorder.replies = [(200, {}, json.dumps(doc).encode())] * 2
    with capture_logs() as logs:
        for _ in range(2):
            got = client.request("GET", "/things", what="list things", keep=lambda i: i["metadata"])
            assert [i["name"] for i in got["items"]] == ["a", "c"]
            assert got["metadata"] == {"resourceVersion": "9"}
    assert counted == ["list things", "list things"]
    assert [(e["event"], e["read"], e["max_bytes"]) for e in logs] == [
        ("kube.object_dropped", "list things", kubeclient.MAX_OBJECT)
    ]


def test_a_list_of_large_items_costs_one_item_at_a_time_not_the_page(server: str) -> None:
    """The red team's 100 rules of 1.2 MB each (here 30, and items under the cap, kept trimmed): the old read
    held the page and its parse whole, ~36 MB and several times that parsed."""
    client = kubeclient.Client(kc.Credentials(server=server), user_agent="t")
    body = json.dumps({"metadata": {}, "items": [item(f"r{i}", 1_200_000) for i in range(30)]}).encode()
    Recorder.replies = [(200, {}, body)]
    tracemalloc.start()
    got = client.request("GET", "/rules", keep=lambda i: {"name": i["metadata"]["name"]}, max_item=2 * MIB)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(got["items"]) == 30
    assert peak < 8 * MIB, peak


def test_an_answer_too_large_to_keep_whole_is_a_transient_error(server: str) -> None:
    client = kubeclient.Client(kc.Credentials(server=server), user_agent="t")
    Recorder.replies = [
        (200, {}, json.dumps({"metadata": {"x": "y" * (kubeclient.MAX_RESPONSE + 1)}}).encode())
    ]
    with pytest.raises(TransientApiError, match=r"^read node n: TooLarge: more than 3145728 bytes"):
        client.request("GET", "/api/v1/nodes/n", what="read node n")


def test_a_watch_event_over_the_cap_makes_its_object_absent_and_the_watch_goes_on(server: str) -> None:
    counted: list[str] = []
    client = kubeclient.Client(kc.Credentials(server=server), user_agent="t", dropped=counted.append)
    events = [
        {"type": "ADDED", "object": item("a")},
        {"type": "MODIFIED", "object": {"metadata": {"name": "a", "resourceVersion": "6"}, "x": "y" * 70000}},
        {"type": "ADDED", "object": {"metadata": {"name": "b", "resourceVersion": "7"}}},
    ]
    Recorder.replies = [(200, {}, b"".join(dumps(e) + b"\n" for e in events))]
    lw = ListWatch(client, selector="s", what="things", max_item=65536)
    assert lw.watch("/things", "5", stop=threading.Event()) == "7"
    _, items = lw.snapshot()
    assert [i["metadata"]["name"] for i in items] == ["b"]  # "a" over the cap: absent, as in a list
    assert counted == ["watch things"]


def test_a_list_of_nodes_by_selector_keeps_no_managed_fields(server: str) -> None:
    """The count of a fleet's GPU nodes is one unpaged list: each node loses its managedFields on arrival."""
    client = kubeclient.Client(kc.Credentials(server=server), user_agent="t")
    Recorder.replies = [(200, {}, dumps({"metadata": {}, "items": [item(f"n{i}", 100) for i in range(3)]}))]
    got = nodes.select(client, "gpu=true", what="count GPU nodes", metadata_only=True)
    assert [i["metadata"] for i in got] == [{"name": f"n{i}", "resourceVersion": "5"} for i in range(3)]
