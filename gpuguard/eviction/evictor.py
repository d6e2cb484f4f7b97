"""The evictor: the thread that evicts the pods holding a faulty GPU (--evict gpu-pods) while the fault holds.

Each round, after the node reconciler has applied the verdict (so the taint is on before a pod leaves, and its
replacement is not placed back on this node): the kubelet's PodResources List, a read by name of each pod
that holds a faulty GPU (`kube.pods.get`: the Role's `get` in the listed namespaces suffices; a 403 is
reported, not evicted), the plan (`plan.plan`), then for each pod to evict the kubelet's Get (a pod that
left since the List is not evicted) and a policy/v1 Eviction with the pod's UID as precondition. The API
server refuses an eviction with 429 while a PodDisruptionBudget allows no disruption: retried with backoff,
1 s doubling to 60 s, never forced. A kubelet or an API server that does not answer is reported and
retried the same way. Every eviction and every refusal is a log line with a stable event name, a count in
gpuguard_pod_evictions_total{result} and, for the eviction and the first refusal of a pod, an Event on
the pod and on the node. In a dry run it logs what it would evict and sends nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol

import structlog

from gpuguard.core.errors import (
    ConfigError,
    ConflictError,
    KubeletError,
    KubeletUnsupported,
    NodeUpdateError,
    PermanentApiError,
    TransientApiError,
)
from gpuguard.core.metrics import Metrics, counted
from gpuguard.core.model import PodDevices, Verdict
from gpuguard.eviction.plan import NOT_LISTED, NOT_QUARANTINED, Decision, Faulty, Pod, held, mig_slices, plan
from gpuguard.kube import client as kubeclient
from gpuguard.kube import events, pods

log = structlog.get_logger(__name__)

BACKOFF_MIN = 1.0
BACKOFF_MAX = 60.0
# A kubelet without the PodResources API will not grow one: asked again this rarely.
UNSUPPORTED_RETRY = 300.0
# While a fault holds, the kubelet is asked again this often even when nothing waits: a pod that lands on the
# faulty GPU later (one placed there while the quarantine was deferred, a static pod's restart) is found.
# One local gRPC call a minute; the API server is asked only about pods that hold a faulty GPU.
RESCAN_S = 60.0
# Why a pod is kept that the plan cannot know: the eviction Role does not cover its namespace (a 403).
NOT_PERMITTED = "namespace-not-permitted"


class Kubelet(Protocol):
    """The kubelet's PodResources API (gpuguard.kube.podresources.client.PodResourcesClient)."""

    def list(self) -> tuple[PodDevices, ...]: ...

    def get(self, namespace: str, name: str) -> PodDevices | None: ...


@dataclass(frozen=True)
class Settings:
    node: str
    grace_period: int | None = None
    dry_run: bool = False
    timeout: float = 10.0


def faulty_gpus(verdict: Verdict) -> frozenset[str]:
    """The UUIDs of the GPUs with a fault of their own (a node-wide fault names no
    GPU: it quarantines the node and evicts nothing)."""
    gpus = [g for g in verdict.gpus if g.faults and g.uuid]
    return frozenset(g.uuid for g in gpus)


def backoff(attempt: int) -> float:
    """The wait after `attempt` (1, 2, ...) refusals in a row: 1 s doubling to 60 s."""
    return float(min(BACKOFF_MAX, BACKOFF_MIN * 2 ** max(0, attempt - 1)))


