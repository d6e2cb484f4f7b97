"""DRA on a real API server, shared by the tests on the real scheduler and the repair's `make e2e` case:
NVIDIA's DeviceClass and a ResourceClaimTemplate for one GPU, a kwok node whose GPUs the driver publishes,
the device the scheduler allocated to a pod, and a DeviceTaintRule gpuguard wrote."""

from __future__ import annotations

from typing import Any

import kubernetes

from harness.dra import DRIVER, gpu_uuid, nvidia_slice
from harness.kube import WORKLOADS, Admin, daemon_pod, eventually, make_gpu_node, read_pod

ApiException = kubernetes.client.exceptions.ApiException

DRA = "resource.k8s.io"
CLAIM_TEMPLATE = "one-gpu"


def dra_objects(admin: Admin) -> None:
    """The DeviceClass of NVIDIA's DRA driver and a ResourceClaimTemplate asking for one GPU of it."""
    custom: Any = kubernetes.client.CustomObjectsApi(admin.api)
    device_class = {
        "apiVersion": f"{DRA}/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DRIVER},
        "spec": {
            "selectors": [
                {
                    "cel": {
                        "expression": f"device.driver == '{DRIVER}' && "
                        f"device.attributes['{DRIVER}'].type == 'gpu'"
                    }
                }
            ]
        },
    }
    template = {
        "apiVersion": f"{DRA}/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": CLAIM_TEMPLATE, "namespace": WORKLOADS},
        "spec": {
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}}
        },
    }
    calls: list[tuple[str, tuple[Any, ...]]] = [
        ("create_cluster_custom_object", (DRA, "v1", "deviceclasses", device_class)),
        ("create_namespaced_custom_object", (DRA, "v1", WORKLOADS, "resourceclaimtemplates", template)),
    ]
    for method, args in calls:
        try:
            getattr(custom, method)(*args)
        except ApiException as exc:
            if exc.status != 409:
                raise


def allocated_device(admin: Admin, pod: str) -> str | None:
    """The device the scheduler allocated to the pod's claim (None while unallocated)."""
    p = read_pod(admin, pod) or {}
    statuses = p.get("status", {}).get("resourceClaimStatuses") or []
    if not statuses or not statuses[0].get("resourceClaimName"):
        return None
    custom: Any = kubernetes.client.CustomObjectsApi(admin.api)
    claim = custom.get_namespaced_custom_object(
        DRA, "v1", WORKLOADS, "resourceclaims", statuses[0]["resourceClaimName"]
    )
    results = (claim.get("status", {}).get("allocation") or {}).get("devices", {}).get("results") or []
    return str(results[0]["device"]) if results else None


def device_rule(admin: Admin, name: str) -> dict[str, Any] | None:
    custom: Any = kubernetes.client.CustomObjectsApi(admin.api)
    try:
        return custom.get_cluster_custom_object(DRA, "v1", "devicetaintrules", name)  # type: ignore[no-any-return]
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def dra_node(admin: Admin, *, published: bool = True) -> tuple[str, dict[str, Any], str]:
    """A kwok GPU node (bootID boot-1) whose 8 GPUs NVIDIA's DRA driver publishes (`published` False: not
    yet, `publish` later), its DaemonSet pod, and the fake NVML state of those GPUs (the same UUIDs)."""
    node = make_gpu_node(admin)
    admin.set_boot_id(node, "boot-1")
    if published:
        publish(admin, node)
    ds_pod = eventually(lambda: daemon_pod(admin, node), 60, what="DaemonSet pod on the node")
    return node, ds_pod, "".join(f"gpu {i} uuid={gpu_uuid(node, i)}\n" for i in range(8))


def publish(admin: Admin, node: str) -> None:
    """NVIDIA's DRA driver's kubelet plugin publishes the node's GPUs."""
    custom: Any = kubernetes.client.CustomObjectsApi(admin.api)
    custom.create_cluster_custom_object(DRA, "v1", "resourceslices", nvidia_slice(node))
