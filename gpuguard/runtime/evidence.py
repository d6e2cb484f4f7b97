"""The evidence recorder: at each fault and degraded mark first judged, one record of what made it, kept in
`--state-dir` (gpuguard.store.evidence; docs/design.md, "Evidence at detection").

It sees every verdict after the reconciler (the agent's `on_verdict`) and only notes what is new on the
agent's thread: the record is built and written on a thread of its own, since the pods on the GPU come from
the kubelet's PodResources API (a socket that may be slow or absent) and the file is written durably. The
readings are the verdict's own, so they are those of the check that judged the fault; the budget's state is
what the reconciler reported at that moment (before the write it is about to make).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import structlog

from gpuguard import __version__
from gpuguard.core.config import Config
from gpuguard.core.model import Fault, GpuVerdict, PodDevices, Verdict, XidEvent, sxid_reason, xid_reason
from gpuguard.judge.explained import rule
from gpuguard.nvml.kmsg.around import lines_around
from gpuguard.store.evidence import EvidenceStore

if TYPE_CHECKING:
    from gpuguard.quarantine.reconciler import NodeStatus

log = structlog.get_logger(__name__)

QUEUE_MOST = 64
"""Detections waiting for their record: a storm past it is logged (`evidence.dropped`), never a wait."""
XIDS_MOST = 8

Pods = Callable[[], Iterable[PodDevices]]


def settings_digest(cfg: Config) -> str:
    """The settings as one short digest (sha256 of their canonical JSON): two agents that judged alike."""
    text = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=_canonical)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _canonical(value: object) -> object:
    if isinstance(value, set | frozenset):
        return sorted(value, key=str)
    return str(value)


class EvidenceRecorder:
    def __init__(
        self,
        store: EvidenceStore,
        cfg: Config,
        *,
        boot_id: str,
        status: Callable[[], NodeStatus],
        pods: Pods | None = None,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        """`pods`: every pod on the node with its devices (the kubelet's PodResources), None where there is
        no such API to ask."""
        self._store = store
        self._cfg = cfg
        self._boot_id = boot_id
        self._status = status
        self._pods = pods
        self._wall = wall
        self._digest = settings_digest(cfg)
        self._queue: queue.Queue[tuple[Verdict, list[tuple[str, Fault]], NodeStatus, float] | None]
        self._queue = queue.Queue(maxsize=QUEUE_MOST)
        self._thread: threading.Thread | None = None
        self._last: Verdict | None = None
        # The marks of the last verdict: one that ends and comes back is a new detection. Those recorded
        # earlier in this boot are not recorded again after a restart (the faults the state file restores).
        self._seen = {str(r.get("key")) for r in store.load() if r.get("boot_id") == boot_id and boot_id}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpuguard-evidence", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5.0)

    def observe(self, verdict: Verdict) -> None:
        """Called with every verdict, on the agent's thread: cheap unless a mark is new."""
        if verdict is self._last:
            return  # the agent keeps the one object while nothing changed: a steady node's every check
        self._last = verdict
        marks = [("fault", f) for f in _faults(verdict)] + [("degraded", f) for f in _degraded(verdict)]
        new = [(kind, f) for kind, f in marks if f.key not in self._seen]
        self._seen = {f.key for _, f in marks}
        if not new:
            return
        try:
            self._queue.put_nowait((verdict, new, self._status(), time.monotonic()))
        except queue.Full:
            log.warning("evidence.dropped", node=self._cfg.node.name, marks=[f.key for _, f in new])

    def record_now(
        self, verdict: Verdict, marks: list[tuple[str, Fault]], status: NodeStatus, seen: float
    ) -> None:
        """Build and keep the records of `marks` judged at `seen` (CLOCK_MONOTONIC): the thread's work."""
        pods = self._pod_list()
        at = self._wall().isoformat()
        for kind, fault in marks:
            xids = [x for x in verdict.fatal_xids if x.uuid == fault.uuid and fault.reason == _reason(x)]
            # The kernel's lines around the Xid's own record where the kernel logged it, else the detection.
            around = max((x.kernel.at for x in xids if x.kernel is not None), default=seen)
            kernel = lines_around(self._cfg.kernel_log, around=around) if self._cfg.kernel_log else []
            record = self.record(verdict, kind, fault, status, pods=pods, at=at, kernel=kernel)
            kept = self._store.add(record)
            log.info(
                "evidence.recorded",
                node=self._cfg.node.name,
                key=fault.key,
                kind=kind,
                bytes=len(json.dumps(kept)),
                trimmed=kept.get("trimmed"),
            )

    def record(
        self,
        verdict: Verdict,
        kind: str,
        fault: Fault,
        status: NodeStatus,
        *,
        pods: list[PodDevices] | None,
        at: str,
        kernel: list[str],
    ) -> dict[str, Any]:
        """One record: what made `fault` (a plain mapping; the store bounds it)."""
        gpu = next((g for g in verdict.gpus if fault.uuid is not None and g.uuid == fault.uuid), None)
        same = [f for f in (*_faults(verdict), *_degraded(verdict)) if f.uuid == fault.uuid]
        policy = self._cfg.policy
        return {
            "at": at,
            "boot_id": self._boot_id,
            "node": self._cfg.node.name,
            "kind": kind,
            "key": fault.key,
            "reason": fault.reason,
            "detail": fault.detail,
            "uuid": fault.uuid,
            "gpu": fault.gpu_index,
            "rule": rule(fault.reason, signals=policy.signals, ecc_threshold=policy.ecc_threshold),
            "verdict": {
                "reasons": [f"{f.reason}: {f.detail}" for f in same],
                "unhealthy_gpus": sum(1 for g in verdict.gpus if g.faults),
                "gpus": len(verdict.gpus),
                "node_reasons": [f.reason for f in verdict.node_faults],
            },
            "readings": _readings(gpu),
            "xids": [_xid(x) for x in verdict.fatal_xids if x.uuid == fault.uuid][-XIDS_MOST:],
            "kernel": kernel,
            "action": {
                "quarantine": self._cfg.node.quarantine,
                "taint_effect": self._cfg.node.taint_effect,
                "dry_run": self._cfg.node.dry_run,
                "recovery_action": None if gpu is None else gpu.recovery_action,
            },
            "pods": None if pods is None else _holding(pods, fault.uuid),
            "budget": {
                "max_quarantined": str(self._cfg.node.max_quarantined),
                "node_tainted": status.tainted,
                "node_deferred": status.deferred,
                "gpus_held": sum(1 for g in status.gpus if not g.deferred),
                "gpus_deferred": sum(1 for g in status.gpus if g.deferred),
            },
            "agent": {"version": __version__, "settings_digest": self._digest},
        }

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self.record_now(*item)
            except Exception:  # never the agent's failure: the fault is judged and written without it
                log.exception("evidence.failed", node=self._cfg.node.name)

    def _pod_list(self) -> list[PodDevices] | None:
        if self._pods is None:
            return None
        try:
            return list(self._pods())
        except Exception as exc:  # an absent or slow kubelet: the record says "unknown", it is not lost
            log.warning("evidence.pods_unknown", node=self._cfg.node.name, error=str(exc)[:200])
            return None


def _faults(verdict: Verdict) -> list[Fault]:
    return [*verdict.node_faults, *(f for g in verdict.gpus for f in g.faults)]


def _degraded(verdict: Verdict) -> list[Fault]:
    return [*verdict.node_degraded, *(f for g in verdict.gpus for f in g.degraded)]


def _readings(gpu: GpuVerdict | None) -> dict[str, Any] | None:
    if gpu is None:
        return None
    return {
        "name": gpu.name,
        "present": gpu.present,
        "ecc_uncorrected": gpu.ecc_uncorrected,
        "recovery_action": gpu.recovery_action,
        "remap_pending": gpu.remap_pending,
        "retired_pages": gpu.retired_pages,
        "pcie_link": list(gpu.pcie_link) if gpu.pcie_link else None,
        "xid_watched": gpu.xid_watched,
    }


def _xid(x: XidEvent) -> dict[str, Any]:
    out: dict[str, Any] = {"code": x.code, "source": x.source, "sxid": x.sxid}
    if x.kernel is not None:
        k = x.kernel
        out.update(seq=k.seq, at=k.at, pci=k.pci, pid=k.pid, process=k.process, text=k.text)
    return out


def _reason(x: XidEvent) -> str:
    return sxid_reason(x.code) if x.sxid else xid_reason(x.code)


def _holding(pods: list[PodDevices], uuid: str | None) -> list[str]:
    """The pods whose containers hold the GPU (a device plugin's ID is the UUID, `UUID::n` when shared); every
    pod with a GPU for a node fault."""
    out = []
    for p in pods:
        ids = [d for _, d in p.devices]
        if any(d == uuid or (uuid is not None and d.startswith(uuid + "::")) for d in ids) or (
            uuid is None and (ids or p.claims)
        ):
            out.append(f"{p.namespace}/{p.name}")
    return out


def kubelet_pods(socket_path: str, timeout: float) -> Pods | None:
    """The kubelet's PodResources List, where its socket exists (grpc imported only then)."""
    if not os.path.exists(socket_path):
        return None
    from gpuguard.kube.podresources.client import PodResourcesClient  # noqa: PLC0415

    client = PodResourcesClient(socket_path, timeout=timeout)
    return client.list


def recorder(cfg: Config, status: Callable[[], NodeStatus]) -> EvidenceRecorder:
    """The recorder of a node with --state-dir: the pods from the kubelet where its PodResources socket is."""
    from gpuguard.store.state import read_boot_id  # noqa: PLC0415

    assert cfg.state_dir is not None
    return EvidenceRecorder(
        EvidenceStore(cfg.state_dir),
        cfg,
        boot_id=read_boot_id(cfg.boot_id_file),
        status=status,
        pods=kubelet_pods(cfg.node.pod_resources_socket, cfg.node.api_timeout),
    )
