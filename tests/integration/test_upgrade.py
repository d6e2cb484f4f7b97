"""An upgrade from an older chart and its rollback, as docs/operations.md "Upgrading and rolling back" says,
with Helm 4 and Helm 3 against a real kube-apiserver: version A of the chart (an earlier commit's, kept as
tests/integration/data/chart-0.2.0-39d03d5.tar.gz so that a shallow clone runs it too) installed with the
page's install command, the page's upgrade to the working tree's chart, then the page's rollback, with the
DaemonSet, the RBAC, the admission policies and the priority levels checked after each step."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from harness.kube import ROOT, Admin
from tests.helmtool import build_helm
from tests.integration.test_operations import Runbook, _helm, admin, blocks, cluster, tools_env

__all__ = ["admin", "cluster"]  # the fixtures, used by name
pytestmark = pytest.mark.timeout(900)


# Version A of the upgrade test: the chart before the per-GPU quarantine. Its ClusterRole has no
# ResourceSlices or DeviceTaintRules, its one admission policy is off by default, and it has no policy or
# priority level for Events: an upgrade to the working tree's chart adds all of them, a rollback removes them.
CHART_A = "39d03d53d49a6e9cef3fe4ada288c7a8b6ae70a0"  # the commit the archive below was made from
ADMISSION = (
    "own-node-only",
    "own-devices-only",
    "own-events-only",
    "evictions",
    "repair-request",
    "repair-executor",
)


CHART_A_ARCHIVE = ROOT / "tests" / "integration" / "data" / "chart-0.2.0-39d03d5.tar.gz"


def chart_at(archive: Path, dest: Path) -> Path:
    """deploy/helm/gpuguard as `archive` holds it (`git archive COMMIT deploy/helm/gpuguard | gzip`)."""
    dest.mkdir()
    subprocess.run(["tar", "-xzf", str(archive), "-C", str(dest)], check=True)
    return dest / "deploy" / "helm" / "gpuguard"


def _release_objects(admin: Admin) -> dict[str, Any]:
    """What the upgrade and the rollback change: the ClusterRole's resources, the admission policies and
    bindings present, the FlowSchemas, the DaemonSet's image and arguments."""
    rbac: Any = kubernetes.client.RbacAuthorizationV1Api(admin.api)
    adm: Any = kubernetes.client.AdmissionregistrationV1Api(admin.api)
    flow: Any = kubernetes.client.FlowcontrolApiserverV1Api(admin.api)
    ds = admin.apps.read_namespaced_daemon_set("gpuguard", "gpuguard").spec.template.spec.containers[0]
    return {
        "resources": sorted(r for rule in rbac.read_cluster_role("gpuguard").rules for r in rule.resources),
        "policies": sorted(p.metadata.name for p in adm.list_validating_admission_policy().items),
        "bindings": sorted(b.metadata.name for b in adm.list_validating_admission_policy_binding().items),
        "flowschemas": sorted(
            f.metadata.name for f in flow.list_flow_schema().items if f.metadata.name.startswith("gpuguard")
        ),
        "image": ds.image,
        "args": ds.args,
        "ignore_xids": [e.value for e in ds.env if e.name == "GPUGUARD_IGNORE_XIDS"],
    }


@pytest.mark.parametrize("helm_major", [4, 3])
def test_an_upgrade_from_an_older_chart_and_the_rollback_work_as_the_page_says(
    helm_major: int, cluster: Any, admin: Admin, tmp_path: Path
) -> None:
    helm = build_helm(tmp_path / "helm-home", major=helm_major)
    book = Runbook(tools_env(tmp_path, cluster, helm.binary, helm.env))
    old = chart_at(CHART_A_ARCHIVE, tmp_path / "a")
    upgrade, rollback = [b for section, b in blocks() if section == "Upgrading and rolling back"]

    def sh(text: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-euo", "pipefail", "-c", text],
            env=book.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )

    # Version A, installed with the page's install command.
    install = blocks()[0][1].replace("deploy/helm/gpuguard", str(old))
    assert sh(install).returncode == 0
    version_a = _release_objects(admin)
    assert version_a["policies"] == [] and version_a["bindings"] == []  # off by default in A
    assert "devicetaintrules" not in version_a["resources"] and version_a["flowschemas"] == ["gpuguard"]
    assert version_a["args"] == ["watch", "--dry-run"]
    assert _helm(book, "history")[-1]["chart"] == "gpuguard-0.2.0"

    # The page's warning: --reuse-values keeps A's defaults, so the policies would stay off.
    kept = sh(
        "helm upgrade gpuguard deploy/helm/gpuguard --namespace gpuguard --reuse-values --dry-run=server"
    )
    assert kept.returncode == 0, kept.stderr
    assert "kind: DaemonSet" in kept.stdout
    assert "kind: ValidatingAdmissionPolicy\n" not in kept.stdout, "--reuse-values took B's default"

    # The page's upgrade: the working tree's chart, A's values that were set kept, its defaults not.
    done = sh(upgrade)
    assert done.returncode == 0, done.stderr
    version_b = _release_objects(admin)
    assert version_b["policies"] == sorted(f"gpuguard-{p}" for p in ADMISSION)
    assert version_b["bindings"] == version_b["policies"]
    assert {"resourceslices", "devicetaintrules"} <= set(version_b["resources"])
    assert version_b["flowschemas"] == ["gpuguard", "gpuguard-events"]
    assert (version_b["image"], version_b["args"]) == (version_a["image"], version_a["args"])
    assert version_b["ignore_xids"] == []  # the built-in list: A's default [] did not come along
    assert _helm(book, "history")[-1]["chart"] == "gpuguard-0.3.0"

    # The page's rollback: A's objects again, what B added deleted.
    back = sh(rollback)
    assert back.returncode == 0, back.stderr
    assert back.stdout.strip().splitlines()[-1] == version_a["image"]
    assert _release_objects(admin) == version_a
    assert _helm(book, "history")[-1]["chart"] == "gpuguard-0.2.0"
    assert [h["revision"] for h in _helm(book, "history")] == [1, 2, 3]
