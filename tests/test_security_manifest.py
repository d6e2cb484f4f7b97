"""Least privilege, read from the manifests: what tests/test_manifests.py does not already pin.

- Every container in the pod, including any added later, runs hardened; the one documented exception is the
  "state-dir" init container (uid 0 with CHOWN only). A new sidecar that forgets its securityContext fails
  here, not in a review.
- The API token reaches only the container that calls the API, read-only, and lives at most an hour.
- deploy/admission-policy.yaml matches the rest: it guards exactly gpuguard's ServiceAccount, every write
  verb the ClusterRole grants on nodes, and lets through exactly the keys and condition the code writes.
The policy's behaviour on a real API server is tests/integration/test_admission.py.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuguard.kube import client as kubeclient
from gpuguard.quarantine import record
from gpuguard.quarantine.node import accelerated, degraded
from gpuguard.quarantine.node import view as node

ROOT = Path(__file__).resolve().parents[1]
DAEMONSET = ROOT / "deploy" / "daemonset.yaml"
POLICY = ROOT / "deploy" / "admission-policy.yaml"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
ROOT_EXCEPTION = "state-dir"  # documented in deploy/daemonset.yaml: chowns the hostPath state dir, exits
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection", "*"}


@cache
def _docs(path: Path) -> tuple[dict[str, Any], ...]:
    return tuple(d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d)


def _one(path: Path, kind: str) -> dict[str, Any]:
    found = [d for d in _docs(path) if d["kind"] == kind]
    assert len(found) == 1, f"{path.name}: expected one {kind}, found {len(found)}"
    return found[0]


def _pod() -> dict[str, Any]:
    spec: dict[str, Any] = _one(DAEMONSET, "DaemonSet")["spec"]["template"]["spec"]
    return spec


def _containers() -> list[dict[str, Any]]:
    pod = _pod()
    return [*pod.get("initContainers", []), *pod["containers"], *pod.get("ephemeralContainers", [])]


def _effective(container: dict[str, Any]) -> dict[str, Any]:
    """The container's security context as kubelet applies it: pod-level values it does not override."""
    pod = _pod().get("securityContext", {})
    inherited = (
        "runAsUser",
        "runAsGroup",
        "runAsNonRoot",
        "seccompProfile",
        "seLinuxOptions",
        "appArmorProfile",
    )
    return {**{k: pod[k] for k in inherited if k in pod}, **container.get("securityContext", {})}


def _agent() -> dict[str, Any]:
    return next(c for c in _pod()["containers"] if c["name"] == "gpuguard")


def _service_account() -> tuple[str, str]:
    sa = _one(DAEMONSET, "ServiceAccount")["metadata"]
    return sa["namespace"], sa["name"]


# -- the pod -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("container", _containers(), ids=lambda c: c["name"])
def test_every_container_is_hardened_and_only_the_documented_init_container_runs_as_root(
    container: dict[str, Any],
) -> None:
    sc = _effective(container)
    assert sc.get("allowPrivilegeEscalation") is False
    assert sc.get("privileged", False) is False
    assert sc.get("readOnlyRootFilesystem") is True
    assert sc.get("seccompProfile") == {"type": "RuntimeDefault"}
    assert sc.get("capabilities", {}).get("drop") == ["ALL"]
    assert sc.get("procMount", "Default") == "Default"
    if container["name"] == ROOT_EXCEPTION:
        assert container in _pod().get("initContainers", []), "the root exception runs once, before the agent"
        assert sc["capabilities"].get("add") == ["CHOWN"], "CHOWN and nothing else"
        return
    assert sc.get("runAsNonRoot") is True
    assert (
        isinstance(sc.get("runAsUser"), int) and not isinstance(sc["runAsUser"], bool) and sc["runAsUser"] > 0
    )
    assert isinstance(sc.get("runAsGroup"), int) and sc["runAsGroup"] > 0
    assert "add" not in sc.get("capabilities", {}), "no capability at all"


def test_the_pod_sets_no_sysctls_and_no_host_process() -> None:
    sc = _pod().get("securityContext", {})
    assert "sysctls" not in sc
    assert not sc.get("windowsOptions", {}).get("hostProcess", False)
    assert _pod().get("shareProcessNamespace", False) is False


def test_the_service_account_does_not_hand_out_tokens_by_default() -> None:
    assert _one(DAEMONSET, "ServiceAccount")["automountServiceAccountToken"] is False
    assert _pod()["automountServiceAccountToken"] is False


