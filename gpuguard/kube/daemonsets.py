"""DaemonSets (apps/v1) through the API server: those a label selector selects, cluster-wide (`gpuguard
uninstall` warns while gpuguard's own still runs: its agents would put the marks back; `gpuguard status`
reads which nodes they select and their settings)."""

from __future__ import annotations

from typing import Any

from gpuguard.kube import client as kubeclient

COLLECTION = "/apis/apps/v1/daemonsets"


def items(api: kubeclient.Client, selector: str, *, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Every DaemonSet the label selector selects, in any namespace, as the API server has them."""
    doc = api.request(
        "GET", COLLECTION, query={"labelSelector": selector}, timeout=timeout, what="list DaemonSets"
    )
    return [d for d in doc.get("items") or [] if isinstance(d, dict)]


def names(api: kubeclient.Client, selector: str, *, timeout: float = 10.0) -> list[str]:
    """ "namespace/name" of every DaemonSet the label selector selects, in any namespace."""
    return sorted(
        f"{(d.get('metadata') or {}).get('namespace', '')}/{(d.get('metadata') or {}).get('name', '')}"
        for d in items(api, selector, timeout=timeout)
    )
