"""The evictor against a real gRPC fake kubelet (harness.kubelet) and a stateful fake API server: which pods
go, PodDisruptionBudget refusals retried with backoff and never forced, API and kubelet outages reported and
retried, a pod that leaves between the kubelet's list and the eviction, Events, metrics and log lines."""

from __future__ import annotations

import copy
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, ClassVar, cast

import pytest
import structlog
from prometheus_client import CollectorRegistry

from gpuguard.core.errors import ConflictError, PermanentApiError, TransientApiError
from gpuguard.core.metrics import Metrics
from gpuguard.core.model import Fault, GpuVerdict, PodDevices, Verdict
from gpuguard.eviction.evictor import Evictor, Settings, backoff, faulty_gpus
from gpuguard.eviction.plan import Faulty, Pod
from gpuguard.kube.podresources.client import PodResourcesClient
from harness.kube import eventually
from harness.kubelet import FakeContainer, FakeKubelet, FakePod, gpu_pod

NODE = "gpu-node-1"
GPU = [f"GPU-{i:08d}-0000-0000-0000-000000000000" for i in range(8)]
PDB_MESSAGE = "Cannot evict pod as it would violate the pod's disruption budget."


class FakeApi:
    """The API server for pods, evictions and Events: PodDisruptionBudgets as a set of blocked pods, an
    outage as injected errors."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = {(p["metadata"]["namespace"], p["metadata"]["name"]): copy.deepcopy(p) for p in pods}
        self.blocked: set[str] = set()  # pod names a PDB protects now
        self.down = False
        self.forbidden: set[str] = set()  # namespaces the token may not read or evict in
        self.reads: list[str] = []
        self.evictions: list[tuple[str, str, dict[str, Any]]] = []
        self.evicted: list[str] = []
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def request(self, method: str, path: str, *, query: Any = None, body: Any = None, **kw: Any) -> Any:
        if self.down:
            raise TransientApiError(f"{kw.get('what')}: ConnectionRefusedError: [Errno 111] refused")
        with self.lock:
            got = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)", path)
            if method == "GET" and got:
                ns, name = got.groups()
                self.reads.append(f"{ns}/{name}")
                if ns in self.forbidden:
                    raise PermanentApiError(f"read pod {ns}/{name}: HTTP 403: forbidden", status=403)
                if (ns, name) not in self.pods:
                    raise PermanentApiError(f"read pod {ns}/{name}: HTTP 404: not found", status=404)
                return self.pods[(ns, name)]
            if method == "POST" and path.endswith("/events"):
                self.events.append(body)
                return body
            m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/eviction", path)
            assert method == "POST" and m, (method, path)
            ns, name = m.groups()
            self.evictions.append((ns, name, body))
            pod = self.pods.get((ns, name))
            if pod is None:
                raise PermanentApiError(f"evict pod {ns}/{name}: HTTP 404: not found", status=404)
            if body["deleteOptions"].get("preconditions", {}).get("uid") != pod["metadata"]["uid"]:
                raise ConflictError(f"evict pod {ns}/{name}: conflict: UID precondition")
            if name in self.blocked:
                raise TransientApiError(f"evict pod {ns}/{name}: HTTP 429: {PDB_MESSAGE}", status=429)
            del self.pods[(ns, name)]
            self.evicted.append(name)
            return {"kind": "Status", "status": "Success"}


def api_pod(name: str, *, ns: str = "ml", uid: str | None = None, **spec: Any) -> dict[str, Any]:
    meta = {"namespace": ns, "name": name, "uid": uid or f"uid-{name}"}
    meta["ownerReferences"] = [{"kind": "ReplicaSet", "name": "train", "controller": True}]  # type: ignore[assignment]
    return {"metadata": meta, "spec": {"nodeName": NODE, **spec}, "status": {"phase": "Running"}}


def verdict(*faulty: int) -> Verdict:
    return Verdict(
        gpus=tuple(
            GpuVerdict(
                i, GPU[i], faults=(Fault("xid-79", "fell off the bus", GPU[i], i),) if i in faulty else ()
            )
            for i in range(8)
        )
    )


@pytest.fixture
def sock() -> Iterator[str]:
    folder = tempfile.mkdtemp(prefix="kubelet-", dir="/tmp")
    yield f"{folder}/kubelet.sock"
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def kubelet(sock: str) -> Iterator[FakeKubelet]:
    with FakeKubelet(sock, pods=[gpu_pod("ml", f"train-{i}", GPU[i]) for i in range(8)]) as k:
        yield k


def make(
    sock: str, api: FakeApi, *, dry_run: bool = False, context: Faulty | None = None
) -> tuple[Evictor, Metrics]:
    metrics = Metrics(CollectorRegistry())
    evictor = Evictor(
        Settings(node=NODE, grace_period=30, dry_run=dry_run, timeout=5),
        kubelet=PodResourcesClient(sock, timeout=5),
        api=lambda: cast(Any, api),
        context=lambda: context or Faulty(frozenset()),
        metrics=metrics,
    )
    return evictor, metrics


def evictions(metrics: Metrics, result: str) -> float:
    return metrics.registry.get_sample_value("gpuguard_pod_evictions_total", {"result": result}) or 0.0


EIGHT = [api_pod(f"train-{i}") for i in range(8)]


def test_an_xid_on_gpu_3_evicts_only_the_pod_holding_it_with_an_event_on_the_pod_and_the_node(
    sock: str, kubelet: FakeKubelet
) -> None:
    api = FakeApi(EIGHT)
    evictor, metrics = make(sock, api)
    evictor.observe(verdict(3))
    with structlog.testing.capture_logs() as logs:
        assert evictor.round() is None  # nothing left to retry
    assert api.evicted == ["train-3"]
    body = api.evictions[0][2]
    assert body["kind"] == "Eviction" and body["apiVersion"] == "policy/v1"
    assert body["deleteOptions"] == {"preconditions": {"uid": "uid-train-3"}, "gracePeriodSeconds": 30}
    assert [(e["involvedObject"]["kind"], e["metadata"]["namespace"], e["reason"]) for e in api.events] == [
        ("Pod", "ml", "GPUPodEvicted"),
        ("Node", "default", "GPUPodEvicted"),
    ]
    assert GPU[3] in api.events[0]["message"] and api.events[1]["involvedObject"]["name"] == NODE
    assert evictions(metrics, "evicted") == 1
    assert [e["event"] for e in logs] == ["eviction.pod_evicted"]
    assert logs[0]["pod"] == "ml/train-3" and logs[0]["gpus"] == [GPU[3]]
    assert "Get ml/train-3" in kubelet.calls  # checked again just before the eviction
    assert api.reads == ["ml/train-3"]  # only the pod the kubelet says holds the GPU is read


def test_a_pod_in_a_namespace_the_role_does_not_list_is_reported_once_on_the_node_and_not_evicted(
    sock: str, kubelet: FakeKubelet
) -> None:
    api = FakeApi(EIGHT)
    api.forbidden.add("ml")
    evictor, metrics = make(sock, api)
    evictor.observe(verdict(3))
    with structlog.testing.capture_logs() as logs:
        assert evictor.round() is None
        assert evictor.round() is None
    assert [(e["event"], e["why"]) for e in logs] == [("eviction.not_permitted", "namespace-not-permitted")]
    assert "403" in logs[0]["error"]
    assert api.evictions == []
    assert [(e["involvedObject"]["kind"], e["reason"]) for e in api.events] == [
        ("Node", "GPUEvictionBlocked")
    ]
    assert evictions(metrics, "failed") == 1


def test_a_pod_the_api_server_has_on_another_node_is_not_evicted(sock: str, kubelet: FakeKubelet) -> None:
    api = FakeApi(EIGHT)
    api.pods[("ml", "train-3")]["spec"]["nodeName"] = "elsewhere"
    evictor, _ = make(sock, api)
    evictor.observe(verdict(3))
    with structlog.testing.capture_logs() as logs:
        assert evictor.round() is None
    assert api.evictions == [] and logs[0]["why"] == "not-on-this-node"


def test_a_healthy_node_asks_nobody_anything(sock: str, kubelet: FakeKubelet) -> None:
    api = FakeApi(EIGHT)
    evictor, _ = make(sock, api)
    evictor.observe(verdict())
    assert evictor.round() is None
    assert kubelet.calls == [] and api.evictions == []


def test_a_pdb_refusal_is_retried_with_backoff_never_forced_and_goes_through_once_the_budget_allows(
    sock: str, kubelet: FakeKubelet
) -> None:
    api = FakeApi(EIGHT)
    api.blocked.add("train-3")
    evictor, metrics = make(sock, api)
    evictor.observe(verdict(3))
    with structlog.testing.capture_logs() as logs:
        waits = [evictor.round() for _ in range(4)]
    assert waits == [1.0, 2.0, 4.0, 8.0]
    assert [e["event"] for e in logs] == ["eviction.blocked"] * 4
    assert all(
        "gracePeriodSeconds" in b["deleteOptions"] and "force" not in str(b) for _, _, b in api.evictions
    )
    # One Event pair for the refusal, not one per retry.
    assert [(e["involvedObject"]["kind"], e["reason"]) for e in api.events] == [
        ("Pod", "GPUEvictionBlocked"),
        ("Node", "GPUEvictionBlocked"),
    ]
    assert "PodDisruptionBudget" in api.events[0]["message"]
    assert evictions(metrics, "blocked") == 4
    api.blocked.clear()
    assert evictor.round() is None
    assert api.evicted == ["train-3"] and evictions(metrics, "evicted") == 1


def test_the_backoff_doubles_from_1_to_60_seconds() -> None:
    assert [backoff(n) for n in (1, 2, 3, 6, 7, 20)] == [1.0, 2.0, 4.0, 32.0, 60.0, 60.0]


def test_the_api_server_down_is_reported_and_retried_then_the_eviction_goes_through(
    sock: str, kubelet: FakeKubelet
) -> None:
    api = FakeApi(EIGHT)
    api.down = True
    evictor, _ = make(sock, api)
    evictor.observe(verdict(3))
    with structlog.testing.capture_logs() as logs:
        assert [evictor.round(), evictor.round()] == [1.0, 2.0]
    assert [e["event"] for e in logs] == ["eviction.api_unavailable"] * 2
    assert "refused" in logs[0]["error"] and logs[0]["gpus"] == [GPU[3]]
    api.down = False
    assert evictor.round() is None
    assert api.evicted == ["train-3"]


def test_a_kubeconfig_that_cannot_be_used_is_reported_and_retried_without_a_traceback(
    sock: str, kubelet: FakeKubelet
) -> None:
    from gpuguard.core.errors import ConfigError

    def unusable() -> Any:
        raise ConfigError("kubeconfig /nowhere: no such file")

    evictor, _ = make(sock, FakeApi(EIGHT))
    evictor._api = unusable
    evictor.observe(verdict(3))
    with structlog.testing.capture_logs() as logs:
        assert evictor.round() == 1.0
    assert [(e["event"], e["log_level"]) for e in logs] == [("eviction.api_unavailable", "warning")]
    assert "no such file" in logs[0]["error"]


def test_a_kubelet_that_is_gone_is_reported_and_retried(sock: str) -> None:
    api = FakeApi(EIGHT)
    evictor, _ = make(sock, api)
    evictor.observe(verdict(3))
    with structlog.testing.capture_logs() as logs:
        assert evictor.round() == 1.0
    assert logs[0]["event"] == "eviction.kubelet_unavailable" and "no socket" in logs[0]["error"]
    with FakeKubelet(sock, pods=[gpu_pod("ml", f"train-{i}", GPU[i]) for i in range(8)]):
        assert evictor.round() is None
    assert api.evicted == ["train-3"]


def test_a_node_without_the_kubelets_socket_is_reported_at_start_not_only_at_the_first_fault(
    sock: str,
) -> None:
    """A DaemonSet without the pod-resources mount (or a kubelet under another root directory): eviction
    cannot work on this node, and the operator learns it when the agent starts, not when a GPU fails."""
    evictor, _ = make(sock, FakeApi(EIGHT))
    with structlog.testing.capture_logs() as logs:
        evictor.start()
        try:
            eventually(
                lambda: any(e["event"] == "eviction.kubelet_unavailable" for e in logs), 5, what="line"
            )
        finally:
            evictor.stop()
    line = next(e for e in logs if e["event"] == "eviction.kubelet_unavailable")
    assert line["log_level"] == "warning" and "no socket" in line["error"] and "gpus" not in line
    with FakeKubelet(sock, pods=[]) as kubelet, structlog.testing.capture_logs() as logs:
        evictor, _ = make(sock, FakeApi(EIGHT))
        evictor.start()
        eventually(lambda: kubelet.calls == ["List"], 5, what="the probe")
        evictor.stop()
    assert [e["event"] for e in logs] == []  # a kubelet that answers: nothing to say


def test_a_pod_on_a_mig_slice_is_reported_once_since_its_gpu_cannot_be_told_never_passed_over_silently(
    sock: str, kubelet: FakeKubelet
) -> None:
    """NVIDIA's device plugin names a MIG slice by its own UUID (MIG-...), not its GPU's: gpuguard cannot
    tell whether the slice is on the faulty GPU, so the pod is not evicted, and the operator is told."""
    mig = FakePod("ml", "mig-pod", [FakeContainer("main", {"nvidia.com/mig-1g.10gb": ["MIG-4d3c2b1a-0000"]})])
    with kubelet.lock:
        kubelet.pods.append(mig)
    api = FakeApi([*EIGHT, api_pod("mig-pod")])
    evictor, _ = make(sock, api)
    evictor.observe(verdict(3))
    with structlog.testing.capture_logs() as logs:
        evictor.round()
        evictor.round()
    assert api.evicted == ["train-3"]
    lines = [e for e in logs if e["event"] == "eviction.mig_unknown"]
    assert (
        len(lines) == 1 and lines[0]["pod"] == "ml/mig-pod" and lines[0]["devices"] == ["MIG-4d3c2b1a-0000"]
    )
    assert lines[0]["log_level"] == "warning"


def test_a_bug_in_the_start_up_check_does_not_end_the_evictor(sock: str, kubelet: FakeKubelet) -> None:
    api = FakeApi(EIGHT)
    evictor, _ = make(sock, api)
    real, calls = PodResourcesClient(sock), []

    class FirstCallBreaks:
        def list(self) -> tuple[PodDevices, ...]:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a bug")
            return real.list()

        def get(self, namespace: str, name: str) -> PodDevices | None:
            return real.get(namespace, name)

    evictor._kubelet = FirstCallBreaks()
    with structlog.testing.capture_logs() as logs:
        evictor.start()
        try:
            evictor.observe(verdict(3))
            eventually(lambda: api.evicted == ["train-3"], 10, what="the eviction")
        finally:
            evictor.stop()
    assert logs[0]["event"] == "eviction.round_failed"


def test_a_kubelet_without_the_api_is_asked_again_only_every_5_minutes(sock: str) -> None:
    api = FakeApi(EIGHT)
    evictor, _ = make(sock, api)
    evictor.observe(verdict(3))
    with FakeKubelet(sock, unimplemented=True), structlog.testing.capture_logs() as logs:
        assert evictor.round() == 300.0
    assert logs[0]["event"] == "eviction.kubelet_unsupported"
    assert api.evictions == []


def test_a_pod_that_leaves_between_the_kubelets_list_and_the_eviction_is_not_evicted(
    sock: str, kubelet: FakeKubelet
) -> None:
    api = FakeApi(EIGHT)
    evictor, metrics = make(sock, api)
    real = PodResourcesClient(sock)

    class Leaving:
        """The kubelet's List, then the pod on GPU 3 finishes and the kubelet forgets it."""

        def list(self) -> tuple[PodDevices, ...]:
            answer = real.list()
            kubelet.remove("ml", "train-3")
            return answer

        def get(self, namespace: str, name: str) -> PodDevices | None:
            return real.get(namespace, name)

    evictor._kubelet = Leaving()
    evictor.observe(verdict(3))
    with structlog.testing.capture_logs() as logs:
        assert evictor.round() is None
    assert api.evictions == [] and api.events == []
    assert [e["event"] for e in logs] == ["eviction.pod_gone"]
    assert evictions(metrics, "gone") == 1


