"""ResourceSlices shaped like NVIDIA's DRA driver's (k8s-dra-driver-gpu, driver gpu.nvidia.com): one pool per
node named after the node, devices gpu-<index> with the attributes the driver publishes (type, uuid, index,
minor, productName, brand, architecture, cudaComputeCapability, driverVersion, pcieBusID) and their memory.
Shared by the unit tests and the tests on the real scheduler."""

from __future__ import annotations

from typing import Any

DRIVER = "gpu.nvidia.com"


def gpu_uuid(node: str, index: int) -> str:
    return f"GPU-{node}-{index}"


def nvidia_device(node: str, index: int, uuid: str | None = None) -> dict[str, Any]:
    return {
        "name": f"gpu-{index}",
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": uuid or gpu_uuid(node, index)},
            "index": {"int": index},
            "minor": {"int": index},
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
            "brand": {"string": "Nvidia"},
            "architecture": {"string": "Hopper"},
            "cudaComputeCapability": {"version": "9.0.0"},
            "driverVersion": {"version": "570.124.6"},
            "cudaDriverVersion": {"version": "12.8.0"},
            "pcieBusID": {"string": f"0000:{0x18 + index:02x}:00.0"},
        },
        "capacity": {"memory": {"value": "80Gi"}},
    }


def nvidia_slice(node: str, gpus: int = 8, uuids: list[str] | None = None) -> dict[str, Any]:
    """The ResourceSlice the driver's kubelet plugin publishes for `node`."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{DRIVER}-gpus"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [nvidia_device(node, i, (uuids or [])[i] if uuids else None) for i in range(gpus)],
        },
    }
