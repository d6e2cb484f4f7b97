"""deploy/admission-policy-devices.yaml on a real kube-apiserver (v1.37, resource.k8s.io/v1
DeviceTaintRules): gpuguard's ServiceAccount, with a token bound to a Pod on its node, may create, change and
delete only its own rules: single devices of its node's pool, gpuguard's taint key, gpuguard's labels. Every
refusal is asserted by the policy's own message, so a 403 from RBAC cannot pass for it.
"""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Callable
from typing import Any

import kubernetes
import pytest

from gpuguard.cli.uninstall import clean_rules
from gpuguard.kube import client as kubeclient
from harness import controlplane
from harness.kube import (
    TAINT_KEY,
    Admin,
    enforced_admin,
    refused_by,
    token_client,
    unique_node,
)

pytestmark = pytest.mark.timeout(180)

POLICY = "gpuguard-own-devices-only"
GROUP, VERSION, PLURAL = "resource.k8s.io", "v1", "devicetaintrules"
DRIVER = "gpu.nvidia.com"
MERGE = {"_content_type": "application/merge-patch+json"}
_names = itertools.count()


@pytest.fixture(scope="module")
def admin(admin_api: kubernetes.client.ApiClient, control_plane: Any) -> Admin:
    def probe(a: Admin) -> Callable[[], Any]:
        here, there = new_node(a), new_node(a)
        api = agent_api(a, control_plane, here)
        return lambda: api.create_cluster_custom_object(
            GROUP, VERSION, PLURAL, rule(there, "gpu-0"), dry_run="All"
        )

    return enforced_admin(admin_api, policy=POLICY, probe=probe)


def new_node(admin: Admin) -> str:
    return unique_node(admin, "dadm")


def agent_api(admin: Admin, control_plane: Any, node: str) -> Any:
    """CustomObjectsApi (any group's REST) as gpuguard's ServiceAccount, token bound to a Pod on `node`."""
    return kubernetes.client.CustomObjectsApi(
        token_client(control_plane.url, control_plane.ca_path, admin.agent_token(node))
    )


def rule(
    pool: str,
    device: str | None,
    *,
    key: str = TAINT_KEY,
    labels: dict[str, str] | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """A DeviceTaintRule as gpuguard writes it (gpuguard.quarantine.gpu.rules.rule_body's shape)."""
    selector = {"driver": DRIVER, "pool": pool} | ({"device": device} if device else {})
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": name
            or (f"gpuguard.{pool}.{device}" if device else f"gpuguard.{pool}.all-{next(_names)}"),
            "labels": {"gpuguard.io/node": pool, "app.kubernetes.io/managed-by": "gpuguard"}
            if labels is None
            else labels,
            "annotations": {"gpuguard.io/node-gpus": "8"},
        },
        "spec": {
            "deviceSelector": selector,
            "taint": {"key": key, "value": "xid-79", "effect": "NoSchedule"},
        },
    }


def refused(call: Callable[[], Any]) -> str:
    return refused_by(POLICY, call)


def custom(admin: Admin) -> Any:
    return kubernetes.client.CustomObjectsApi(admin.api)


def test_the_agent_creates_changes_and_deletes_a_rule_for_one_device_of_its_own_node(
    admin: Admin, control_plane: Any
) -> None:
    node = new_node(admin)
    api = agent_api(admin, control_plane, node)
    body = rule(node, "gpu-3")
    name = body["metadata"]["name"]
    api.create_cluster_custom_object(GROUP, VERSION, PLURAL, body)
    api.patch_cluster_custom_object(
        GROUP,
        VERSION,
        PLURAL,
        name,
        {"metadata": {"annotations": {"gpuguard.io/faults": "ecc/GPU-3"}}},
        **MERGE,
    )
    api.delete_cluster_custom_object(GROUP, VERSION, PLURAL, name)


def test_a_rule_for_another_nodes_pool_is_denied(admin: Admin, control_plane: Any) -> None:
    here, there = new_node(admin), new_node(admin)
    api = agent_api(admin, control_plane, here)
    text = refused(lambda: api.create_cluster_custom_object(GROUP, VERSION, PLURAL, rule(there, "gpu-0")))
    assert text.startswith(f"gpuguard may taint only single devices of its own node {here}'s pool"), text
    assert f"{there}/gpu-0" in text