def test_a_pod_replaced_under_the_same_name_is_not_evicted_and_one_already_deleted_counts_as_gone(
    sock: str, kubelet: FakeKubelet
) -> None:
    api = FakeApi(EIGHT)
    evictor, metrics = make(sock, api)
    evictor.observe(verdict(3, 4))
    real_request = api.request

    def racing(method: str, path: str, **kw: Any) -> Any:
        answer = real_request(method, path, **kw)
        if method == "GET" and path.endswith("train-4"):  # after the reads: train-3 is made again (a
            api.pods[("ml", "train-3")] = api_pod("train-3", uid="new-uid")  # StatefulSet), train-4 deleted
            del api.pods[("ml", "train-4")]
        return answer

    api.request = racing  # type: ignore[method-assign]
    assert evictor.round() is None
    assert api.evicted == [] and evictions(metrics, "gone") == 2
    assert ("ml", "train-3") in api.pods


def test_a_pod_made_again_under_the_same_name_on_a_healthy_gpu_of_this_node_is_not_evicted(
    sock: str, kubelet: FakeKubelet
) -> None:
    """Between the kubelet's List and the API server's read, train-3 (on faulty GPU 3) is deleted and made
    again under the same name (a StatefulSet) on this node, on healthy GPU 7: the API server has only the new
    pod (a new UID), so the UID precondition cannot tell; the kubelet's Get must still show the faulty GPU."""
    api = FakeApi([p for p in EIGHT if p["metadata"]["name"] != "train-7"])
    kubelet.remove("ml", "train-7")
    evictor, metrics = make(sock, api)
    real = PodResourcesClient(sock)

    class Remade:
        def list(self) -> tuple[PodDevices, ...]:
            answer = real.list()
            kubelet.remove("ml", "train-3")
            kubelet.pods.append(gpu_pod("ml", "train-3", GPU[7]))
            api.pods[("ml", "train-3")] = api_pod("train-3", uid="new-uid")
            return answer

        def get(self, namespace: str, name: str) -> PodDevices | None:
            return real.get(namespace, name)

    evictor._kubelet = Remade()
    evictor.observe(verdict(3))
    with structlog.testing.capture_logs() as logs:
        assert evictor.round() is None
    assert api.evictions == [] and api.events == []
    assert [e["event"] for e in logs] == ["eviction.pod_gone"]
    assert evictions(metrics, "gone") == 1


