"""kube.nodes.select with ";"-separated alternatives (the GPU nodes of several platforms, ORed as the
DaemonSet's node affinity terms): one list each, united by name; `within` adds a label to each alternative."""

from __future__ import annotations

from typing import Any

from gpuguard.kube import nodes


class ListingApi:
    """Answers a node list by label selector from a fixed set of nodes (equality and existence terms)."""

    def __init__(self, labels: dict[str, dict[str, str]]) -> None:
        self.labels = labels
        self.selectors: list[str | None] = []

    def request(self, method: str, path: str, **kw: Any) -> Any:
        selector = (kw.get("query") or {}).get("labelSelector")
        self.selectors.append(selector)

        def matches(labels: dict[str, str]) -> bool:
            terms = [t.split("=", 1) for t in (selector or "").split(",") if t]
            return all(t[0] in labels and (len(t) == 1 or labels[t[0]] == t[1]) for t in terms)

        return {
            "items": [{"metadata": {"name": n}} for n, lab in self.labels.items() if matches(lab)] or None
        }


def test_alternatives_are_one_list_each_united_by_name() -> None:
    api = ListingApi(
        {
            "gfd": {"nvidia.com/gpu.present": "true"},
            "gke": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
            "both": {"nvidia.com/gpu.present": "true", "cloud.google.com/gke-accelerator": "nvidia-l4"},
            "cpu": {},
        }
    )
    found = nodes.select(api, "nvidia.com/gpu.present=true;cloud.google.com/gke-accelerator", what="x")  # type: ignore[arg-type]
    assert [i["metadata"]["name"] for i in found] == ["gfd", "both", "gke"]
    assert api.selectors == ["nvidia.com/gpu.present=true", "cloud.google.com/gke-accelerator"]


def test_one_selector_is_one_list_and_the_empty_one_lists_every_node() -> None:
    api = ListingApi({"a": {"x": "1"}, "b": {}})
    assert len(nodes.select(api, "x=1", what="x")) == 1  # type: ignore[arg-type]
    assert len(nodes.select(api, "", what="x")) == 2  # type: ignore[arg-type]
    assert api.selectors == ["x=1", None]


def test_a_label_within_a_selector_is_added_to_each_alternative() -> None:
    assert nodes.within("q=true", "a=b;c") == "q=true,a=b;q=true,c"
    assert nodes.within("q=true", "a=b") == "q=true,a=b"
    assert nodes.within("q=true", "") == "q=true"
