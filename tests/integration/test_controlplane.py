"""The test control plane behaves like a real cluster in the ways gpuguard relies on.

Why: later integration tests assume Node status, bound ServiceAccount tokens, RBAC and
the audit log all work; these tests pin that down on their own, with clear failures.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from typing import Any, TypeVar

import kubernetes
import pytest
import urllib3
from kubernetes.client import (
    ApiClient,
    AuthenticationV1TokenRequest,
    V1BoundObjectReference,
    V1Container,
    V1Namespace,
    V1Node,
    V1NodeStatus,
    V1NodeSystemInfo,
    V1ObjectMeta,
    V1Pod,
    V1PodSpec,
    V1SelfSubjectReview,
    V1ServiceAccount,
    V1TokenRequestSpec,
)
from kubernetes.client.exceptions import ApiException

from harness import controlplane

ControlPlane = controlplane.ControlPlane
T = TypeVar("T")


def _some(value: T | None) -> T:
    """Narrow the client's Optional fields; the server always fills these."""
    assert value is not None
    return value


def _suffix() -> str:
    return uuid.uuid4().hex[:8]


def _client_for_token(cp: ControlPlane, token: str, user_agent: str) -> ApiClient:
    """An ApiClient that authenticates with a bearer token and sends user_agent."""
    cfg = kubernetes.client.Configuration(
        host=cp.url,
        ssl_ca_cert=str(cp.ca_path),
        api_key={"authorization": token},
        api_key_prefix={"authorization": "Bearer"},
    )
    client = ApiClient(cfg)
    client.user_agent = user_agent
    return client


def _admin_client(cp: ControlPlane, user_agent: str) -> ApiClient:
    client: ApiClient = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=str(cp.kubeconfig_path)
    )
    client.user_agent = user_agent
    return client


def _wait_audit(
    cp: ControlPlane, user_agent: str, since: int, count: int, timeout: float = 5.0
) -> list[dict[str, Any]]:
    """Audit events of user_agent after line `since`, waiting until `count` are there."""
    deadline = time.monotonic() + timeout
    events = cp.audit_events(user_agent_prefix=user_agent, since_line=since)
    while len(events) < count and time.monotonic() < deadline:
        time.sleep(0.05)
        events = cp.audit_events(user_agent_prefix=user_agent, since_line=since)
    return events


@pytest.fixture(scope="module")
def namespace(admin_api: ApiClient) -> Iterator[str]:
    """A fresh namespace (unique, so reused clusters do not collide)."""
    name = f"itest-{_suffix()}"
    core = kubernetes.client.CoreV1Api(admin_api)
    core.create_namespace(V1Namespace(metadata=V1ObjectMeta(name=name)))
    yield name
    # Without kube-controller-manager the namespace stays Terminating; harmless.
    core.delete_namespace(name)


@dataclass(frozen=True)
class Node:
    """A registered Node and the bootID it was created with."""

    name: str
    uid: str
    boot_id: str


def _node_info(boot_id: str) -> V1NodeSystemInfo:
    """What a kubelet reports; every field is required by the client model."""
    return V1NodeSystemInfo(
        architecture="amd64",
        boot_id=boot_id,
        container_runtime_version="containerd://2.0.0",
        kernel_version="6.1.0",
        kube_proxy_version="",
        kubelet_version=controlplane.kube_version(),
        machine_id=uuid.uuid4().hex,
        operating_system="linux",
        os_image="Debian GNU/Linux 13 (trixie)",
        system_uuid=str(uuid.uuid4()),
    )


@pytest.fixture(scope="module")
def node(admin_api: ApiClient) -> Iterator[Node]:
    """A Node object as a kubelet would register it (no kubelet runs)."""
    name = f"gpu-node-{_suffix()}"
    core = kubernetes.client.CoreV1Api(admin_api)
    boot_id = str(uuid.uuid4())
    created = core.create_node(
        V1Node(
            metadata=V1ObjectMeta(name=name, labels={"nvidia.com/gpu.present": "true"}),
            status=V1NodeStatus(node_info=_node_info(boot_id)),
        )
    )
    yield Node(name=name, uid=_some(_some(created.metadata).uid), boot_id=boot_id)
    core.delete_node(name)