def test_a_dry_run_writes_no_event_for_a_pod_in_a_namespace_the_role_does_not_list(
    sock: str, kubelet: FakeKubelet
) -> None:
    api = FakeApi(EIGHT)
    api.forbidden.add("ml")
    evictor, _ = make(sock, api, dry_run=True)
    evictor.observe(verdict(3))
    with structlog.testing.capture_logs() as logs:
        assert evictor.round() is None
    assert api.events == [] and api.evictions == []
    assert [(e["event"], e["why"]) for e in logs] == [("eviction.not_permitted", "namespace-not-permitted")]


def test_no_pod_is_evicted_before_the_quarantine_is_on_the_node_and_it_is_asked_again_soon(
    sock: str, kubelet: FakeKubelet
) -> None:
    """The node's taint write failed or is still pending (the API server refused the patch): an evicted
    pod's replacement could be placed back on the same faulty GPU, so nothing is evicted yet."""
    api = FakeApi(EIGHT)
    context = Faulty(frozenset(), node_tainted=False)
    evictor, _ = make(sock, api)
    evictor._context = lambda: context
    evictor.observe(verdict(3))
    with structlog.testing.capture_logs() as logs:
        waits = [evictor.round() for _ in range(3)]
    assert api.evictions == [] and waits == [1.0, 2.0, 4.0]  # soon, but no hammering if the write is refused
    assert [(e["event"], e["why"]) for e in logs] == [("eviction.pod_kept", "not-quarantined")]
    context = Faulty(frozenset(), node_tainted=True)
    assert evictor.round() is None
    assert api.evicted == ["train-3"]
    context = Faulty(frozenset(), node_tainted=False)
    evictor.observe(verdict(4))
    assert [evictor.round(), evictor.round()] == [1.0, 2.0]
    evictor.observe(verdict())  # the fault clears while waiting; the next one's wait starts from 1 s again
    assert evictor.round() is None
    evictor.observe(verdict(5))
    assert evictor.round() == 1.0


