"""deploy/admission-policy.yaml on a real kube-apiserver: gpuguard's ServiceAccount, with a token bound to a
Pod on its node, may change only that node and only gpuguard's keys; everyone else is unaffected.

Every refusal is asserted by its message (the policy names what it refused), so a 403 from RBAC or a 422
from the API server's own validation cannot pass for the policy's. The policy is loaded asynchronously,
so the module first waits until a dry-run probe write is denied.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from gpuguard import __version__
from harness.kube import (
    DEPLOY,
    GPUS_OK,
    NAMESPACE,
    SERVICE_ACCOUNT,
    TAINT_KEY,
    Admin,
    Agent,
    api_message,
    enforced_admin,
    eventually,
    policy_denial,
    refused_by,
    token_client,
    token_kubeconfig,
    unique_node,
)

pytestmark = pytest.mark.timeout(180)

POLICY = "gpuguard-own-node-only"
POLICY_FILE = DEPLOY / "admission-policy.yaml"
AGENT_USER = f"system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}"
DENIED_BY_POLICY = policy_denial(POLICY)
MERGE = {"_content_type": "application/merge-patch+json"}
FOREIGN = {"key": "example.com/maintenance", "value": "planned", "effect": "NoSchedule"}
CORDONED = {"gpuguard.io/cordoned": "true"}
OTHER_CONDITIONS = "conditions other than GPUHealthy and GPUDegraded"
_names = itertools.count()

ApiException = kubernetes.client.exceptions.ApiException


# -- fixtures and helpers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def admin(admin_api: kubernetes.client.ApiClient, control_plane: Any) -> Admin:
    a = enforced_admin(admin_api, policy=POLICY, probe=other_node_probe(control_plane))
    _assert_live_policy_is_the_file(admin_api)
    return a


def other_node_probe(control_plane: Any) -> Callable[[Admin], Callable[[], Any]]:
    """The write the policy refuses once enforced: an agent's dry-run patch of another node."""

    def probe(a: Admin) -> Callable[[], Any]:
        here, there = new_node(a), new_node(a)
        core = agent_core(a, control_plane, here)
        annotation = {"metadata": {"annotations": {"gpuguard.io/probe": "1"}}}
        return lambda: core.patch_node(there, annotation, dry_run="All", **MERGE)

    return probe


def _assert_live_policy_is_the_file(api: kubernetes.client.ApiClient) -> None:
    """On a reused cluster (GPUGUARD_KUBECONFIG_REUSE=1) create() leaves an older policy in place: fail
    loudly instead of testing it."""
    wanted = next(
        d for d in yaml.safe_load_all(POLICY_FILE.read_text()) if d and d["kind"].endswith("Policy")
    )
    admission: Any = kubernetes.client.AdmissionregistrationV1Api(api)
    resp = admission.read_validating_admission_policy(POLICY, _preload_content=False)
    live = json.loads(resp.data)["spec"]
    for key in ("matchConditions", "variables", "validations", "failurePolicy"):
        assert live[key] == wanted["spec"][key], f"the live policy's {key} is stale: delete it and rerun"


def new_node(admin: Admin, **kw: Any) -> str:
    return unique_node(admin, "adm", **kw)


def agent_core(admin: Admin, control_plane: Any, node: str) -> Any:
    """CoreV1Api as gpuguard's ServiceAccount, with a token bound to a Pod of the DaemonSet on `node`, and
    gpuguard's User-Agent: the API server names the agent's managedFields entries after it ("gpuguard")."""
    client = token_client(control_plane.url, control_plane.ca_path, admin.agent_token(node))
    client.user_agent = f"gpuguard/{__version__}"
    return kubernetes.client.CoreV1Api(client)


def refused(call: Callable[[], Any]) -> str:
    """Run a write that the policy must refuse; return the policy's own message."""
    return refused_by(POLICY, call)


def named(message: str, prefix: str) -> set[str]:
    """The names a refusal lists after `prefix` (a set: the policy walks maps in no fixed order)."""
    assert message.startswith(prefix), message
    return set(message[len(prefix) :].split(", "))


def taints(admin: Admin, node: str) -> list[dict[str, Any]]:
    return list(admin.node(node)["spec"].get("taints") or [])


def ours(effect: str = "NoSchedule", value: str = "ecc") -> dict[str, str]:
    return {"key": TAINT_KEY, "value": value, "effect": effect}


@pytest.fixture
def extra_agent_rights(admin: Admin) -> Iterator[None]:
    """Grant gpuguard's ServiceAccount nodes create, update and delete, and nodes/status patch (which its
    ClusterRole may or may not grant), for one test: the policy alone must still refuse what it must.
    Removed afterwards, and waited for, so that test_agent_cluster's RBAC checks see the real ClusterRole."""
    rbac: Any = kubernetes.client.RbacAuthorizationV1Api(admin.api)
    name = "gpuguard-admission-test-extra"
    rbac.create_cluster_role(
        {
            "metadata": {"name": name},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["nodes", "nodes/status"],
                    "verbs": ["create", "update", "patch", "delete"],
                }
            ],
        }
    )
    rbac.create_cluster_role_binding(
        {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}],
        }
    )
    try:
        eventually(lambda: _allowed(admin, AGENT_USER, "delete", "nodes"), 10, what="RBAC grant")
        yield
    finally:
        rbac.delete_cluster_role_binding(name)
        rbac.delete_cluster_role(name)
        eventually(lambda: not _allowed(admin, AGENT_USER, "delete", "nodes"), 10, what="RBAC revoke")