def test_only_the_agent_mounts_the_api_token_read_only_and_short_lived() -> None:
    volumes = {v["name"]: v for v in _pod()["volumes"]}
    token_volumes = {
        name
        for name, v in volumes.items()
        if any("serviceAccountToken" in s for s in v.get("projected", {}).get("sources", []))
    }
    assert len(token_volumes) == 1
    assert not [n for n, v in volumes.items() if "secret" in v], (
        "no Secret volumes: no long-lived credentials"
    )
    for c in _containers():
        mounts = [m for m in c.get("volumeMounts", []) if m["name"] in token_volumes]
        if c["name"] == "gpuguard":
            assert mounts == [{"name": next(iter(token_volumes)), "mountPath": SA_DIR, "readOnly": True}]
        else:
            assert not mounts, f"{c['name']} does not call the API and gets no token"
    (token_volume,) = (volumes[n] for n in token_volumes)
    (token,) = (
        s["serviceAccountToken"] for s in token_volume["projected"]["sources"] if "serviceAccountToken" in s
    )
    assert token["expirationSeconds"] <= 3600


def test_the_agent_writes_only_to_its_state_dir() -> None:
    writable = [m for m in _agent()["volumeMounts"] if not m.get("readOnly", False)]
    assert [m["mountPath"] for m in writable] == [_env(_agent())["GPUGUARD_STATE_DIR"]]
    assert _effective(_agent())["readOnlyRootFilesystem"] is True


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


# -- the admission policy ------------------------------------------------------------------------------------


def _policy() -> dict[str, Any]:
    return _one(POLICY, "ValidatingAdmissionPolicy")


def _binding() -> dict[str, Any]:
    return _one(POLICY, "ValidatingAdmissionPolicyBinding")


def _expressions() -> str:
    spec = _policy()["spec"]
    parts = [c["expression"] for c in spec.get("matchConditions", [])]
    parts += [v["expression"] for v in spec.get("variables", [])]
    parts += [x.get("expression", "") + x.get("messageExpression", "") for x in spec["validations"]]
    return "\n".join(parts)


def test_the_policy_file_holds_one_v1_policy_and_its_binding_and_nothing_else() -> None:
    assert sorted(d["kind"] for d in _docs(POLICY)) == [
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]
    for doc in _docs(POLICY):
        assert doc["apiVersion"] == "admissionregistration.k8s.io/v1", "GA since Kubernetes 1.30"
        assert "namespace" not in doc["metadata"], "cluster-scoped"
    assert _binding()["spec"]["policyName"] == _policy()["metadata"]["name"]


