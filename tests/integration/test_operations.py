"""docs/operations.md, run as written: every `sh` block, in order, with kubectl (hack/testenv), Helm 4 and
then Helm 3 (hack/helm), and gpuguard, against a fresh real kube-apiserver per Helm version. Between the
blocks the test plays the cluster: an agent (the real one, on the fake NVML, as the chart's ServiceAccount)
quarantines a node, and it stops the agent before the uninstall, as the page says to.

There is no kubelet or controller-manager: no pod of the DaemonSet runs, and a deleted namespace stays
Terminating. The Prometheus Operator's CRDs are stood in by schema-less CRDs of the same group, kind and
scope, enough for `kubectl apply` and `helm upgrade` to create the objects.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from harness import controlplane
from harness.kube import GPUS_OK, ROOT, Admin, agent_as_node, eventually
from tests.helmtool import build_helm

DOC = ROOT / "docs" / "operations.md"
README = ROOT / "README.md"
pytestmark = pytest.mark.timeout(900)

# Commands the page names in its prose (inline code) rather than in a block, and the test that runs them.
EXERCISED_ELSEWHERE = {
    "gpuguard uninstall --node NAME": "test_uninstall_of_one_node_and_its_dry_run_do_what_the_page_says",
    "gpuguard check": "test_check_label.py::test_check_fails_a_node_labelled_with_8_gpus_whose_library_shows_7",  # noqa: E501
    "kubectl delete": "test_the_plain_manifests_apply_and_delete_with_kubectl_and_why_the_namespace_comes_first",  # noqa: E501
    "kubectl auth can-i patch nodes --as system:serviceaccount:gpuguard:gpuguard": (
        "test_the_operations_runbook_works_as_written"
    ),
    "gpuguard release": "test_operator_commands.py::test_a_pending_release_is_not_overwritten_without_force",
    "gpuguard release --node NODE --gpu UUID --by YOU": (
        "test_repeat_offenders.py::test_an_xid_that_returns_after_two_reboots_holds_the_gpu_until_an_operator_releases_it"
    ),
    "gpuguard explain": (
        "test_explain.py::test_explain_on_the_node_and_from_the_cluster_of_a_node_quarantined_for_a_kernel_logged_xid"
    ),
    'gpuguard explain --node "$NODE"': (
        "test_explain.py::test_explain_on_the_node_and_from_the_cluster_of_a_node_quarantined_for_a_kernel_logged_xid"
    ),
    "gpuguard hold": "test_operator_day.py::test_hold_holds_a_gpu_through_the_agent_and_history_shows_the_hold_and_the_release",  # noqa: E501
    "gpuguard hold --node NODE --gpu UUID [--by WHO] [--force] [--wait]": (
        "test_operator_day.py::test_hold_holds_a_gpu_through_the_agent_and_history_shows_the_hold_and_the_release"
    ),
    "gpuguard history --node NODE [--gpu UUID] [-o json]": (
        "test_operator_day.py::test_hold_holds_a_gpu_through_the_agent_and_history_shows_the_hold_and_the_release"
    ),
    "kubectl get pdb -n NS": "test_the_operations_runbook_works_as_written",
    "kubectl get node NODE -o jsonpath='{.metadata.annotations.gpuguard\\.io/repair-state}'": (
        "test_the_operations_runbook_works_as_written"
    ),
    "gpuguard check --fail-on-degraded": (
        "test_degraded_shown.py::test_check_exits_0_on_degraded_gpus_unless_told_to_fail"
    ),
    "kubectl get nodes -l gpuguard.io/degraded=true": (
        "test_degraded.py::test_a_degraded_node_is_marked_softly_stays_schedulable_outside_the_budget_and_is_released"
    ),
    "kubectl delete nodeclaim NAME": "test_karpenter.py::test_karpenter_launches_gated_nodes_once_and_pods_land_only_where_gpuguard_verified_the_gpus",  # noqa: E501
    # tests/integration/test_device_admission.py
    "kubectl get devicetaintrules -l app.kubernetes.io/managed-by=gpuguard": (
        "test_the_pages_kubectl_commands_list_and_delete_gpuguards_rules_and_no_one_elses"
    ),
    "kubectl delete devicetaintrules -l app.kubernetes.io/managed-by=gpuguard": (
        "test_the_pages_kubectl_commands_list_and_delete_gpuguards_rules_and_no_one_elses"
    ),
}


def blocks() -> list[tuple[str, str]]:
    """(section heading, block text) of every ```sh block, in order."""
    out, section = [], ""
    for m in re.finditer(r"^## ([^\n]+)$|^```sh\n(.*?)^```$", DOC.read_text(), re.M | re.S):
        if m.group(1):
            section = m.group(1)
        else:
            out.append((section, m.group(2)))
    return out


class Runbook:
    """Runs the page's blocks in order and remembers which ran."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.pending = blocks()
        self.ran: list[str] = []

    def run(self, section: str, **env: str) -> str:
        """Run the next block, which must belong to `section`; its stdout."""
        heading, text = self.pending.pop(0)
        assert heading == section, (
            f"the page's next block is under {heading!r}, the test expected {section!r}"
        )
        out = self.shell(text, **env)
        self.ran.append(text)
        return out

    def shell(self, text: str, **env: str) -> str:
        """Run `text` with bash -euo pipefail in the page's environment; its stdout (exit 0 asserted)."""
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", text],
            env=self.env | env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert result.returncode == 0, f"{text}\n{result.stdout}\n{result.stderr}"
        return result.stdout


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Any]:
    cp = controlplane.ControlPlane(tmp_path / "kube", allow_build=False, die_with_parent=True)
    try:
        cp.start()
        yield cp
    finally:
        cp.stop()


@pytest.fixture
def admin(cluster: Any) -> Iterator[Admin]:
    api: kubernetes.client.ApiClient = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=str(cluster.kubeconfig_path)
    )
    with closing(api):
        yield Admin(api)


def tools_env(tmp_path: Path, cluster: Any, helm_binary: str, helm_env: dict[str, str]) -> dict[str, str]:
    """PATH with kubectl, helm and gpuguard first; the cluster's admin kubeconfig; a private HOME."""
    bins = controlplane.cached_binaries()
    assert bins is not None and bins.kubectl is not None
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "kubectl").symlink_to(bins.kubectl)
    (tools / "helm").symlink_to(helm_binary)
    (tools / "gpuguard").symlink_to(ROOT / ".venv" / "bin" / "gpuguard")
    home = tmp_path / "home"
    home.mkdir()
    return helm_env | {
        "PATH": f"{tools}:{os.environ['PATH']}",
        "KUBECONFIG": str(cluster.kubeconfig_path),
        "HOME": str(home),
    }


def monitoring_crds(admin: Admin) -> None:
    """Schema-less stand-ins for the Prometheus Operator's PodMonitor and PrometheusRule CRDs."""
    ext: Any = kubernetes.client.ApiextensionsV1Api(admin.api)
    for kind, plural in (("PodMonitor", "podmonitors"), ("PrometheusRule", "prometheusrules")):
        ext.create_custom_resource_definition(
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{plural}.monitoring.coreos.com"},
                "spec": {
                    "group": "monitoring.coreos.com",
                    "scope": "Namespaced",
                    "names": {
                        "kind": kind,
                        "plural": plural,
                        "singular": kind.lower(),
                        "listKind": f"{kind}List",
                    },
                    "versions": [
                        {
                            "name": "v1",
                            "served": True,
                            "storage": True,
                            "schema": {
                                "openAPIV3Schema": {
                                    "type": "object",
                                    "x-kubernetes-preserve-unknown-fields": True,
                                }
                            },
                        }
                    ],
                },
            }
        )
    custom: Any = kubernetes.client.CustomObjectsApi(admin.api)
    eventually(
        lambda: _served(
            lambda: custom.list_cluster_custom_object("monitoring.coreos.com", "v1", "prometheusrules")
        ),
        30,
        what="the stand-in CRDs to be served",
    )


def _served(call: Any) -> bool:
    try:
        call()
    except kubernetes.client.exceptions.ApiException:
        return False
    return True


def gpuguard_marks(node: dict[str, Any]) -> list[str]:
    meta, spec = node["metadata"], node["spec"]
    marks = [f"label {k}" for k in meta.get("labels") or {} if k.startswith("gpuguard.io/")]
    marks += [f"annotation {k}" for k in meta.get("annotations") or {} if k.startswith("gpuguard.io/")]
    marks += [f"taint {t['key']}" for t in spec.get("taints") or [] if t["key"].startswith("gpuguard.io/")]
    marks += [
        "condition GPUHealthy" for c in node["status"].get("conditions") or [] if c["type"] == "GPUHealthy"
    ]
    return marks


@pytest.mark.parametrize("helm_major", [4, 3])
def test_the_operations_runbook_works_as_written(
    helm_major: int, cluster: Any, admin: Admin, fakenvml: Path, tmp_path: Path
) -> None:
    helm = build_helm(tmp_path / "helm-home", major=helm_major)
    book = Runbook(tools_env(tmp_path, cluster, helm.binary, helm.env))
    apps, core, rbac = admin.apps, admin.core, kubernetes.client.RbacAuthorizationV1Api(admin.api)

    # -- Install, in dry run.
    book.run("Install")
    ds = apps.read_namespaced_daemon_set("gpuguard", "gpuguard")
    agent_container = ds.spec.template.spec.containers[0]
    assert agent_container.image == "registry.example.com/gpuguard:0.1.0"
    assert agent_container.args == ["watch", "--dry-run"]
    ns = core.read_namespace("gpuguard")
    assert ns.metadata.labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert ns.metadata.annotations["meta.helm.sh/release-name"] == "gpuguard"  # the chart's, adopted

    monitoring_crds(admin)
    book.run("Install")  # monitoring through the chart
    custom: Any = kubernetes.client.CustomObjectsApi(admin.api)
    rule = custom.get_namespaced_custom_object(
        "monitoring.coreos.com", "v1", "gpuguard", "prometheusrules", "gpuguard"
    )
    assert {r["alert"] for r in rule["spec"]["groups"][0]["rules"]} >= {
        "GpuguardGPUFault",
        "GpuguardAgentDown",
    }
    book.run("Install")  # the same objects as plain files
    pm = custom.get_namespaced_custom_object(
        "monitoring.coreos.com", "v1", "gpuguard", "podmonitors", "gpuguard"
    )
    assert pm["spec"]["jobLabel"] == "app.kubernetes.io/name"
    out = book.run("Which protections are installed")  # the chart's default: every one of them
    for name in ("own-node-only", "own-devices-only", "own-events-only", "evictions", "events"):
        assert f"gpuguard-{name} " in out, name
    # The check the page's prose gives for a refused write ("When the API server refuses ..."): the
    # chart's ClusterRole lets the agent's ServiceAccount patch nodes, and nothing lets it delete one.
    can_i = "kubectl auth can-i patch nodes --as system:serviceaccount:gpuguard:gpuguard"
    assert can_i in " ".join(DOC.read_text().split())
    assert book.shell(can_i).strip() == "yes"
    denied = subprocess.run(
        ["bash", "-c", can_i.replace("patch", "delete")],
        env=book.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (denied.returncode, denied.stdout.strip()) == (1, "no"), denied

    # -- A first week in dry run, then enforce.
    out = book.run("A first week in dry run")
    assert out.strip().splitlines()[-1] == '["watch"]'
    assert apps.read_namespaced_daemon_set("gpuguard", "gpuguard").spec.template.spec.containers[0].args == [
        "watch"
    ]

    # -- The cluster's part: a GPU node whose agent (as the chart's ServiceAccount) sees an ECC fault.
    node = f"gpu-node-{helm_major}"
    admin.make_node(node)
    state = tmp_path / "gpus.state"
    state.write_text(GPUS_OK)
    agent = agent_as_node(admin, cluster, node, state=state, lib=fakenvml).start()
    try:
        eventually(agent.ready, 15, what="agent /readyz")
        state.write_text(GPUS_OK.replace("GPU-it-1", "GPU-it-1 ecc=2"))
        eventually(lambda: admin.our_taint(node), 10, what="taint")
        eventually(
            lambda: gpuguard_marks(admin.node(node)).count("condition GPUHealthy"), 10, what="condition"
        )
        eventually(lambda: admin.events_for(node), 10, what="the GPUUnhealthy Event")  # written last

        # -- Reading a quarantine.
        out = book.run("Reading a quarantine", NODE=node)
        get_nodes, describe, status = _split(out, node)
        assert re.search(rf"^{node}\s+.*\strue$", get_nodes, re.M), get_nodes
        assert "gpuguard.io/gpu-unhealthy=ecc:NoSchedule" in describe
        assert "Unschedulable:      true" in describe
        assert re.search(r"GPUHealthy\s+False", describe), describe
        assert "GPUUnhealthy" in describe  # the Event
        assert status.splitlines()[0].split() == [
            "NODE",
            "STATE",
            "REASON",
            "SINCE",
            "CORDONED",
            "FAULTS",
            "DEGRADED",
            "REPEAT-OFFENDERS",
            "DETAIL",
        ]
        row = next(line for line in status.splitlines() if line.startswith(node))
        assert row.split()[1:3] == ["quarantined", "ecc"] and " gpuguard " in row and "ecc/GPU-it-1" in row
        assert row.endswith("ecc: 2 uncorrected volatile ECC errors (GPU 1, GPU-it-1)")
        assert "None" not in status

        # The commands the chart's NOTES.txt prints after the install: the agents, and the tainted node.
        notes = subprocess.run(
            ["helm", "get", "notes", "gpuguard", "--namespace", "gpuguard"],
            env=book.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        told = [line.strip() for line in notes.splitlines() if line.strip().startswith("kubectl ")]
        assert len(told) == 2, notes
        outputs = [book.shell(line) for line in told]
        assert re.search(rf"^{node}\s+.*gpuguard\.io/gpu-unhealthy", outputs[1], re.M), outputs[1]

        # -- Releasing a node after repair: by hand; gpuguard does not put it back for the same fault.
        book.run("Releasing a node after repair", NODE=node)
        n = admin.node(node)
        assert admin.our_taint(node) is None and not n["spec"].get("unschedulable")
        time.sleep(2)  # ten checks of the agent, which still sees the same ECC count
        assert admin.our_taint(node) is None and not admin.node(node)["spec"].get("unschedulable")

        # -- Living beside the GPU Operator: both tools' labels in one view.
        out = book.run("Living beside the GPU Operator, the device plugin and DCGM")
        assert "GPU-DRIVER-UPGRADE-STATE" in out and node in out

        # -- Evicting the pods on a faulty GPU: a Role and RoleBinding in each listed namespace (and only
        # there), the kubelet's pod-resources folder mounted read-only, the mode passed to the agent.
        for ns in ("ml-serving", "training"):
            core.create_namespace({"metadata": {"name": ns}})
        book.run("Evicting the pods on a faulty GPU")
        for ns in ("ml-serving", "training"):
            role: Any = rbac.read_namespaced_role("gpuguard-evict", ns)
            binding: Any = rbac.read_namespaced_role_binding("gpuguard-evict", ns)
            assert {(r.resources[0], tuple(r.verbs)) for r in role.rules} == {
                ("pods", ("get",)),
                ("pods/eviction", ("create",)),
                ("events", ("create",)),
            }
            assert binding.subjects[0].name == "gpuguard"
        roles: Any = rbac.list_namespaced_role("default").items
        assert "gpuguard-evict" not in {r.metadata.name for r in roles}
        spec = apps.read_namespaced_daemon_set("gpuguard", "gpuguard").spec.template.spec
        mount = next(m for m in spec.containers[0].volume_mounts if m.mount_path.endswith("pod-resources"))
        assert mount.read_only
        assert _agent_env(admin).get("GPUGUARD_EVICT") == "gpu-pods"
        assert "No resources found" in book.shell("kubectl get pdb -n ml-serving 2>&1")

        # -- Repairing a GPU by a reset: the executor in dry run (its own DaemonSet and ServiceAccount), the
        # agent told so, then an operator's veto on the node (lifted again: it is the operator's, not ours).
        book.run("Repairing a GPU by a reset")
        executor = apps.read_namespaced_daemon_set("gpuguard-repair", "gpuguard").spec.template.spec
        assert executor.service_account_name == "gpuguard-repair"
        assert {e.name: e.value for e in executor.containers[0].env}["GPUGUARD_REPAIR"] == "dry-run"
        assert _agent_env(admin)["GPUGUARD_REPAIR"] == "dry-run"
        book.run("Repairing a GPU by a reset", NODE=node)
        vetoed = admin.node(node)["metadata"]["annotations"]
        assert vetoed["gpuguard.io/repair-veto"] == "maintenance until Friday"
        admin.patch_node(node, {"metadata": {"annotations": {"gpuguard.io/repair-veto": None}}})

        # Quarantine once more, so the uninstall has every kind of mark to remove.
        admin.patch_node(node, {"metadata": {"annotations": {"gpuguard.io/faults": None}}})
        state.write_text(GPUS_OK.replace("GPU-it-0", "GPU-it-0 ecc=1"))
        eventually(lambda: admin.our_taint(node), 10, what="taint again")
    finally:
        agent.stop()  # "Remove the agents first"
    before = gpuguard_marks(admin.node(node))
    assert {
        "taint gpuguard.io/gpu-unhealthy",
        "label gpuguard.io/quarantined",
        "condition GPUHealthy",
    } <= set(before)

    # -- Alerts: the budget raised through the chart, and where the agents run (none here: no kubelet).
    book.run("Alerts")
    assert _agent_env(admin)["GPUGUARD_MAX_QUARANTINED"] == "20%"
    book.run("Alerts")

    # -- Upgrading and rolling back, here to the same chart: a new revision that keeps the values set
    # (--reset-then-reuse-values), then back to the revision before it.
    out = book.run("Upgrading and rolling back")
    history = _helm(book, "history")
    assert history[-1]["status"] == "deployed" and history[-1]["description"] == "Upgrade complete"
    assert "gpuguard" in out and "DESIRED" in out  # the history, then the DaemonSet
    assert _agent_env(admin)["GPUGUARD_MAX_QUARANTINED"] == "20%"
    assert apps.read_namespaced_daemon_set("gpuguard", "gpuguard").spec.template.spec.containers[0].args == [
        "watch"
    ]
    out = book.run("Upgrading and rolling back")
    assert out.strip().splitlines()[-1] == "registry.example.com/gpuguard:0.1.0"  # after helm's "success"
    after = _helm(book, "history")
    assert after[-1]["description"] == f"Rollback to {history[-1]['revision'] - 1}", after[-1]
    assert _agent_env(admin)["GPUGUARD_MAX_QUARANTINED"] == "20%"

    # -- Uninstalling cleanly.
    out = book.run("Uninstalling cleanly")
    assert f"{node}: removed " in out
    n = admin.node(node)
    assert gpuguard_marks(n) == [] and not n["spec"].get("unschedulable")
    for read in (
        lambda: rbac.read_cluster_role("gpuguard"),
        lambda: apps.read_namespaced_daemon_set("gpuguard", "gpuguard"),
    ):
        with pytest.raises(kubernetes.client.exceptions.ApiException) as exc:
            read()
        assert exc.value.status == 404
    assert core.read_namespace("gpuguard").status.phase == "Terminating"

    assert book.pending == [], "a block of docs/operations.md was not run"
    assert len(book.ran) == len(blocks())


def _agent_env(admin: Admin) -> dict[str, str]:
    ds = admin.apps.read_namespaced_daemon_set("gpuguard", "gpuguard")
    return {e.name: e.value for e in ds.spec.template.spec.containers[0].env if e.value is not None}


def _helm(book: Runbook, *args: str) -> Any:
    """`helm ARGS -o json` on the page's release, parsed."""
    result = subprocess.run(
        ["helm", *args, "gpuguard", "--namespace", "gpuguard", "-o", "json"],
        env=book.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(result.stdout)


def _split(out: str, node: str) -> tuple[str, str, str]:
    """The three outputs of the Reading block: kubectl get nodes, kubectl describe node, gpuguard status."""
    start_describe = out.index(f"Name:               {node}")
    start_status = out.index("NODE  ")
    assert start_describe < start_status
    return out[:start_describe], out[start_describe:start_status], out[start_status:]


def test_the_readme_installs_with_the_pages_exact_commands() -> None:
    install = blocks()[0][1]
    assert f"```sh\n{install}```" in README.read_text()


def test_every_command_the_page_names_in_its_prose_is_run_by_a_test() -> None:
    text = DOC.read_text()
    prose = re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)
    # A command the prose wraps over two lines is the same command.
    named = {" ".join(c.split()) for c in re.findall(r"`((?:kubectl|helm|gpuguard) [^`]*)`", prose)}
    in_blocks = "\n".join(b for _, b in blocks())
    assert {c for c in named if c not in in_blocks} <= set(EXERCISED_ELSEWHERE), named


def test_uninstall_of_one_node_and_its_dry_run_do_what_the_page_says(
    admin: Admin, cluster: Any, tmp_path: Path
) -> None:
    admin.make_node("n-1", taints=[{"key": "team", "value": "ml", "effect": "NoSchedule"}])
    admin.make_node("n-2")
    marks = {
        "metadata": {
            "labels": {"gpuguard.io/quarantined": "true", "team": "ml"},
            "annotations": {
                "gpuguard.io/cordoned": "true",
                "gpuguard.io/reason": "ecc: 2",
                "gpuguard.io/since": "2026-12-01T00:00:00Z",
                "owner": "ops",
            },
        },
        "spec": {
            "unschedulable": True,
            "taints": [
                {"key": "team", "value": "ml", "effect": "NoSchedule"},
                {"key": "gpuguard.io/gpu-unhealthy", "value": "ecc", "effect": "NoSchedule"},
            ],
        },
    }
    for n in ("n-1", "n-2"):
        admin.patch_node(n, marks)
        admin.core.patch_node_status(
            n, {"status": {"conditions": [{"type": "GPUHealthy", "status": "False", "reason": "GPUFault"}]}}
        )

    def gpuguard(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                str(ROOT / ".venv" / "bin" / "gpuguard"),
                "uninstall",
                "--kubeconfig",
                str(cluster.kubeconfig_path),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    dry = gpuguard("--node", "n-1", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines() == [
        "n-1: would remove taint gpuguard.io/gpu-unhealthy, label gpuguard.io/quarantined, annotation "
        "gpuguard.io/cordoned, annotation gpuguard.io/reason, annotation gpuguard.io/since, the cordon "
        "gpuguard made, condition GPUHealthy",
        "uninstall (dry run): would remove gpuguard's marks from 1 of 1 node, would delete 0 device taint "
        "rules, would keep 0 operator's marks",
    ]
    assert len(gpuguard_marks(admin.node("n-1"))) == 6  # nothing written

    done = gpuguard("--node", "n-1")
    assert done.returncode == 0 and done.stdout.startswith("n-1: removed taint gpuguard.io/gpu-unhealthy"), (
        done
    )
    n1 = admin.node("n-1")
    assert gpuguard_marks(n1) == [] and not n1["spec"].get("unschedulable")
    assert n1["spec"]["taints"] == [{"key": "team", "value": "ml", "effect": "NoSchedule"}]
    assert n1["metadata"]["labels"]["team"] == "ml" and n1["metadata"]["annotations"]["owner"] == "ops"
    assert len(gpuguard_marks(admin.node("n-2"))) == 6  # only the node named

    again = gpuguard("--node", "n-1")
    assert again.stdout.splitlines()[0] == "n-1: clean: nothing of gpuguard's"

    # An operator's own cordon (no gpuguard.io/cordoned) stays.
    admin.patch_node("n-2", {"metadata": {"annotations": {"gpuguard.io/cordoned": None}}})
    assert gpuguard("--all").returncode == 0
    n2 = admin.node("n-2")
    assert gpuguard_marks(n2) == [] and n2["spec"]["unschedulable"] is True

    usage = gpuguard()
    assert usage.returncode == 2
    assert (
        usage.stderr.strip() == "gpuguard: error: uninstall: name the nodes with --node NAME, or pass --all"
    )


def test_the_plain_manifests_apply_and_delete_with_kubectl_and_why_the_namespace_comes_first(
    cluster: Any, admin: Admin, tmp_path: Path
) -> None:
    helm3 = build_helm(tmp_path / "helm-home", major=3)
    env = tools_env(tmp_path, cluster, helm3.binary, helm3.env)

    def sh(command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", command],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    # The page's reason for `kubectl create namespace` + `--take-ownership`: Helm 3 refuses the chart's own
    # namespace with --create-namespace.
    refused = sh("helm install gpuguard deploy/helm/gpuguard --namespace other --create-namespace")
    assert refused.returncode != 0 and 'namespaces "other" already exists' in refused.stderr, refused.stderr

    # "Installed with the plain manifests, remove them with `kubectl delete` on the same files".
    files = "-f deploy/daemonset.yaml -f deploy/admission-policy.yaml -f deploy/networkpolicy.yaml"
    applied = sh(f"kubectl apply {files}")
    assert applied.returncode == 0, applied.stderr
    assert admin.apps.read_namespaced_daemon_set("gpuguard", "gpuguard")
    # --wait=false: without a controller-manager here the namespace never leaves Terminating.
    deleted = sh(f"kubectl delete --wait=false {files}")
    assert deleted.returncode == 0, deleted.stderr
    assert 'daemonset.apps "gpuguard" deleted' in deleted.stdout
    rbac: Any = kubernetes.client.RbacAuthorizationV1Api(admin.api)
    with pytest.raises(kubernetes.client.exceptions.ApiException) as exc:
        rbac.read_cluster_role("gpuguard")
    assert exc.value.status == 404


def readme_deploy_blocks() -> list[str]:
    """The ```sh blocks of the README's Deploy section, in order."""
    deploy = README.read_text().split("\n## Deploy\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```sh\n(.*?)^```$", deploy, re.M | re.S)


def test_the_readmes_plain_manifest_deploy_starts_in_dry_run_and_enforces_with_the_file_as_shipped(
    cluster: Any, admin: Admin, tmp_path: Path
) -> None:
    """The README's Deploy section run as written: the plain manifests with every admission policy and the
    agents in dry run, then the file as shipped (enforcing); its Helm block is the page's install (above)."""
    helm4 = build_helm(tmp_path / "helm-home")
    env = tools_env(tmp_path, cluster, helm4.binary, helm4.env)
    first, enforce, with_helm = readme_deploy_blocks()
    assert with_helm == blocks()[0][1]

    def run(text: str) -> str:
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", text],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, f"{text}\n{result.stdout}\n{result.stderr}"
        return result.stdout

    def args() -> list[str]:
        ds = admin.apps.read_namespaced_daemon_set("gpuguard", "gpuguard")
        return list(ds.spec.template.spec.containers[0].args)

    out = run(first)
    assert args() == ["watch", "--dry-run"]
    for name in ("own-node-only", "own-devices-only", "own-events-only", "evictions"):
        assert f"validatingadmissionpolicybinding.admissionregistration.k8s.io/gpuguard-{name} created" in out
    assert "flowschema.flowcontrol.apiserver.k8s.io/gpuguard-events created" in out
    run(enforce)
    assert args() == ["watch"]