def test_a_rule_for_a_whole_pool_is_denied(admin: Admin, control_plane: Any) -> None:
    node = new_node(admin)
    api = agent_api(admin, control_plane, node)
    text = refused(lambda: api.create_cluster_custom_object(GROUP, VERSION, PLURAL, rule(node, None)))
    assert f"{node}/(all)" in text


def test_a_foreign_taint_key_is_denied(admin: Admin, control_plane: Any) -> None:
    node = new_node(admin)
    api = agent_api(admin, control_plane, node)
    body = rule(node, "gpu-1", key="example.com/maintenance")
    text = refused(lambda: api.create_cluster_custom_object(GROUP, VERSION, PLURAL, body))
    assert text.startswith("gpuguard may write only device taints with key gpuguard.io/gpu-unhealthy"), text
    assert "example.com/maintenance" in text


DEGRADED_KEY = "gpuguard.io/gpu-degraded"


def degraded_rule(node: str, device: str, *, effect: str = "None", name: str | None = None) -> dict[str, Any]:
    """The effect-None rule of a degraded GPU (gpu.degraded.degraded_rule_body's shape)."""
    body = rule(node, device, key=DEGRADED_KEY, name=name or f"gpuguard-degraded.{node}.{device}")
    body["spec"]["taint"] = {"key": DEGRADED_KEY, "value": "nvlink-down", "effect": effect}
    return body


def test_the_agent_creates_changes_and_deletes_the_effect_none_rule_of_a_degraded_gpu(
    admin: Admin, control_plane: Any
) -> None:
    node = new_node(admin)
    api = agent_api(admin, control_plane, node)
    body = degraded_rule(node, "gpu-2")
    name = body["metadata"]["name"]
    api.create_cluster_custom_object(GROUP, VERSION, PLURAL, body)
    change = {"metadata": {"annotations": {"gpuguard.io/faults": "pcie-width/GPU-2"}}}
    api.patch_cluster_custom_object(GROUP, VERSION, PLURAL, name, change, **MERGE)
    api.delete_cluster_custom_object(GROUP, VERSION, PLURAL, name)


@pytest.mark.parametrize("effect", ["NoSchedule", "NoExecute"])
def test_a_degraded_rule_that_would_block_is_denied(admin: Admin, control_plane: Any, effect: str) -> None:
    node = new_node(admin)
    api = agent_api(admin, control_plane, node)
    body = degraded_rule(node, "gpu-2", effect=effect)
    text = refused(lambda: api.create_cluster_custom_object(GROUP, VERSION, PLURAL, body))
    assert text.startswith("gpuguard may write only device taints with key gpuguard.io/gpu-unhealthy"), text
    assert f"{DEGRADED_KEY} (effect {effect})" in text
    # Nor may a held degraded rule be made to block by a patch.
    api.create_cluster_custom_object(GROUP, VERSION, PLURAL, degraded_rule(node, "gpu-3"))
    harden = {"spec": {"taint": {"key": DEGRADED_KEY, "value": "nvlink-down", "effect": effect}}}
    name = f"gpuguard-degraded.{node}.gpu-3"
    text = refused(lambda: api.patch_cluster_custom_object(GROUP, VERSION, PLURAL, name, harden, **MERGE))
    assert f"{DEGRADED_KEY} (effect {effect})" in text


def test_the_degraded_key_and_name_go_together(admin: Admin, control_plane: Any) -> None:
    """A fault rule's name cannot carry the degraded key, nor a degraded name the fault key: one device has
    one rule of each kind, each under the one name a create may give it."""
    node = new_node(admin)
    api = agent_api(admin, control_plane, node)
    mixed = degraded_rule(node, "gpu-4", name=f"gpuguard.{node}.gpu-4")
    text = refused(lambda: api.create_cluster_custom_object(GROUP, VERSION, PLURAL, mixed))
    assert text.startswith("gpuguard gives the key gpuguard.io/gpu-degraded to its rules named"), text
    hard = rule(node, "gpu-4", name=f"gpuguard-degraded.{node}.gpu-4")
    text = refused(lambda: api.create_cluster_custom_object(GROUP, VERSION, PLURAL, hard))
    assert text.startswith("gpuguard gives the key gpuguard.io/gpu-degraded to its rules named"), text


