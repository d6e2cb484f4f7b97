"""Dynamic Resource Allocation through the API server (resource.k8s.io): a node's ResourceSlices (read only)
and DeviceTaintRules, created, read, patched (a JSON merge patch), deleted (with the uid and the
resourceVersion read as preconditions) and listed by label selector, a page at a time. DeviceTaintRules are
served as v1 from Kubernetes 1.37 and as v1beta2 by 1.36 (beta, off by default: --runtime-config and the
DRADeviceTaintRules gate): every call names the version the caller's first list found served (`VERSIONS`,
newest first); an unserved one answers 404, a `PermanentApiError`.
Errors are the client's (`gpuguard.kube.client`), a 404 included: what it means is the caller's, who counts
each request with its answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuguard.kube import client as kubeclient
from gpuguard.kube.listwatch import lean

GROUP = "resource.k8s.io"
VERSIONS = ("v1", "v1beta2")
"""The versions that may serve DeviceTaintRules, the one to try first first."""
SLICES = f"/apis/{GROUP}/v1/resourceslices"
MAX_RULE_BYTES = 256 * 1024
"""A rule read of more bytes is dropped as it streams (`kubeclient.Client.request`): the policy keeps a
token's rules to 16 KiB of annotations and 8 KiB of managedFields names, under 100 KiB even in JSON's
escapes; the agent's own are about 1 KiB."""


def api_version(version: str) -> str:
    """A rule's apiVersion in that version: "resource.k8s.io/v1"."""
    return f"{GROUP}/{version}"


def rules_path(version: str) -> str:
    """The rules' collection (what a list or a watch of them asks, `kube.listwatch.ListWatch`)."""
    return f"/apis/{GROUP}/{version}/devicetaintrules"


def _rule(version: str, name: str) -> str:
    return kubeclient.path_of(rules_path(version)[1:], name)


def slices(api: kubeclient.Client, *, node: str, driver: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The ResourceSlices of `driver` on `node` (field selectors: the server sends no other). A 404 where
    the API server serves no resource.k8s.io/v1 (Kubernetes < 1.34, or DRA off)."""
    query = {"fieldSelector": f"spec.nodeName={node},spec.driver={driver}"}
    doc = api.request("GET", SLICES, query=query, timeout=timeout, what="list resource slices")
    return list(doc.get("items") or [])


def list_page(
    api: kubeclient.Client,
    version: str,
    *,
    selector: str,
    limit: int | None = None,
    after: str | None = None,
    timeout: float = 10.0,
) -> dict[str, Any]:
    """One page of the rules of a label selector, as the API server sends it but for each rule's
    managedFields (`listwatch.lean`): its metadata.continue, where `limit` left more, is the next page's
    `after`. None `limit`: one page holds them all."""
    query = {"labelSelector": selector}
    if limit is not None:
        query["limit"] = str(limit)
    if after is not None:
        query["continue"] = after
    doc: dict[str, Any] = api.request(
        "GET",
        rules_path(version),
        query=query,
        timeout=timeout,
        what="list device taint rules",
        keep=lean,
        max_item=MAX_RULE_BYTES,
    )
    return doc


def create(api: kubeclient.Client, version: str, body: Mapping[str, Any], *, timeout: float = 10.0) -> Any:
    """Create the rule `body` describes, in `version`; the rule as the API server made it."""
    name = body["metadata"]["name"]
    return api.request(
        "POST",
        rules_path(version),
        body={**body, "apiVersion": api_version(version)},
        timeout=timeout,
        what=f"create device taint rule {name}",
    )


def get(api: kubeclient.Client, version: str, name: str, *, timeout: float = 10.0) -> Any:
    """The rule of that name (a 404 where there is none)."""
    return api.request("GET", _rule(version, name), timeout=timeout, what=f"read rule {name}")


def patch(
    api: kubeclient.Client, version: str, name: str, body: Mapping[str, Any], *, timeout: float = 10.0
) -> Any:
    """A JSON merge patch of the rule; the rule as the API server now has it."""
    return api.request(
        "PATCH",
        _rule(version, name),
        body=body,
        content_type="application/merge-patch+json",
        timeout=timeout,
        what=f"patch device taint rule {name}",
    )


def delete(
    api: kubeclient.Client,
    version: str,
    name: str,
    *,
    uid: str,
    resource_version: str,
    timeout: float = 10.0,
) -> None:
    """Delete the rule, only if it is still the one read (this uid, unchanged since: else a 409)."""
    body = {
        "apiVersion": "v1",
        "kind": "DeleteOptions",
        "preconditions": {"uid": uid, "resourceVersion": resource_version},
    }
    api.request(
        "DELETE", _rule(version, name), body=body, timeout=timeout, what=f"delete device taint rule {name}"
    )