@pytest.mark.parametrize("kind", ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"])
def test_the_policy_matches_the_kubernetes_api_schema(kind: str) -> None:
    from kubernetes import client

    model = getattr(client, f"V1{kind}")
    if not hasattr(model, "model_validate"):
        pytest.skip("this kubernetes client has no strict (pydantic) models")
    model.model_validate(_one(POLICY, kind))


def test_the_policy_fails_closed_and_the_binding_denies_and_audits() -> None:
    assert _policy()["spec"]["failurePolicy"] == "Fail"
    actions = _binding()["spec"]["validationActions"]
    assert "Deny" in actions and "Warn" not in actions
    assert "Audit" in actions, "a stolen token's attempts show up in the audit log"
    assert "paramRef" not in _binding()["spec"] and "matchResources" not in _binding()["spec"]


def test_the_policy_guards_exactly_the_daemon_sets_service_account() -> None:
    namespace, name = _service_account()
    conditions = _policy()["spec"]["matchConditions"]
    assert [c["expression"] for c in conditions] == [
        f"request.userInfo.username == 'system:serviceaccount:{namespace}:{name}'"
    ]
    binding = _one(DAEMONSET, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]


def test_the_policy_covers_every_write_the_cluster_role_grants_on_nodes() -> None:
    rules = _policy()["spec"]["matchConstraints"]["resourceRules"]
    covered = {
        (resource, op)
        for rule in rules
        if "" in rule["apiGroups"]
        for resource in rule["resources"]
        for op in rule["operations"]
    }
    granted = {
        (resource, verb)
        for rule in _one(DAEMONSET, "ClusterRole")["rules"]
        if "" in rule["apiGroups"]
        for resource in rule["resources"]
        if resource.split("/")[0] == "nodes"
        for verb in rule["verbs"]
        if verb in WRITE_VERBS
    }
    assert granted, "the ClusterRole lets gpuguard write nodes"
    # Admission sees a patch as an UPDATE.
    operation = {"patch": "UPDATE", "update": "UPDATE", "create": "CREATE", "delete": "DELETE"}
    for resource, verb in granted:
        assert (resource, operation[verb]) in covered, f"{verb} {resource} is granted but not guarded"
    assert {("nodes", "UPDATE"), ("nodes/status", "UPDATE")} <= covered


CLUSTER_AUTOSCALER_STARTUP_PREFIX = "startup-taint.cluster-autoscaler.kubernetes.io/"


def test_what_the_policy_lets_through_is_exactly_what_the_agent_writes() -> None:
    cel = _expressions()
    prefix = f"{record.DOMAIN}/"
    # The keys themselves, the same keys as managedFields names them ("f:" + key), and the Cluster
    # Autoscaler start-up prefix a gate key may use (remove only).
    # and the message prefix that tells gpuguard's AcceleratedHardwareReady from another writer's.
    expected = {prefix, f"f:{prefix}", CLUSTER_AUTOSCALER_STARTUP_PREFIX, accelerated.MESSAGE_PREFIX}
    assert set(re.findall(r"startsWith\('([^']*)'\)", cel)) == expected
    written = [record.TAINT_KEY, node.UNVERIFIED_TAINT_KEY, node.LABEL_QUARANTINED, *node.OUR_ANNOTATIONS]
    written += [record.DEGRADED_TAINT_KEY, degraded.LABEL_DEGRADED, degraded.ANN_DEGRADED]
    assert all(key.startswith(prefix) for key in written), written
    conditions = {node.CONDITION_TYPE, node.DEGRADED_CONDITION_TYPE}
    assert set(re.findall(r"'(GPU\w+)'", cel)) == conditions
    conditions.add(node.ACCELERATED_CONDITION_TYPE)
    assert set(re.findall(r"'(\w*Ready)'", cel)) == {node.ACCELERATED_CONDITION_TYPE}
    assert set(re.findall(r'k:\{"type":"(\w+)"\}', cel)) == conditions
    # The fields that change on every write are never compared; everything else in metadata is, and
    # managedFields by rules of its own.
    assert "'resourceVersion', 'managedFields', 'generation'" in cel
    assert "object.metadata.?managedFields" in cel and "oldObject.metadata.?managedFields" in cel


def test_the_policy_knows_gpuguards_field_manager_and_its_cordon_annotation() -> None:
    """The API server names a client's managedFields entries after its User-Agent up to the first "/"."""
    cel = _expressions()
    manager = kubeclient.USER_AGENT.split("/", 1)[0]
    assert manager == "gpuguard"
    assert f"e.?manager.orValue('') == '{manager}'" in cel
    assert f"variables.oldAnnotations[?'{node.ANN_CORDONED}'].orValue('') == 'true'" in cel


def test_other_conditions_are_compared_in_order_not_as_a_set() -> None:
    variables = {v["name"]: v["expression"] for v in _policy()["spec"]["variables"]}
    assert variables["conditionsKept"] == "variables.oldConditions == variables.newConditions"


def test_the_policy_names_the_node_from_the_token_not_from_the_request() -> None:
    cel = _expressions()
    assert "request.userInfo.extra['authentication.kubernetes.io/node-name']" in cel
    validation = _policy()["spec"]["validations"][1]
    assert (
        validation["expression"]
        == "variables.tokenNode.size() == 1 && variables.tokenNode[0] == request.name"
    )


def test_every_refusal_has_a_message_naming_what_was_refused() -> None:
    for v in _policy()["spec"]["validations"]:
        assert "refused" in v["messageExpression"], v["expression"]
        assert v["reason"] == "Forbidden"


def test_the_policy_documents_the_kubernetes_versions_it_needs() -> None:
    header = POLICY.read_text(encoding="utf-8").split("\n---", 1)[0]
    for needed in ("1.30", "1.32", "< 1.30", "ServiceAccountTokenPodNodeInfo", "failurePolicy Fail"):
        assert needed in header, needed


# -- the other policies, the install paths -------------------------------------------------------------------

DEVICE_POLICY = ROOT / "deploy" / "admission-policy-devices.yaml"
EVENT_POLICY = ROOT / "deploy" / "admission-policy-events.yaml"
EVICTION_POLICY = ROOT / "deploy" / "admission-policy-evictions.yaml"
EVENT_FLOWS = ROOT / "deploy" / "flowcontrol-events.yaml"


def _cel(path: Path) -> str:
    spec = _one(path, "ValidatingAdmissionPolicy")["spec"]
    parts = [v["expression"] for v in spec["variables"]]
    parts += [x["expression"] + x["messageExpression"] for x in spec["validations"]]
    return "\n".join(parts)


def test_the_readmes_deploy_command_applies_every_policy_and_the_events_priority_level() -> None:
    """The red team found the README applying the node policy only: a token could then taint every GPU."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    # The first install: the manifest (through a sed that starts the agents in dry run) and the policies.
    command = re.search(
        r"```sh\n(sed [^\n]* deploy/daemonset\.yaml \| kubectl apply -f - .*?)```", readme, re.S
    )
    assert command is not None, "the README's deploy command"
    applied = set(re.findall(r"(deploy/\S+\.yaml)", command.group(1)))
    wanted = {f"deploy/{p.name}" for p in (ROOT / "deploy").glob("admission-policy*.yaml")}
    assert wanted == {
        "deploy/admission-policy.yaml",
        f"deploy/{DEVICE_POLICY.name}",
        f"deploy/{EVENT_POLICY.name}",
        f"deploy/{EVICTION_POLICY.name}",
        "deploy/admission-policy-repair.yaml",
    }
    assert applied == wanted | {"deploy/daemonset.yaml", f"deploy/{EVENT_FLOWS.name}"}


@pytest.mark.parametrize("path", [DEVICE_POLICY, EVENT_POLICY, EVICTION_POLICY], ids=lambda p: p.name)
def test_the_other_policies_guard_the_service_account_fail_closed_and_name_every_refusal(path: Path) -> None:
    namespace, name = _service_account()
    spec = _one(path, "ValidatingAdmissionPolicy")["spec"]
    assert [c["expression"] for c in spec["matchConditions"]] == [
        f"request.userInfo.username == 'system:serviceaccount:{namespace}:{name}'"
    ]
    assert spec["failurePolicy"] == "Fail"
    assert _one(path, "ValidatingAdmissionPolicyBinding")["spec"]["validationActions"] == ["Deny", "Audit"]
    for v in spec["validations"]:
        assert "refused" in v["messageExpression"] and v["reason"] == "Forbidden", v["expression"]


def test_the_device_policy_requires_the_name_and_bounds_the_agent_writes() -> None:
    from gpuguard.core import validation
    from gpuguard.quarantine.gpu import degraded as degraded_rules
    from gpuguard.quarantine.gpu import rules as devices

    cel = _cel(DEVICE_POLICY)
    assert f"'{devices.RULE_PREFIX}') + variables.node + '.'" in cel
    assert f"'{degraded_rules.DEGRADED_RULE_PREFIX}' : '{devices.RULE_PREFIX}'" in cel
    assert f"'{record.DEGRADED_TAINT_KEY}' && r.spec.taint.?effect.orValue('') == 'None'" in cel
    assert f"variables.annotationBytes > {validation.MAX_ANNOTATION_BYTES}" in cel
    assert f"'{devices.LABEL_NODE}', '{devices.LABEL_MANAGED_BY}'" in cel


def test_the_event_policy_covers_the_events_role_and_bounds_what_the_agent_writes() -> None:
    from gpuguard.core import validation

    rules = _one(EVENT_POLICY, "ValidatingAdmissionPolicy")["spec"]["matchConstraints"]["resourceRules"]
    assert {g for r in rules for g in r["apiGroups"]} == {"", "events.k8s.io"}
    assert {"CREATE", "UPDATE"} <= {op for r in rules for op in r["operations"]}
    granted = _one(DAEMONSET, "Role")["rules"]
    assert [r["resources"] for r in granted] == [["events"]]
    cel = _cel(EVENT_POLICY)
    assert f"bytes(variables.text).size() > {validation.MAX_EVENT_MESSAGE_BYTES}" in cel
    assert "variables.component != 'gpuguard'" in cel


def test_events_have_a_priority_level_of_their_own_matched_before_the_agents_other_requests() -> None:
    events = _one(EVENT_FLOWS, "FlowSchema")["spec"]
    rest = _one(DAEMONSET, "FlowSchema")["spec"]
    assert events["matchingPrecedence"] < rest["matchingPrecedence"]
    assert (
        events["priorityLevelConfiguration"]["name"]
        == _one(EVENT_FLOWS, "PriorityLevelConfiguration")["metadata"]["name"]
        != rest["priorityLevelConfiguration"]["name"]
    )
    (rule,) = events["rules"]
    assert rule["subjects"] == rest["rules"][0]["subjects"]
    assert rule["resourceRules"] == [
        {"verbs": ["*"], "apiGroups": ["", "events.k8s.io"], "resources": ["events"], "namespaces": ["*"]}
    ]
