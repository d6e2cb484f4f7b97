"""Which DeviceTaintRule API the agent finds, on the real kube-apiserver (the pinned v1.37.2) started with
--runtime-config as other releases serve resource.k8s.io:

- Kubernetes 1.36 with the beta API and the DRADeviceTaintRules gate on: DeviceTaintRules only in
  resource.k8s.io/v1beta2 (`resource.k8s.io/v1beta2=true,resource.k8s.io/v1/devicetaintrules=false`; v1.37.2
  still serves v1beta2 when asked, from the same storage as 1.36). ResourceSlices stay v1 (GA since 1.34).
- Kubernetes 1.34/1.35, or 1.36 with the gate off: DRA and its slices, but no DeviceTaintRules in any version
  (`resource.k8s.io/v1/devicetaintrules=false`).

The real agent (the DaemonSet's ServiceAccount, a Pod-bound token, the admission policies applied) on the
fake NVML library: on the first, an Xid on GPU 3 is one rule created and, after a reboot, deleted in
v1beta2; on the second, the node taint. Both say what they found in one log line and on /healthz.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from harness import controlplane
from harness.dra import DRIVER, gpu_uuid, nvidia_slice
from harness.kube import Admin, agent_as_node, api_message, eventually, policy_denial, token_client
from tests.integration.test_device_admission import POLICY, rule

pytestmark = pytest.mark.timeout(240)

BETA_ONLY = "resource.k8s.io/v1beta2=true,resource.k8s.io/v1/devicetaintrules=false"
NO_RULES = "resource.k8s.io/v1/devicetaintrules=false"
GROUP = "resource.k8s.io"
ApiException = kubernetes.client.exceptions.ApiException
_names = itertools.count()


def _cluster(tmp_path_factory: pytest.TempPathFactory, runtime_config: str) -> Iterator[tuple[Any, Admin]]:
    cp = controlplane.ControlPlane(
        tmp_path_factory.mktemp("kube-rules-api"),
        allow_build=False,
        die_with_parent=True,
        runtime_config=runtime_config,
    )
    try:
        cp.start()
        api = kubernetes.config.new_client_from_config(config_file=str(cp.kubeconfig_path))  # type: ignore[no-untyped-call]
        with closing(api):
            admin = Admin(api)
            admin.apply_deploy_manifests()
            yield cp, admin
    finally:
        cp.stop()


@pytest.fixture(scope="module")
def beta_only_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Admin]]:
    yield from _cluster(tmp_path_factory, BETA_ONLY)


@pytest.fixture(scope="module")
def no_rules_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Admin]]:
    yield from _cluster(tmp_path_factory, NO_RULES)


def served(cp: Any, version: str) -> bool:
    code: int = cp.get(f"/apis/{GROUP}/{version}/devicetaintrules")[0]
    return code == 200


def dra_node(admin: Admin) -> tuple[str, str]:
    """A GPU node whose eight GPUs NVIDIA's DRA driver publishes (v1 ResourceSlice); its fake NVML state."""
    node = f"rapi-{next(_names)}"
    admin.make_node(node)
    kubernetes.client.CustomObjectsApi(admin.api).create_cluster_custom_object(
        GROUP, "v1", "resourceslices", nvidia_slice(node)
    )
    return node, "".join(f"gpu {i} uuid={gpu_uuid(node, i)}\n" for i in range(8))