def test_deleting_a_rule_gpuguard_did_not_make_is_denied(admin: Admin, control_plane: Any) -> None:
    """An administrator's rule on the agent's own pool, even with gpuguard's taint key: not the agent's."""
    node = new_node(admin)
    theirs = rule(node, "gpu-2", labels={"team": "infra"})
    custom(admin).create_cluster_custom_object(GROUP, VERSION, PLURAL, theirs)
    api = agent_api(admin, control_plane, node)
    name = theirs["metadata"]["name"]
    text = refused(lambda: api.delete_cluster_custom_object(GROUP, VERSION, PLURAL, name))
    assert text.startswith("gpuguard may change or delete only its own rules"), text
    # Nor taken over by a patch that adds gpuguard's labels (the rule as it was is checked too).
    takeover = {
        "metadata": {"labels": {"gpuguard.io/node": node, "app.kubernetes.io/managed-by": "gpuguard"}}
    }
    refused(lambda: api.patch_cluster_custom_object(GROUP, VERSION, PLURAL, name, takeover, **MERGE))
    custom(admin).get_cluster_custom_object(GROUP, VERSION, PLURAL, name)  # still there


def test_an_agent_cannot_delete_another_agents_rule(admin: Admin, control_plane: Any) -> None:
    here, there = new_node(admin), new_node(admin)
    body = rule(there, "gpu-5")
    agent_api(admin, control_plane, there).create_cluster_custom_object(GROUP, VERSION, PLURAL, body)
    api = agent_api(admin, control_plane, here)
    refused(lambda: api.delete_cluster_custom_object(GROUP, VERSION, PLURAL, body["metadata"]["name"]))


def test_other_users_are_not_affected(admin: Admin) -> None:
    node = new_node(admin)
    body = rule("some-other-pool", None, key="example.com/maintenance", labels={})
    custom(admin).create_cluster_custom_object(GROUP, VERSION, PLURAL, body)
    custom(admin).delete_cluster_custom_object(GROUP, VERSION, PLURAL, body["metadata"]["name"])
    assert node


def test_uninstall_deletes_gpuguards_rules_of_the_named_nodes_and_no_one_elses(
    admin: Admin, control_plane: Any
) -> None:
    here, there = new_node(admin), new_node(admin)
    mine, other = rule(here, "gpu-1"), rule(there, "gpu-1")
    agent_api(admin, control_plane, here).create_cluster_custom_object(GROUP, VERSION, PLURAL, mine)
    agent_api(admin, control_plane, there).create_cluster_custom_object(GROUP, VERSION, PLURAL, other)
    theirs = rule(here, "gpu-2", labels={"team": "infra"})
    custom(admin).create_cluster_custom_object(GROUP, VERSION, PLURAL, theirs)
    api = kubeclient.load(str(control_plane.kubeconfig_path), user_agent="test")
    name = mine["metadata"]["name"]
    assert clean_rules(api, (here,), dry_run=True) == [f"{here}/gpu-1 ({name})"]
    assert custom(admin).get_cluster_custom_object(GROUP, VERSION, PLURAL, name)  # a dry run deletes nothing
    assert clean_rules(api, (here,)) == [f"{here}/gpu-1 ({name})"]
    left = {
        d["metadata"]["name"]
        for d in custom(admin).list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]
    }
    assert name not in left and {other["metadata"]["name"], theirs["metadata"]["name"]} <= left


GET_RULES = "kubectl get devicetaintrules -l app.kubernetes.io/managed-by=gpuguard"
DELETE_RULES = "kubectl delete devicetaintrules -l app.kubernetes.io/managed-by=gpuguard"


def test_the_pages_kubectl_commands_list_and_delete_gpuguards_rules_and_no_one_elses(
    admin: Admin, control_plane: Any
) -> None:
    """docs/operations.md names these two commands in its prose; run as written, with the pinned kubectl."""
    bins = controlplane.cached_binaries()
    assert bins is not None and bins.kubectl is not None
    node = new_node(admin)
    mine = rule(node, "gpu-4")
    agent_api(admin, control_plane, node).create_cluster_custom_object(GROUP, VERSION, PLURAL, mine)
    theirs = rule(node, "gpu-5", labels={"team": "infra"})
    custom(admin).create_cluster_custom_object(GROUP, VERSION, PLURAL, theirs)

    def kubectl(command: str) -> str:
        argv = [str(bins.kubectl), *command.split()[1:], "--kubeconfig", str(control_plane.kubeconfig_path)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout

    listed = kubectl(GET_RULES)
    assert mine["metadata"]["name"] in listed and theirs["metadata"]["name"] not in listed
    kubectl(DELETE_RULES)
    left = {
        d["metadata"]["name"]
        for d in custom(admin).list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]
    }
    assert mine["metadata"]["name"] not in left and theirs["metadata"]["name"] in left