def _allowed(admin: Admin, user: str, verb: str, resource: str, subresource: str = "") -> bool:
    """What the RBAC authorizer answers now (it reads bindings through an informer, like the policy)."""
    authz: Any = kubernetes.client.AuthorizationV1Api(admin.api)
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": user,
            "groups": [
                "system:serviceaccounts",
                f"system:serviceaccounts:{NAMESPACE}",
                "system:authenticated",
            ],
            "resourceAttributes": {
                "verb": verb,
                "resource": resource,
                "subresource": subresource,
                "group": "",
            },
        },
    }
    resp = authz.create_subject_access_review(review, _preload_content=False)
    return bool(json.loads(resp.data)["status"].get("allowed"))


# -- what the agent may do on its own node -------------------------------------------------------------------


def test_the_agent_can_taint_cordon_annotate_and_label_its_own_node_and_undo_it(
    admin: Admin, control_plane: Any
) -> None:
    node = new_node(admin, taints=[FOREIGN])
    core = agent_core(admin, control_plane, node)
    core.patch_node(node, {"spec": {"taints": [*taints(admin, node), ours()]}}, **MERGE)
    core.patch_node(node, {"spec": {"unschedulable": True}, "metadata": {"annotations": CORDONED}}, **MERGE)
    core.patch_node(node, {"metadata": {"annotations": {"gpuguard.io/reason": "ecc: 3 errors"}}}, **MERGE)
    core.patch_node(node, {"metadata": {"labels": {"gpuguard.io/quarantined": "true"}}}, **MERGE)
    n = admin.node(node)
    assert ours() in n["spec"]["taints"] and FOREIGN in n["spec"]["taints"]
    assert n["spec"]["unschedulable"] is True
    assert n["metadata"]["annotations"]["gpuguard.io/reason"] == "ecc: 3 errors"
    assert n["metadata"]["labels"]["gpuguard.io/quarantined"] == "true"
    # Changing its own taint's value and effect, then recovering: all of it back, foreign taint kept.
    kept = [t for t in taints(admin, node) if t["key"] != TAINT_KEY]
    core.patch_node(node, {"spec": {"taints": [*kept, ours("NoExecute", "xid-79")]}}, **MERGE)
    core.patch_node(
        node,
        {
            "spec": {"taints": kept, "unschedulable": False},
            "metadata": {
                "annotations": {"gpuguard.io/reason": None, "gpuguard.io/cordoned": None},
                "labels": {"gpuguard.io/quarantined": None},
            },
        },
        **MERGE,
    )
    n = admin.node(node)
    assert FOREIGN in n["spec"]["taints"] and not [t for t in n["spec"]["taints"] if t["key"] == TAINT_KEY]
    assert not n["spec"].get("unschedulable")
    assert not [k for k in n["metadata"].get("annotations", {}) if k.startswith("gpuguard.io/")]


def test_the_agent_can_remove_the_unverified_startup_taint_from_its_own_node(
    admin: Admin, control_plane: Any
) -> None:
    gate = {"key": "gpuguard.io/unverified", "effect": "NoSchedule"}
    node = new_node(admin, taints=[FOREIGN, gate])
    core = agent_core(admin, control_plane, node)
    core.patch_node(node, {"spec": {"taints": [t for t in taints(admin, node) if t != gate]}}, **MERGE)
    assert gate not in taints(admin, node) and FOREIGN in taints(admin, node)


CA_GATE = {"key": "startup-taint.cluster-autoscaler.kubernetes.io/gpuguard", "effect": "NoSchedule"}


def test_the_agent_can_remove_a_cluster_autoscaler_startup_taint_from_its_own_node(
    admin: Admin, control_plane: Any
) -> None:
    """--gate-taint-key startup-taint.cluster-autoscaler.kubernetes.io/...: the gate outside gpuguard.io/."""
    node = new_node(admin, taints=[FOREIGN, CA_GATE])
    core = agent_core(admin, control_plane, node)
    # Writes that keep it as it is pass (the condition, gpuguard's own taint beside it)...
    core.patch_node(node, {"spec": {"taints": [*taints(admin, node), ours()]}}, **MERGE)
    assert CA_GATE in taints(admin, node)
    # ...and so does its removal.
    core.patch_node(node, {"spec": {"taints": [t for t in taints(admin, node) if t != CA_GATE]}}, **MERGE)
    assert CA_GATE not in taints(admin, node) and FOREIGN in taints(admin, node)


@pytest.mark.parametrize("change", ["add", "change effect"])
def test_the_agent_cannot_add_or_change_a_cluster_autoscaler_startup_taint(
    admin: Admin, control_plane: Any, change: str
) -> None:
    node = new_node(admin, taints=[FOREIGN] + ([CA_GATE] if change != "add" else []))
    core = agent_core(admin, control_plane, node)
    current = taints(admin, node)
    others = [t for t in current if t["key"] != CA_GATE["key"]]
    new = [*others, {**CA_GATE, "effect": "NoExecute"}] if change != "add" else [*current, CA_GATE]
    message = refused(lambda: core.patch_node(node, {"spec": {"taints": new}}, **MERGE))
    assert message.endswith(f"refused change to taint {CA_GATE['key']}")
    assert taints(admin, node) == current


def test_the_agent_can_set_its_gpu_healthy_condition_through_node_status(
    admin: Admin, control_plane: Any, extra_agent_rights: None
) -> None:
    node = new_node(admin)
    core = agent_core(admin, control_plane, node)
    condition = {"type": "GPUHealthy", "status": "False", "reason": "ECC", "message": "ecc: 3 errors"}
    core.patch_node_status(node, {"status": {"conditions": [condition]}})  # strategic merge on "type"
    core.patch_node_status(
        node, {"status": {"conditions": [{**condition, "status": "True", "reason": "OK"}]}}
    )
    conditions = {c["type"]: c for c in admin.node(node)["status"]["conditions"]}
    assert conditions["GPUHealthy"]["status"] == "True"


