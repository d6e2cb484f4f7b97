"""The Helm chart deploy/helm/gpuguard: its default render is deploy/daemonset.yaml, object for object.

helm itself comes from hack/helm/build.sh (built once from the pinned Go module into
~/.cache/gpuguard/helm/, a few minutes cold, instant afterwards). A failed build fails these tests;
GPUGUARD_SKIP_HELM=1 skips them on machines without Go. Every non-default value must change exactly the
agent setting it names, and every setting the chart can render must be one `gpuguard watch` accepts.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import gpuguard
from gpuguard.cli import cli
from gpuguard.core.config import ServerSettings
from gpuguard.quarantine.record import TAINT_KEY
from harness.agentproc import WatchProcess
from tests.helmtool import CHART, NAMESPACE, ROOT, Docs, Helm, build_helm
from tests.test_manifests import gpu_node_terms, selector_of

MANIFEST = ROOT / "deploy" / "daemonset.yaml"
ADMISSION_POLICY = ROOT / "deploy" / "admission-policy.yaml"
DEVICE_POLICY = ROOT / "deploy" / "admission-policy-devices.yaml"
EVENT_POLICY = ROOT / "deploy" / "admission-policy-events.yaml"
EVICTION_POLICY = ROOT / "deploy" / "admission-policy-evictions.yaml"
EVENT_FLOWS = ROOT / "deploy" / "flowcontrol-events.yaml"
# What the default render is, object for object: the README's deploy command.
DEFAULT_FILES = (
    "daemonset.yaml",
    "flowcontrol-events.yaml",
    *(p.name for p in (ADMISSION_POLICY, DEVICE_POLICY, EVENT_POLICY, EVICTION_POLICY)),
    "admission-policy-repair.yaml",
)

# The first run builds helm inside the test session: allow it more than pytest's default timeout.
pytestmark = pytest.mark.timeout(1200)


# -- helpers -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """helm 4 from hack/helm/build.sh, its config, cache and data directories isolated from the user's."""
    return build_helm(tmp_path_factory.mktemp("helm-home"))


