"""gpuguard.quarantine.gpu.writers against a stateful fake of the API server's resource.k8s.io paths: which
DeviceTaintRule version the agent finds (v1, 1.36's v1beta2, or neither), the one log line that says so, and
a dry run that decides as the agent would. The same on the real kube-apiserver:
tests/integration/test_device_versions.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from structlog.testing import capture_logs

from gpuguard.core.config import NodeSettings, PolicySettings
from gpuguard.core.errors import PermanentApiError
from gpuguard.core.model import GpuReading, Snapshot, Verdict, XidEvent
from gpuguard.judge.policy import evaluate
from gpuguard.quarantine.gpu.quarantine import DeviceQuarantine
from gpuguard.quarantine.gpu.writers import (
    RULES_API_NONE,
    RULES_API_UNKNOWN,
    DryRunDeviceSource,
    KubeDeviceSource,
)
from gpuguard.quarantine.node.view import NodeView
from gpuguard.quarantine.reconciler import NodeReconciler
from harness.dra import DRIVER, gpu_uuid, nvidia_slice
from harness.fakes import FakeNodeWriter
from harness.judging import hand_over

NODE = "gpu-node-1"
GROUP = "/apis/resource.k8s.io"


class FakeResourceApi:
    """resource.k8s.io as an API server serves it: ResourceSlices in v1, DeviceTaintRules in the versions
    `served` (404 in the others, as for a resource the server does not serve); records every request."""

    def __init__(self, served: tuple[str, ...], slices: list[dict[str, Any]] | None = None) -> None:
        self.served = served
        self.slices = slices if slices is not None else [nvidia_slice(NODE)]
        self.rules: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []

    def request(self, method: str, path: str, *, body: Any = None, **_kw: Any) -> Any:
        self.calls.append((method, path))
        if path == f"{GROUP}/v1/resourceslices":
            return {"items": self.slices}
        version, _, rest = path.removeprefix(f"{GROUP}/").partition("/devicetaintrules")
        if version not in self.served:
            raise PermanentApiError(f"{method} {path}: HTTP 404: the server could not find it", status=404)
        name = rest.strip("/")
        if method == "GET" and not name:
            return {"items": list(self.rules.values())}
        if method == "POST":
            assert body["apiVersion"] == f"resource.k8s.io/{version}"
            doc = {**body, "metadata": {**body["metadata"], "uid": "u1", "resourceVersion": "1"}}
            self.rules[doc["metadata"]["name"]] = doc
            return doc
        if method == "DELETE":
            self.rules.pop(name)
            return {}
        raise AssertionError(f"unexpected {method} {path}")


def source(api: FakeResourceApi) -> KubeDeviceSource:
    return KubeDeviceSource(NODE, api=api, driver=DRIVER, announce=True)  # type: ignore[arg-type]


def rules_api_lines(logs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [e for e in logs if e["event"] == "device.rules_api"]


def test_before_the_first_list_the_rules_api_is_unknown() -> None:
    assert source(FakeResourceApi(("v1",))).api_version == RULES_API_UNKNOWN


@pytest.mark.parametrize(
    ("served", "found", "tried"),
    [
        (("v1",), "resource.k8s.io/v1", ["resource.k8s.io/v1"]),
        (("v1", "v1beta2"), "resource.k8s.io/v1", ["resource.k8s.io/v1"]),
        (("v1beta2",), "resource.k8s.io/v1beta2", ["resource.k8s.io/v1", "resource.k8s.io/v1beta2"]),
    ],
    ids=["1.37", "1.37 with the beta API on", "1.36 with the beta API and the gate on"],
)
def test_the_first_list_finds_the_served_version_and_says_so_in_one_line(
    served: tuple[str, ...], found: str, tried: list[str]
) -> None:
    src = source(FakeResourceApi(served))
    with capture_logs() as logs:
        src.rules()
        src.rules()
    assert src.api_version == found
    assert [(e["log_level"], e["api_version"], e["tried"]) for e in rules_api_lines(logs)] == [
        ("info", found, tried)
    ]


def test_rules_are_created_and_deleted_in_the_version_found() -> None:
    api = FakeResourceApi(("v1beta2",))
    src = source(api)
    src.rules()
    rule = src.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceTaintRule",
            "metadata": {"name": "gpuguard-gpu-node-1-gpu-3", "labels": {}, "annotations": {}},
            "spec": {"deviceSelector": {"driver": DRIVER, "pool": NODE, "device": "gpu-3"}, "taint": {}},
        }
    )
    assert api.rules["gpuguard-gpu-node-1-gpu-3"]["apiVersion"] == "resource.k8s.io/v1beta2"
    src.delete(rule)
    assert api.rules == {}
    assert api.calls[-2:] == [
        ("POST", f"{GROUP}/v1beta2/devicetaintrules"),
        ("DELETE", f"{GROUP}/v1beta2/devicetaintrules/gpuguard-gpu-node-1-gpu-3"),
    ]


def test_served_in_neither_version_is_one_warning_that_the_node_taint_stands_in() -> None:
    src = source(FakeResourceApi(()))
    with capture_logs() as logs:
        assert src.rules() == []
        assert src.rules() == []
    assert src.api_version == RULES_API_NONE
    [line] = rules_api_lines(logs)
    assert line["log_level"] == "warning" and line["api_version"] is None
    assert line["tried"] == ["resource.k8s.io/v1", "resource.k8s.io/v1beta2"]
    assert "node taint" in line["note"]


def test_a_cluster_that_turns_the_api_on_later_is_found_at_the_next_list() -> None:
    api = FakeResourceApi(())
    src = source(api)
    src.rules()
    api.served = ("v1beta2",)
    with capture_logs() as logs:
        src.rules()
    assert src.api_version == "resource.k8s.io/v1beta2"
    assert [e["api_version"] for e in rules_api_lines(logs)] == ["resource.k8s.io/v1beta2"]


def test_the_cluster_wide_readers_of_status_and_uninstall_stay_quiet() -> None:
    """`gpuguard status` prints its answer on stdout, where structlog's default logger would write too."""
    quiet = KubeDeviceSource("", api=FakeResourceApi(()), driver="")  # type: ignore[arg-type]
    with capture_logs() as logs:
        assert quiet.all_rules() == []
    assert quiet.api_version == RULES_API_NONE and rules_api_lines(logs) == []


