"""node/listwatch.py's thread body (`ListWatch.run`), shared by the budget's watch of the quarantined nodes
and the watch of gpuguard's DeviceTaintRules: what a failure does. The watches themselves against a real API
server: tests/integration/test_fleet_watch.py."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from gpuguard.core.errors import NodeUpdateError, TransientApiError
from gpuguard.kube import client as kubeclient
from gpuguard.kube import kubeconfig
from gpuguard.kube.listwatch import ListWatch


class _Script(kubeclient.Client):
    """Lists answer at once; each watch does what the script says next: "end" (the server's timeoutSeconds),
    an HTTP status to fail with, or "stop" (the caller's stop())."""

    def __init__(self, script: list[object], stop: threading.Event, gate: threading.Event | None) -> None:
        super().__init__(kubeconfig.Credentials(server="https://127.0.0.1:9"), user_agent="test")
        self.script, self.stop, self.gate = script, stop, gate
        self.calls: list[str] = []

    def request(self, method: str, path: str, **kw: Any) -> Any:
        self.calls.append("list")
        return {"metadata": {"resourceVersion": "7"}, "items": []}

    def watch(self, path: str, *, query: Mapping[str, str], **kw: Any) -> Iterator[Any]:
        self.calls.append(f"watch@{query['resourceVersion']}")
        step = self.script.pop(0)
        if step == "stop" or not self.script:
            self.stop.set()
            if self.gate is not None:
                self.gate.set()  # stop() sets the gate too: the loop must not wait on it
            return iter(())
        if step == "end":
            return iter(())
        if step == 410:
            return iter([{"type": "ERROR", "object": {"code": 410}}])
        assert isinstance(step, int)
        raise TransientApiError(f"watch: HTTP {step}", status=step)


@pytest.fixture(autouse=True)
def _no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(random, "uniform", lambda a, b: 0.0)  # the backoff's jitter: no wait


def run(script: list[object], *, gate: threading.Event | None = None) -> tuple[list[str], list[str]]:
    stop = threading.Event()
    api = _Script(script, stop, gate)
    said: list[str] = []
    lw = ListWatch(api, selector="a=b", what="things")

    def broken(exc: NodeUpdateError) -> None:
        said.append(f"broken {exc.status}")
        assert not lw.synced  # the caller's lists answer meanwhile

    lw.run(lambda: "/things", stop=stop, watching=lambda: said.append("watching"), broken=broken, gate=gate)
    return api.calls, said


def test_a_failure_is_said_once_until_a_watch_is_established_again_and_the_watch_resumes() -> None:
    calls, said = run(["end", 503, 503, "end", "stop"])
    assert calls == ["list", "watch@7", "watch@7", "watch@7", "watch@7", "watch@7"]
    assert said == ["watching", "broken 503", "watching"]


def test_410_lists_again_and_a_404_without_a_gate_only_retries_the_watch() -> None:
    calls, _ = run([410, 404, "stop"])
    assert calls == ["list", "watch@7", "list", "watch@7", "watch@7"]


def test_with_a_gate_a_404_lists_again_only_after_the_gate_is_set_again() -> None:
    gate = threading.Event()
    gate.set()
    reopened = threading.Timer(0.3, gate.set)  # the next read that finds the collection served
    t0 = time.monotonic()
    reopened.start()
    calls, said = run([404, "stop"], gate=gate)
    assert time.monotonic() - t0 >= 0.3  # waited for the gate, not for the backoff alone
    assert calls == ["list", "watch@7", "list", "watch@7"]
    assert said == ["broken 404", "watching"]


class _Pages(kubeclient.Client):
    """A collection of 250 items served in pages of the limit asked for."""

    def __init__(self) -> None:
        super().__init__(kubeconfig.Credentials(server="https://127.0.0.1:9"), user_agent="test")
        self.queries: list[dict[str, str]] = []

    def request(self, method: str, path: str, **kw: Any) -> Any:
        query = dict(kw["query"])
        self.queries.append(query)
        start, limit = int(query.get("continue", "0")), int(query["limit"])
        names = [f"item-{i}" for i in range(start, min(start + limit, 250))]
        rest = str(start + limit) if start + limit < 250 else ""
        keep = kw.get("keep") or (lambda i: i)  # as the client applies it, to each item as it arrives
        return {
            "metadata": {"resourceVersion": "9" if start == 0 else "", "continue": rest},
            "items": [keep(self.item(n)) for n in names],
        }

    def item(self, name: str) -> dict[str, Any]:
        return {"metadata": {"name": name}, "big": "x" * 1000}


def test_a_paged_list_reads_every_page_and_keeps_only_what_keep_returns() -> None:
    api = _Pages()
    lw = ListWatch(api, selector="a=b", what="things", keep=lambda i: {"metadata": i["metadata"]}, page=100)
    assert lw.list("/things") == "9"
    assert [q.get("continue") for q in api.queries] == [None, "100", "200"]
    assert all(q["limit"] == "100" for q in api.queries)
    _, items = lw.snapshot()
    assert len(items) == 250 and all("big" not in i for i in items)


def test_no_item_keeps_its_managed_fields_whatever_keep_returns() -> None:
    """A stolen token's 1.2 MB managedFields on each of 100 rules took an agent listing them to 288 MiB: no
    reader needs them, so they are dropped as each item arrives, before `keep` (which may keep metadata)."""

    class Bloated(_Pages):
        def item(self, name: str) -> dict[str, Any]:
            item = super().item(name)
            item["metadata"]["managedFields"] = [{"manager": "x", "fieldsV1": {"f:x": {}}}]
            return item

    lw = ListWatch(
        Bloated(), selector="a=b", what="things", keep=lambda i: {"metadata": i["metadata"]}, page=100
    )
    lw.list("/things")
    _, items = lw.snapshot()
    assert len(items) == 250 and not [i for i in items if "managedFields" in i["metadata"]]
