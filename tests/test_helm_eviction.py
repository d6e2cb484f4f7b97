"""The chart's eviction values (evict.mode, evict.gracePeriodSeconds, evict.namespaces): nothing at
all with the default mode none; with gpu-pods a Role and RoleBinding in each listed namespace and nowhere
else, the agent's variables, the kubelet's pod-resources folder mounted read-only, and uid 0 for its
socket."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helmtool import CHART, NAMESPACE, Docs, Helm, build_helm
from tests.test_helm import _watch_variables

pytestmark = pytest.mark.timeout(1200)

ON = ("--set", "evict.mode=gpu-pods", "--set", "evict.namespaces={ml,batch}")


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return build_helm(tmp_path_factory.mktemp("helm-home"))


def agent(docs: Docs) -> dict[str, Any]:
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    container: dict[str, Any] = ds["spec"]["template"]["spec"]["containers"][0]
    return container


def pod_spec(docs: Docs) -> dict[str, Any]:
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    spec: dict[str, Any] = ds["spec"]["template"]["spec"]
    return spec


def env(docs: Docs) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in agent(docs)["env"]}


def evict_objects(docs: Docs) -> list[tuple[str, str, str]]:
    return sorted(
        (d["kind"], d["metadata"]["namespace"], d["metadata"]["name"])
        for d in docs
        if d["kind"] in ("Role", "RoleBinding") and d["metadata"]["name"].endswith("-evict")
    )


def test_the_default_mode_none_renders_no_eviction_role_variable_or_mount(helm: Helm) -> None:
    docs = helm.render("--set", "evict.namespaces={ml}")  # a namespace alone grants nothing
    assert evict_objects(docs) == []
    assert not {"GPUGUARD_EVICT", "GPUGUARD_EVICT_GRACE_PERIOD"} & set(env(docs))
    assert "pod-resources" not in {v["name"] for v in pod_spec(docs)["volumes"]}
    assert agent(docs)["securityContext"].get("runAsUser") is None


def test_gpu_pods_grants_get_evict_and_events_in_each_listed_namespace_only(helm: Helm) -> None:
    docs = helm.render(*ON, "--set", "evict.gracePeriodSeconds=30")
    assert evict_objects(docs) == [
        ("Role", "batch", "gpuguard-evict"),
        ("Role", "ml", "gpuguard-evict"),
        ("RoleBinding", "batch", "gpuguard-evict"),
        ("RoleBinding", "ml", "gpuguard-evict"),
    ]
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["namespace"] == "ml")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    ]
    binding = next(d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["namespace"] == "ml")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpuguard", "namespace": NAMESPACE}]
    assert binding["roleRef"]["name"] == "gpuguard-evict"
    assert {k: v for k, v in env(docs).items() if "EVICT" in k} == {
        "GPUGUARD_EVICT": "gpu-pods",
        "GPUGUARD_EVICT_GRACE_PERIOD": "30",
    }
    assert {"GPUGUARD_EVICT", "GPUGUARD_EVICT_GRACE_PERIOD"} <= _watch_variables()
    mount = next(m for m in agent(docs)["volumeMounts"] if m["name"] == "pod-resources")
    assert mount == {"name": "pod-resources", "mountPath": "/var/lib/kubelet/pod-resources", "readOnly": True}
    volume = next(v for v in pod_spec(docs)["volumes"] if v["name"] == "pod-resources")
    assert volume["hostPath"] == {"path": "/var/lib/kubelet/pod-resources", "type": "DirectoryOrCreate"}
    security = agent(docs)["securityContext"]
    assert security["runAsUser"] == 0 and security["capabilities"] == {"drop": ["ALL"]}
    assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True


def test_another_release_name_names_the_roles_and_binds_its_own_service_account(helm: Helm) -> None:
    docs = helm.render(*ON, release="guard")
    account = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
    assert account != "gpuguard"
    bindings = [d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["name"] == f"{account}-evict"]
    assert len(bindings) == 2
    assert {b["roleRef"]["name"] for b in bindings} == {f"{account}-evict"}
    assert {b["subjects"][0]["name"] for b in bindings} == {account}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (("--set", "evict.mode=gpu-pods"), "evict.mode gpu-pods needs evict.namespaces"),
        (("--set", "evict.mode=all"), "/evict/mode"),
        (("--set", "evict.namespaces={Not_A_Name}"), "/evict/namespaces/0"),
        (("--set", "evict.gracePeriodSeconds=-1"), "/evict/gracePeriodSeconds"),
    ],
)
def test_eviction_values_that_cannot_work_fail_the_render(
    helm: Helm, values: tuple[str, ...], message: str
) -> None:
    result = helm.run("template", "gpuguard", str(CHART), "--namespace", NAMESPACE, *values)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