def read_rule(admin: Admin, version: str, name: str) -> dict[str, Any] | None:
    try:
        custom: Any = kubernetes.client.CustomObjectsApi(admin.api)
        resp = custom.get_cluster_custom_object(
            GROUP, version, "devicetaintrules", name, _preload_content=False
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return json.loads(resp.data)  # type: ignore[no-any-return]


def test_the_control_plane_serves_device_taint_rules_only_in_v1beta2(beta_only_plane: Any) -> None:
    cp, _ = beta_only_plane
    assert served(cp, "v1beta2") and not served(cp, "v1")
    assert cp.get(f"/apis/{GROUP}/v1/resourceslices")[0] == 200


def test_on_a_1_36_style_api_the_agent_finds_v1beta2_and_creates_and_deletes_its_rule_there(
    beta_only_plane: Any, fakenvml: Path, tmp_path: Path
) -> None:
    cp, admin = beta_only_plane
    node, gpus = dra_node(admin)
    state = tmp_path / "gpus.state"
    state.write_text(gpus)
    args = ("--max-quarantined", "100%", "--node-resync", "1")
    agent = agent_as_node(admin, cp, node, state=state, lib=fakenvml, args=args).start()
    name = f"gpuguard.{node}.gpu-3"
    try:
        eventually(agent.ready, 20, what="agent /readyz")
        [line] = eventually(lambda: agent.events("device.rules_api"), 5, what="the device.rules_api line")
        assert line["api_version"] == "resource.k8s.io/v1beta2" and line["level"] == "info"
        assert line["tried"] == ["resource.k8s.io/v1", "resource.k8s.io/v1beta2"]
        assert agent.healthz()[1]["device_taint_api"] == "resource.k8s.io/v1beta2"

        state.write_text(gpus + "xid 3 79\n")
        got = eventually(
            lambda: read_rule(admin, "v1beta2", name), 20, interval=0.05, what="the v1beta2 rule"
        )
        assert got["apiVersion"] == f"{GROUP}/v1beta2"
        assert got["spec"]["deviceSelector"] == {"driver": DRIVER, "pool": node, "device": "gpu-3"}
        assert got["spec"]["taint"]["key"] == "gpuguard.io/gpu-unhealthy"
        assert got["spec"]["taint"]["effect"] == "NoSchedule"
        # The GPU alone: the node carries no taint of gpuguard's; /healthz names the GPU.
        assert admin.our_taint(node) is None
        health = eventually(
            lambda: (h := agent.healthz()[1])["gpu_quarantines"] and h, 10, what="/healthz gpu_quarantines"
        )
        assert [g["device"] for g in health["gpu_quarantines"]] == ["gpu-3"]
        assert not agent.events("device.rule_rejected")
    finally:
        agent.stop()

    # A reboot clears the Xid's evidence: the new agent deletes the rule, in v1beta2 too.
    admin.set_boot_id(node, "boot-2")
    state.write_text(gpus)
    agent = agent_as_node(
        admin, cp, node, state=state, lib=fakenvml, args=args, host_boot_id="host-boot-2"
    ).start()
    try:
        eventually(
            lambda: read_rule(admin, "v1beta2", name) is None, 30, what="the rule deleted after the reboot"
        )
        assert admin.our_taint(node) is None
    finally:
        agent.stop()


def test_the_device_admission_policy_holds_for_v1beta2_rules(beta_only_plane: Any) -> None:
    """The policy matches every version of the group: a rule for another node's pool is denied in v1beta2."""
    cp, admin = beta_only_plane
    here, _ = dra_node(admin)
    there, _ = dra_node(admin)
    custom: Any = kubernetes.client.CustomObjectsApi(
        token_client(cp.url, cp.ca_path, admin.agent_token(here))
    )
    foreign = {**rule(there, "gpu-0"), "apiVersion": f"{GROUP}/v1beta2"}

    def denied() -> str | None:
        try:
            custom.create_cluster_custom_object(GROUP, "v1beta2", "devicetaintrules", foreign, dry_run="All")
        except ApiException as exc:
            text = api_message(exc)
            return text if exc.status == 403 and policy_denial(POLICY) in text else None
        raise AssertionError("a rule for another node's pool was admitted")

    text = eventually(denied, 30, interval=0.1, what="the policy's refusal")
    assert f"{there}/gpu-0" in text
    own = {**rule(here, "gpu-0"), "apiVersion": f"{GROUP}/v1beta2"}
    custom.create_cluster_custom_object(GROUP, "v1beta2", "devicetaintrules", own, dry_run="All")


def test_where_no_version_serves_device_taint_rules_the_agent_says_so_and_taints_the_node(
    no_rules_plane: Any, fakenvml: Path, tmp_path: Path
) -> None:
    cp, admin = no_rules_plane
    assert not served(cp, "v1") and not served(cp, "v1beta2")
    node, gpus = dra_node(admin)
    state = tmp_path / "gpus.state"
    state.write_text(gpus)
    agent = agent_as_node(admin, cp, node, state=state, lib=fakenvml, args=("--max-quarantined", "100%"))
    agent.start()
    try:
        eventually(agent.ready, 20, what="agent /readyz")
        [line] = eventually(lambda: agent.events("device.rules_api"), 5, what="the device.rules_api line")
        assert line["api_version"] is None and line["level"] == "warning"
        assert line["tried"] == ["resource.k8s.io/v1", "resource.k8s.io/v1beta2"]
        assert "node taint" in line["note"]
        assert agent.healthz()[1]["device_taint_api"] == "none"

        state.write_text(gpus + "xid 3 79\n")
        assert eventually(lambda: admin.tainted_for(node), 20, what="gpuguard's node taint") == "xid-79"
        assert agent.healthz()[1]["gpu_quarantines"] == []
    finally:
        agent.stop()
