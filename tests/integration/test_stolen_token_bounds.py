"""What a stolen agent token could still bloat or take with every policy applied (the red team's third run,
kube-apiserver v1.37, every deploy/*.yaml applied, a token bound to a Pod on its node): managedFields of
1.2 MB on each of its own node's rules, made-up keys in gpuguard's own managedFields entry of its node, a
1 MiB GPUHealthy message, thousands of gpuguard.io/ taints, and an operator's needs-repair label. Each write
answered 200 or 201 before; now the policy refuses it with a message that names the bound, and what the
agent itself writes still passes. Evictions and pod Events: tests/integration/test_eviction_token.py.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import pytest

from harness.kube import Admin, refused_by
from tests.integration.test_admission import agent_core
from tests.integration.test_device_admission import GROUP, PLURAL, VERSION, agent_api, rule
from tests.integration.test_stolen_token import (  # noqa: F401
    DEVICE_POLICY,
    KIB,
    MERGE,
    NODE_POLICY,
    admin,
    create,
    new_node,
)

pytestmark = pytest.mark.timeout(240)

REPAIR = "gpuguard.io/needs-repair"
PLACED = "gpuguard.io/needs-repair-placed"


def bomb(keys: int, *, api_version: str = "v1", prefix: str = "f:example.com/made-up-") -> dict[str, Any]:
    """A managedFields entry claiming `keys` made-up annotations, each key ~60 bytes, under the object's own
    apiVersion (the API server drops an entry of another version)."""
    return {
        "manager": "ops",
        "operation": "Update",
        "apiVersion": api_version,
        "time": "2026-01-01T00:00:00Z",
        "fieldsType": "FieldsV1",
        "fieldsV1": {
            "f:metadata": {"f:annotations": {f"{prefix}{i:06d}-{'x' * 32}": {} for i in range(keys)}}
        },
    }


# -- DeviceTaintRules: the whole rule, managedFields included -----------------------------------------------


def test_a_token_cannot_create_a_rule_with_a_managed_fields_bomb(admin: Admin, control_plane: Any) -> None:
    """The attack: 100 of its own node's rules, each with a 1.2 MB managedFields entry; an agent listing them
    peaked at 288 MiB. A rule as the agent writes it passes."""
    here = new_node(admin)
    api = agent_api(admin, control_plane, here)
    body = rule(here, "gpu-1")
    body["metadata"]["managedFields"] = [bomb(200, api_version=f"{GROUP}/{VERSION}")]
    text = refused_by(DEVICE_POLICY, create(api, body))
    assert text.startswith(
        "gpuguard's rules carry managedFields of at most 8 KiB of field names; "
        f"refused CREATE of rule gpuguard.{here}.gpu-1 with managedFields of "
    ), text
    assert int(text.rsplit(" ", 2)[1]) > 200 * 60, text
    body["metadata"]["managedFields"] = [
        bomb(20_000, api_version=f"{GROUP}/{VERSION}")
    ]  # the red team's 1.2 MB
    refused_by(DEVICE_POLICY, create(api, body))
    made = api.create_cluster_custom_object(GROUP, VERSION, PLURAL, rule(here, "gpu-1"))
    name = made["metadata"]["name"]
    # ...and a patch of its own rule cannot bring one in either.
    patch = {
        "metadata": {
            "managedFields": [*made["metadata"]["managedFields"], bomb(200, api_version=f"{GROUP}/{VERSION}")]
        }
    }
    text = refused_by(
        DEVICE_POLICY, lambda: api.patch_cluster_custom_object(GROUP, VERSION, PLURAL, name, patch, **MERGE)
    )
    assert f"refused UPDATE of rule {name} with managedFields of " in text, text
    api.delete_cluster_custom_object(GROUP, VERSION, PLURAL, name)


# -- its own node: gpuguard's managedFields entry, taints, condition messages --------------------------------


def test_gpuguards_own_managed_fields_entry_may_name_only_keys_the_node_holds(
    admin: Admin, control_plane: Any
) -> None:
    """The attack: gpuguard's own entry on its node with 1,248 made-up f:gpuguard.io/ keys (the old check
    looked at the prefix only): the node grew from 2 KB to 1.26 MB. The same entry naming only the label the
    write sets passes."""
    node = new_node(admin)
    core = agent_core(admin, control_plane, node)
    core.patch_node(
        node,
        {
            "metadata": {"labels": {"gpuguard.io/quarantined": "true"}},
            "spec": {
                "taints": [
                    *(admin.node(node)["spec"].get("taints") or []),
                    {"key": "gpuguard.io/gpu-unhealthy", "value": "ecc", "effect": "NoSchedule"},
                ]
            },
        },
        **MERGE,
    )
    entries = admin.node(node)["metadata"]["managedFields"]
    ours = next(e for e in entries if e["manager"] == "gpuguard" and not e.get("subresource"))
    forged = {
        **ours,
        "fieldsV1": {
            "f:metadata": {
                "f:annotations": bomb(1248, prefix="f:gpuguard.io/made-up-")["fieldsV1"]["f:metadata"][
                    "f:annotations"
                ],
                **ours["fieldsV1"]["f:metadata"],
            },
            "f:spec": ours["fieldsV1"]["f:spec"],
        },
    }
    body = {"metadata": {"managedFields": [e if e is not ours else forged for e in entries]}}
    text = refused_by(NODE_POLICY, lambda: core.patch_node(node, body, **MERGE))
    assert text == (
        "gpuguard's managedFields may claim only gpuguard's fields; "
        "refused managedFields of gpuguard (Update)"
    )
    # A made-up key nested under a real one (a leaf that is not {}) is refused the same way.
    nested = {
        **ours,
        "fieldsV1": {
            **ours["fieldsV1"],
            "f:metadata": {"f:labels": {"f:gpuguard.io/quarantined": {f"f:x{i}": {} for i in range(100)}}},
        },
    }
    body = {"metadata": {"managedFields": [e if e is not ours else nested for e in entries]}}
    refused_by(NODE_POLICY, lambda: core.patch_node(node, body, **MERGE))
    assert len(str(admin.node(node)["metadata"]["managedFields"])) < 4 * KIB
    # The agent's own next write, on the same entry, passes.
    core.patch_node(node, {"metadata": {"annotations": {"gpuguard.io/reason": "ecc"}}}, **MERGE)


def test_ancient_changes_at_the_managers_cap_cannot_gain_made_up_keys(
    admin: Admin, control_plane: Any
) -> None:
    """The API server keeps 10 Update entries and merges the oldest into "ancient-changes"; on a node at that
    cap the policy let the entry grow (only the API server's own merge grows it). The attack: 1,000 made-up
    annotation keys added there, ~60 KB on every copy of the node (20,000 made it 1.2 MB). A key another
    Update entry already holds may move there, as the API server's merge does; the agent writes on."""
    node = new_node(admin)
    for i in range(10):
        admin.core.patch_node(
            node, {"metadata": {"labels": {f"example.com/l{i}": "v"}}}, field_manager=f"tool-{i}", **MERGE
        )
        time.sleep(1.05)  # entries are ordered by their time, which has a resolution of one second
    core = agent_core(admin, control_plane, node)
    core.patch_node(node, {"metadata": {"annotations": {"gpuguard.io/reason": "ecc"}}}, **MERGE)
    entries = admin.node(node)["metadata"]["managedFields"]
    assert sum(1 for e in entries if e["operation"] == "Update") >= 10, entries
    ancient = next(e for e in entries if e["manager"] == "ancient-changes")
    made_up = bomb(1000)["fieldsV1"]["f:metadata"]["f:annotations"]
    grown = {**ancient, "fieldsV1": {**ancient["fieldsV1"]}}
    grown["fieldsV1"]["f:metadata"] = {**ancient["fieldsV1"]["f:metadata"], "f:annotations": made_up}
    body = {"metadata": {"managedFields": [grown if e is ancient else e for e in entries]}}
    text = refused_by(NODE_POLICY, lambda: core.patch_node(node, body, **MERGE))
    assert "ancient-changes (Update) with fields no Update entry held" in text, text
    assert admin.node(node)["metadata"]["managedFields"] == entries
    # The agent's own next write at the cap passes.
    core.patch_node(node, {"metadata": {"annotations": {"gpuguard.io/reason": "xid"}}}, **MERGE)


def test_gpuguards_entry_loses_a_key_an_operator_removed_and_the_agent_writes_on(
    admin: Admin, control_plane: Any
) -> None:
    """What the strict entry must not break: an operator removes a gpuguard.io/ annotation the agent set;
    the API server takes the key out of gpuguard's entry, so the agent's next write passes."""
    node = new_node(admin)
    core = agent_core(admin, control_plane, node)
    core.patch_node(
        node, {"metadata": {"annotations": {"gpuguard.io/reason": "ecc", "gpuguard.io/x": "1"}}}, **MERGE
    )
    admin.core.patch_node(node, {"metadata": {"annotations": {"gpuguard.io/x": None}}}, **MERGE)
    ours = [e for e in admin.node(node)["metadata"]["managedFields"] if e["manager"] == "gpuguard"]
    assert all("f:gpuguard.io/x" not in str(e["fieldsV1"]) for e in ours), ours
    core.patch_node(node, {"metadata": {"annotations": {"gpuguard.io/reason": "ecc again"}}}, **MERGE)


def test_a_token_cannot_put_more_than_eight_gpuguard_taints_on_its_node(
    admin: Admin, control_plane: Any
) -> None:
    """The attack: 6,000 gpuguard.io/ NoExecute taints on its own node. Three (what the agent sets at most)
    pass."""
    node = new_node(admin)
    core = agent_core(admin, control_plane, node)

    foreign = admin.node(node)["spec"].get("taints") or []

    def taints(n: int) -> dict[str, Any]:
        ours = [{"key": f"gpuguard.io/t{i}", "effect": "NoExecute"} for i in range(n)]
        return {"spec": {"taints": [*foreign, *ours]}}

    text = refused_by(NODE_POLICY, lambda: core.patch_node(node, taints(9), **MERGE))
    assert text == (
        "gpuguard may keep at most 8 gpuguard.io/ taints on a node; "
        f"refused growth of node {node} to 9 taints"
    )
    refused_by(NODE_POLICY, lambda: core.patch_node(node, taints(600), **MERGE))
    core.patch_node(node, taints(3), **MERGE)


def test_a_token_cannot_write_a_gpu_condition_message_over_32_kib(admin: Admin, control_plane: Any) -> None:
    """The attack: a 1 MiB GPUHealthy message (the 32 KiB bound was the agent's own only). 4 KiB passes."""
    node = new_node(admin)
    core = agent_core(admin, control_plane, node)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def condition(kind: str, message: str) -> dict[str, Any]:
        c = {"type": kind, "status": "False", "reason": "GPUFault", "message": message}
        return {"status": {"conditions": [{**c, "lastTransitionTime": stamp, "lastHeartbeatTime": stamp}]}}

    for kind in ("GPUHealthy", "GPUDegraded"):
        text = refused_by(
            NODE_POLICY, partial(core.patch_node_status, node, condition(kind, "x" * KIB * KIB), **MERGE)
        )
        assert text == (
            "gpuguard may write GPUHealthy and GPUDegraded messages of at most 32 KiB; "
            f"refused {kind} message of {KIB * KIB} bytes on node {node}"
        )
    core.patch_node_status(node, condition("GPUHealthy", "ecc " * KIB), **MERGE)


# -- an operator's repair mark -------------------------------------------------------------------------------


def test_a_token_cannot_remove_or_claim_an_operators_needs_repair_label(
    admin: Admin, control_plane: Any
) -> None:
    """An operator's own gpuguard.io/needs-repair=true (selected on by a repair controller): the token
    removed it, or first set gpuguard.io/needs-repair-placed to make it look like gpuguard's. Both refused;
    a label gpuguard placed (label and annotation in one write) it may still remove."""
    node = new_node(admin)
    core = agent_core(admin, control_plane, node)
    admin.core.patch_node(node, {"metadata": {"labels": {REPAIR: "true"}}}, **MERGE)
    expected = (
        "gpuguard may remove or change only a gpuguard.io/needs-repair label it placed, and record that only "
        f"in the write that adds it; refused change to the repair mark of node {node}"
    )
    for body in (
        {"metadata": {"labels": {REPAIR: None}}},
        {"metadata": {"labels": {REPAIR: "false"}}},
        {"metadata": {"annotations": {PLACED: "true"}}},
        {"metadata": {"labels": {REPAIR: None}, "annotations": {PLACED: "true"}}},
    ):
        assert refused_by(NODE_POLICY, partial(core.patch_node, node, body, **MERGE)) == expected, body
    assert admin.node(node)["metadata"]["labels"][REPAIR] == "true"
    # gpuguard's own mark: placed with its annotation, removed with it (quarantine/repeat/marks.py).
    other = new_node(admin)
    core = agent_core(admin, control_plane, other)
    core.patch_node(
        other, {"metadata": {"labels": {REPAIR: "true"}, "annotations": {PLACED: "true"}}}, **MERGE
    )
    core.patch_node(other, {"metadata": {"labels": {REPAIR: None}, "annotations": {PLACED: None}}}, **MERGE)
    assert REPAIR not in (admin.node(other)["metadata"].get("labels") or {})
