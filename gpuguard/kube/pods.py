"""Pods through the API server, for the eviction of the pods that hold a faulty GPU (gpuguard.eviction): the
pods on one node (a list with the fieldSelector spec.nodeName, which the API server answers from its watch
cache) and a policy/v1 Eviction, which the API server refuses with 429 while a PodDisruptionBudget allows no
disruption. Errors are the client's (`gpuguard.kube.client`): a 429 is a `TransientApiError`, whose
`budget` tells a budget's refusal from the API server's own throttling."""

from __future__ import annotations

from typing import Any

from gpuguard.errors import TransientApiError
from gpuguard.kube import client as kubeclient

# The API server's words when a PodDisruptionBudget refuses an eviction (its 429's message and cause).
_BUDGET_WORDS = ("disruption budget", "DisruptionBudget")


def on_node(api: kubeclient.Client, node: str, *, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Every pod bound to `node`, as the API server lists them (resourceVersion 0: from its cache)."""
    doc = api.request(
        "GET",
        "/api/v1/pods",
        query={"fieldSelector": f"spec.nodeName={node}", "resourceVersion": "0"},
        timeout=timeout,
        what=f"list pods on node {node}",
    )
    items = doc.get("items") if isinstance(doc, dict) else None
    return [i for i in items or () if isinstance(i, dict)]


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