def test_a_dry_run_logs_the_eviction_and_sends_none(sock: str, kubelet: FakeKubelet) -> None:
    api = FakeApi(EIGHT)
    evictor, metrics = make(sock, api, dry_run=True)
    evictor.observe(verdict(3))
    with structlog.testing.capture_logs() as logs:
        assert evictor.round() is None
        assert evictor.round() is None
    assert api.evictions == [] and api.events == []
    assert [e["event"] for e in logs] == ["eviction.dry_run"] and evictions(metrics, "dry-run") == 1


def test_a_gpu_under_a_noexecute_device_taint_rule_is_left_to_kube_controller_manager(
    sock: str, kubelet: FakeKubelet
) -> None:
    api = FakeApi(EIGHT)
    evictor, _ = make(sock, api, context=Faulty(frozenset(), dra_noexecute=frozenset({GPU[3]})))
    evictor.observe(verdict(3, 5))
    with structlog.testing.capture_logs() as logs:
        assert evictor.round() is None
    assert api.evicted == ["train-5"]
    assert {"event": "eviction.pod_kept", "why": "dra-noexecute"}.items() <= logs[0].items()


def test_kept_pods_are_logged_once_not_every_round(sock: str, kubelet: FakeKubelet) -> None:
    api = FakeApi([api_pod(f"train-{i}", tolerations=[{"operator": "Exists"}]) for i in range(8)])
    evictor, _ = make(sock, api)
    evictor.observe(verdict(3))
    with structlog.testing.capture_logs() as logs:
        evictor.round()
        evictor.round()
    assert [(e["event"], e["why"]) for e in logs] == [("eviction.pod_kept", "tolerates-taint")]
    assert api.evictions == []


