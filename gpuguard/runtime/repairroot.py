"""The repair executor's composition root (`gpuguard repair-executor`): the real seams of
`quarantine.repair.executor` (its node on the API server, the kubelet's PodResources with the evictor of
`--evict gpu-pods`, NVML, the reset and validation commands, kured's sentinel, the pace's Lease) and its loop
until SIGTERM. A process of its own, in a container of its own: the agent never holds its privileges."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from gpuguard.core import logs
from gpuguard.core.model import REPAIR_HELD, Fault, GpuVerdict, Verdict
from gpuguard.core.repairconfig import RepairSettings
from gpuguard.eviction import evictor as ev
from gpuguard.eviction.plan import Faulty, held
from gpuguard.kube import client as kubeclient
from gpuguard.kube import devicerules, events, nodes
from gpuguard.kube.podresources.client import PodResourcesClient
from gpuguard.quarantine.gpu.slices import slice_devices
from gpuguard.quarantine.repair.bucket import Bucket
from gpuguard.quarantine.repair.executor import Executor
from gpuguard.quarantine.repair.pace import LeasePace

log = structlog.get_logger(__name__)


class _Api:
    def __init__(self, s: RepairSettings) -> None:
        self._s, self._lock = s, threading.Lock()
        self._client_: kubeclient.Client | None = None

    def __call__(self) -> kubeclient.Client:
        with self._lock:
            if self._client_ is None:
                self._client_ = kubeclient.load(self._s.kubeconfig, user_agent="gpuguard-repair")
            return self._client_


class _Node:
    """This node: read, its repair record annotated (a merge patch of that key alone: only the executor
    writes it), an Event about it."""

    def __init__(self, s: RepairSettings, api: _Api) -> None:
        self._s, self._api = s, api

    def read(self) -> Mapping[str, Any]:
        return nodes.read(self._api(), self._s.node, timeout=self._s.api_timeout)  # type: ignore[no-any-return]

    def annotate(self, annotations: Mapping[str, str | None]) -> None:
        body = {"metadata": {"annotations": dict(annotations)}}
        nodes.patch(self._api(), self._s.node, body, timeout=self._s.api_timeout)

    def event(self, type: str, reason: str, message: str) -> None:
        body = events.body(
            events.node_ref(self._s.node),
            namespace=events.NODE_NAMESPACE,
            type=type,
            reason=reason,
            message=message,
            host=self._s.node,
            now=datetime.now(UTC),
        )
        try:
            events.post(self._api(), body, timeout=self._s.api_timeout, what=f"event {reason}")
        except Exception as exc:  # best effort: the log line and the record say it too
            log.warning("repair.event_failed", node=self._s.node, reason=reason, error=str(exc))


class _Idler:
    """The pods holding a GPU (PodResources), and one round of the evictor of `--evict gpu-pods` for it."""

    def __init__(self, s: RepairSettings, api: _Api) -> None:
        self._s, self._api = s, api
        self._kubelet = PodResourcesClient(s.pod_resources_socket, timeout=s.api_timeout)
        # The request is written only once the GPU's quarantine is in place (quarantine/repair/asking.py).
        self._evictor = ev.Evictor(
            ev.Settings(node=s.node, timeout=s.api_timeout),
            kubelet=self._kubelet,
            api=api,
            context=lambda: Faulty(frozenset(), dra_devices=self._devices, node_tainted=True),
        )
        self._devices: dict[str, tuple[str, str, str]] = {}

    def _read_devices(self) -> None:
        """The node's DRA devices by UUID (its ResourceSlices), so a pod that claims the GPU is found too."""
        items = devicerules.slices(self._api(), node=self._s.node, driver=self._s.dra_driver)
        found = slice_devices(items, driver=self._s.dra_driver, node=self._s.node)
        self._devices = {u: (d.driver, d.pool, d.device) for u, d in found.items()}

    def holders(self, uuid: str) -> tuple[str, ...]:
        if uuid not in self._devices:
            self._read_devices()
        faulty = Faulty(frozenset({uuid}), dra_devices=self._devices)
        return tuple(sorted(f"{p.namespace}/{p.name}" for p in self._kubelet.list() if held(p, faulty)))

    def evict(self, uuid: str) -> None:
        fault = Fault(REPAIR_HELD, "being repaired", uuid)
        self._evictor.observe(Verdict(gpus=(GpuVerdict(index=0, uuid=uuid, faults=(fault,)),)))
        self._evictor.round()


class _Commands:
    def run(self, argv: Sequence[str], timeout: float) -> tuple[int, str]:
        try:
            done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return 127, str(exc)
        return done.returncode, (done.stdout + done.stderr)


class _Sentinel:
    """kured's reboot sentinel on the host: its presence is the request (kured --reboot-sentinel)."""

    def __init__(self, path: str) -> None:
        self._path = Path(path)

    def request(self, why: str) -> None:
        tmp = self._path.with_name(self._path.name + ".gpuguard-tmp")
        tmp.write_text(why + "\n", encoding="utf-8")
        os.replace(tmp, self._path)


def build(s: RepairSettings) -> Executor:
    from prometheus_client import Counter  # noqa: PLC0415

    from gpuguard.nvml.real.repairreads import RepairReads  # noqa: PLC0415 - pynvml only where it runs

    steps = Counter("gpuguard_repair_steps_total", "Repair steps by step and result", ["step", "result"])
    api = _Api(s)
    return Executor(
        s,
        node=_Node(s, api),
        idler=_Idler(s, api),
        gpus=RepairReads(),
        commands=_Commands(),
        reboot=_Sentinel(s.reboot_sentinel),
        pace=LeasePace(api, Bucket(s.per_hour, s.burst), namespace=s.namespace),
        count=lambda step, result: steps.labels(step, result).inc(),
    )


def run(s: RepairSettings, *, run_for: float | None = None) -> None:
    """Until SIGTERM/SIGINT (or `run_for` seconds, for tests)."""
    logs.configure(s.log_format)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if run_for is not None:
        threading.Timer(run_for, stop.set).start()
    executor = build(s)
    if s.metrics_port:
        from prometheus_client import start_http_server  # noqa: PLC0415

        start_http_server(s.metrics_port)
    _Api(s)()  # a kubeconfig that cannot be used is a usage error now, one line, not a loop of them
    executor.run(stop)
    log.info("repair.stopped", node=s.node)
