"""DaemonSets (apps/v1) through the API server: the names of those a label selector selects, cluster-wide
(`gpuguard uninstall` warns while gpuguard's own still runs: its agents would put the marks back)."""

from __future__ import annotations

from gpuguard.kube import client as kubeclient

COLLECTION = "/apis/apps/v1/daemonsets"


def names(api: kubeclient.Client, selector: str, *, timeout: float = 10.0) -> list[str]:
    """ "namespace/name" of every DaemonSet the label selector selects, in any namespace."""
    doc = api.request(
        "GET", COLLECTION, query={"labelSelector": selector}, timeout=timeout, what="list DaemonSets"
    )
    return sorted(
        f"{(d.get('metadata') or {}).get('namespace', '')}/{(d.get('metadata') or {}).get('name', '')}"
        for d in doc.get("items") or []
    )
