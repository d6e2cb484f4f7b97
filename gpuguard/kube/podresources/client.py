"""A gRPC client of the kubelet's PodResources API v1 (List, Get) on its unix socket.

The kubelet serves it on /var/lib/kubelet/pod-resources/kubelet.sock (the DaemonSet mounts that folder
read-only when eviction is on). Every call has a deadline, so a kubelet that hangs never stalls the evictor.
Errors are mapped here: no socket, nothing listening or a deadline passed is `KubeletUnavailable`; a kubelet
without the API (gRPC UNIMPLEMENTED) is `KubeletUnsupported`. `get` of a pod the kubelet no longer knows is
None: the kubelet answers that with UNKNOWN and "not found" in its message (its server wraps a plain Go
error), or NOT_FOUND.
"""

from __future__ import annotations

import os
import stat
import threading
from typing import Any

import grpc

from gpuguard.core.errors import KubeletUnavailable, KubeletUnsupported
from gpuguard.core.model import PodDevices
from gpuguard.kube.podresources.v1 import api_pb2, api_pb2_grpc

SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
# The kubelet's own client allows answers up to 16 MiB (podresources.DefaultMaxMsgSize): a node's every
# pod with every CPU and device fits.
MAX_MESSAGE = 16 * 1024 * 1024
_MAX_DETAIL = 300


class PodResourcesClient:
    """One channel to the kubelet's socket, made at the first call and kept. Thread-safe, as a gRPC
    channel is."""

    def __init__(self, socket_path: str = SOCKET, *, timeout: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: Any = None

    def list(self) -> tuple[PodDevices, ...]:
        """Every pod the kubelet reports, with its containers' devices."""
        answer = self._call("List", api_pb2.ListPodResourcesRequest())
        return tuple(_pod(p) for p in answer.pod_resources)

    def get(self, namespace: str, name: str) -> PodDevices | None:
        """One pod's devices; None when the kubelet does not know the pod (it left)."""
        request = api_pb2.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace)
        try:
            answer = self._call("Get", request)
        except _NotFound:
            return None
        return _pod(answer.pod_resources)

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = self._stub = None

    def _call(self, method: str, request: Any) -> Any:
        what = f"kubelet PodResources {method} on {self.socket_path}"
        try:
            mode = os.stat(self.socket_path).st_mode
        except OSError as exc:
            raise KubeletUnavailable(
                f"{what}: no socket ({exc.strerror}): is /var/lib/kubelet/pod-resources mounted?"
            ) from None
        if not stat.S_ISSOCK(mode):
            raise KubeletUnavailable(f"{what}: not a unix socket")
        try:
            return getattr(self._stub_of(), method)(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise _mapped(exc, what) from None

    def _stub_of(self) -> Any:
        with self._lock:
            if self._stub is None:
                self._channel = grpc.insecure_channel(
                    f"unix://{os.path.abspath(self.socket_path)}",
                    options=[
                        ("grpc.max_receive_message_length", MAX_MESSAGE),
                        ("grpc.enable_http_proxy", 0),  # a unix socket: never through a proxy
                    ],
                )
                self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
            return self._stub


class _NotFound(Exception):
    pass


def _mapped(exc: grpc.RpcError, what: str) -> Exception:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = " ".join(str(exc.details() if isinstance(exc, grpc.Call) else exc).split())[:_MAX_DETAIL]
    name = code.name if code is not None else "UNKNOWN"
    if code == grpc.StatusCode.NOT_FOUND or (code == grpc.StatusCode.UNKNOWN and "not found" in details):
        return _NotFound(details)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return KubeletUnsupported(f"{what}: the kubelet does not serve it ({name}: {details})")
    return KubeletUnavailable(f"{what}: {name}: {details}")


def _pod(pod: api_pb2.PodResources) -> PodDevices:
    devices: list[tuple[str, str]] = []
    claims: list[tuple[str, str, str]] = []
    for container in pod.containers:
        for group in container.devices:
            devices.extend((group.resource_name, device) for device in group.device_ids)
        for dynamic in container.dynamic_resources:
            claims.extend((r.driver_name, r.pool_name, r.device_name) for r in dynamic.claim_resources)
    return PodDevices(
        namespace=pod.namespace,
        name=pod.name,
        devices=tuple(dict.fromkeys(devices)),
        claims=tuple(dict.fromkeys(claims)),
    )
