"""The chart's repair values (repair.mode and the executor's settings): nothing but the admission policies
with the default off; with dry-run or on the executor's ServiceAccount, RBAC, eviction Roles and DaemonSet,
and the agent's GPUGUARD_REPAIR; the repair policies follow the release's names."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.helmtool import CHART, ROOT, Docs, Helm, build_helm

pytestmark = pytest.mark.timeout(1200)

ON = ("--set", "repair.mode=on", "--set", "evict.namespaces={ml,batch}")
POLICY = ROOT / "deploy" / "admission-policy-repair.yaml"


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return build_helm(tmp_path_factory.mktemp("helm-home"))


def named(docs: Docs, suffix: str) -> list[tuple[str, str]]:
    return sorted(
        (d["kind"], d["metadata"].get("namespace", ""))
        for d in docs
        if d["metadata"]["name"].endswith(suffix)
    )


def env(docs: Docs, name: str) -> dict[str, Any]:
    ds = next(d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == name)
    return {e["name"]: e.get("value") for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_off_by_default_renders_no_executor_and_the_agent_asks_for_nothing(helm: Helm) -> None:
    docs = helm.render()
    assert not [d for d in docs if d["metadata"]["name"] == "gpuguard-repair"]
    assert "GPUGUARD_REPAIR" not in env(docs, "gpuguard")


def test_on_renders_the_executor_with_only_what_a_reset_needs_and_tells_the_agent(helm: Helm) -> None:
    docs = helm.render(*ON, "--set", "repair.perHour=3", "--set", "repair.validateCommand=dcgmi diag -r 1")
    assert env(docs, "gpuguard")["GPUGUARD_REPAIR"] == "on"
    executor = env(docs, "gpuguard-repair")
    assert executor["GPUGUARD_REPAIR"] == "on" and executor["GPUGUARD_PER_HOUR"] == "3"
    assert executor["GPUGUARD_VALIDATE_COMMAND"] == "dcgmi diag -r 1"
    assert named(docs, "-repair-evict") == [
        ("Role", "batch"),
        ("Role", "ml"),
        ("RoleBinding", "batch"),
        ("RoleBinding", "ml"),
    ]
    ds = next(d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "gpuguard-repair")
    spec = ds["spec"]["template"]["spec"]
    security = spec["containers"][0]["securityContext"]
    assert security["privileged"] is False and security["capabilities"] == {"drop": ["ALL"]}
    assert not spec.get("hostNetwork") and not spec.get("hostPID")
    assert sorted(v["hostPath"]["path"] for v in spec["volumes"]) == [
        "/var/lib/kubelet/pod-resources",
        "/var/run/gpuguard-reboot",
    ]
    # Its pods are not the agent's: the two DaemonSets' selectors do not overlap.
    agent = next(d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "gpuguard")
    assert (
        agent["spec"]["selector"]["matchLabels"].items()
        - ds["spec"]["template"]["metadata"]["labels"].items()
    )


def test_on_without_namespaces_to_evict_in_fails_the_render(helm: Helm) -> None:
    result = helm.run("template", "gpuguard", str(CHART), "--set", "repair.mode=on")
    assert result.returncode != 0 and "repair.mode needs evict.namespaces" in result.stderr


def test_the_repair_policies_are_the_deploy_files_and_follow_the_release(helm: Helm) -> None:
    expected = [d for d in yaml.safe_load_all(POLICY.read_text()) if d]
    rendered = [d for d in helm.render() if d["metadata"]["name"].startswith("gpuguard-repair-")]
    for doc in rendered:
        doc["metadata"]["labels"] = {"app.kubernetes.io/name": "gpuguard"}
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(rendered, key=key) == sorted(expected, key=key)
    other = helm.render(release="gpu", namespace="gpu-health")
    conditions = {
        d["metadata"]["name"]: d["spec"]["matchConditions"][0]["expression"]
        for d in other
        if d["kind"] == "ValidatingAdmissionPolicy" and "-repair-" in d["metadata"]["name"]
    }
    assert conditions == {
        "gpu-gpuguard-repair-request": (
            "request.userInfo.username == 'system:serviceaccount:gpu-health:gpu-gpuguard'"
        ),
        "gpu-gpuguard-repair-executor": (
            "request.userInfo.username == 'system:serviceaccount:gpu-health:gpu-gpuguard-repair'"
        ),
    }