@dataclass(frozen=True)
class BoundToken:
    """A ServiceAccount token bound to a Pod on `node`, as a DaemonSet pod would hold."""

    namespace: str
    service_account: str
    pod: str
    pod_uid: str
    node: str
    token: str


@pytest.fixture(scope="module")
def bound_token(admin_api: ApiClient, namespace: str, node: Node) -> Iterator[BoundToken]:
    """ServiceAccount + Pod on the node + TokenRequest bound to that Pod."""
    core = kubernetes.client.CoreV1Api(admin_api)
    sa = "gpuguard"
    core.create_namespaced_service_account(namespace, V1ServiceAccount(metadata=V1ObjectMeta(name=sa)))
    pod = core.create_namespaced_pod(
        namespace,
        V1Pod(
            metadata=V1ObjectMeta(name="gpuguard-agent"),
            spec=V1PodSpec(
                node_name=node.name,
                service_account_name=sa,
                containers=[V1Container(name="agent", image="registry.invalid/gpuguard:test")],
            ),
        ),
    )
    pod_meta = _some(pod.metadata)
    pod_name, pod_uid = _some(pod_meta.name), _some(pod_meta.uid)
    request = core.create_namespaced_service_account_token(
        sa,
        namespace,
        AuthenticationV1TokenRequest(
            spec=V1TokenRequestSpec(
                expiration_seconds=600,
                bound_object_ref=V1BoundObjectReference(
                    api_version="v1", kind="Pod", name=pod_name, uid=pod_uid
                ),
            )
        ),
    )
    yield BoundToken(
        namespace=namespace,
        service_account=sa,
        pod=pod_name,
        pod_uid=pod_uid,
        node=node.name,
        token=_some(_some(request.status).token),
    )
    # No kubelet will confirm a graceful delete: force it.
    core.delete_namespaced_pod(pod_name, namespace, grace_period_seconds=0)


def test_version_is_pinned_release(control_plane: ControlPlane, admin_api: ApiClient) -> None:
    """/version reports the release build.sh pinned (ldflags took effect)."""
    pinned = controlplane.kube_version()
    info = kubernetes.client.VersionApi(admin_api).get_code()
    assert info.git_version == pinned
    major, minor, _ = pinned.lstrip("v").split(".")
    assert (info.major, info.minor) == (major, minor)
    assert info.git_tree_state == "clean"
    assert control_plane.version()["gitVersion"] == pinned
    assert (int(major), int(minor)) >= (1, 34)


def test_node_status_boot_id(admin_api: ApiClient, node: Node) -> None:
    """status.nodeInfo.bootID survives create, and the status subresource can change it."""
    core = kubernetes.client.CoreV1Api(admin_api)
    got = core.read_node(node.name)
    assert _some(_some(got.status).node_info).boot_id == node.boot_id

    rebooted = str(uuid.uuid4())
    core.patch_node_status(node.name, {"status": {"nodeInfo": {"bootID": rebooted}}})
    status = _some(core.read_node_status(node.name).status)
    assert _some(status.node_info).boot_id == rebooted
    core.patch_node_status(node.name, {"status": {"nodeInfo": {"bootID": node.boot_id}}})


def test_bound_token_identity_is_audited(control_plane: ControlPlane, bound_token: BoundToken) -> None:
    """A Pod-bound token authenticates as the SA, carries pod/node claims, and is audited."""
    user_agent = f"gpuguard-itest/{_suffix()}"
    since = control_plane.audit_line_count()
    with closing(_client_for_token(control_plane, bound_token.token, user_agent)) as client:
        review = kubernetes.client.AuthenticationV1Api(client).create_self_subject_review(
            V1SelfSubjectReview()
        )
    username = f"system:serviceaccount:{bound_token.namespace}:{bound_token.service_account}"
    info = _some(_some(review.status).user_info)
    extra = _some(info.extra)
    assert info.username == username
    assert extra["authentication.kubernetes.io/pod-name"] == [bound_token.pod]
    assert extra["authentication.kubernetes.io/pod-uid"] == [bound_token.pod_uid]
    assert extra["authentication.kubernetes.io/node-name"] == [bound_token.node]

    # Blocking audit mode: the event is on disk before the response, so no waiting here.
    events = control_plane.audit_events(user_agent_prefix=user_agent, since_line=since)
    assert len(events) == 1, events
    event = events[0]
    assert event["userAgent"] == user_agent
    assert event["verb"] == "create"
    assert event["objectRef"]["resource"] == "selfsubjectreviews"
    assert event["user"]["username"] == username
    assert event["user"]["extra"]["authentication.kubernetes.io/pod-name"] == [bound_token.pod]
    assert event["stage"] == "ResponseComplete"
    assert event["responseStatus"]["code"] == 201


