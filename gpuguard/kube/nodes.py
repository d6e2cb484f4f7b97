"""Nodes (core/v1) through the API server: one node read and patched (its metadata and spec by a JSON merge
patch, its conditions by a strategic merge patch on nodes/status, where conditions merge by type), and nodes
listed by label selector, whole or as metadata only (PartialObjectMetadata: no specs, no statuses, what a
budget counts). A patch's body is the caller's plan: the resourceVersion it carries is the precondition
(a node that moved on answers 409, a `ConflictError`). Errors are the client's (`gpuguard.kube.client`).

`tokens`: what a request takes from the client's rate limiter (`Client.request`): a read that reserves the
write after it takes 2, that write 0.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from gpuguard.kube import client as kubeclient
from gpuguard.kube.listwatch import lean

COLLECTION = "/api/v1/nodes"
"""Every node: what a list or a watch of nodes asks (`kube.listwatch.ListWatch`)."""
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
METADATA = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
METADATA_ONLY = (METADATA_LIST, METADATA)
"""The Accept headers of a metadata-only list and watch (`ListWatch`'s `accept`)."""
_MERGE = "application/merge-patch+json"
_STRATEGIC = "application/strategic-merge-patch+json"
PAGE = 500
"""Nodes per page of `names`."""


def path(name: str) -> str:
    return kubeclient.path_of(COLLECTION[1:], name)


def read(api: kubeclient.Client, name: str, *, timeout: float = 10.0, tokens: float = 1.0) -> Any:
    """The node as the API server has it."""
    return api.request("GET", path(name), timeout=timeout, what=f"read node {name}", tokens=tokens)


def patch(
    api: kubeclient.Client,
    name: str,
    body: Mapping[str, Any],
    *,
    timeout: float = 10.0,
    tokens: float = 1.0,
) -> Any:
    """A JSON merge patch of the node (`body["metadata"]["resourceVersion"]`, where there is one, the
    precondition); the node as the API server now has it."""
    return _patch(api, path(name), body, _MERGE, what=f"patch node {name}", timeout=timeout, tokens=tokens)


def patch_status(
    api: kubeclient.Client,
    name: str,
    conditions: list[dict[str, str]],
    *,
    timeout: float = 10.0,
    tokens: float = 1.0,
) -> Any:
    """A strategic merge patch of nodes/status with these conditions (they merge by type; one with
    "$patch": "delete" goes); the node as the API server now has it."""
    body = {"status": {"conditions": conditions}}
    what = f"patch node {name} status"
    return _patch(api, path(name) + "/status", body, _STRATEGIC, what=what, timeout=timeout, tokens=tokens)


def _patch(
    api: kubeclient.Client,
    where: str,
    body: Mapping[str, Any],
    content_type: str,
    *,
    what: str,
    timeout: float,
    tokens: float,
) -> Any:
    return api.request(
        "PATCH", where, body=body, content_type=content_type, timeout=timeout, what=what, tokens=tokens
    )


def select(
    api: kubeclient.Client,
    selector: str,
    *,
    what: str,
    metadata_only: bool = False,
    timeout: float = 10.0,
) -> list[dict[str, Any]]:
    """The nodes of a label selector ("": every node), in one list, each without its managedFields as it
    arrives (a fleet's list is one answer); `metadata_only`: as PartialObjectMetadata. Alternatives
    separated by ";" (the GPU nodes of several platforms: a label selector cannot say "or") are one list
    each, united by name."""
    found: dict[str, dict[str, Any]] = {}
    for alternative in selector.split(";") if selector else [""]:
        doc = api.request(
            "GET",
            COLLECTION,
            query={"labelSelector": alternative} if alternative else None,
            accept=METADATA_LIST if metadata_only else "application/json",
            timeout=timeout,
            what=what,
            keep=lean,
        )
        for item in doc.get("items") or ():  # an empty metadata list comes as "items": null
            found.setdefault(str((item.get("metadata") or {}).get("name", "")), item)
    return list(found.values())


def within(label: str, selector: str) -> str:
    """`label` (key=value) and `selector`, as one selector: the label added to each of its alternatives."""
    return ";".join(
        ",".join(s for s in (label, alt) if s) for alt in (selector.split(";") if selector else [""])
    )


def names(api: kubeclient.Client, *, timeout: float = 10.0) -> Iterator[str]:
    """Every node's name, a list page of PAGE nodes at a time."""
    query = {"limit": str(PAGE)}
    while True:
        doc = api.request("GET", COLLECTION, query=query, timeout=timeout, what="list nodes")
        for item in doc.get("items") or []:
            yield str(item["metadata"]["name"])
        token = (doc.get("metadata") or {}).get("continue")
        if not token:
            return
        query = {"limit": str(PAGE), "continue": token}
