"""A fake kubelet: a real gRPC server on a unix socket that serves the official PodResources v1 proto
(gpuguard/kube/podresources/v1) from a table of pods, containers and devices, as the kubelet does.

`pods` is the table, changed by the test at any time (a pod added, one that leaves). `unimplemented=True`
serves no PodResources service at all (a kubelet without the API: every call answers UNIMPLEMENTED, from
gRPC itself). `get` of an unknown pod answers as the kubelet does: UNKNOWN, "pod X not found in namespace Y".
"""

from __future__ import annotations

import os
import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from gpuguard.kube.podresources.v1 import api_pb2, api_pb2_grpc

GPU_RESOURCE = "nvidia.com/gpu"


@dataclass
class FakeContainer:
    name: str
    devices: dict[str, list[str]] = field(default_factory=dict)  # resource name -> device IDs
    claims: list[tuple[str, str, str]] = field(default_factory=list)  # (driver, pool, device)


@dataclass
class FakePod:
    namespace: str
    name: str
    containers: list[FakeContainer] = field(default_factory=list)


def gpu_pod(namespace: str, name: str, *uuids: str) -> FakePod:
    """A pod of one container that holds these GPUs through NVIDIA's device plugin."""
    return FakePod(namespace, name, [FakeContainer("main", {GPU_RESOURCE: list(uuids)})])


class _Lister(api_pb2_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    def __init__(self, kubelet: FakeKubelet) -> None:
        self._kubelet = kubelet

    def List(self, request: object, context: object) -> api_pb2.ListPodResourcesResponse:
        with self._kubelet.lock:
            self._kubelet.calls.append("List")
            return api_pb2.ListPodResourcesResponse(pod_resources=[_message(p) for p in self._kubelet.pods])

    def Get(
        self, request: api_pb2.GetPodResourcesRequest, context: grpc.ServicerContext
    ) -> api_pb2.GetPodResourcesResponse:
        with self._kubelet.lock:
            self._kubelet.calls.append(f"Get {request.pod_namespace}/{request.pod_name}")
            for p in self._kubelet.pods:
                if (p.namespace, p.name) == (request.pod_namespace, request.pod_name):
                    return api_pb2.GetPodResourcesResponse(pod_resources=_message(p))
        context.abort(
            grpc.StatusCode.UNKNOWN,
            f"pod {request.pod_name} not found in namespace {request.pod_namespace}",
        )
        raise AssertionError("abort returns only by raising")


def _message(pod: FakePod) -> api_pb2.PodResources:
    containers = []
    for c in pod.containers:
        devices = [api_pb2.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in c.devices.items()]
        dynamic = (
            [
                api_pb2.DynamicResource(
                    claim_name=f"{pod.name}-{c.name}",
                    claim_namespace=pod.namespace,
                    claim_resources=[
                        api_pb2.ClaimResource(driver_name=d, pool_name=pool, device_name=dev)
                        for d, pool, dev in c.claims
                    ],
                )
            ]
            if c.claims
            else []
        )
        containers.append(api_pb2.ContainerResources(name=c.name, devices=devices, dynamic_resources=dynamic))
    return api_pb2.PodResources(name=pod.name, namespace=pod.namespace, containers=containers)


class FakeKubelet:
    """The PodResources server on `socket_path`, started by start() (or `with`), stopped by stop()."""

    def __init__(self, socket_path: str, *, pods: list[FakePod] | None = None, unimplemented: bool = False):
        self.socket_path = socket_path
        self.pods: list[FakePod] = list(pods or [])
        self.calls: list[str] = []
        self.lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        if not unimplemented:
            api_pb2_grpc.add_PodResourcesListerServicer_to_server(_Lister(self), self._server)
        if self._server.add_insecure_port(f"unix://{os.path.abspath(socket_path)}") == 0:
            raise OSError(f"cannot listen on {socket_path}")

    def start(self) -> FakeKubelet:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None).wait(5)

    def remove(self, namespace: str, name: str) -> None:
        """The pod leaves the node (the kubelet forgets it)."""
        with self.lock:
            self.pods = [p for p in self.pods if (p.namespace, p.name) != (namespace, name)]

    def __enter__(self) -> FakeKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