def test_a_fault_that_clears_stops_the_retries(sock: str, kubelet: FakeKubelet) -> None:
    api = FakeApi(EIGHT)
    api.blocked.add("train-3")
    evictor, _ = make(sock, api)
    evictor.observe(verdict(3))
    assert evictor.round() == 1.0
    evictor.observe(verdict())
    assert evictor.round() is None
    assert len(api.evictions) == 1


def test_the_thread_evicts_as_soon_as_it_observes_the_fault(sock: str, kubelet: FakeKubelet) -> None:
    api = FakeApi(EIGHT)
    evictor, _ = make(sock, api)
    evictor.start()
    try:
        evictor.observe(verdict())
        evictor.observe(verdict(3))
        deadline = time.monotonic() + 10
        while not api.evicted and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        evictor.stop()
    assert api.evicted == ["train-3"]


def test_while_the_fault_holds_a_pod_that_lands_on_the_faulty_gpu_later_is_found_and_evicted(
    sock: str, kubelet: FakeKubelet
) -> None:
    api = FakeApi(EIGHT)
    evictor, _ = make(sock, api)
    evictor._rescan = 0.05
    evictor.start()
    try:
        evictor.observe(verdict(3))
        eventually(lambda: api.evicted == ["train-3"], 10, what="the first eviction")
        kubelet.remove("ml", "train-3")
        with kubelet.lock:  # a pod that tolerated the deferred taint lands on GPU 3
            kubelet.pods.append(gpu_pod("ml", "late", GPU[3]))
        api.pods[("ml", "late")] = api_pod("late")
        eventually(lambda: api.evicted == ["train-3", "late"], 10, what="the late pod evicted")
    finally:
        evictor.stop()