def _manifest(path: Path = MANIFEST) -> Docs:
    with path.open(encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _by_kind(docs: Docs) -> dict[str, dict[str, Any]]:
    """The objects of deploy/daemonset.yaml, one per kind: the admission policies and the Events' priority
    level (deploy/admission-policy*.yaml, deploy/flowcontrol-events.yaml) have tests of their own."""
    mine = [
        d for d in docs if d["kind"] not in ADMISSION_KINDS and not d["metadata"]["name"].endswith("-events")
    ]
    out = {d["kind"]: d for d in mine}
    assert len(out) == len(mine), "one object per kind"
    return out


def _sorted(docs: Docs) -> Docs:
    return sorted(docs, key=lambda d: (d["kind"], d["metadata"]["name"]))


def _pod_spec(docs: Docs) -> dict[str, Any]:
    spec: dict[str, Any] = _by_kind(docs)["DaemonSet"]["spec"]["template"]["spec"]
    return spec


def _agent(docs: Docs) -> dict[str, Any]:
    (container,) = _pod_spec(docs)["containers"]
    assert container["name"] == "gpuguard"
    return dict(container)


def _agent_in(docs: Docs) -> dict[str, Any]:
    """The agent container itself (not a copy), to edit."""
    container: dict[str, Any] = _pod_spec(docs)["containers"][0]
    return container


def _env(docs: Docs) -> dict[str, Any]:
    """name -> value (or the valueFrom source) of the agent container's environment."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in _agent(docs)["env"]}


def _watch_variables() -> set[str]:
    read: set[str] = set()
    for param in cli.commands["watch"].params:
        envvar = getattr(param, "envvar", None)
        read.update([envvar] if isinstance(envvar, str) else envvar or [])
    return read


@pytest.fixture(scope="module")
def default_render(helm: Helm) -> Docs:
    return helm.render()


# -- the default render ------------------------------------------------------------------------------------


def test_the_default_render_is_exactly_the_objects_of_the_readmes_deploy_command(
    default_render: Docs,
) -> None:
    everything = [d for name in DEFAULT_FILES for d in _manifest(ROOT / "deploy" / name)]
    assert _sorted(default_render) == _sorted(everything)


def test_the_chart_passes_helm_lint_strict(helm: Helm) -> None:
    result = helm.run("lint", "--strict", str(CHART))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_charts_app_version_is_gpuguards_version_and_the_default_image_tag() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == gpuguard.__version__
    assert chart["name"] == NAMESPACE
    image = next(d for d in _manifest() if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    assert image["containers"][0]["image"].endswith(f":{chart['appVersion']}")


# -- the admission policies (on by default) ----------------------------------------------------------------

ADMISSION_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
DISABLE_POLICY = ("--set", "admissionPolicy.enabled=false")
POLICIES = {
    "own-node-only": ADMISSION_POLICY,
    "own-devices-only": DEVICE_POLICY,
    "own-events-only": EVENT_POLICY,
    "evictions": EVICTION_POLICY,
}
# deploy/admission-policy-repair.yaml holds two (tests/test_helm_repair.py follows them through the names).
REPAIR_POLICIES = ("repair-request", "repair-executor")


def test_the_admission_policies_are_on_by_default_and_a_value_turns_them_off_with_a_warning(
    helm: Helm, default_render: Docs
) -> None:
    names = sorted(d["metadata"]["name"] for d in default_render if d["kind"] == "ValidatingAdmissionPolicy")
    assert names == sorted(f"gpuguard-{suffix}" for suffix in (*POLICIES, *REPAIR_POLICIES))
    off = helm.render(*DISABLE_POLICY)
    assert _sorted(off) == _sorted([d for d in default_render if d["kind"] not in ADMISSION_KINDS])
    assert "WARNING: admissionPolicy.enabled=false" in helm.notes(*DISABLE_POLICY)
    assert "WARNING" not in helm.notes()


def test_the_admission_policies_follow_the_release_name_and_namespace(helm: Helm) -> None:
    everything = helm.render(release="gpu", namespace="gpu-health")
    rendered = _by_kind(everything)
    account = rendered["ServiceAccount"]["metadata"]
    assert (account["namespace"], account["name"]) == ("gpu-health", "gpu-gpuguard")
    expected_match = "request.userInfo.username == 'system:serviceaccount:gpuguard:gpuguard'"
    for suffix, path in POLICIES.items():
        name = f"gpu-gpuguard-{suffix}"
        policy, binding = (
            next(d for d in everything if d["kind"] == kind and d["metadata"]["name"] == name)
            for kind in ADMISSION_KINDS
        )
        (condition,) = policy["spec"]["matchConditions"]
        assert condition["expression"] == (
            "request.userInfo.username == 'system:serviceaccount:gpu-health:gpu-gpuguard'"
        )
        assert binding["spec"]["policyName"] == name
        # ...and nothing else of the policy changes.
        condition["expression"] = expected_match
        for doc in (policy, binding):
            doc["metadata"]["name"] = f"gpuguard-{suffix}"
        binding["spec"]["policyName"] = f"gpuguard-{suffix}"
        expected = {d["kind"]: d for d in _manifest(path)}
        assert [policy, binding] == [expected[kind] for kind in ADMISSION_KINDS], suffix


def test_the_eviction_policy_allows_exactly_the_charts_grace_period(helm: Helm, default_render: Docs) -> None:
    """The one grace period an operator configured (evict.gracePeriodSeconds) may be sent; by default none
    (the pod's own), as deploy/admission-policy-evictions.yaml says."""

    def allowed(docs: Docs) -> str:
        policy = next(
            d
            for d in docs
            if d["kind"] == ADMISSION_KINDS[0] and d["metadata"]["name"].endswith("-evictions")
        )
        variables = {v["name"]: v["expression"] for v in policy["spec"].get("variables", [])}
        return str(variables["allowedGrace"])

    assert allowed(default_render) == "[]"
    evicting = ("--set", "evict.mode=gpu-pods", "--set", "evict.namespaces={ml}")
    assert allowed(helm.render(*evicting, "--set", "evict.gracePeriodSeconds=30")) == "[30]"
    assert allowed(helm.render(*evicting)) == "[]"


def test_the_chart_passes_helm_lint_strict_without_the_admission_policies(helm: Helm) -> None:
    result = helm.run("lint", "--strict", str(CHART), *DISABLE_POLICY)
    assert result.returncode == 0, result.stdout + result.stderr


# -- values that change the agent's settings ---------------------------------------------------------------

# (--set arguments, variables added or changed, variables removed)
ENV_CASES: list[tuple[list[str], dict[str, str], set[str]]] = [
    (["--set", "taintEffect=NoExecute"], {"GPUGUARD_TAINT_EFFECT": "NoExecute"}, set()),
    (["--set", "cordon=false"], {"GPUGUARD_NO_CORDON": "true"}, set()),
    (["--set", "degradedTaint=false"], {"GPUGUARD_NO_DEGRADED_TAINT": "true"}, set()),
    (["--set", "interval=1"], {"GPUGUARD_INTERVAL": "1"}, set()),
    (["--set", "interval=0.5"], {"GPUGUARD_INTERVAL": "0.5"}, set()),
    (["--set", "recovery.enabled=false"], {"GPUGUARD_NO_RECOVER": "true"}, set()),
    (["--set", "recovery.recoverAfter=5"], {"GPUGUARD_RECOVER_AFTER": "5"}, set()),
    (["--set", "budget.maxQuarantined=2"], {"GPUGUARD_MAX_QUARANTINED": "2"}, set()),
    (["--set", "budget.maxQuarantined=25%"], {"GPUGUARD_MAX_QUARANTINED": "25%"}, set()),
    (["--set", "budget.maxQuarantined="], {}, {"GPUGUARD_MAX_QUARANTINED"}),
    (["--set", "flapWindow=0"], {"GPUGUARD_FLAP_WINDOW": "0"}, set()),
    (["--set", "flapWindow=null"], {}, {"GPUGUARD_FLAP_WINDOW"}),
    (["--set", "ignoredXids={13,43}"], {"GPUGUARD_IGNORE_XIDS": "13,43"}, set()),
    # [] is "none", as --ignore-xids '' (the agent's empty variable means the same); null the built-in list.
    (["--set-json", "ignoredXids=[]"], {"GPUGUARD_IGNORE_XIDS": ""}, set()),
    (["--set", "ignoredXids=null"], {}, set()),
    (["--set", "fatalXids={13}"], {"GPUGUARD_FATAL_XIDS": "13"}, set()),
    (["--set", "eccThreshold=0"], {"GPUGUARD_ECC_THRESHOLD": "0"}, set()),
    (["--set", "eccThreshold=2"], {"GPUGUARD_ECC_THRESHOLD": "2"}, set()),
    (["--set", "gate.removal=external"], {"GPUGUARD_GATE_REMOVAL": "external"}, set()),
    (["--set", "apiServer.startupJitter=30"], {"GPUGUARD_STARTUP_JITTER": "30"}, set()),
    (["--set", "apiServer.startupJitter=0"], {"GPUGUARD_STARTUP_JITTER": "0"}, set()),
    (["--set", "apiServer.qps=2.5"], {"GPUGUARD_API_QPS": "2.5"}, set()),
    (["--set", "apiServer.burst=40"], {"GPUGUARD_API_BURST": "40"}, set()),
    (["--set", "quarantine.mode=node"], {"GPUGUARD_QUARANTINE": "node"}, set()),
    (["--set", "quarantine.mode=gpu"], {"GPUGUARD_QUARANTINE": "gpu"}, set()),
    (["--set", "quarantine.mode=null"], {}, {"GPUGUARD_QUARANTINE"}),
    (["--set", "quarantine.draDriver=gpu.example.com"], {"GPUGUARD_DRA_DRIVER": "gpu.example.com"}, set()),
    (["--set", "quarantine.draDriver=null"], {}, {"GPUGUARD_DRA_DRIVER"}),
    (
        ["--set", "taintEffect=NoExecute", "--set", "cordon=false", "--set", "interval=1"],
        {"GPUGUARD_TAINT_EFFECT": "NoExecute", "GPUGUARD_NO_CORDON": "true", "GPUGUARD_INTERVAL": "1"},
        set(),
    ),
]


# One value of every agent setting the chart has, none of them the default.
EVERY_SETTING = [
    *("--set", "taintEffect=NoExecute", "--set", "cordon=false", "--set", "interval=1"),
    *("--set", "recovery.enabled=false", "--set", "recovery.recoverAfter=5"),
    *("--set", "budget.maxQuarantined=2", "--set", "flapWindow=30", "--set", "eccThreshold=2"),
    *("--set", "ignoredXids={13,43}", "--set", "fatalXids={13}", "--set", "metrics.port=9000"),
    *("--set", "gate.taintKey=startup-taint.cluster-autoscaler.kubernetes.io/gpuguard"),
    *("--set", "gate.removal=external"),
    *("--set", "apiServer.startupJitter=30", "--set", "apiServer.qps=2.5", "--set", "apiServer.burst=40"),
    *("--set", "quarantine.mode=gpu", "--set", "quarantine.draDriver=gpu.example.com"),
    *("--set", "degradedTaint=false"),
]


@pytest.mark.parametrize(
    ("values", "changed", "removed"), ENV_CASES, ids=[" ".join(c[0][1::2]) for c in ENV_CASES]
)
def test_a_non_default_value_changes_exactly_the_agent_variable_it_names(
    helm: Helm, default_render: Docs, values: list[str], changed: dict[str, str], removed: set[str]
) -> None:
    rendered = helm.render(*values)
    expected = {k: v for k, v in _env(default_render).items() if k not in removed} | changed
    assert _env(rendered) == expected
    # ...and nothing else: with the default env put back, the render is the default one.
    _agent_in(rendered)["env"] = _agent(default_render)["env"]
    assert rendered == default_render


def test_every_variable_the_chart_can_set_is_one_the_watch_command_reads(helm: Helm) -> None:
    ours = {name for name in _env(helm.render(*EVERY_SETTING)) if name.startswith("GPUGUARD_")}
    assert ours == {
        *("GPUGUARD_LOG_FORMAT", "GPUGUARD_INTERVAL", "GPUGUARD_TAINT_EFFECT", "GPUGUARD_NO_CORDON"),
        "GPUGUARD_NO_DEGRADED_TAINT",
        *(
            "GPUGUARD_NO_RECOVER",
            "GPUGUARD_RECOVER_AFTER",
            "GPUGUARD_MAX_QUARANTINED",
            "GPUGUARD_FLAP_WINDOW",
        ),
        *("GPUGUARD_IGNORE_XIDS", "GPUGUARD_FATAL_XIDS", "GPUGUARD_ECC_THRESHOLD", "GPUGUARD_LISTEN"),
        *(
            "GPUGUARD_STATE_DIR",
            "GPUGUARD_GPU_NODE_SELECTOR",
            "GPUGUARD_GATE_TAINT_KEY",
            "GPUGUARD_GATE_REMOVAL",
        ),
        *("GPUGUARD_STARTUP_JITTER", "GPUGUARD_API_QPS", "GPUGUARD_API_BURST"),
        *("GPUGUARD_QUARANTINE", "GPUGUARD_DRA_DRIVER"),
    }
    missing = ours - _watch_variables()
    assert not missing, f"not read by `gpuguard watch`: {sorted(missing)}"


@pytest.mark.parametrize(
    "key", ["startup-taint.cluster-autoscaler.kubernetes.io/gpuguard", "example.com/gpu-unverified"]
)
def test_another_gate_key_reaches_the_agent_and_its_tolerations(
    helm: Helm, default_render: Docs, key: str
) -> None:
    rendered = helm.render("--set", f"gate.taintKey={key}")
    assert _env(rendered) == _env(default_render) | {"GPUGUARD_GATE_TAINT_KEY": key}
    pod = _pod_spec(rendered)
    assert {"key": key, "operator": "Exists"} in pod["tolerations"]
    # ...and nothing else changed.
    pod["tolerations"] = [t for t in pod["tolerations"] if t["key"] != key]
    _agent_in(rendered)["env"] = _agent(default_render)["env"]
    assert rendered == default_render


def test_the_charts_gpu_nodes_are_the_manifests_and_its_budget_counts_the_same_nodes(
    default_render: Docs,
) -> None:
    manifest = next(
        d
        for d in yaml.safe_load_all((ROOT / "deploy/daemonset.yaml").read_text())
        if d and d["kind"] == "DaemonSet"
    )["spec"]["template"]["spec"]
    spec = _pod_spec(default_render)
    assert spec["affinity"] == manifest["affinity"] and "nodeSelector" not in spec
    assert _env(default_render)["GPUGUARD_GPU_NODE_SELECTOR"] == selector_of(gpu_node_terms(spec))


# A review of the agent on a cluster, defect 4: the budget counts the nodes the DaemonSet runs on.
def test_defect_04_the_budget_counts_the_nodes_of_the_charts_gpu_nodes_and_node_selector(helm: Helm) -> None:
    one = '{"matchExpressions": [{"key": "cloud.example.com/gpu", "operator": "In", "values": ["h100"]}]}'
    other = '{"matchExpressions": [{"key": "example.com/gpu", "operator": "Exists"}]}'
    rendered = helm.render("--set-json", f"gpuNodes=[{one}, {other}]", "--set-string", "nodeSelector.pool=ml")
    spec = _pod_spec(rendered)
    assert spec["nodeSelector"] == {"pool": "ml"} and len(gpu_node_terms(spec)) == 2
    selector = "cloud.example.com/gpu=h100,pool=ml;example.com/gpu,pool=ml"
    assert _env(rendered)["GPUGUARD_GPU_NODE_SELECTOR"] == selector
    everywhere = helm.render("--set-json", "gpuNodes=[]")
    assert "affinity" not in _pod_spec(everywhere) and "nodeSelector" not in _pod_spec(everywhere)
    assert _env(everywhere)["GPUGUARD_GPU_NODE_SELECTOR"] == ""  # every node


def test_a_gpu_nodes_term_a_label_selector_cannot_count_is_refused_at_render(helm: Helm) -> None:
    term = '[{"matchExpressions": [{"key": "example.com/gpu", "operator": "In", "values": ["a", "b"]}]}]'
    result = helm.run("template", "gpuguard", str(CHART), "--set-json", f"gpuNodes={term}")
    assert result.returncode != 0 and "gpuNodes" in result.stderr


# A review of the agent on a cluster, defect 14: IPv6.
def test_defect_14_the_chart_does_not_hard_code_an_ipv4_listen_address() -> None:
    template = (ROOT / "deploy/helm/gpuguard/templates/daemonset.yaml").read_text()
    assert "0.0.0.0" not in template


def test_the_watch_command_accepts_what_the_chart_renders(
    helm: Helm, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = ["--set", "taintEffect=PreferNoSchedule", "--set", "interval=0.5", "--set", "cordon=false"]
    values += ["--set", "recovery.enabled=false", "--set", "recovery.recoverAfter=4"]
    values += ["--set", "ignoredXids={13,43}", "--set", "fatalXids={43}", "--set", "eccThreshold=1"]
    values += ["--set", "metrics.port=9000", "--set", "budget.maxQuarantined=12.5%", "--set", "flapWindow=30"]
    values += ["--set", "quarantine.mode=node", "--set", "quarantine.draDriver=gpu.example.com"]
    env = _env(helm.render(*values))
    for name, value in env.items():
        if isinstance(value, str):
            monkeypatch.setenv(name, value)
    ctx = cli.commands["watch"].make_context("watch", [])
    assert ctx.params["taint_effect"] == "PreferNoSchedule"
    assert ctx.params["interval"] == 0.5
    assert ctx.params["no_cordon"] is True and ctx.params["no_recover"] is True
    assert ctx.params["recover_after"] == 4
    assert (ctx.params["ignore_xids"], ctx.params["fatal_xids"]) == ("13,43", "43")
    assert ctx.params["ecc_threshold"] == 1
    assert ctx.params["listen"] == ":9000"
    assert (ctx.params["max_quarantined"], ctx.params["flap_window"]) == ("12.5%", 30.0)
    assert ctx.params["state_dir"] == "/var/lib/gpuguard"
    assert (ctx.params["quarantine"], ctx.params["dra_driver"]) == ("node", "gpu.example.com")


def test_an_empty_ignored_xids_list_means_no_ignored_xid_in_the_chart_as_on_the_command_line(
    helm: Helm, tmp_path: Path
) -> None:
    """ignoredXids: [] and --ignore-xids '' both mean "every Xid is a fault"; null and no flag both mean the
    built-in list (which ignores the application Xid 13)."""
    scenario = tmp_path / "xid13.yaml"
    scenario.write_text("devices: [{index: 0, uuid: GPU-a}]\nevents: [{at: 0.0, gpu: 0, xid: 13}]\n")

    def check(env: dict[str, Any], *flags: str) -> int:
        variables = {k: v for k, v in env.items() if k.startswith("GPUGUARD_") and isinstance(v, str)}
        args = ["check", "--backend", "mock", "--scenario", str(scenario), "--at", "1", *flags]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("GPUGUARD_")}
        return subprocess.run(
            [sys.executable, "-m", "gpuguard", *args], env=clean | variables, capture_output=True, check=False
        ).returncode

    assert check(_env(helm.render("--set-json", "ignoredXids=[]"))) == 1
    assert check({}, "--ignore-xids", "") == 1
    assert check(_env(helm.render())) == 0
    assert check({}) == 0


def test_the_agent_starts_with_every_setting_the_chart_renders(helm: Helm, tmp_path: Path) -> None:
    """Past flag parsing too: the agent's own validation (a bad value would be exit 2)."""
    rendered = {k: v for k, v in _env(helm.render(*EVERY_SETTING)).items() if isinstance(v, str)}
    env = rendered | {"GPUGUARD_STATE_DIR": str(tmp_path)}
    p = WatchProcess("--dry-run", "--backend", "mock", "--run-for", "0.5", env=env).start()
    assert p.wait(60) == 0, p.lines[-10:]


def test_another_metrics_port_moves_the_listener_the_container_port_and_the_scrape_annotation(
    helm: Helm, default_render: Docs
) -> None:
    rendered = helm.render("--set", "metrics.port=9000")
    assert _env(rendered) == _env(default_render) | {"GPUGUARD_LISTEN": ":9000"}
    assert _agent(rendered)["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    annotations = _by_kind(rendered)["DaemonSet"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9000"
    assert _agent(default_render)["ports"][0]["containerPort"] == ServerSettings.port


def test_the_scrape_annotations_can_be_turned_off(helm: Helm) -> None:
    rendered = helm.render("--set", "metrics.scrapeAnnotations=false")
    assert "annotations" not in _by_kind(rendered)["DaemonSet"]["spec"]["template"]["metadata"]


def test_another_state_dir_moves_the_host_path_both_mounts_the_variable_and_the_init_script(
    helm: Helm,
) -> None:
    rendered = helm.render("--set", "stateDir=/var/lib/gpu-guard")
    spec = _pod_spec(rendered)
    (state,) = [v for v in spec["volumes"] if v["name"] == "state"]
    assert state["hostPath"] == {"path": "/var/lib/gpu-guard", "type": "DirectoryOrCreate"}
    for c in spec["containers"] + spec["initContainers"]:
        assert {"name": "state", "mountPath": "/var/lib/gpu-guard"} in c["volumeMounts"], c["name"]
    assert _env(rendered)["GPUGUARD_STATE_DIR"] == "/var/lib/gpu-guard"
    assert "p = '/var/lib/gpu-guard';" in spec["initContainers"][0]["command"][2]


def test_the_image_tag_and_extra_args_reach_the_containers(helm: Helm) -> None:
    rendered = helm.render(
        "--set", "image.tag=0.2.0", "--set", "image.pullPolicy=Always", "--set", "extraArgs={--dry-run}"
    )
    spec = _pod_spec(rendered)
    for c in spec["containers"] + spec["initContainers"]:
        assert (c["image"], c["imagePullPolicy"]) == ("registry.example.com/gpuguard:0.2.0", "Always")
    assert _agent(rendered)["args"] == ["watch", "--dry-run"]


def test_replacing_the_tolerations_keeps_the_agents_own_taint_and_the_cordon(helm: Helm) -> None:
    tolerations = _pod_spec(helm.render("--set-json", "tolerations=[]"))["tolerations"]
    assert tolerations == [
        {"key": TAINT_KEY, "operator": "Exists"},
        {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"},
    ]


def test_the_namespace_is_left_out_when_namespace_create_is_false(helm: Helm, default_render: Docs) -> None:
    rendered = helm.render("--set", "namespace.create=false")
    assert rendered == [d for d in default_render if d["kind"] != "Namespace"]


def test_flow_control_off_leaves_out_exactly_the_flow_schema_and_its_priority_level(
    helm: Helm, default_render: Docs
) -> None:
    rendered = helm.render("--set", "flowControl.enabled=false")
    assert rendered == [
        d for d in default_render if d["kind"] not in ("FlowSchema", "PriorityLevelConfiguration")
    ]


def test_the_priority_levels_shares_and_queues_are_values(helm: Helm) -> None:
    docs = _by_kind(
        helm.render(
            *("--set", "flowControl.nominalConcurrencyShares=50", "--set", "flowControl.lendablePercent=0"),
            *("--set", "flowControl.queuing.queues=128", "--set", "flowControl.queuing.handSize=6"),
            *(
                "--set",
                "flowControl.queuing.queueLengthLimit=500",
                "--set",
                "flowControl.matchingPrecedence=950",
            ),
        )
    )
    limited = docs["PriorityLevelConfiguration"]["spec"]["limited"]
    assert limited["nominalConcurrencyShares"] == 50 and limited["lendablePercent"] == 0
    assert limited["limitResponse"]["queuing"] == {"queues": 128, "handSize": 6, "queueLengthLimit": 500}
    assert docs["FlowSchema"]["spec"]["matchingPrecedence"] == 950


def test_another_release_name_renames_every_object_consistently(helm: Helm) -> None:
    docs = _by_kind(helm.render(release="gpu"))
    for kind in (
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "DaemonSet",
        "FlowSchema",
        "PriorityLevelConfiguration",
    ):
        assert docs[kind]["metadata"]["name"] == "gpu-gpuguard", kind
    schema = docs["FlowSchema"]["spec"]
    assert schema["priorityLevelConfiguration"] == {"name": "gpu-gpuguard"}
    assert schema["rules"][0]["subjects"] == [
        {"kind": "ServiceAccount", "serviceAccount": {"name": "gpu-gpuguard", "namespace": NAMESPACE}}
    ]
    binding = docs["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == "gpu-gpuguard"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpu-gpuguard", "namespace": NAMESPACE}]
    assert docs["DaemonSet"]["spec"]["template"]["spec"]["serviceAccountName"] == "gpu-gpuguard"
    assert docs["Namespace"]["metadata"]["name"] == NAMESPACE


def test_a_render_with_every_value_changed_matches_the_kubernetes_api_schema(helm: Helm) -> None:
    from kubernetes import client  # heavy import: only this test needs it

    if not hasattr(client.V1DaemonSet, "model_validate"):
        pytest.skip("this kubernetes client has no strict (pydantic) models")
    values = [*EVERY_SETTING, "--set", "priorityClassName=", "--set", "nodeSelector=null"]
    docs = _by_kind(helm.render(*values))
    daemonset = copy.deepcopy(docs["DaemonSet"])
    client.V1DaemonSet.model_validate(daemonset)
    assert "priorityClassName" not in daemonset["spec"]["template"]["spec"]
    assert "nodeSelector" not in daemonset["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["--set", "taintEffect=NoExecut"], "/taintEffect"),
        (["--set", "gate.removal=kubelet"], "/gate/removal"),
        (["--set", "gate.taintKey=a b"], "/gate/taintKey"),
        (["--set", "taintEfect=NoExecute"], "taintEfect"),
        (["--set", "interval=soon"], "/interval"),
        (["--set", "budget.maxQuarantined=ten"], "/budget/maxQuarantined"),
        (["--set", "stateDir=relative/path"], "/stateDir"),
        (["--set", "stateDir=/var/lib/x'; import shutil"], "/stateDir"),
        (["--set", "metrics.port=0"], "/metrics/port"),
        (["--set", "admissionPolicy.enabled=yes"], "/admissionPolicy/enabled"),
        (["--set", "admissionPolicy.enable=true"], "'enable' not allowed"),
        (["--set", "apiServer.startupJitter=-1"], "/apiServer/startupJitter"),
        (["--set", "flowControl.queuing.handSize=0"], "/flowControl/queuing/handSize"),
        (["--set", "quarantine.mode=device"], "/quarantine/mode"),
        (["--set", "quarantine.draDriver=GPU.nvidia.com"], "/quarantine/draDriver"),
    ],
    ids=[
        "a misspelt taint effect",
        "an unknown gate removal",
        "a gate key with a space",
        "a misspelt key",
        "a word for the interval",
        "a word for the budget",
        "a relative state dir",
        "python in the state dir",
        "port 0",
        "a word for the admission policy switch",
        "a misspelt admission policy key",
        "a negative start-up jitter",
        "an empty hand",
        "an unknown quarantine mode",
        "a DRA driver that is no DNS subdomain",
    ],
)
def test_the_values_schema_rejects_a_mistake_before_anything_is_deployed(
    helm: Helm, values: list[str], message: str
) -> None:
    result = helm.run("template", "gpuguard", str(CHART), "--namespace", NAMESPACE, *values)
    assert result.returncode != 0
    assert message in result.stderr
