"""Pods through the API server, for the eviction of the pods that hold a faulty GPU (gpuguard.eviction): one
pod read by name (only the pods the kubelet says hold a faulty GPU: a `get` in the namespaces the eviction
Role lists, where a list of the node's pods would need every pod of the cluster readable, since RBAC cannot
limit a list to one node) and a policy/v1 Eviction, which the API server refuses with 429 while a
PodDisruptionBudget allows no disruption; and for `gpuguard status`, the pods of gpuguard's agents
(`selected`), read with the operator's own rights. Errors are the client's (`gpuguard.kube.client`): a 429
is a `TransientApiError`, and `budget_refused` tells a budget's refusal from the API server's own
throttling."""

from __future__ import annotations

from typing import Any

from gpuguard.core.errors import PermanentApiError, TransientApiError
from gpuguard.kube import client as kubeclient

# The API server's words when a PodDisruptionBudget refuses an eviction (its 429's message and cause).
_BUDGET_WORDS = ("disruption budget", "DisruptionBudget")


def get(api: kubeclient.Client, namespace: str, name: str, *, timeout: float = 10.0) -> dict[str, Any] | None:
    """One pod as the API server has it; None when it has none of that name (404)."""
    try:
        doc = api.request(
            "GET",
            kubeclient.path_of("api/v1/namespaces", namespace, "pods", name),
            timeout=timeout,
            what=f"read pod {namespace}/{name}",
        )
    except PermanentApiError as exc:
        if exc.status == 404:
            return None
        raise
    return doc if isinstance(doc, dict) else None


def selected(api: kubeclient.Client, selector: str, *, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Every pod the label selector selects, in any namespace (`gpuguard status`: gpuguard's agents)."""
    doc = api.request(
        "GET", "/api/v1/pods", query={"labelSelector": selector}, timeout=timeout, what="list pods"
    )
    return [p for p in doc.get("items") or [] if isinstance(p, dict)]


def evict(
    api: kubeclient.Client,
    namespace: str,
    name: str,
    *,
    uid: str,
    grace_period: int | None,
    timeout: float = 10.0,
) -> None:
    """Ask the API server to evict one pod (policy/v1 Eviction), only if it is still the pod of this `uid`
    (a pod of the same name made since is not the one that held the GPU: a 409). `grace_period` None: the
    pod's own terminationGracePeriodSeconds."""
    options: dict[str, Any] = {"preconditions": {"uid": uid}} if uid else {}
    if grace_period is not None:
        options["gracePeriodSeconds"] = grace_period
    body = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": namespace},
        "deleteOptions": options,
    }
    api.request(
        "POST",
        kubeclient.path_of("api/v1/namespaces", namespace, "pods", name, "eviction"),
        body=body,
        timeout=timeout,
        what=f"evict pod {namespace}/{name}",
    )


def budget_refused(exc: TransientApiError) -> bool:
    """A 429 from a PodDisruptionBudget (not the API server's rate limits)."""
    return exc.status == 429 and any(w in str(exc) for w in _BUDGET_WORDS)