def test_a_node_wide_fault_names_no_gpu_and_evicts_nothing() -> None:
    v = Verdict(node_faults=(Fault("gpu-missing", "7 of 8"),), gpus=verdict().gpus)
    assert faulty_gpus(v) == frozenset()
    assert faulty_gpus(verdict(2)) == frozenset({GPU[2]})


def test_watch_builds_the_evictor_only_for_evict_gpu_pods_and_hands_it_each_verdict(
    sock: str, tmp_path: Any
) -> None:
    from gpuguard.core.config import Config, NodeSettings
    from gpuguard.runtime.root import build

    off = build(
        Config(backend="mock", node=NodeSettings(name=NODE, dry_run=True)), registry=CollectorRegistry()
    )
    assert off.evictor is None
    scenario = tmp_path / "s.yaml"
    scenario.write_text("gpus: 2\nevents:\n  - {at: 0.0, gpu: 1, ecc_uncorrected: 3}\n")
    cfg = Config(
        backend="mock",
        scenario=str(scenario),
        interval=0.05,
        node=NodeSettings(name=NODE, dry_run=True, evict="gpu-pods", pod_resources_socket=sock),
    )
    parts = build(cfg, registry=CollectorRegistry())
    assert parts.evictor is not None
    parts.agent.run(run_for=0.3)  # the evictor is not started: what it was handed stays to be read
    assert parts.evictor._faulty == frozenset({"GPU-mock-1"})


