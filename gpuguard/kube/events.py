"""Kubernetes Events (core/v1), the one shape gpuguard writes them in: about a node (the quarantine's changes,
the evictor's refusals) or a pod (its eviction), reported by the agent of `host`, best effort for its callers.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from gpuguard.core import validation
from gpuguard.kube import client as kubeclient

# Where the Events about a node go: "default", like the kubelet's node Events (kubectl describe node). The
# only namespace, besides an evicted pod's, whose Events the agent may create (a Role there,
# deploy/daemonset.yaml).
NODE_NAMESPACE = "default"
COMPONENT = "gpuguard"


def node_ref(name: str, uid: str | None = None) -> dict[str, str]:
    """The involvedObject of an Event about a node; with its uid where the caller read it."""
    ref = {"apiVersion": "v1", "kind": "Node", "name": name}
    return ref if uid is None else {**ref, "uid": uid}


def pod_ref(namespace: str, name: str, uid: str) -> dict[str, str]:
    """The involvedObject of an Event about a pod."""
    return {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": name, "uid": uid}


def body(
    about: dict[str, str],
    *,
    namespace: str,
    type: str,
    reason: str,
    message: str,
    host: str,
    now: datetime,
    name: str | None = None,
) -> dict[str, Any]:
    """One Event, seen once at `now`. `name`: the Event's own name; None: the API server makes one up
    (generateName "<subject>.gpuguard-"). The message is cleaned and cut to what the API server takes."""
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    meta = {"name": name} if name is not None else {"generateName": f"{about['name']}.{COMPONENT}-"}
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {**meta, "namespace": namespace},
        "involvedObject": about,
        "type": type,
        "reason": reason,
        "message": validation.clean_text(message, max_bytes=validation.MAX_EVENT_MESSAGE_BYTES),
        "source": {"component": COMPONENT, "host": host},
        "reportingComponent": COMPONENT,
        "reportingInstance": host,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def post(api: kubeclient.Client, event: dict[str, Any], *, timeout: float = 10.0, what: str = "") -> None:
    """Create `event` (from `body`) in its namespace."""
    namespace = event["metadata"]["namespace"]
    api.request(
        "POST",
        kubeclient.path_of("api/v1/namespaces", namespace, "events"),
        body=event,
        timeout=timeout,
        what=what or "create event",
    )


EVENTS_MOST = 500
"""Events of one node `gpuguard explain` reads: the API server keeps an Event an hour by default."""


def about_node(api: kubeclient.Client, name: str, *, timeout: float = 10.0) -> list[dict[str, Any]]:
    """gpuguard's Events about the node `name` (one list request, at most EVENTS_MOST), oldest first."""
    selector = f"involvedObject.kind=Node,involvedObject.name={name},source={COMPONENT}"
    answer = api.request(
        "GET",
        kubeclient.path_of("api/v1/namespaces", NODE_NAMESPACE, "events"),
        query={"fieldSelector": selector, "limit": str(EVENTS_MOST)},
        timeout=timeout,
        what="list events",
    )
    items = [e for e in (answer or {}).get("items", []) if isinstance(e, dict)]
    return sorted(items, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
