"""The AcceleratedHardwareReady mirror (--accelerated-hardware-condition) on the real API server, written by
the agent's own token under the enforced admission policy: the condition Karpenter's AWS repair policy and EKS
node auto-repair read is written, and one the EKS node monitoring agent owns is left alone (never two
writers: the agent holds off, and the policy refuses its token the write)."""

from __future__ import annotations

from typing import Any

import pytest

from harness.kube import GPUS_OK, Admin, eventually
from tests.integration.fixtures import start_agent  # noqa: F401
from tests.integration.test_admission import admin, agent_core, refused  # noqa: F401

pytestmark = pytest.mark.timeout(120)

TYPE = "AcceleratedHardwareReady"
ECC = GPUS_OK.replace("GPU-it-0", "GPU-it-0 ecc=2")
EKS_OWNED = {
    "type": TYPE,
    "status": "True",
    "reason": "NvidiaAcceleratedHardwareIsReady",
    "message": "Monitoring for the Nvidia AcceleratedHardware system is active",
    "lastHeartbeatTime": "2026-01-01T00:00:00Z",
    "lastTransitionTime": "2026-01-01T00:00:00Z",
}


def accelerated(admin: Admin, node: str) -> dict[str, Any] | None:
    conditions = admin.node(node).get("status", {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == TYPE), None)


def test_the_agent_writes_accelerated_hardware_ready_false_with_the_eks_reason_while_it_quarantines(
    admin: Admin,
    start_agent: Any,
) -> None:
    _, node, state = start_agent(args=("--accelerated-hardware-condition",))
    healthy = eventually(lambda: accelerated(admin, node), 10, what="AcceleratedHardwareReady")
    assert (healthy["status"], healthy["reason"]) == ("True", "NvidiaAcceleratedHardwareIsReady")
    assert healthy["message"] == "gpuguard: 2 GPUs healthy"
    state.write_text(ECC)
    faulty = eventually(
        lambda: (c := accelerated(admin, node)) is not None and c["status"] == "False" and c, 10, what="False"
    )
    assert faulty["reason"] == "NvidiaDoubleBitError"
    assert faulty["message"].startswith("gpuguard: ecc: 2 uncorrected")
    assert admin.our_taint(node) is not None


def test_an_accelerated_hardware_ready_the_eks_agent_owns_is_left_alone(
    admin: Admin,
    control_plane: Any,
    start_agent: Any,
) -> None:
    agent, node, state = start_agent(args=("--accelerated-hardware-condition",))
    admin.core.patch_node_status(node, {"status": {"conditions": [EKS_OWNED]}}, _preload_content=False)
    state.write_text(ECC)
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    eventually(
        lambda: any(line.get("event") == "node.accelerated_condition_foreign" for line in agent.lines),
        10,
        what="the agent saying it holds off",
    )
    assert accelerated(admin, node) == EKS_OWNED
    # And the admission policy refuses the agent's token the write, whatever the agent would do.
    ours = {**EKS_OWNED, "status": "False", "reason": "NvidiaDoubleBitError", "message": "gpuguard: ecc"}
    core = agent_core(admin, control_plane, node)
    refused(lambda: core.patch_node_status(node, {"status": {"conditions": [ours]}}))
    assert accelerated(admin, node) == EKS_OWNED
