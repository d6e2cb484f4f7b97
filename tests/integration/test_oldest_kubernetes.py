"""A smoke subset on the oldest supported Kubernetes (versions.env KUBE_VERSION_OLDEST, built by
`hack/testenv/build.sh --oldest`): the manifests and the admission policy apply, the policy is enforced, and
the real agent, as the DaemonSet's ServiceAccount with a Pod-bound token, taints, cordons and recovers its
node without a refusal. The rest of the suite runs on the newest (KUBE_VERSION). The chart on the oldest:
tests/integration/test_helm_install.py."""

from __future__ import annotations

import itertools
import subprocess
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from harness import controlplane
from harness.kube import GPUS_OK, Admin, agent_as_node, enforced_admin, eventually
from tests.helmtool import ROOT, build_helm
from tests.integration.test_admission import POLICY, other_node_probe

pytestmark = pytest.mark.timeout(300)
_names = itertools.count()


@pytest.fixture(scope="module")
def oldest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    cp = controlplane.ControlPlane(
        tmp_path_factory.mktemp("kube-oldest"), allow_build=False, die_with_parent=True, release="oldest"
    )
    try:
        cp.start()
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="module")
def oldest_admin(oldest: Any) -> Iterator[Admin]:
    api: kubernetes.client.ApiClient = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=str(oldest.kubeconfig_path)
    )
    with closing(api):
        yield enforced_admin(api, policy=POLICY, probe=other_node_probe(oldest))


def test_the_oldest_control_plane_is_the_pinned_oldest_supported_release(oldest: Any) -> None:
    assert oldest.version()["gitVersion"] == controlplane.kube_version("oldest")
    assert controlplane.kube_version("oldest") < controlplane.kube_version("newest")


def test_on_the_oldest_release_the_real_agent_taints_and_recovers_its_node_under_the_admission_policy(
    oldest_admin: Admin, oldest: Any, fakenvml: Path, tmp_path: Path
) -> None:
    node = f"old-{next(_names)}-{int(time.time() * 1000) % 100000}"
    oldest_admin.make_node(node)
    state = tmp_path / "gpus.state"
    state.write_text(GPUS_OK)
    agent = agent_as_node(oldest_admin, oldest, node, state=state, lib=fakenvml).start()
    try:
        eventually(agent.ready, 15, what="agent /readyz")
        state.write_text(GPUS_OK.replace("GPU-it-1", "GPU-it-1 ecc=2"))
        eventually(lambda: oldest_admin.our_taint(node), 10, what="taint")
        n = oldest_admin.node(node)
        assert n["spec"]["unschedulable"] is True
        assert n["metadata"]["labels"]["gpuguard.io/quarantined"] == "true"
        # The condition is its own write (nodes/status), after the taint's.
        eventually(
            lambda: any(
                c["type"] == "GPUHealthy" and c["status"] == "False"
                for c in oldest_admin.node(node)["status"].get("conditions") or []
            ),
            10,
            what="GPUHealthy=False",
        )
        state.write_text(GPUS_OK)
        eventually(lambda: oldest_admin.our_taint(node) is None, 10, what="recovery")
        assert oldest_admin.node(node)["spec"].get("unschedulable") in (None, False)
        assert [e for e in oldest_admin.events_for(node) if e["reason"] == "GPUUnhealthy"]
    finally:
        agent.stop()
    assert not agent.events("node.write_rejected")
    assert not [line for line in agent.lines if line.get("level") == "error"]


def test_on_the_oldest_release_the_readmes_helm_install_upgrade_and_uninstall_work(
    oldest: Any, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.integration.test_operations import blocks, tools_env

    helm = build_helm(tmp_path_factory.mktemp("helm-home"))
    env = tools_env(tmp_path, oldest, helm.binary, helm.env)
    namespace = "gpuguard-helm"
    install = blocks()[0][1].replace("gpuguard --take-ownership", f"{namespace} --take-ownership")
    install = install.replace("namespace gpuguard\n", f"namespace {namespace}\n").replace(
        "helm install gpuguard", "helm install gg"
    )
    steps = [
        install,
        f"helm upgrade gg deploy/helm/gpuguard --namespace {namespace} --reuse-values --set cordon=false",
        f"helm uninstall gg --namespace {namespace}",
    ]
    for step in steps:
        r = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", step],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert r.returncode == 0, f"{step}\n{r.stdout}\n{r.stderr}"
