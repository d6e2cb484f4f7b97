"""What a stolen agent token could do with `gpuguard hold` and `gpuguard history`'s node marks, with every
policy applied (as tests/integration/test_stolen_token_bounds.py): place a hold on its own node's GPUs or
change an operator's pending one (refused, as a release is: only removal, which the agent does once it has
handled it), and write a GPU history summary past the 4096 bytes the agent keeps to (refused; 4096 pass)."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from gpuguard.quarantine.repeat import published
from harness.kube import Admin, refused_by
from tests.integration.test_admission import agent_core
from tests.integration.test_stolen_token import MERGE, NODE_POLICY, admin, new_node  # noqa: F401

pytestmark = pytest.mark.timeout(240)

HOLD = "gpuguard.io/hold"


def test_a_token_cannot_place_or_change_a_hold_only_remove_one(admin: Admin, control_plane: Any) -> None:
    node = new_node(admin)
    admin.patch_node(node, {"metadata": {"annotations": {"node.alpha.kubernetes.io/ttl": "0"}}})
    core = agent_core(admin, control_plane, node)
    text = '{"at":"2026-12-05T08:00:00Z","by":"mallory","gpu":"GPU-aaaa"}'
    write = {"metadata": {"annotations": {HOLD: text}}}
    message = (
        "gpuguard may only remove gpuguard.io/hold (a human or a controller with its own RBAC holds a GPU for"
        f" repair); refused hold of node {node}"
    )
    assert refused_by(NODE_POLICY, partial(core.patch_node, node, write, **MERGE)) == message
    assert refused_by(NODE_POLICY, partial(core.patch_node_status, node, write, **MERGE)) == message
    admin.patch_node(node, {"metadata": {"annotations": {HOLD: text.replace("mallory", "ops")}}})
    assert refused_by(NODE_POLICY, partial(core.patch_node, node, write, **MERGE)) == message
    core.patch_node(node, {"metadata": {"annotations": {HOLD: None}}}, **MERGE)  # handled: removed
    assert HOLD not in (admin.node(node)["metadata"].get("annotations") or {})


def test_a_token_cannot_write_a_gpu_history_summary_over_4096_bytes(admin: Admin, control_plane: Any) -> None:
    node = new_node(admin)
    core = agent_core(admin, control_plane, node)
    key = published.ANN_HISTORY
    assert published.MAX_BYTES == 4096
    text = refused_by(
        NODE_POLICY,
        partial(core.patch_node, node, {"metadata": {"annotations": {key: "x" * 4097}}}, **MERGE),
    )
    assert text == (
        f"gpuguard may write at most 4096 bytes of gpuguard.io/gpu-history; refused 4097 bytes on node {node}"
    )
    core.patch_node(node, {"metadata": {"annotations": {key: "x" * 4096}}}, **MERGE)
