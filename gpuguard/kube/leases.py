"""Leases (coordination.k8s.io/v1): one read, created, or replaced with its resourceVersion as precondition
(a Lease that moved on answers 409, a `ConflictError`). The repair executor keeps its cluster-wide pace in
one (`gpuguard.quarantine.repair.pace`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuguard.core.errors import PermanentApiError
from gpuguard.kube import client as kubeclient


def _collection(namespace: str) -> str:
    return kubeclient.path_of("apis/coordination.k8s.io/v1/namespaces", namespace, "leases")


def read(api: kubeclient.Client, namespace: str, name: str, *, timeout: float = 10.0) -> Any | None:
    """The Lease, None where there is none."""
    try:
        return api.request(
            "GET", f"{_collection(namespace)}/{name}", timeout=timeout, what=f"read lease {namespace}/{name}"
        )
    except PermanentApiError as exc:
        if exc.status == 404:
            return None
        raise


def create(
    api: kubeclient.Client,
    namespace: str,
    name: str,
    annotations: Mapping[str, str],
    *,
    timeout: float = 10.0,
) -> Any:
    body = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name, "namespace": namespace, "annotations": dict(annotations)},
        "spec": {},
    }
    return api.request(
        "POST", _collection(namespace), body=body, timeout=timeout, what=f"create lease {namespace}/{name}"
    )


def replace(
    api: kubeclient.Client, lease: Mapping[str, Any], annotations: Mapping[str, str], *, timeout: float = 10.0
) -> Any:
    """The Lease with these annotations, sent with the resourceVersion it was read at (409 if it moved)."""
    meta = lease["metadata"]
    body = {**lease, "metadata": {**meta, "annotations": {**(meta.get("annotations") or {}), **annotations}}}
    namespace, name = str(meta["namespace"]), str(meta["name"])
    return api.request(
        "PUT",
        f"{_collection(namespace)}/{name}",
        body=body,
        timeout=timeout,
        what=f"update lease {namespace}/{name}",
    )