def xid_on_gpu_3() -> Verdict:
    gpus = tuple(GpuReading(index=i, uuid=gpu_uuid(NODE, i)) for i in range(8))
    xids = (XidEvent(gpu_index=3, uuid=gpu_uuid(NODE, 3), code=79),)
    return evaluate(Snapshot(gpus=gpus, xids=xids), previous=None, settings=PolicySettings())


def dry_run(api: FakeResourceApi) -> tuple[FakeNodeWriter, NodeReconciler, DryRunDeviceSource]:
    writer = FakeNodeWriter(NodeView(name=NODE, resource_version="1", boot_id="b"))
    settings = NodeSettings(name=NODE, dry_run=True)
    dry = DryRunDeviceSource(source(api))
    r = NodeReconciler(writer, settings, devices=DeviceQuarantine(dry, settings))
    hand_over(r, xid_on_gpu_3(), 0)
    r.reconcile_now()
    return writer, r, dry


def test_a_dry_run_on_a_cluster_without_device_taint_rules_plans_the_node_taint_as_the_agent_would() -> None:
    writer, r, dry = dry_run(FakeResourceApi(()))
    assert writer.node.our_taint is not None and writer.node.record.primary_reason == "xid-79"
    assert r.status.gpus == () and dry.api_version == RULES_API_NONE


def test_a_dry_run_on_a_cluster_with_v1beta2_rules_plans_the_rule_and_writes_nothing() -> None:
    api = FakeResourceApi(("v1beta2",))
    writer, r, dry = dry_run(api)
    assert writer.node.our_taint is None and [g.device for g in r.status.gpus] == ["gpu-3"]
    assert dry.api_version == "resource.k8s.io/v1beta2"
    assert api.rules == {} and all(method == "GET" for method, _ in api.calls)


def test_a_dry_run_without_a_cluster_does_not_look_for_the_rules_api() -> None:
    assert DryRunDeviceSource(None).api_version is None


class PagedRulesApi(FakeResourceApi):
    """v1 rules served in pages of the limit a list asks for (a `continue` token of the next offset)."""

    def __init__(self, count: int) -> None:
        super().__init__(("v1",))
        self.queries: list[dict[str, str]] = []
        for i in range(count):
            name = f"gpuguard.node-{i:03}.gpu-0"
            self.rules[name] = {
                "metadata": {
                    "name": name,
                    "labels": {
                        "gpuguard.io/node": f"node-{i:03}",
                        "app.kubernetes.io/managed-by": "gpuguard",
                    },
                    "annotations": {"gpuguard.io/node-gpus": "8", "gpuguard.io/reason": "ecc: 1 error"},
                },
                "spec": {"deviceSelector": {"driver": DRIVER, "pool": f"node-{i:03}", "device": "gpu-0"}},
            }

    def request(self, method: str, path: str, *, body: Any = None, **kw: Any) -> Any:
        if method != "GET" or not path.endswith("/devicetaintrules"):
            return super().request(method, path, body=body, **kw)
        query = dict(kw.get("query") or {})
        self.queries.append(query)
        items = list(self.rules.values())
        start = int(query.get("continue") or 0)
        end = start + int(query["limit"]) if "limit" in query else len(items)
        more = {"continue": str(end)} if end < len(items) else {}
        return {"items": items[start:end], "metadata": more}


def test_every_nodes_rules_are_read_in_pages_of_100_each_kept_as_far_as_the_budget_reads_it() -> None:
    api = PagedRulesApi(250)
    rules = source(api).all_rules()
    assert [q.get("continue") for q in api.queries] == [None, "100", "200"]
    assert all(q["limit"] == "100" for q in api.queries)
    assert len({r.name for r in rules}) == 250
    assert all(r.annotations == {"gpuguard.io/node-gpus": "8"} for r in rules)
    # gpuguard status reads them whole, in pages too; and so does the node's own list (a stolen token makes
    # as many of its own node's rules as it likes: each is bounded by the policy, their number is not).
    api.queries.clear()
    whole = source(api).all_rules(whole=True)
    assert [q.get("limit") for q in api.queries] == ["100", "100", "100"]
    assert whole[0].reason == "ecc: 1 error" and len(whole) == 250
    api.queries.clear()
    source(api).rules()
    assert [q.get("limit") for q in api.queries] == ["100", "100", "100"]
