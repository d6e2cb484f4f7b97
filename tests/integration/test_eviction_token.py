"""What a stolen agent token can do with the eviction Role (deploy/eviction/rbac.yaml in ONE namespace), on
the real API server with every admission policy of deploy/ enforced: the measurements behind docs/security.md,
"Eviction: what a stolen token can do". Each answer is the API server's own; nothing here is mocked."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import kubernetes
import pytest
import yaml
from kubernetes import utils

from harness.kube import DEPLOY, Admin, refused_by, token_client
from tests.integration.test_stolen_token import EVENT_POLICY, admin, new_node  # noqa: F401

pytestmark = pytest.mark.timeout(240)

ApiException = kubernetes.client.exceptions.ApiException
LISTED, OTHER = "evict-listed", "evict-other"


def setup_namespaces(admin: Admin) -> None:
    """LISTED with the eviction Role, OTHER without it (an ordinary namespace of another team)."""
    core: Any = admin.core
    for ns in (LISTED, OTHER):
        # No controller-manager here: the namespace's default ServiceAccount, which pods need, made by hand.
        for create, args in (
            (core.create_namespace, ({"metadata": {"name": ns}},)),
            (core.create_namespaced_service_account, (ns, {"metadata": {"name": "default"}})),
        ):
            try:
                create(*args)
            except ApiException as exc:
                if exc.status != 409:
                    raise
    for doc in yaml.safe_load_all(
        (DEPLOY / "eviction" / "rbac.yaml").read_text().replace("ml-serving", LISTED)
    ):
        try:
            utils.create_from_dict(admin.api, doc)  # type: ignore[no-untyped-call]
        except utils.FailToCreateError as exc:
            if not all(getattr(e, "status", None) == 409 for e in exc.api_exceptions):
                raise


def agent(admin: Admin, control_plane: Any, node: str) -> Any:
    """CoreV1Api with the agent's token, bound to a pod of the DaemonSet on `node`."""
    return kubernetes.client.CoreV1Api(
        token_client(control_plane.url, control_plane.ca_path, admin.agent_token(node))
    )


def running(admin: Admin, namespace: str, name: str) -> None:
    """The pod Running and Ready, as its kubelet would report it (none runs here): a Pending pod's eviction
    ignores PodDisruptionBudgets, a running one's does not."""
    admin.core.patch_namespaced_pod_status(
        name,
        namespace,
        {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
    )


def pod(admin: Admin, namespace: str, node: str, *, grace: int | None = None) -> str:
    """A pod bound to `node` (no kubelet runs it: it stays Pending, which eviction does not care about);
    `grace`: its terminationGracePeriodSeconds."""
    name = f"victim-{time.monotonic_ns() % 10**9}"
    spec: dict[str, Any] = {"nodeName": node, "containers": [{"name": "c", "image": "registry.example/x:1"}]}
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    admin.core.create_namespaced_pod(
        namespace, {"metadata": {"name": name, "labels": {"app": name}}, "spec": spec}
    )
    return name


def eviction(name: str, namespace: str) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace}}


def status(call: Callable[[], Any]) -> int:
    try:
        call()
    except ApiException as exc:
        return int(exc.status)
    return 201


def pod_event(node: str, namespace: str, name: str, **fields: Any) -> dict[str, Any]:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "metadata": {"generateName": f"{name}.gpuguard-", "namespace": namespace},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": name},
        "type": "Warning",
        "reason": "GPUPodEvicted",
        "message": f"gpuguard evicted pod {namespace}/{name} from node {node}",
        "source": {"component": "gpuguard", "host": node},
        "reportingComponent": "gpuguard",
        "reportingInstance": node,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
        **fields,
    }


def test_a_stolen_token_evicts_in_the_listed_namespace_on_any_node_and_nothing_elsewhere(
    admin: Admin, control_plane: Any
) -> None:
    setup_namespaces(admin)
    here, there = new_node(admin), new_node(admin)
    core = agent(admin, control_plane, here)
    own, foreign, elsewhere = pod(admin, LISTED, here), pod(admin, LISTED, there), pod(admin, OTHER, here)

    # What it is for: a pod on its own node, in the listed namespace.
    assert status(lambda: core.create_namespaced_pod_eviction(own, LISTED, eviction(own, LISTED))) == 201
    # RBAC cannot bind pods/eviction to a node: a pod of the listed namespace on ANOTHER node goes too.
    assert (
        status(lambda: core.create_namespaced_pod_eviction(foreign, LISTED, eviction(foreign, LISTED))) == 201
    )
    # Nothing in a namespace that is not listed, not even on its own node.
    assert (
        status(lambda: core.create_namespaced_pod_eviction(elsewhere, OTHER, eviction(elsewhere, OTHER)))
        == 403
    )
    # No delete (which would bypass PodDisruptionBudgets), no list, no watch, no update: only get, by name.
    kept = pod(admin, LISTED, there)
    assert status(lambda: core.delete_namespaced_pod(kept, LISTED)) == 403
    assert status(lambda: core.list_namespaced_pod(LISTED)) == 403
    assert status(core.list_pod_for_all_namespaces) == 403
    assert (
        status(lambda: core.patch_namespaced_pod(kept, LISTED, {"metadata": {"labels": {"x": "y"}}})) == 403
    )
    assert status(lambda: core.read_namespaced_pod(kept, LISTED)) == 201  # its spec is readable by name
    assert status(lambda: core.read_namespaced_pod(elsewhere, OTHER)) == 403
    assert status(lambda: core.list_namespaced_secret(LISTED)) == 403