class Evictor:
    """Evicts the pods on faulty GPUs on its own thread; `observe` hands it each verdict (never blocks)."""

    def __init__(
        self,
        settings: Settings,
        *,
        kubelet: Kubelet,
        api: Callable[[], kubeclient.Client],
        context: Callable[[], Faulty] = lambda: Faulty(frozenset()),
        settled: Callable[[float], bool] = lambda timeout: True,
        metrics: Metrics | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        rescan: float = RESCAN_S,
    ) -> None:
        """`context`: what the quarantine does now (DRA devices and NoExecute rules, the node taint's effect),
        as a Faulty without GPUs; `settled(timeout)`: waits until the node reconciler applied the newest
        verdict."""
        self._s = settings
        self._kubelet = kubelet
        self._api = api
        self._context = context
        self._settled = settled
        self._metrics = metrics
        self._now = now
        self._rescan = rescan
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._faulty: frozenset[str] = frozenset()
        self._attempts: dict[str, int] = {}  # pod UID -> refusals in a row
        self._reported: set[tuple[str, str]] = set()  # (pod UID, what) already logged or told in an Event
        self._failures = 0  # rounds in a row that could not read the kubelet or the API server
        self._unheld = 0  # rounds in a row that kept a pod because the quarantine was not on yet
        self._unsupported = False  # the kubelet answered UNIMPLEMENTED
        self._forbidden: dict[tuple[str, str], str] = {}  # pods the token may not read: the refusal
        self._thread = threading.Thread(target=self._run, name="gpuguard-evictor", daemon=True)
        self.rounds = 0

    def observe(self, verdict: Verdict) -> None:
        faulty = faulty_gpus(verdict)
        with self._lock:
            changed, self._faulty = faulty != self._faulty, faulty
        if changed:
            self._wake.set()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Ends the thread at its next wake-up: now, unless a round is under way."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:  # at start: a node where eviction cannot work (no mount, no API) is reported now, not at a fault
            self._kubelet.list()
        except KubeletError as exc:
            unsupported = isinstance(exc, KubeletUnsupported)
            event = "eviction.kubelet_unsupported" if unsupported else "eviction.kubelet_unavailable"
            log.warning(event, node=self._s.node, error=str(exc), note="at start: no pod can be evicted yet")
        except Exception:  # never the end of the thread before its first round
            log.exception("eviction.round_failed", node=self._s.node)
        wait: float | None = None
        while not self._stop.is_set():
            self._wake.wait(wait)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                wait = self.round()
                with self._lock:
                    holds = bool(self._faulty)
                if wait is None and holds:
                    wait = self._rescan
            except Exception:
                # A bug must not end evictions for good: logged, and the next round tries again.
                log.exception("eviction.round_failed", node=self._s.node)
                wait = BACKOFF_MAX

    def round(self) -> float | None:
        """One round; the seconds until the next (a retry), or None when nothing waits (no fault, or every
        pod on a faulty GPU evicted or kept)."""
        with self._lock:
            uuids = self._faulty
        if not uuids:
            self._attempts.clear()
            self._reported.clear()
            self._failures = self._unheld = 0
            return None
        self.rounds += 1
        self._settled(self._s.timeout)
        faulty = replace(self._context(), uuids=uuids)
        decisions = self._plan(faulty)
        if decisions is None:
            return self._failure_wait()
        self._failures = 0
        self._unsupported = False
        self._unheld = self._unheld + 1 if any(d.keep == NOT_QUARANTINED for d in decisions) else 0
        waits = [w for d in decisions if (w := self._apply(d, faulty)) is not None]
        return min(waits) if waits else None

    def _plan(self, faulty: Faulty) -> list[Decision] | None:
        node = self._s.node
        try:
            resources = self._kubelet.list()
        except KubeletError as exc:
            self._failures += 1
            self._unsupported = isinstance(exc, KubeletUnsupported)
            event = "eviction.kubelet_unsupported" if self._unsupported else "eviction.kubelet_unavailable"
            log.warning(
                event, node=node, error=str(exc), gpus=sorted(faulty.uuids), retry_in_s=self._failure_wait()
            )
            return None
        holders = [r for r in resources if held(r, faulty)]
        for r in resources:  # MIG slices: which GPU they are on is unknown here (plan.mig_slices)
            name = f"{r.namespace}/{r.name}"
            if r not in holders and (mig := mig_slices(r)) and self._once(name, "mig"):
                log.warning("eviction.mig_unknown", node=node, pod=name, devices=list(mig))
        found: dict[tuple[str, str], Pod] = {}
        try:
            for r in holders:
                obj = self._read(r.namespace, r.name)
                if obj is not None:
                    found[(r.namespace, r.name)] = Pod.from_api(obj)
        except (NodeUpdateError, ConfigError) as exc:  # ConfigError: a kubeconfig that cannot be used
            self._failures += 1
            log.warning(
                "eviction.api_unavailable",
                node=node,
                error=str(exc),
                gpus=sorted(faulty.uuids),
                retry_in_s=self._failure_wait(),
            )
            return None
        by_key = {k: p for k, p in found.items() if p.node == node}
        return [
            replace(d, keep=NOT_PERMITTED) if d.pod.key in self._forbidden and d.keep == NOT_LISTED else d
            for d in plan(faulty, holders, by_key)
        ]

    def _read(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod, None if it is gone; a pod in a namespace the eviction Role does not list (403) is noted
        in `_forbidden` (reported, not evicted) and read as None."""
        try:
            with counted(self._metrics, "get"):
                obj = pods.get(self._api(), namespace, name, timeout=self._s.timeout)
        except PermanentApiError as exc:
            if exc.status != 403:
                raise
            self._forbidden[(namespace, name)] = str(exc)
            return None
        self._forbidden.pop((namespace, name), None)
        return obj

    def _failure_wait(self) -> float:
        return UNSUPPORTED_RETRY if self._unsupported else backoff(self._failures)

    def _apply(self, d: Decision, faulty: Faulty) -> float | None:
        pod = d.pod
        fields: dict[str, Any] = {
            "node": self._s.node,
            "pod": f"{pod.namespace}/{pod.name}",
            "gpus": list(d.gpus),
        }
        if d.keep == NOT_PERMITTED:
            if self._once(f"{pod.namespace}/{pod.name}", NOT_PERMITTED):
                error = self._forbidden.get(pod.key, "")
                log.warning("eviction.not_permitted", why=d.keep, error=error, **fields)
                self._count("failed")
                if not self._s.dry_run:  # a dry run writes nothing, Events included
                    self._node_event(
                        "GPUEvictionBlocked",
                        f"gpuguard may not evict pod {pod.namespace}/{pod.name} from faulty GPU "
                        f"{', '.join(d.gpus)} on node {self._s.node}: namespace {pod.namespace} is not "
                        "in the eviction's namespaces",
                    )
            return None
        if d.keep is not None:
            if self._once(pod.uid or pod.name, f"kept:{d.keep}"):
                log.info("eviction.pod_kept", why=d.keep, **fields)
            # Not on yet: asked again soon, backing off as for a refusal (its write may be refused for long).
            return backoff(self._unheld) if d.keep == NOT_QUARANTINED else None
        if self._s.dry_run:
            if self._once(pod.uid, "dry-run"):
                log.info("eviction.dry_run", grace_period_s=self._s.grace_period, **fields)
                self._count("dry-run")
            return None
        if self._kubelet_gone(pod, faulty):
            log.info(
                "eviction.pod_gone",
                note="the pod left, or was made again on a healthy GPU, after the kubelet's list",
                **fields,
            )
            self._count("gone")
            return None
        return self._evict(d, fields)

    def _kubelet_gone(self, pod: Pod, faulty: Faulty) -> bool:
        """The kubelet no longer has this pod on a faulty GPU. A pod deleted and made again under the same
        name on this node after the List (a StatefulSet) is the API server's only pod of that name, so the
        UID precondition cannot tell it apart: the kubelet's Get, by name too, shows what the new one has."""
        try:
            answer = self._kubelet.get(pod.namespace, pod.name)
            return answer is None or not held(answer, faulty)
        except KubeletError:
            return False  # the List just answered: the Eviction's UID precondition still guards the pod

    def _evict(self, d: Decision, fields: dict[str, Any]) -> float | None:
        pod = d.pod
        try:
            with counted(self._metrics, "create"):
                pods.evict(
                    self._api(),
                    pod.namespace,
                    pod.name,
                    uid=pod.uid,
                    grace_period=self._s.grace_period,
                    timeout=self._s.timeout,
                )
        except (ConflictError, PermanentApiError) as exc:
            if isinstance(exc, ConflictError) or exc.status == 404:
                log.info("eviction.pod_gone", note="deleted or replaced before its eviction", **fields)
                self._count("gone")
                return None
            return self._refused(d, fields, exc, blocked=False)
        except TransientApiError as exc:
            return self._refused(d, fields, exc, blocked=pods.budget_refused(exc))
        except ConfigError as exc:  # a kubeconfig that cannot be used: as good as no answer
            return self._refused(d, fields, exc, blocked=False)
        self._attempts.pop(pod.uid, None)
        self._count("evicted")
        log.warning("eviction.pod_evicted", grace_period_s=self._s.grace_period, **fields)
        gpus = ", ".join(d.gpus)
        self._events(
            pod,
            "GPUPodEvicted",
            "Warning",
            f"gpuguard evicted pod {pod.namespace}/{pod.name} from node {self._s.node}: "
            f"it holds faulty GPU {gpus}",
        )
        return None

    def _refused(
        self, d: Decision, fields: dict[str, Any], exc: NodeUpdateError | ConfigError, *, blocked: bool
    ) -> float:
        pod = d.pod
        attempt = self._attempts.get(pod.uid, 0) + 1
        self._attempts[pod.uid] = attempt
        wait = backoff(attempt)
        self._count("blocked" if blocked else "failed")
        event = "eviction.blocked" if blocked else "eviction.failed"
        log.warning(event, error=str(exc), attempt=attempt, retry_in_s=wait, **fields)
        if self._once(pod.uid, event):
            why = "a PodDisruptionBudget allows no disruption now" if blocked else f"the API server: {exc}"
            self._events(
                pod,
                "GPUEvictionBlocked",
                "Warning",
                f"gpuguard cannot evict pod {pod.namespace}/{pod.name} from faulty GPU {', '.join(d.gpus)} "
                f"on node {self._s.node} yet ({why}); retried while the fault holds",
            )
        return wait

    def _once(self, uid: str, what: str) -> bool:
        if (uid, what) in self._reported:
            return False
        self._reported.add((uid, what))
        return True

    def _count(self, result: str) -> None:
        if self._metrics is not None:
            self._metrics.pod_evictions.labels(result).inc()

    def _node_event(self, reason: str, message: str) -> None:
        self._events(None, reason, "Warning", message)

    def _events(self, pod: Pod | None, reason: str, kind: str, message: str) -> None:
        """The Event on the pod (in its namespace) and on the node; one that cannot be written is logged."""
        subjects: list[tuple[str, dict[str, str]]] = []
        if pod is not None:
            subjects.append((pod.namespace, events.pod_ref(pod.namespace, pod.name, pod.uid)))
        subjects.append((events.NODE_NAMESPACE, events.node_ref(self._s.node)))
        now = self._now()
        for namespace, subject in subjects:
            body = events.body(
                subject,
                namespace=namespace,
                type=kind,
                reason=reason,
                message=message,
                host=self._s.node,
                now=now,
            )
            try:
                with counted(self._metrics, "create"):
                    events.post(
                        self._api(),
                        body,
                        timeout=self._s.timeout,
                        what=f"create event {reason} about {subject['kind']} {subject['name']}",
                    )
            except (NodeUpdateError, ConfigError) as exc:
                log.warning("eviction.event_failed", node=self._s.node, reason=reason, error=str(exc))
