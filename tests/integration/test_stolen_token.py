"""What a stolen agent token could still do with every policy applied (a red team's, kube-apiserver
v1.37, every deploy/*.yaml applied, a token bound to a Pod on its node). Each attack answered 201 or 200
before; now the policy refuses it with a message that names the rule, node or Event, or, where the agent
reads what others wrote, the victim's GPU is quarantined all the same and the budget is not spent.
The slow-body flood of API Priority and Fairness: tests/integration/test_apf_flood.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from gpuguard.quarantine.gpu.rules import rule_name
from harness import controlplane
from harness.dra import gpu_uuid, nvidia_slice
from harness.kube import (
    GPU_NODE_LABELS,
    Admin,
    enforced_admin,
    eventually,
    refused_by,
    token_client,
    unique_node,
)
from tests.integration.fixtures import start_agent  # noqa: F401
from tests.integration.test_admission import agent_core, other_node_probe
from tests.integration.test_device_admission import GROUP, PLURAL, VERSION, agent_api, rule

pytestmark = pytest.mark.timeout(240)

NODE_POLICY = "gpuguard-own-node-only"
DEVICE_POLICY = "gpuguard-own-devices-only"
EVENT_POLICY = "gpuguard-own-events-only"
MERGE = {"_content_type": "application/merge-patch+json"}
KIB = 1024


@pytest.fixture(scope="module")
def admin(admin_api: kubernetes.client.ApiClient, control_plane: Any) -> Admin:
    """Every policy enforced: each one's own refusal of a dry-run write seen once."""

    def other_pool(a: Admin) -> Callable[[], Any]:
        here, there = new_node(a), new_node(a)
        api = agent_api(a, control_plane, here)
        body = rule(there, "gpu-3")
        return lambda: api.create_cluster_custom_object(GROUP, VERSION, PLURAL, body, dry_run="All")

    def foreign_event(a: Admin) -> Callable[[], Any]:
        here, there = new_node(a), new_node(a)
        core = agent_events(a, control_plane, here)
        return lambda: core.create_namespaced_event("default", event(there), dry_run="All")

    enforced_admin(admin_api, policy=NODE_POLICY, probe=other_node_probe(control_plane))
    enforced_admin(admin_api, policy=EVENT_POLICY, probe=foreign_event)
    return enforced_admin(admin_api, policy=DEVICE_POLICY, probe=other_pool)


def new_node(admin: Admin, **kw: Any) -> str:
    return unique_node(admin, "steal", **kw)


def custom(admin: Admin) -> Any:
    return kubernetes.client.CustomObjectsApi(admin.api)


def create(api: Any, body: dict[str, Any]) -> Callable[[], Any]:
    return lambda: api.create_cluster_custom_object(GROUP, VERSION, PLURAL, body)


def agent_events(admin: Admin, control_plane: Any, node: str) -> Any:
    return kubernetes.client.CoreV1Api(
        token_client(control_plane.url, control_plane.ca_path, admin.agent_token(node))
    )