def test_the_agent_can_set_its_degraded_marks_and_the_gpu_degraded_condition(
    admin: Admin, control_plane: Any, extra_agent_rights: None
) -> None:
    """Issue 29's second level: the PreferNoSchedule taint, label, annotation and GPUDegraded condition."""
    node = new_node(admin, taints=[FOREIGN])
    core = agent_core(admin, control_plane, node)
    soft = {"key": "gpuguard.io/gpu-degraded", "value": "nvlink-down", "effect": "PreferNoSchedule"}
    marks = {
        "metadata": {
            "labels": {"gpuguard.io/degraded": "true"},
            "annotations": {"gpuguard.io/degraded-signals": '["nvlink-down/GPU-0"]'},
        },
        "spec": {"taints": [*taints(admin, node), soft]},
    }
    core.patch_node(node, marks, **MERGE)
    condition = {"type": "GPUDegraded", "status": "True", "reason": "GPUDegraded", "message": "nvlink-down"}
    core.patch_node_status(node, {"status": {"conditions": [condition]}})
    core.patch_node_status(node, {"status": {"conditions": [{**condition, "status": "False"}]}})
    n = admin.node(node)
    assert soft in n["spec"]["taints"] and n["metadata"]["labels"]["gpuguard.io/degraded"] == "true"
    assert {c["type"]: c["status"] for c in n["status"]["conditions"]}["GPUDegraded"] == "False"
    kept = [t for t in taints(admin, node) if t["key"] != soft["key"]]
    core.patch_node(node, {"spec": {"taints": kept}}, **MERGE)  # and removes them again
    assert taints(admin, node) == kept


@pytest.mark.parametrize("effect", ["NoSchedule", "NoExecute"])
def test_the_agent_cannot_make_its_degraded_taint_more_than_a_preference(
    admin: Admin, control_plane: Any, effect: str
) -> None:
    node = new_node(admin)
    core = agent_core(admin, control_plane, node)
    hard = {"key": "gpuguard.io/gpu-degraded", "value": "nvlink-down", "effect": effect}
    new = [*taints(admin, node), hard]
    message = refused(lambda: core.patch_node(node, {"spec": {"taints": new}}, **MERGE))
    assert message == (
        "gpuguard may set its gpuguard.io/gpu-degraded taint only with effect PreferNoSchedule; refused "
        f"taint of node {node}"
    )
    assert hard not in taints(admin, node)


@pytest.mark.parametrize("effect", ["NoSchedule", "NoExecute"])
def test_an_administrators_own_hard_degraded_taint_does_not_block_the_agents_other_writes(
    admin: Admin, control_plane: Any, effect: str
) -> None:
    """An administrator marked the node by hand with gpuguard.io/gpu-degraded:NoSchedule: gpuguard leaves it
    as it is (node/degraded.py), and its fault quarantine must still reach the node beside it."""
    theirs = {"key": "gpuguard.io/gpu-degraded", "value": "by-hand", "effect": effect}
    node = new_node(admin, taints=[FOREIGN, theirs])
    core = agent_core(admin, control_plane, node)
    core.patch_node(node, {"spec": {"taints": [*taints(admin, node), ours()]}}, **MERGE)
    core.patch_node(node, {"metadata": {"labels": {"gpuguard.io/quarantined": "true"}}}, **MERGE)
    assert ours() in taints(admin, node) and theirs in taints(admin, node)
    changed = [t for t in taints(admin, node) if t != theirs] + [{**theirs, "value": "other"}]
    assert refused(lambda: core.patch_node(node, {"spec": {"taints": changed}}, **MERGE)).startswith(
        "gpuguard may set its gpuguard.io/gpu-degraded taint only with effect PreferNoSchedule"
    )


# -- what it may not do --------------------------------------------------------------------------------------


def test_the_agent_cannot_taint_cordon_or_annotate_another_node(admin: Admin, control_plane: Any) -> None:
    here, there = new_node(admin), new_node(admin)
    core = agent_core(admin, control_plane, here)
    expected = f"gpuguard may change only its own node {here}; refused: node {there}"
    assert refused(lambda: core.patch_node(there, {"spec": {"taints": [ours()]}}, **MERGE)) == expected
    assert refused(lambda: core.patch_node(there, {"spec": {"unschedulable": True}}, **MERGE)) == expected
    annotate = {"metadata": {"annotations": {"gpuguard.io/reason": "x"}}}
    assert refused(lambda: core.patch_node(there, annotate, **MERGE)) == expected
    n = admin.node(there)
    assert not n["spec"].get("unschedulable") and ours() not in (n["spec"].get("taints") or [])
    assert "gpuguard.io/reason" not in n["metadata"].get("annotations", {})


@pytest.mark.parametrize(
    "change",
    ["remove", "change value", "change effect", "add another"],
)
def test_the_agent_cannot_remove_change_or_add_a_foreign_taint_on_its_own_node(
    admin: Admin, control_plane: Any, change: str
) -> None:
    node = new_node(admin, taints=[FOREIGN])
    core = agent_core(admin, control_plane, node)
    current = taints(admin, node)
    others = [t for t in current if t["key"] != FOREIGN["key"]]
    new, key = {
        "remove": (others, FOREIGN["key"]),
        "change value": ([*others, {**FOREIGN, "value": "never"}], FOREIGN["key"]),
        "change effect": ([*others, {**FOREIGN, "effect": "NoExecute"}], FOREIGN["key"]),
        "add another": (
            [*current, {"key": "evil.example/drain", "effect": "NoExecute"}],
            "evil.example/drain",
        ),
    }[change]
    # The agent's own taint in the same write does not make the foreign change acceptable.
    message = refused(lambda: core.patch_node(node, {"spec": {"taints": [*new, ours()]}}, **MERGE))
    assert (
        message
        == "gpuguard may change only taints with the gpuguard.io/ prefix (and remove a Cluster Autoscaler"
        f" start-up taint); refused change to taint {key}"
    )
    assert taints(admin, node) == current