@pytest.mark.parametrize(
    ("node", "error"),
    [
        ({"evict": "all"}, "--evict must be one of none, gpu-pods"),
        ({"evict_grace_period": -1}, "--evict-grace-period must be between 0 and 86400"),
    ],
)
def test_eviction_settings_that_cannot_work_are_refused(node: dict[str, Any], error: str) -> None:
    from gpuguard.core.config import Config, NodeSettings
    from gpuguard.core.errors import ConfigError

    with pytest.raises(ConfigError, match=error):
        Config(node=NodeSettings(name=NODE, **node))


def test_the_default_socket_is_the_kubelets() -> None:
    from gpuguard.core.config import NodeSettings
    from gpuguard.kube.podresources.client import SOCKET

    assert NodeSettings().pod_resources_socket == SOCKET == "/var/lib/kubelet/pod-resources/kubelet.sock"


@pytest.mark.parametrize(
    ("call", "loaded"),
    [
        ("build(Config(backend='mock', node=NodeSettings(name='n1', dry_run=True, evict='none')))", False),
        ("build(Config(backend='mock', node=NodeSettings(name='n1', dry_run=True, evict='gpu-pods')))", True),
        ("check_once(Config(backend='mock', node=NodeSettings(dry_run=True, evict='gpu-pods')))", False),
    ],
    ids=["watch", "watch --evict gpu-pods", "check"],
)
def test_grpc_is_loaded_only_when_the_agent_evicts(call: str, loaded: bool) -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from gpuguard.core.config import Config, NodeSettings\n"
        "from gpuguard.runtime.root import build, check_once\n"
        f"{call}\n"
        "print('grpc' in sys.modules, 'google.protobuf' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(loaded), str(loaded)]