def event(about: str, **fields: Any) -> dict[str, Any]:
    """An Event shaped as gpuguard writes it (quarantine/node/writers.py record_event), about node `about`."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "metadata": {"name": f"{about}.{time.time_ns():x}", "namespace": "default"},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": about},
        "type": "Warning",
        "reason": "GPUUnhealthy",
        "message": "GPU 3 (GPU-x): xid-79",
        "source": {"component": "gpuguard", "host": about},
        "reportingComponent": "gpuguard",
        "reportingInstance": about,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
        **fields,
    }


# -- 1. rule squatting ---------------------------------------------------------------------------------------


def test_a_token_cannot_create_a_rule_under_another_nodes_gpu_name(admin: Admin, control_plane: Any) -> None:
    """The attack: a rule named for another node's GPU 3, in the token's own pool, with effect None. When that
    GPU then failed, its agent met the name on a 409 and adopted it. Both the dotted name and the one agents
    used before are refused; the token's own GPU's name is not."""
    here, there = new_node(admin), new_node(admin)
    api = agent_api(admin, control_plane, here)
    for name in (f"gpuguard.{there}.gpu-3", f"gpuguard-{there}-gpu-3"):
        body = rule(here, "gpu-3", name=name)
        body["spec"]["taint"]["effect"] = "None"
        text = refused_by(DEVICE_POLICY, create(api, body))
        assert text == (
            f"gpuguard may create a rule only under its exact name gpuguard.{here}.gpu-3; "
            f"refused CREATE of rule {name}"
        )
    api.create_cluster_custom_object(GROUP, VERSION, PLURAL, rule(here, "gpu-3"))
    api.delete_cluster_custom_object(GROUP, VERSION, PLURAL, f"gpuguard.{here}.gpu-3")


# -- 2. the GPU budget ---------------------------------------------------------------------------------------


def test_a_token_cannot_create_a_rule_without_its_gpu_count(admin: Admin, control_plane: Any) -> None:
    """The forged rules that spent the budget: effect None, a made-up device, no gpuguard.io/node-gpus (so
    each counted as a whole node)."""
    here = new_node(admin)
    api = agent_api(admin, control_plane, here)
    body = rule(here, "made-up-7")
    body["metadata"]["annotations"] = {}
    body["spec"]["taint"]["effect"] = "None"
    text = refused_by(DEVICE_POLICY, create(api, body))
    assert text == (
        "gpuguard's rules carry at most 16 annotations of 16 KiB together and gpuguard.io/node-gpus from 1 "
        f"to 1024; refused CREATE of rule gpuguard.{here}.made-up-7 with 0 annotations of 0 bytes, "
        'node-gpus ""'
    )


# -- 4. storage ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "what, change, named",
    [
        (
            "a 255 KiB annotation",
            lambda b: b["metadata"]["annotations"].update({"gpuguard.io/reason": "x" * 255 * KIB}),
            "with 2 annotations of 261160 bytes",
        ),
        ("a label of its own", lambda b: b["metadata"]["labels"].update({"team": "ml"}), "with label team"),
        (
            "an annotation of its own",
            lambda b: b["metadata"]["annotations"].update({"example.com/x": "y"}),
            "with annotation example.com/x",
        ),
        (
            "a finalizer",
            lambda b: b["metadata"].update({"finalizers": ["example.com/hold"]}),
            "finalizer example.com/hold",
        ),
    ],
)
def test_a_rule_carries_only_gpuguards_bounded_metadata(
    admin: Admin, control_plane: Any, what: str, change: Callable[[dict[str, Any]], None], named: str
) -> None:
    here = new_node(admin)
    api = agent_api(admin, control_plane, here)
    body = rule(here, "gpu-1")
    change(body)
    text = refused_by(DEVICE_POLICY, create(api, body))
    assert f"refused CREATE of rule gpuguard.{here}.gpu-1 " in text and named in text, (what, text)


def test_a_token_cannot_add_a_finalizer_to_its_own_rule(admin: Admin, control_plane: Any) -> None:
    """A foreign finalizer would keep the rule (and its GPU's quarantine) after its agent deletes it."""
    here = new_node(admin)
    api = agent_api(admin, control_plane, here)
    name = f"gpuguard.{here}.gpu-2"
    api.create_cluster_custom_object(GROUP, VERSION, PLURAL, rule(here, "gpu-2"))
    hold = {"metadata": {"finalizers": ["example.com/hold"]}}
    text = refused_by(
        DEVICE_POLICY, lambda: api.patch_cluster_custom_object(GROUP, VERSION, PLURAL, name, hold, **MERGE)
    )
    assert text.endswith(f"refused UPDATE of rule {name} with finalizer example.com/hold"), text
    api.delete_cluster_custom_object(GROUP, VERSION, PLURAL, name)


def test_a_token_cannot_grow_gpuguards_keys_on_its_own_node_past_the_bounds(
    admin: Admin, control_plane: Any
) -> None:
    """A 250 KiB gpuguard.io/ annotation was accepted, and every agent's budget watch receives it; nine
    gpuguard.io/ labels likewise. The agent's own writes (six annotations, one label) stay well inside."""
    node = new_node(admin)
    core = agent_core(admin, control_plane, node)
    big = {"metadata": {"annotations": {"gpuguard.io/reason": "x" * 250 * KIB}}}
    text = refused_by(NODE_POLICY, lambda: core.patch_node(node, big, **MERGE))
    size = len("gpuguard.io/reason") + 250 * KIB
    assert text == (
        "gpuguard may keep at most 8 gpuguard.io/ labels and 16 gpuguard.io/ annotations of 32 KiB "
        f"together on a node; refused growth of node {node} to annotations: 1 of {size} bytes"
    )
    labels = {"metadata": {"labels": {f"gpuguard.io/l{i}": "x" for i in range(9)}}}
    text = refused_by(NODE_POLICY, lambda: core.patch_node(node, labels, **MERGE))
    assert text.endswith(f"refused growth of node {node} to labels: 9"), text
    core.patch_node(node, {"metadata": {"annotations": {"gpuguard.io/reason": "ecc " * 1000}}}, **MERGE)
    assert "gpuguard.io/reason" in admin.node(node)["metadata"]["annotations"]


# -- 6. ancient-changes --------------------------------------------------------------------------------------


def test_a_token_cannot_add_an_ancient_changes_entry_below_the_managers_cap(
    admin: Admin, control_plane: Any
) -> None:
    """The attack: an "ancient-changes" entry appended on a node with 2 managers, claiming a GitOps label,
    nvidia.com/gpu.present and spec.podCIDR. Only the API server's own merge at the cap of 10 Update entries
    may make one (tests/integration/test_admission.py: gpuguard's write at the cap passes)."""
    node = new_node(admin, labels={**GPU_NODE_LABELS, "gitops.example.com/owner": "flux"})
    before = list(admin.node(node)["metadata"].get("managedFields") or [])
    assert 1 <= len(before) <= 3, before
    forged = {
        "manager": "ancient-changes",
        "operation": "Update",
        "apiVersion": "v1",
        "time": "2026-01-01T00:00:00Z",
        "fieldsType": "FieldsV1",
        "fieldsV1": {
            "f:metadata": {"f:labels": {"f:gitops.example.com/owner": {}, "f:nvidia.com/gpu.present": {}}},
            "f:spec": {"f:podCIDR": {}},
        },
    }
    core = agent_core(admin, control_plane, node)
    body = {"metadata": {"managedFields": [*before, forged]}}
    text = refused_by(NODE_POLICY, lambda: core.patch_node(node, body, **MERGE))
    assert "ancient-changes (Update) below the cap of 10 Update entries" in text, text
    assert admin.node(node)["metadata"].get("managedFields") == before


# -- 7. Events -----------------------------------------------------------------------------------------------


def test_a_token_may_post_events_only_about_its_own_node_as_gpuguard_and_bounded(
    admin: Admin, control_plane: Any
) -> None:
    """In "default" (the only namespace RBAC allows) the red team posted an Event about another node with
    source kubelet; and a 1 MiB one."""
    here, there = new_node(admin), new_node(admin)
    core = agent_events(admin, control_plane, here)

    def post(body: dict[str, Any]) -> Callable[[], Any]:
        return lambda: core.create_namespaced_event("default", body)

    other = event(there, source={"component": "kubelet", "host": there}, reason="Evicted")
    text = refused_by(EVENT_POLICY, post(other))
    assert text == (
        f"gpuguard may write Events only about its own node {here}; refused CREATE of event "
        f"{other['metadata']['name']} about Node {there}"
    )
    kubelet = event(here, source={"component": "kubelet", "host": here}, reportingComponent="")
    text = refused_by(EVENT_POLICY, post(kubelet))
    assert text.endswith(f"{kubelet['metadata']['name']} with source kubelet"), text
    huge = event(here, message="x" * KIB * KIB)
    text = refused_by(EVENT_POLICY, post(huge))
    assert text.endswith(f"{huge['metadata']['name']} with message of {KIB * KIB} bytes"), text
    # What the agent writes passes.
    core.create_namespaced_event("default", event(here))


# -- the agent's own reads: the victim's GPU quarantined, the budget not spent -------------------------------


def dra_node(admin: Admin, **labels: str) -> tuple[str, str]:
    """A node whose 8 GPUs NVIDIA's DRA driver publishes, and the fake NVML state listing them."""
    node = new_node(admin, labels={**GPU_NODE_LABELS, **labels})
    custom(admin).create_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", nvidia_slice(node))
    return node, "".join(f"gpu {i} uuid={gpu_uuid(node, i)}\n" for i in range(8))


def forged(pool: str, device: str, *, effect: str, name: str | None = None) -> dict[str, Any]:
    """A rule under gpuguard's labels as a token without the devices policy could write it."""
    body = rule(pool, device, name=name)
    body["metadata"]["annotations"] = {}
    body["spec"]["taint"]["effect"] = effect
    return body


@pytest.fixture
def made(admin: Admin) -> Iterator[list[str]]:
    """Names of rules the test made as admin: deleted at the end (they would count in later budgets)."""
    names: list[str] = []
    yield names
    for name in names:
        try:
            custom(admin).delete_cluster_custom_object(GROUP, VERSION, PLURAL, name)
        except kubernetes.client.exceptions.ApiException as exc:
            if exc.status != 404:
                raise


def rule_of(admin: Admin, name: str) -> dict[str, Any] | None:
    try:
        return custom(admin).get_cluster_custom_object(GROUP, VERSION, PLURAL, name)  # type: ignore[no-any-return]
    except kubernetes.client.exceptions.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def test_a_squatted_rule_name_leaves_the_victims_gpu_quarantined_by_the_node_taint(
    admin: Admin, start_agent: Any, tmp_path: Path, made: list[str]
) -> None:
    """The squat as it was done before the policy required the name (or on a cluster without that policy):
    another node's rule under the name this agent gives its GPU 3, with effect None. The agent does not adopt
    it on the 409: its node takes the taint, and the other rule is left as it was."""
    squatter = new_node(admin)
    victim, gpus = dra_node(admin)
    name = rule_name(victim, "gpu-3")
    assert name is not None
    made.append(name)
    custom(admin).create_cluster_custom_object(
        GROUP, VERSION, PLURAL, forged(squatter, "gpu-3", effect="None", name=name)
    )
    squatted = rule_of(admin, name)
    state = tmp_path / "gpus.state"
    state.write_text(gpus)
    agent, _, _ = start_agent(node=victim, state=state)
    state.write_text(gpus.replace(f"{gpu_uuid(victim, 3)}\n", f"{gpu_uuid(victim, 3)} ecc=2\n"))
    assert eventually(lambda: admin.tainted_for(victim), 15, what="the victim's node taint") == "ecc"
    after = rule_of(admin, name)
    assert after is not None and squatted is not None
    assert after["metadata"]["resourceVersion"] == squatted["metadata"]["resourceVersion"]
    assert [e["rule"] for e in agent.lines if e.get("event") == "device.rule_conflict"] == [name]


def test_forged_rules_leave_the_gpu_budget_to_real_faults(
    admin: Admin, start_agent: Any, tmp_path: Path, made: list[str]
) -> None:
    """Three forged rules (effect None, made-up devices, no node-gpus record) made a third node's real ECC
    rule "budget spent" at --max-quarantined 2; three more that block, all in one pool, now count as that one
    node. The victim's rule blocks (NoSchedule), its agent never says the budget is spent."""
    pool = f"steal-pool-{time.time_ns() % 10**9}"
    for i in range(3):
        for owner, effect in ((f"{pool}-forger-{i}", "None"), (f"{pool}-blocker", "NoSchedule")):
            body = forged(owner, f"made-up-{i}", effect=effect, name=f"gpuguard.{owner}.made-up-{i}")
            made.append(body["metadata"]["name"])
            custom(admin).create_cluster_custom_object(GROUP, VERSION, PLURAL, body)
    victim, gpus = dra_node(admin, **{"gpuguard-test/pool": pool})
    state = tmp_path / "gpus.state"
    state.write_text(gpus)
    args = ("--max-quarantined", "2", "--gpu-node-selector", f"gpuguard-test/pool={pool}")
    agent, _, _ = start_agent(node=victim, state=state, args=args)
    name = rule_name(victim, "gpu-1")
    assert name is not None
    made.append(name)
    state.write_text(gpus.replace(f"{gpu_uuid(victim, 1)}\n", f"{gpu_uuid(victim, 1)} ecc=2\n"))
    got = eventually(lambda: rule_of(admin, name), 15, what="the victim's rule")
    time.sleep(2.0)  # the order check after the create, which would step it back
    got = rule_of(admin, name) or got
    assert got["spec"]["taint"]["effect"] == "NoSchedule", json.dumps(got)
    assert "gpuguard.io/quarantine-deferred" not in got["metadata"].get("annotations", {})
    assert not [e for e in agent.lines if e.get("event") in ("device.budget_spent", "device.rule_yielded")]
    assert admin.our_taint(victim) is None


# -- 5. the install: which protections are there ------------------------------------------------------------


def test_the_operations_pages_check_names_every_protection_and_each_missing_one(
    admin: Admin, control_plane: Any
) -> None:
    """docs/operations.md, "Which protections are installed": its commands as written, with the pinned
    kubectl. All there: both succeed and list every name; one binding gone: that one is named, status 1."""
    bins = controlplane.cached_binaries()
    assert bins is not None and bins.kubectl is not None
    page = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    section = page.split("## Which protections are installed", 1)[1].split("\n#", 1)[0]
    commands = re.findall(r"^kubectl get .+$", section, re.M)
    assert len(commands) == 3, commands

    def kubectl(command: str) -> subprocess.CompletedProcess[str]:
        argv = [str(bins.kubectl), *command.split()[1:], "--kubeconfig", str(control_plane.kubeconfig_path)]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)

    names = [w for c in commands for w in c.split()[3:]]
    assert set(names) >= {NODE_POLICY, DEVICE_POLICY, EVENT_POLICY, "gpuguard", "gpuguard-events"}
    for command in commands:
        done = kubectl(command)
        assert done.returncode == 0, done.stderr
        assert all(n in done.stdout for n in command.split()[3:]), done.stdout
    bindings: Any = kubernetes.client.AdmissionregistrationV1Api(admin.api)
    saved = bindings.read_validating_admission_policy_binding(EVENT_POLICY)
    bindings.delete_validating_admission_policy_binding(EVENT_POLICY)
    try:
        done = kubectl(commands[0])
        assert done.returncode == 1 and f'"{EVENT_POLICY}" not found' in done.stderr, done.stderr
        assert NODE_POLICY in done.stdout and DEVICE_POLICY in done.stdout
    finally:
        bindings.create_validating_admission_policy_binding(
            {"metadata": {"name": EVENT_POLICY, "labels": saved.metadata.labels}, "spec": saved.spec}
        )