@pytest.mark.parametrize("field", ["labels", "annotations"])
@pytest.mark.parametrize("change", ["change", "remove", "add"])
def test_the_agent_cannot_change_a_label_or_annotation_that_is_not_gpuguards(
    admin: Admin, control_plane: Any, field: str, change: str
) -> None:
    node = new_node(admin)
    admin.patch_node(node, {"metadata": {field: {"team": "ml"}}})
    core = agent_core(admin, control_plane, node)
    key, value = {"change": ("team", "evil"), "remove": ("team", None), "add": ("example.com/x", "y")}[change]
    body = {"metadata": {field: {key: value, "gpuguard.io/quarantined": "true"}}}
    message = refused(lambda: core.patch_node(node, body, **MERGE))
    kind = field[:-1]
    assert (
        message
        == f"gpuguard may change only {field} with the gpuguard.io/ prefix; refused change to {kind} {key}"
    )
    meta = admin.node(node)["metadata"]
    assert meta[field]["team"] == "ml" and "gpuguard.io/quarantined" not in meta[field]


@pytest.mark.parametrize(
    ("spec", "refused_fields"),
    [
        # The API server fills in podCIDRs from podCIDR before admission: both are named.
        ({"podCIDR": "10.9.0.0/24"}, {"spec.podCIDR", "spec.podCIDRs"}),
        ({"providerID": "aws:///us-east-1a/i-0abc"}, {"spec.providerID"}),
    ],
    ids=["podCIDR", "providerID"],
)
def test_the_agent_cannot_change_other_spec_fields(
    admin: Admin, control_plane: Any, spec: dict[str, str], refused_fields: set[str]
) -> None:
    # Unset on the node: the API server itself would refuse to change a set podCIDR or providerID (422).
    node = new_node(admin)
    core = agent_core(admin, control_plane, node)
    message = refused(lambda: core.patch_node(node, {"spec": spec}, **MERGE))
    prefix = "gpuguard may change only spec.taints and spec.unschedulable; refused change to "
    assert named(message, prefix) == refused_fields
    # ...and the same write by an admin succeeds: the refusal was the policy's, not the API server's.
    admin.patch_node(node, {"spec": spec})


def test_the_agent_cannot_add_a_finalizer_to_its_own_node(admin: Admin, control_plane: Any) -> None:
    node = new_node(admin)
    core = agent_core(admin, control_plane, node)
    message = refused(
        lambda: core.patch_node(node, {"metadata": {"finalizers": ["example.com/hold"]}}, **MERGE)
    )
    assert message.endswith("refused change to metadata.finalizers")


