"""gpuguard's taint carries no value (a toleration with `operator: Exists` matches it whatever the fault), and
an upgrade from a version that put the fault's reason there (`gpuguard.io/gpu-unhealthy=ecc`) swaps the old
taint for the new one in one write: on the real API server, under the enforced admission policy, a watch of
the node sees no version without the taint between the two."""

from __future__ import annotations

import json
import threading
from typing import Any

import kubernetes
import pytest
import urllib3

from harness.kube import GPUS_OK, Admin, eventually
from tests.integration.fixtures import start_agent  # noqa: F401
from tests.integration.test_admission import admin  # noqa: F401

pytestmark = pytest.mark.timeout(120)

KEY = "gpuguard.io/gpu-unhealthy"
ECC = GPUS_OK.replace("GPU-it-0", "GPU-it-0 ecc=2")


def _ours(node: dict[str, Any]) -> dict[str, Any] | None:
    return next((t for t in node["spec"].get("taints") or () if t["key"] == KEY), None)


class NodeVersions:
    """Every version of one Node the API server tells a watch about, from a resourceVersion on."""

    def __init__(self, admin: Admin, name: str, since: str) -> None:
        self.seen: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._watch: Any = kubernetes.watch.Watch()  # type: ignore[no-untyped-call]
        self._thread = threading.Thread(target=self._run, args=(admin, name, since), daemon=True)
        self._thread.start()

    def _run(self, admin: Admin, name: str, since: str) -> None:
        stream = self._watch.stream(
            admin.core.list_node,
            field_selector=f"metadata.name={name}",
            resource_version=since,
            timeout_seconds=60,
            _preload_content=False,
        )
        try:
            for event in stream:
                obj = event["raw_object"] if "raw_object" in event else json.loads(event["object"])
                self.seen.append(obj)
        except urllib3.exceptions.ProtocolError:
            if not self._stop.is_set():  # cut short by stop(): expected
                raise

    def stop(self) -> None:
        self._stop.set()
        self._watch.stop()


def test_the_taint_has_no_value_and_the_reason_is_in_the_record_and_the_condition(
    admin: Admin, start_agent: Any
) -> None:
    _, node, state = start_agent()
    state.write_text(ECC)
    taint = eventually(lambda: _ours(admin.node(node)), 10, what="taint")
    assert taint == {"key": KEY, "effect": "NoSchedule"}
    n = admin.node(node)
    assert n["metadata"]["annotations"]["gpuguard.io/reason"].startswith("ecc: ")
    gpu = next(c for c in n["status"]["conditions"] if c["type"] == "GPUHealthy")
    assert gpu["status"] == "False" and gpu["message"].startswith("ecc: ")


def test_an_upgrade_from_a_taint_valued_with_the_reason_swaps_it_in_one_write_never_leaving_the_node_bare(
    admin: Admin, start_agent: Any
) -> None:
    agent, node, state = start_agent()
    state.write_text(ECC)
    eventually(lambda: _ours(admin.node(node)), 10, what="taint")
    agent.stop()
    # The node as an earlier version left it: the same record, the taint valued with the fault's reason (and a
    # timeAdded, which the swap keeps).
    admin.update_node(
        node,
        lambda n: {
            "spec": {
                "taints": [
                    {**t, "value": "ecc", "timeAdded": "2026-12-01T00:00:00Z"} if t["key"] == KEY else t
                    for t in n["spec"]["taints"]
                ]
            }
        },
    )
    old = admin.node(node)
    assert _ours(old) == {
        "key": KEY,
        "effect": "NoSchedule",
        "value": "ecc",
        "timeAdded": "2026-12-01T00:00:00Z",
    }
    versions = NodeVersions(admin, node, old["metadata"]["resourceVersion"])
    try:
        start_agent(node=node, state=state)
        eventually(lambda: "value" not in (_ours(admin.node(node)) or {"value": ""}), 10, what="swap")
        eventually(lambda: any(_ours(v) == _ours(admin.node(node)) for v in versions.seen), 10, what="watch")
    finally:
        versions.stop()
    taints = [_ours(v) for v in versions.seen]
    assert None not in taints, taints  # no version of the node without the taint
    swapped = [t for t in taints if t is not None and "value" not in t]
    assert swapped and swapped[0] == {"key": KEY, "effect": "NoSchedule", "timeAdded": "2026-12-01T00:00:00Z"}
    # One write did it: the version before the first valueless one is the old taint as it was.
    first = taints.index(swapped[0])
    assert first == 0 or taints[first - 1] == _ours(old)
    now = admin.node(node)
    assert (
        now["metadata"]["annotations"]["gpuguard.io/faults"]
        == old["metadata"]["annotations"]["gpuguard.io/faults"]
    )
    assert now["metadata"]["labels"]["gpuguard.io/quarantined"] == "true"
