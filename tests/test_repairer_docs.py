"""What the docs tell an operator about the systems that repair nodes, held to the facts they cite: which GKE
mode re-creates a cordoned node, GPUd's reboot threshold, and what kube-controller-manager does to the pods
of a NoExecute taint (it deletes them; an Eviction would ask their PodDisruptionBudgets)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
OPERATIONS = ROOT / "docs" / "operations.md"


def _tracked(*tops: str) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--", *tops], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [ROOT / name for name in out.split("\0") if name and name.endswith((".md", ".py", ".yaml"))]


def _sentences(text: str) -> list[str]:
    flat = re.sub(r"\s+", " ", text)
    return re.split(r"(?<=[.;:])\s", flat)


def test_the_docs_say_only_gke_autopilot_recreates_a_node_for_its_cordon() -> None:
    text = re.sub(r"\s+", " ", OPERATIONS.read_text())
    assert "Standard with auto-repair on" not in text
    assert "Only GKE Autopilot treats a cordoned node as broken" in text
    assert "GKE Standard's auto-repair does not look at the cordon" in text


def test_gpuds_xid_reboot_threshold_is_cited_as_its_default_2_everywhere() -> None:
    for path in _tracked("README.md", "docs", "gpuguard"):
        text = re.sub(r"\s+", " ", path.read_text())
        assert "more than 3 reboots" not in text, path
        if "GPUd asks for" in text:
            assert "after 2 reboots" in text and "default 2" in text, path


def test_the_readme_never_says_kube_controller_manager_evicts_the_pods_of_a_noexecute_taint() -> None:
    """kube-controller-manager deletes them (taint-based eviction is a DELETE of the pod): no Eviction, so
    no PodDisruptionBudget is asked. gpuguard's own --evict gpu-pods evicts."""
    wrong = [
        s
        for s in _sentences(README.read_text())
        if re.search(r"kube-controller-manager|taint manager", s) and re.search(r"\bevict(s|ing|ed)?\b", s)
    ]
    assert wrong == []