def test_a_dra_claim_on_a_faulty_gpu_without_a_rule_of_its_own_is_still_matched(sock: str) -> None:
    """GPU 6's rule could not be written (its fault went to the node's taint): its pods' DRA claims name
    (driver, pool, device), matched through the GPUs the node's ResourceSlices publish, not only the rules."""
    from gpuguard.core.config import Config, NodeSettings
    from gpuguard.core.model import GpuQuarantine
    from gpuguard.eviction.plan import plan
    from gpuguard.quarantine.reconciler import NodeStatus
    from gpuguard.runtime.root import Connection, make_evictor

    class Devices:
        published: ClassVar = {
            GPU[6]: ("gpu.nvidia.com", NODE, "gpu-6"),
            GPU[3]: ("gpu.nvidia.com", NODE, "gpu-3"),
        }

    class Reconciler:
        status = NodeStatus(
            tainted=True, gpus=(GpuQuarantine(GPU[3], "gpu-3", "r3", "xid-79", "NoSchedule", deferred=False),)
        )
        devices = Devices()

        def wait_idle(self, timeout: float) -> bool:
            return True

    settings = NodeSettings(name=NODE, dry_run=True, evict="gpu-pods", pod_resources_socket=sock)
    cfg = Config(backend="mock", node=settings)
    evictor = make_evictor(cfg, Connection(settings), cast(Any, Reconciler()), Metrics(CollectorRegistry()))
    assert evictor is not None
    faulty = replace(evictor._context(), uuids=frozenset({GPU[3], GPU[6]}))
    claims = [
        PodDevices("ml", "on-6", claims=(("gpu.nvidia.com", NODE, "gpu-6"),)),
        PodDevices("ml", "on-3", claims=(("gpu.nvidia.com", NODE, "gpu-3"),)),
    ]
    listed = {("ml", n): Pod("ml", n, uid=n, node=NODE) for n in ("on-6", "on-3")}
    got = {d.pod.name: d.keep for d in plan(faulty, claims, listed)}
    # GPU 6: held out by the node's taint; GPU 3: by its own rule. Both pods go.
    assert got == {"on-6": None, "on-3": None}


def test_the_evictor_sees_the_quarantine_through_the_reconcilers_status(sock: str) -> None:
    """running.make_evictor's context: the GPUs' DeviceTaintRules (a NoExecute one, not deferred, is left to
    kube-controller-manager; each rule's device for DRA claims) and a NoExecute node taint."""
    from gpuguard.core.config import Config, NodeSettings
    from gpuguard.core.model import GpuQuarantine
    from gpuguard.quarantine.reconciler import NodeStatus
    from gpuguard.runtime.root import Connection, make_evictor

    class Reconciler:
        status = NodeStatus(
            tainted=True,
            gpus=(
                GpuQuarantine(GPU[3], "gpu-3", "r3", "xid-79", "NoExecute", deferred=False),
                GpuQuarantine(GPU[4], "gpu-4", "r4", "xid-79", "NoExecute", deferred=True),
                GpuQuarantine(GPU[5], "gpu-5", "r5", "xid-79", "NoSchedule", deferred=False),
            ),
        )
        devices = None  # a node quarantine only: no ResourceSlices read

        def wait_idle(self, timeout: float) -> bool:
            return True

    for effect, node_noexecute in (("NoSchedule", False), ("NoExecute", True)):
        settings = NodeSettings(
            name=NODE, dry_run=True, evict="gpu-pods", pod_resources_socket=sock, taint_effect=effect
        )
        cfg = Config(backend="mock", node=settings)
        evictor = make_evictor(
            cfg, Connection(settings), cast(Any, Reconciler()), Metrics(CollectorRegistry())
        )
        assert evictor is not None
        got = evictor._context()
        assert got.dra_noexecute == frozenset({GPU[3]})
        assert dict(got.dra_devices or {}) == {
            GPU[3]: ("gpu.nvidia.com", NODE, "gpu-3"),
            GPU[4]: ("gpu.nvidia.com", NODE, "gpu-4"),
            GPU[5]: ("gpu.nvidia.com", NODE, "gpu-5"),
        }
        assert (got.taint_effect, got.node_noexecute) == (effect, node_noexecute)
        assert (got.deferred, got.node_deferred) == (frozenset({GPU[4]}), False)
    Reconciler.status = replace(Reconciler.status, deferred=True)
    got = make_evictor(
        cfg, Connection(settings), cast(Any, Reconciler()), Metrics(CollectorRegistry())
    )._context()  # type: ignore[union-attr]
    assert got.node_deferred and not got.node_noexecute
    assert got.node_tainted
    Reconciler.status = replace(Reconciler.status, tainted=False)
    got = make_evictor(
        cfg, Connection(settings), cast(Any, Reconciler()), Metrics(CollectorRegistry())
    )._context()  # type: ignore[union-attr]
    assert not got.node_tainted