def test_a_stolen_token_cannot_evict_past_a_pod_disruption_budget(admin: Admin, control_plane: Any) -> None:
    setup_namespaces(admin)
    here = new_node(admin)
    core = agent(admin, control_plane, here)
    guarded = pod(admin, LISTED, here)
    running(admin, LISTED, guarded)
    policy: Any = kubernetes.client.PolicyV1Api(admin.api)
    policy.create_namespaced_pod_disruption_budget(
        LISTED,
        {
            "metadata": {"name": guarded},
            "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": guarded}}},
        },
    )
    try:
        core.create_namespaced_pod_eviction(guarded, LISTED, eviction(guarded, LISTED))
    except ApiException as exc:
        assert exc.status == 429, exc.body
        assert "disruption budget" in json.loads(exc.body or "{}")["message"]
    else:
        raise AssertionError("evicted past the budget")
    assert admin.core.read_namespaced_pod(guarded, LISTED).metadata.deletion_timestamp is None


def test_a_stolen_token_posts_pod_events_only_with_the_evictions_reasons_as_its_node(
    admin: Admin, control_plane: Any
) -> None:
    setup_namespaces(admin)
    here, there = new_node(admin), new_node(admin)
    core = agent(admin, control_plane, here)
    victim = pod(admin, LISTED, here)

    def post(namespace: str, body: dict[str, Any]) -> Callable[[], Any]:
        return lambda: core.create_namespaced_event(namespace, body)

    core.create_namespaced_event(LISTED, pod_event(here, LISTED, victim))  # what the agent writes
    blocked = pod_event(here, LISTED, victim, reason="GPUEvictionBlocked")
    core.create_namespaced_event(LISTED, blocked)
    text = refused_by(EVENT_POLICY, post(LISTED, pod_event(here, LISTED, victim, reason="Killing")))
    assert f"about Pod {victim}" in text
    text = refused_by(EVENT_POLICY, post(LISTED, pod_event(here, LISTED, victim, reportingInstance=there)))
    assert "reportingInstance" in text or f"about Pod {victim}" in text
    other_ns = pod_event(here, LISTED, victim)
    other_ns["involvedObject"]["namespace"] = OTHER  # about a pod of another namespace: the API's own 422
    assert status(post(LISTED, other_ns)) == 422
    assert status(post(OTHER, pod_event(here, OTHER, victim))) == 403  # RBAC: no Events outside the listed


EVICTION_POLICY = "gpuguard-evictions"


def test_a_stolen_token_cannot_shorten_an_evicted_pods_grace_period(admin: Admin, control_plane: Any) -> None:
    """The attack: an Eviction with deleteOptions.gracePeriodSeconds 0 deleted a pod whose own grace period
    is 300 s at once. Refused, whatever the number; the agent's own Eviction (no grace period: the pod's
    own) passes, and the pod is given its 300 s."""
    setup_namespaces(admin)
    here = new_node(admin)
    core = agent(admin, control_plane, here)
    victim = pod(admin, LISTED, here)
    for seconds in (0, 1, 300, 3600):
        body = {**eviction(victim, LISTED), "deleteOptions": {"gracePeriodSeconds": seconds}}
        text = refused_by(EVICTION_POLICY, partial(core.create_namespaced_pod_eviction, victim, LISTED, body))
        assert text == (
            "gpuguard evicts a pod with its own terminationGracePeriodSeconds; refused eviction of pod "
            f"{LISTED}/{victim} with gracePeriodSeconds {seconds}"
        )
    assert admin.core.read_namespaced_pod(victim, LISTED).metadata.deletion_timestamp is None
    slow = pod(admin, LISTED, here, grace=300)
    running(admin, LISTED, slow)
    core.create_namespaced_pod_eviction(slow, LISTED, eviction(slow, LISTED))
    assert admin.core.read_namespaced_pod(slow, LISTED).metadata.deletion_grace_period_seconds == 300


def test_a_stolen_token_posts_no_pod_event_where_it_may_not_evict(admin: Admin, control_plane: Any) -> None:
    """The attack: a GPUPodEvicted Event about a pod in "default" (where the Role for node Events lets the
    token write), with eviction off there. Refused in every namespace where the token may not evict; in the
    eviction's namespace the agent's own Event still passes."""
    setup_namespaces(admin)
    here = new_node(admin)
    core = agent(admin, control_plane, here)
    body = pod_event(here, "default", "web-0")
    text = refused_by(EVENT_POLICY, lambda: core.create_namespaced_event("default", body))
    assert text.endswith("about Pod web-0"), text
    victim = pod(admin, LISTED, here)
    core.create_namespaced_event(LISTED, pod_event(here, LISTED, victim))