def test_the_agent_cannot_change_other_status_or_another_nodes_condition(
    admin: Admin, control_plane: Any, extra_agent_rights: None
) -> None:
    here, there = new_node(admin), new_node(admin)
    admin.core.patch_node_status(here, {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    core = agent_core(admin, control_plane, here)
    gpu = {"status": {"conditions": [{"type": "GPUHealthy", "status": "False"}]}}
    prefix = (
        "gpuguard may change only the GPUHealthy and GPUDegraded conditions in status; refused change to "
        "status "
    )
    ready = {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    assert refused(lambda: core.patch_node_status(here, ready)) == prefix + OTHER_CONDITIONS
    boot = {"status": {"nodeInfo": {"bootID": "forged"}}}
    assert refused(lambda: core.patch_node_status(here, boot)) == prefix + "nodeInfo"
    gpus = {"status": {"capacity": {"nvidia.com/gpu": "8"}}}  # allocatable defaults to capacity
    assert named(refused(lambda: core.patch_node_status(here, gpus)), prefix) == {"capacity", "allocatable"}
    assert refused(lambda: core.patch_node_status(there, gpu)).startswith(
        "gpuguard may change only its own node"
    )


def test_the_agent_cannot_create_or_delete_nodes_even_if_rbac_allowed_it(
    admin: Admin, control_plane: Any, extra_agent_rights: None
) -> None:
    node = new_node(admin)
    core = agent_core(admin, control_plane, node)
    assert (
        refused(lambda: core.delete_node(node))
        == f"gpuguard may only update nodes; refused: DELETE of node {node}"
    )
    assert refused(lambda: core.create_node({"metadata": {"name": f"{node}-x"}})).startswith(
        "gpuguard may only update nodes; refused: CREATE"
    )
    assert admin.node(node)["metadata"]["name"] == node


def test_a_token_bound_to_no_node_can_change_no_node(admin: Admin, control_plane: Any) -> None:
    """A TokenRequest without a Pod (or a legacy Secret token) carries no node name: not even "its own"."""
    node = new_node(admin)
    resp = admin.core.create_namespaced_service_account_token(
        SERVICE_ACCOUNT, NAMESPACE, {"spec": {"expirationSeconds": 600}}, _preload_content=False
    )
    token = json.loads(resp.data)["status"]["token"]
    core: Any = kubernetes.client.CoreV1Api(token_client(control_plane.url, control_plane.ca_path, token))
    message = refused(lambda: core.patch_node(node, {"spec": {"taints": [ours()]}}, **MERGE))
    assert message.startswith(
        "gpuguard may change only the node its token is bound to, and this token names none"
    )
    assert core.read_node(node).metadata.name == node  # reads are not the policy's business


def test_refusals_are_recorded_in_the_audit_log(admin: Admin, control_plane: Any) -> None:
    here, there = new_node(admin), new_node(admin)
    core = agent_core(admin, control_plane, here)
    since = control_plane.audit_line_count()
    refused(lambda: core.patch_node(there, {"spec": {"unschedulable": True}}, **MERGE))
    events = [
        e
        for e in control_plane.audit_events(since_line=since, stage="ResponseComplete")
        if e.get("objectRef", {}).get("name") == there and e["user"]["username"] == AGENT_USER
    ]
    assert len(events) == 1 and events[0]["responseStatus"]["code"] == 403
    failures = json.loads(events[0]["annotations"]["validation.policy.admission.k8s.io/validation_failure"])
    assert failures[0]["policy"] == POLICY and f"refused: node {there}" in failures[0]["message"]


# -- what got through before: managed fields, conditions, the cordon (issue 13) ------------------------------

MANAGED = (
    "gpuguard may not change other managers' managedFields entries (they may only lose gpuguard's fields)"
)
MANAGED_PREFIX = f"{MANAGED}; refused change to the managedFields of "


def managed_fields(admin: Admin, node: str) -> list[dict[str, Any]]:
    return list(admin.node(node)["metadata"].get("managedFields") or [])


def apply_as(admin: Admin, manager: str, node: str, fields: dict[str, Any]) -> None:
    """Server-side apply by another manager (kubectl apply --server-side, a GitOps controller)."""
    body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}, **fields}
    admin.core.patch_node(
        node, body, field_manager=manager, force=True, _content_type="application/apply-patch+yaml"
    )


def entry_of(entries: list[dict[str, Any]], manager: str, subresource: str = "") -> dict[str, Any] | None:
    return next(
        (e for e in entries if e["manager"] == manager and e.get("subresource", "") == subresource), None
    )


def test_the_agent_cannot_replace_managed_fields_with_a_forged_entry_for_another_manager(
    admin: Admin, control_plane: Any
) -> None:
    """The attack as reported: a merge patch that sets managedFields to one entry for "ops" claiming the
    node's hostname and GPU labels and its taints; ops' next server-side apply would delete them."""
    node = new_node(admin, taints=[FOREIGN])
    apply_as(admin, "ops", node, {"metadata": {"labels": {"team": "ml"}}})
    before = managed_fields(admin, node)
    core = agent_core(admin, control_plane, node)
    forged = {
        "manager": "ops",
        "operation": "Apply",
        "apiVersion": "v1",
        "fieldsType": "FieldsV1",
        "fieldsV1": {
            "f:metadata": {"f:labels": {"f:kubernetes.io/hostname": {}, "f:nvidia.com/gpu.present": {}}},
            "f:spec": {"f:taints": {}},
        },
    }
    message = refused(lambda: core.patch_node(node, {"metadata": {"managedFields": [forged]}}, **MERGE))
    assert named(message, MANAGED_PREFIX) == {
        "OpenAPI-Generator (Update)",
        "OpenAPI-Generator (Update status)",
        "ops (Apply)",
        "new entry ops (Apply)",
    }
    assert managed_fields(admin, node) == before


def test_the_agent_cannot_add_fields_to_another_managers_managed_fields_entry(
    admin: Admin, control_plane: Any
) -> None:
    node = new_node(admin, taints=[FOREIGN])
    apply_as(admin, "ops", node, {"metadata": {"labels": {"team": "ml"}}})
    before = managed_fields(admin, node)
    forged = json.loads(json.dumps(before))
    ops = entry_of(forged, "ops")
    assert ops is not None
    ops["fieldsV1"]["f:metadata"]["f:labels"]["f:nvidia.com/gpu.present"] = {}
    ops["fieldsV1"]["f:spec"] = {"f:taints": {}}
    core = agent_core(admin, control_plane, node)
    message = refused(lambda: core.patch_node(node, {"metadata": {"managedFields": forged}}, **MERGE))
    assert message == MANAGED_PREFIX + "ops (Apply)"
    assert managed_fields(admin, node) == before


def test_the_agent_cannot_wipe_managed_fields(admin: Admin, control_plane: Any) -> None:
    """managedFields: [{}] dropped every entry, so server-side apply saw no conflict any more."""
    node = new_node(admin)
    apply_as(admin, "ops", node, {"metadata": {"labels": {"team": "ml"}}})
    before = managed_fields(admin, node)
    core = agent_core(admin, control_plane, node)
    message = refused(lambda: core.patch_node(node, {"metadata": {"managedFields": [{}]}}, **MERGE))
    assert {"OpenAPI-Generator (Update)", "OpenAPI-Generator (Update status)", "ops (Apply)"} <= named(
        message, MANAGED_PREFIX
    )
    assert managed_fields(admin, node) == before


def test_the_agent_cannot_rewrite_managed_fields_through_node_status(
    admin: Admin, control_plane: Any, extra_agent_rights: None
) -> None:
    node = new_node(admin)
    apply_as(admin, "ops", node, {"metadata": {"labels": {"team": "ml"}}})
    before = managed_fields(admin, node)
    core = agent_core(admin, control_plane, node)
    body = {
        "metadata": {"managedFields": [{}]},
        "status": {"conditions": [{"type": "GPUHealthy", "status": "True"}]},
    }
    try:
        core.patch_node_status(node, body, **MERGE)
    except ApiException as exc:
        assert exc.status == 403 and MANAGED in api_message(exc), api_message(exc)
    # Either refused, or the API server kept metadata as it was (a status write changes no metadata).
    after = managed_fields(admin, node)
    assert [e for e in after if e["manager"] != "gpuguard"] == before


def test_the_agent_cannot_claim_foreign_fields_in_its_own_managed_fields_entry(
    admin: Admin, control_plane: Any
) -> None:
    node = new_node(admin)
    before = managed_fields(admin, node)
    claim = {
        "manager": "gpuguard",
        "operation": "Update",
        "apiVersion": "v1",
        "fieldsType": "FieldsV1",
        "fieldsV1": {"f:metadata": {"f:labels": {"f:nvidia.com/gpu.present": {}}}},
    }
    core = agent_core(admin, control_plane, node)
    message = refused(
        lambda: core.patch_node(node, {"metadata": {"managedFields": [*before, claim]}}, **MERGE)
    )
    assert message == (
        "gpuguard's managedFields may claim only gpuguard's fields; refused managedFields of "
        "gpuguard (Update)"
    )
    assert managed_fields(admin, node) == before


def test_the_agents_write_passes_when_it_takes_a_field_from_another_manager(
    admin: Admin, control_plane: Any, extra_agent_rights: None
) -> None:
    """spec.taints is one atomic field: when gpuguard's merge patch changes it, the API server moves it from
    the manager that set it (here ops, by server-side apply) to gpuguard. Allowed: ops only loses it."""
    node = new_node(admin)
    apply_as(admin, "ops", node, {"metadata": {"labels": {"team": "ml"}}, "spec": {"taints": [FOREIGN]}})
    ops_spec = (entry_of(managed_fields(admin, node), "ops") or {})["fieldsV1"].get("f:spec", {})
    assert "f:taints" in ops_spec
    core = agent_core(admin, control_plane, node)
    core.patch_node(
        node,
        {
            "spec": {"taints": [FOREIGN, ours()], "unschedulable": True},
            "metadata": {"annotations": {**CORDONED, "gpuguard.io/reason": "ecc"}},
        },
        **MERGE,
    )
    core.patch_node_status(node, {"status": {"conditions": [{"type": "GPUHealthy", "status": "False"}]}})
    entries = managed_fields(admin, node)
    ops = entry_of(entries, "ops")
    assert ops is not None and "f:spec" not in ops["fieldsV1"], ops
    assert ops["fieldsV1"]["f:metadata"]["f:labels"]["f:team"] == {}
    gpuguard = entry_of(entries, "gpuguard")
    assert gpuguard is not None and set(gpuguard["fieldsV1"]["f:spec"]) == {"f:taints", "f:unschedulable"}
    core.patch_node(
        node,
        {
            "spec": {"taints": [FOREIGN], "unschedulable": False},
            "metadata": {"annotations": {"gpuguard.io/cordoned": None, "gpuguard.io/reason": None}},
        },
        **MERGE,
    )
    assert taints(admin, node) == [FOREIGN]


def test_the_agents_write_passes_when_the_api_server_caps_update_managers(
    admin: Admin, control_plane: Any
) -> None:
    """The API server keeps at most 10 Update entries: past that it merges the oldest into one named
    "ancient-changes". gpuguard's first write on such a node adds an entry and so triggers the merge."""
    node = new_node(admin)
    for i in range(10):
        admin.core.patch_node(
            node,
            {"metadata": {"labels": {f"example.com/l{i}": "v"}}},
            field_manager=f"tool-{i}",
            _content_type="application/merge-patch+json",
        )
        time.sleep(1.05)  # entries are ordered by their time, which has a resolution of one second
    core = agent_core(admin, control_plane, node)
    core.patch_node(node, {"spec": {"taints": [*taints(admin, node), ours()]}}, **MERGE)
    managers = {e["manager"] for e in managed_fields(admin, node)}
    print(sorted(managers))
    assert "gpuguard" in managers


def test_the_agent_cannot_duplicate_a_condition(
    admin: Admin, control_plane: Any, extra_agent_rights: None
) -> None:
    """A merge patch replaces the list: the current conditions plus a second, identical Ready=True."""
    node = new_node(admin)
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is ready"}
    admin.core.patch_node_status(node, {"status": {"conditions": [ready]}})
    current = admin.node(node)["status"]["conditions"]
    core = agent_core(admin, control_plane, node)
    body = {"status": {"conditions": [*current, current[0]]}}
    message = refused(lambda: core.patch_node_status(node, body, **MERGE))
    assert (
        message
        == "gpuguard may not leave a condition type twice in status; refused duplicate condition Ready"
    )
    assert admin.node(node)["status"]["conditions"] == current


def test_the_agent_cannot_reorder_conditions(
    admin: Admin, control_plane: Any, extra_agent_rights: None
) -> None:
    """Readers take the first condition of a type: order is meaning, not noise."""
    node = new_node(admin)
    fresh = {"type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": "runtime down"}
    memory = {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory"}
    admin.core.patch_node_status(node, {"status": {"conditions": [fresh, memory]}}, **MERGE)
    current = admin.node(node)["status"]["conditions"]
    core = agent_core(admin, control_plane, node)
    swapped = {"status": {"conditions": [current[1], current[0]]}}
    assert refused(lambda: core.patch_node_status(node, swapped, **MERGE)) == (
        "gpuguard may change only the GPUHealthy and GPUDegraded conditions in status; refused change to "
        "status " + OTHER_CONDITIONS
    )
    # A duplicated type that a writer other than gpuguard left (the API server does not refuse one): the
    # stale Ready=True may not be moved ahead of the kubelet's Ready=False.
    stale = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "saved copy"}
    admin.core.patch_node_status(node, {"status": {"conditions": [*current, stale]}}, **MERGE)
    current = admin.node(node)["status"]["conditions"]
    stale_first = {"status": {"conditions": [current[2], current[1], current[0]]}}
    assert refused(lambda: core.patch_node_status(node, stale_first, **MERGE)) == (
        "gpuguard may not leave a condition type twice in status; refused duplicate condition Ready"
    )
    assert admin.node(node)["status"]["conditions"] == current


def test_the_agent_cannot_lift_a_cordon_it_did_not_place(admin: Admin, control_plane: Any) -> None:
    node = new_node(admin, unschedulable=True)  # an administrator's cordon
    core = agent_core(admin, control_plane, node)
    assert refused(lambda: core.patch_node(node, {"spec": {"unschedulable": False}}, **MERGE)) == (
        "gpuguard may lift only a cordon it placed (gpuguard.io/cordoned=true); refused uncordon of node "
        + node
    )
    # Nor claim the cordon first and lift it in a second write.
    claim = {"metadata": {"annotations": CORDONED}}
    assert refused(lambda: core.patch_node(node, claim, **MERGE)) == (
        "gpuguard may set gpuguard.io/cordoned only in the write that cordons the node; refused claim to"
        f" the cordon of node {node}"
    )
    n = admin.node(node)
    assert n["spec"]["unschedulable"] is True and "gpuguard.io/cordoned" not in n["metadata"].get(
        "annotations", {}
    )


def test_the_agent_cannot_label_its_node_quarantined_without_its_taint(
    admin: Admin, control_plane: Any
) -> None:
    """Other agents count the label against the quarantine budget and cannot see taints in the metadata they
    list: a label without the taint would spend budget while the node stays schedulable."""
    node = new_node(admin)
    core = agent_core(admin, control_plane, node)
    for value in ("true", "deferred"):
        label = {"metadata": {"labels": {"gpuguard.io/quarantined": value}}}
        assert refused(lambda: core.patch_node(node, label, **MERGE)) == (  # noqa: B023 - called at once
            "gpuguard may label a node gpuguard.io/quarantined only together with its "
            f"gpuguard.io/gpu-unhealthy taint; refused label of node {node}"
        )
    # Together with the taint, as the agent writes it: allowed; and an administrator's removal of the taint
    # leaves a label the agent's later writes may keep (until it clears it).
    core.patch_node(
        node,
        {
            "metadata": {"labels": {"gpuguard.io/quarantined": "true"}},
            "spec": {"taints": [*taints(admin, node), ours()]},
        },
        **MERGE,
    )
    admin.patch_node(node, {"spec": {"taints": [t for t in taints(admin, node) if t["key"] != TAINT_KEY]}})
    core.patch_node(node, {"metadata": {"annotations": {"gpuguard.io/reason": "still"}}}, **MERGE)
    core.patch_node(node, {"metadata": {"labels": {"gpuguard.io/quarantined": None}}}, **MERGE)


def test_the_agent_cannot_release_its_own_repeat_offender_only_remove_a_release(
    admin: Admin, control_plane: Any
) -> None:
    """`gpuguard release` (a human, or a controller with its own RBAC) writes gpuguard.io/release; the agent
    reads it and removes it. The agent's own token may neither add nor change it, through nodes or
    nodes/status: a compromised agent cannot release its own GPUs held for repair."""
    node = new_node(admin)
    # Annotations as a kubelet's registration leaves them (a real node always has some): the release's
    # writer then owns only its own annotation, which the agent's removal takes from it.
    admin.patch_node(node, {"metadata": {"annotations": {"node.alpha.kubernetes.io/ttl": "0"}}})
    core = agent_core(admin, control_plane, node)
    release = '{"at":"2026-12-05T08:00:00Z","by":"mallory","gpu":"*"}'
    write = {"metadata": {"annotations": {"gpuguard.io/release": release}}}
    message = (
        "gpuguard may only remove gpuguard.io/release (a human or a controller with its own RBAC releases a"
        f" repeat offender); refused release of node {node}"
    )
    assert refused(lambda: core.patch_node(node, write, **MERGE)) == message
    assert refused(lambda: core.patch_node_status(node, write, **MERGE)) == message
    # The operator's release (here the admin's), which the agent may then remove, but not change.
    admin.patch_node(
        node, {"metadata": {"annotations": {"gpuguard.io/release": release.replace("mallory", "ops")}}}
    )
    assert refused(lambda: core.patch_node(node, write, **MERGE)) == message
    core.patch_node(node, {"metadata": {"annotations": {"gpuguard.io/release": None}}}, **MERGE)
    assert "gpuguard.io/release" not in (admin.node(node)["metadata"].get("annotations") or {})


# -- who is not affected -------------------------------------------------------------------------------------


def test_another_service_account_allowed_to_patch_nodes_is_not_affected(
    admin: Admin, control_plane: Any
) -> None:
    node = new_node(admin, taints=[FOREIGN])
    rbac: Any = kubernetes.client.RbacAuthorizationV1Api(admin.api)
    name = f"node-labeller-{next(_names)}"
    admin.core.create_namespaced_service_account("default", {"metadata": {"name": name}})
    rbac.create_cluster_role(
        {
            "metadata": {"name": name},
            "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}],
        }
    )
    rbac.create_cluster_role_binding(
        {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": "default"}],
        }
    )
    try:
        user = f"system:serviceaccount:default:{name}"
        eventually(lambda: _allowed(admin, user, "patch", "nodes"), 10, what="RBAC grant")
        resp = admin.core.create_namespaced_service_account_token(
            name, "default", {"spec": {"expirationSeconds": 600}}, _preload_content=False
        )
        token = json.loads(resp.data)["status"]["token"]
        core: Any = kubernetes.client.CoreV1Api(token_client(control_plane.url, control_plane.ca_path, token))
        # Everything the policy refuses gpuguard, on a node this token is not bound to.
        core.patch_node(
            node,
            {
                "metadata": {"labels": {"team": "infra"}, "annotations": {"owner": "infra"}},
                "spec": {"taints": [{**FOREIGN, "value": "moved"}], "providerID": "aws:///i-1"},
            },
            **MERGE,
        )
        n = admin.node(node)
        assert (
            n["spec"]["taints"] == [{**FOREIGN, "value": "moved"}] and n["spec"]["providerID"] == "aws:///i-1"
        )
    finally:
        rbac.delete_cluster_role_binding(name)
        rbac.delete_cluster_role(name)
        admin.core.delete_namespaced_service_account(name, "default")


def test_an_admin_is_not_affected(admin: Admin) -> None:
    node = new_node(admin, taints=[FOREIGN])
    admin.patch_node(
        node,
        {
            "metadata": {"labels": {"team": "infra"}, "finalizers": ["example.com/hold"]},
            "spec": {"taints": [ours(), {**FOREIGN, "effect": "NoExecute"}], "podCIDR": "10.8.0.0/24"},
        },
    )
    n = admin.node(node)
    assert n["spec"]["podCIDR"] == "10.8.0.0/24" and {**FOREIGN, "effect": "NoExecute"} in n["spec"]["taints"]
    admin.patch_node(node, {"metadata": {"finalizers": None}})
    admin.core.delete_node(node)


# -- the agent itself, and the policy's cost -----------------------------------------------------------------


def test_the_policy_stays_within_cel_cost_limits_on_a_heavily_decorated_node(
    admin: Admin, control_plane: Any
) -> None:
    """With failurePolicy Fail a CEL cost-limit error would refuse gpuguard's own writes: 1000 foreign
    taints, 200 labels and ~200 KiB of annotations must still let it taint and recover."""
    foreign = [{"key": f"example.com/t{i}", "value": "v", "effect": "NoSchedule"} for i in range(1000)]
    node = new_node(admin, taints=foreign)
    admin.patch_node(
        node,
        {
            "metadata": {
                "labels": {f"example.com/l{i}": "v" * 63 for i in range(200)},
                "annotations": {f"example.com/a{i}": "x" * 1000 for i in range(200)},
            }
        },
    )
    core = agent_core(admin, control_plane, node)
    current = taints(admin, node)
    started = time.monotonic()
    core.patch_node(
        node,
        {
            "spec": {"taints": [*current, ours()], "unschedulable": True},
            "metadata": {"annotations": CORDONED},
        },
        **MERGE,
    )
    core.patch_node(
        node,
        {
            "spec": {"taints": current, "unschedulable": False},
            "metadata": {"annotations": {"gpuguard.io/cordoned": None}},
        },
        **MERGE,
    )
    elapsed = time.monotonic() - started
    # A foreign change is still refused (the message stays generic past 100 taints, to bound its cost).
    message = refused(lambda: core.patch_node(node, {"spec": {"taints": current[1:]}}, **MERGE))
    assert message.endswith("start-up taint); refused change to the node's other taints"), message
    print(f"two allowed writes on a node with 1000 taints: {elapsed:.2f}s")


def test_the_real_agent_taints_and_recovers_its_node_with_the_policy_enforced_and_is_never_refused(
    admin: Admin, control_plane: Any, fakenvml: Path, tmp_path: Path
) -> None:
    node = new_node(admin, taints=[FOREIGN], boot_id="boot-a")
    admin.patch_node(node, {"metadata": {"labels": {"team": "ml"}, "annotations": {"owner": "ops"}}})
    state = tmp_path / "gpus.state"
    state.write_text(GPUS_OK)
    kubeconfig = token_kubeconfig(
        tmp_path / "kubeconfig",
        server=control_plane.url,
        ca_path=control_plane.ca_path,
        token=admin.agent_token(node),
    )
    since = control_plane.audit_line_count()
    agent = Agent(node=node, kubeconfig=kubeconfig, state=state, lib=fakenvml).start()
    try:
        eventually(agent.ready, 15, what="agent /readyz")
        state.write_text(GPUS_OK.replace("GPU-it-1", "GPU-it-1 ecc=2"))
        eventually(lambda: admin.our_taint(node), 10, what="taint")
        assert admin.node(node)["spec"]["unschedulable"] is True
        state.write_text(GPUS_OK)  # ECC counter reset: evidence gone
        eventually(lambda: admin.our_taint(node) is None, 10, what="recovery")
    finally:
        agent.stop()
    assert not agent.events("node.write_rejected")
    writes = [
        e
        for e in control_plane.audit_events(
            f"gpuguard/{__version__}", since_line=since, stage="ResponseComplete"
        )
        if e.get("objectRef", {}).get("resource") == "nodes" and e["verb"] == "patch"
    ]
    # Taint, recovery and the GPUHealthy condition (nodes/status) all pass; a 409 is the agent's own
    # resourceVersion precondition after its condition write, re-read and retried.
    codes = [e["responseStatus"]["code"] for e in writes]
    assert codes.count(200) >= 3 and set(codes) <= {200, 409}, codes
    n = admin.node(node)
    assert FOREIGN in n["spec"]["taints"] and n["metadata"]["labels"]["team"] == "ml"
