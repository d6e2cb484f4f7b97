"""What the per-GPU quarantine trusts of the rules it reads (gpuguard.quarantine.gpu.trust): a rule squatting
this node's name, a rule under its label that is not its own, and forged rules meant to spend the GPU
budget are never adopted, released or counted; the GPU they aim at is quarantined all the same."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from structlog.testing import capture_logs

from gpuguard.quarantine.budget import Budget
from gpuguard.quarantine.gpu.order import rules_past_limit, rules_share
from gpuguard.quarantine.gpu.rules import ANN_NODE_GPUS, DeviceRule, rule_name
from gpuguard.quarantine.gpu.trust import countable, trusted_rules
from harness.dra import DRIVER
from tests.test_devices import NODE, NOW, make, own_rule, run, verdict

SQUATTER = "gpu-node-9"


def doc(pool: str, device: str, *, name: str | None = None, effect: str = "None") -> dict[str, Any]:
    """A rule as a stolen token of node `pool` would write it (its own pool and labels)."""
    return {
        "metadata": {
            "name": name or rule_name(pool, device),
            "uid": "uid-squat",
            "resourceVersion": "7",
            "labels": {"gpuguard.io/node": pool, "app.kubernetes.io/managed-by": "gpuguard"},
            "annotations": {},
        },
        "spec": {
            "deviceSelector": {"driver": DRIVER, "pool": pool, "device": device},
            "taint": {"key": "gpuguard.io/gpu-unhealthy", "value": "x", "effect": effect},
        },
    }


def test_a_rule_squatting_this_gpus_name_is_not_adopted_and_the_node_taint_stands_in() -> None:
    """Another node's token made this GPU's rule name in its own pool with effect None: the 409 is not taken
    for a rule of ours from before a restart (the old agent adopted it, then took its absence under its own
    label for an operator's deletion and left the GPU with no quarantine at all)."""
    writer, source, r, clock = make()
    name = rule_name(NODE, "gpu-3")
    assert name is not None
    source.store[name] = doc(SQUATTER, "gpu-3", name=name)
    with capture_logs() as logs:
        run(r, verdict(xid_on=3))
    assert writer.node.our_taint is not None and writer.node.record.primary_reason == "xid-79"
    assert source.store[name] == doc(SQUATTER, "gpu-3", name=name), "the squatted rule is left alone"
    (line,) = [e for e in logs if e["event"] == "device.rule_conflict"]
    assert (line["rule"], line["found_pool"], line["log_level"]) == (name, SQUATTER, "error")
    # Still held by the node taint at the next read, never "deleted by an operator".
    clock.t += 3600
    with capture_logs() as logs:
        run(r, verdict(xid_on=3))
    assert writer.node.our_taint is not None
    assert not [e for e in logs if e["event"] == "device.rule_removed_by_operator"]


def test_a_rule_of_this_gpu_from_before_a_restart_is_adopted_on_the_409() -> None:
    writer, source, r, _ = make()
    name = rule_name(NODE, "gpu-3")
    assert name is not None
    source.store[name] = doc(NODE, "gpu-3", effect="NoSchedule")
    with capture_logs() as logs:
        run(r, verdict(xid_on=3))
    assert writer.node.our_taint is None
    assert [e["rule"] for e in logs if e["event"] == "device.rule_adopted"] == [name]


def test_an_adopted_rule_of_effect_none_that_is_not_deferred_is_made_to_block() -> None:
    """A rule of this GPU that blocks nothing without the budget's say (written with effect None by a token
    of this node, or by an agent with --taint-effect PreferNoSchedule) gets the configured effect."""
    writer, source, r, _ = make()
    name = rule_name(NODE, "gpu-3")
    assert name is not None
    source.store[name] = doc(NODE, "gpu-3", effect="None")
    run(r, verdict(xid_on=3))
    run(r, verdict(xid_on=3))
    assert source.store[name]["spec"]["taint"]["effect"] == "NoSchedule"
    assert writer.node.our_taint is None


def test_a_rule_under_this_nodes_label_that_is_not_its_own_is_ignored_and_logged_once() -> None:
    writer, source, r, clock = make()
    stray = doc(NODE, "gpu-3", name="made-by-someone")
    source.store["made-by-someone"] = stray
    with capture_logs() as logs:
        run(r, verdict(xid_on=3))
        clock.t += 3600
        run(r, verdict(xid_on=3))
    assert [e["rule"] for e in logs if e["event"] == "device.rule_untrusted"] == ["made-by-someone"]
    assert source.store["made-by-someone"] == stray
    assert rule_name(NODE, "gpu-3") in source.store  # the GPU has its own rule
    assert writer.node.our_taint is None


def test_forged_rules_do_not_spend_the_gpu_budget() -> None:
    """The red team's three forged rules (effect None, made-up devices, no node-gpus record) made a third
    node's real ECC rule "budget spent" at --max-quarantined 2. Rules that block nothing count nothing; a
    token's blocking rules count at most its own node's worth."""
    _, source, r, _ = make(budget=Budget(quarantined=0, limit=2))
    forged = [DeviceRule.from_api(doc(SQUATTER, f"fake-{i}")) for i in range(3)]
    blocking = [DeviceRule.from_api(doc("gpu-node-8", f"fake-{i}", effect="NoSchedule")) for i in range(3)]
    source.other_rules = [*forged, *blocking]
    run(r, verdict(ecc_on=0))
    assert [d["spec"]["taint"]["effect"] for d in source.store.values()] == ["NoSchedule"]


def test_only_gpuguards_own_blocking_rules_count_one_per_device_and_one_node_per_node() -> None:
    honest = own_rule("a", "gpu-0", annotations={ANN_NODE_GPUS: "8"})
    twice = own_rule("a", "gpu-0", name="gpuguard-a-gpu-0", annotations={ANN_NODE_GPUS: "8"})
    wrong_name = own_rule("b", "gpu-0", name="gpuguard.c.gpu-0")
    wrong_label = own_rule("b", "gpu-1", labels={"gpuguard.io/node": "c"})
    wrong_key = own_rule("b", "gpu-2", key="example.com/x")
    no_driver = own_rule("b", "gpu-3", driver="")
    deferred = own_rule("b", "gpu-4", annotations={"gpuguard.io/quarantine-deferred": "x"})
    none = own_rule("b", "gpu-5", effect="None")
    assert countable([honest, twice, wrong_name, wrong_label, wrong_key, no_driver, deferred, none]) == [
        honest
    ]
    # Nine whole-node rules of one node (no GPU count recorded) are one node's worth.
    greedy = [own_rule("c", f"gpu-{i}") for i in range(9)]
    assert rules_share([honest, *greedy]) == Fraction(1, 8) + 1
    assert rules_past_limit([], [*greedy, honest], 2, now=NOW) == {}
    # Limit 1: the honest 1/8 first, then c's first rule is past; c's others cost nothing beyond it.
    assert set(rules_past_limit([], [*greedy, honest], 1, now=NOW)) == {"gpuguard.c.gpu-0"}


def test_a_rule_kept_for_the_budget_is_bounded_whatever_it_holds() -> None:
    """The red team's 160 rules with 255 KiB annotations took another agent's list of all rules to 157 MiB
    against its 128 Mi limit. The watch keeps only what the budget reads, each value cut."""
    import json

    from gpuguard.quarantine.gpu.rules import trim_rule

    big = doc("gpu-node-8", "gpu-1", effect="NoSchedule")
    big["metadata"]["annotations"] = {
        "gpuguard.io/reason": "x" * 255 * 1024,
        "gpuguard.io/since": "2026-12-03T00:00:00Z",
        ANN_NODE_GPUS: "8",
        "example.com/junk": "y" * 1024,
    }
    big["metadata"]["labels"]["example.com/junk"] = "z" * 63
    big["metadata"]["finalizers"] = ["example.com/" + "f" * 300]
    kept = trim_rule(big)
    assert len(json.dumps(kept)) < 1024
    whole, trimmed = DeviceRule.from_api(big), DeviceRule.from_api(kept)
    for field in ("name", "pool", "device", "driver", "effect", "key", "share", "deferred", "uid"):
        assert getattr(trimmed, field) == getattr(whole, field), field
    assert trimmed.annotations["gpuguard.io/since"] == "2026-12-03T00:00:00Z"
    assert trimmed.own("gpu-node-8") and countable([trimmed]) == [trimmed]


def test_every_rule_of_the_nodes_own_is_trusted_whichever_comes_first() -> None:
    others = own_rule("other-node", "gpu-0")
    listed = [own_rule(NODE, "gpu-0"), others, own_rule(NODE, "gpu-1"), own_rule(NODE, "gpu-2")]
    rules, untrusted = trusted_rules(NODE, listed, logged=set())
    assert sorted(rules) == sorted(r.name for r in listed if r is not others)
    assert untrusted == {others.name}