def test_bound_token_cannot_list_secrets(control_plane: ControlPlane, bound_token: BoundToken) -> None:
    """RBAC is enforced: a ServiceAccount with no bindings gets 403, and that is audited."""
    user_agent = f"gpuguard-itest/{_suffix()}"
    since = control_plane.audit_line_count()
    with (
        closing(_client_for_token(control_plane, bound_token.token, user_agent)) as client,
        pytest.raises(ApiException) as excinfo,
    ):
        kubernetes.client.CoreV1Api(client).list_namespaced_secret(bound_token.namespace)
    assert excinfo.value.status == 403
    events = _wait_audit(control_plane, user_agent, since, 1)
    assert [e["responseStatus"]["code"] for e in events] == [403]
    assert events[0]["annotations"]["authorization.k8s.io/decision"] == "forbid"


def test_audit_counts_requests_per_user_agent(control_plane: ControlPlane, node: Node) -> None:
    """Each request of a client shows up exactly once, keyed by its User-Agent."""
    user_agent = f"gpuguard-count/{_suffix()}"
    since = control_plane.audit_line_count()
    with closing(_admin_client(control_plane, user_agent)) as client:
        core = kubernetes.client.CoreV1Api(client)
        for _ in range(3):
            core.read_node(node.name)
        core.list_node(label_selector="nvidia.com/gpu.present=true")
    events = control_plane.audit_events(user_agent_prefix=user_agent, since_line=since)
    assert [(e["verb"], e["objectRef"]["resource"]) for e in events] == [
        ("get", "nodes"),
        ("get", "nodes"),
        ("get", "nodes"),
        ("list", "nodes"),
    ]
    assert all(e["user"]["username"] == "admin" for e in events)
    assert "system:masters" in events[0]["user"]["groups"]


def test_apiserver_restart(control_plane: ControlPlane, admin_api: ApiClient, node: Node) -> None:
    """stop_apiserver()/start_apiserver() give an outage and a recovery; etcd keeps data."""
    core = kubernetes.client.CoreV1Api(admin_api)
    url = control_plane.url
    control_plane.stop_apiserver()
    try:
        assert not control_plane.is_ready()
        with pytest.raises(urllib3.exceptions.HTTPError):  # connection refused, after retries
            core.read_node(node.name, _request_timeout=2)
    finally:
        control_plane.start_apiserver()
    assert control_plane.url == url
    assert control_plane.is_ready()
    assert _some(core.read_node(node.name).metadata).uid == node.uid


def test_with_all_means_every_component_but_karpenter_which_is_asked_for_by_name() -> None:
    assert controlplane.parse_components("all") == ("controller-manager", "scheduler", "kwok")
    assert controlplane.parse_components(" karpenter,all ") == (
        "controller-manager",
        "scheduler",
        "kwok",
        "karpenter",
    )
    assert controlplane.parse_components("") == ()


@pytest.mark.parametrize(
    ("text", "why"),
    [("karpenter", "karpenter needs kwok"), ("scheduler,kubelet", "unknown components ['kubelet']")],
)
def test_a_component_list_that_cannot_start_is_refused_before_anything_starts(text: str, why: str) -> None:
    with pytest.raises(controlplane.ControlPlaneError, match=why.replace("[", r"\[").replace("]", r"\]")):
        controlplane.ControlPlane(components=tuple(text.split(",")))
