"""The eviction plan (pure): which pods holding a faulty GPU go, which stay and why, table-driven."""

from __future__ import annotations

from typing import Any

import pytest

from gpuguard.core.model import PodDevices
from gpuguard.eviction import plan as p
from gpuguard.eviction.plan import Decision, Faulty, Pod, Toleration, plan
from gpuguard.quarantine.record import TAINT_KEY

NODE = "gpu-node-1"
GPU = [f"GPU-{i:08d}-0000-0000-0000-000000000000" for i in range(8)]


def dp(name: str, *uuids: str, ns: str = "ml", resource: str = "nvidia.com/gpu") -> PodDevices:
    return PodDevices(ns, name, devices=tuple((resource, u) for u in uuids))


def pod(name: str, ns: str = "ml", **kw: Any) -> Pod:
    return Pod(ns, name, uid=f"uid-{name}", node=NODE, **kw)


EIGHT = [dp(f"train-{i}", GPU[i]) for i in range(8)]
LISTED = {("ml", f"train-{i}"): pod(f"train-{i}") for i in range(8)}


def test_only_the_pod_holding_the_faulty_gpu_is_evicted_the_seven_others_are_not_mentioned() -> None:
    got = plan(Faulty(frozenset({GPU[3]})), EIGHT, LISTED)
    assert got == [Decision(LISTED[("ml", "train-3")], (GPU[3],))]
    assert got[0].evict


def test_no_faulty_gpu_evicts_nothing() -> None:
    assert plan(Faulty(frozenset()), EIGHT, LISTED) == []


def test_a_time_sliced_share_of_the_gpu_is_held_by_each_pod_that_has_a_share() -> None:
    shares = [dp("a", f"{GPU[3]}::0"), dp("b", f"{GPU[3]}::1"), dp("c", f"{GPU[4]}::0")]
    listed = {("ml", n): pod(n) for n in "abc"}
    got = plan(Faulty(frozenset({GPU[3]})), shares, listed)
    assert [(d.pod.name, d.gpus) for d in got if d.evict] == [("a", (GPU[3],)), ("b", (GPU[3],))]


def test_a_mig_resource_of_nvidia_counts_another_vendors_device_with_the_same_id_does_not() -> None:
    pods = [
        dp("mig", GPU[3], resource="nvidia.com/mig-1g.10gb"),
        dp("other", GPU[3], resource="example.com/x"),
    ]
    listed = {("ml", n): pod(n) for n in ("mig", "other")}
    assert [d.pod.name for d in plan(Faulty(frozenset({GPU[3]})), pods, listed)] == ["mig"]


def test_a_dra_claim_on_the_faulty_gpus_device_is_evicted() -> None:
    dra = {GPU[3]: ("gpu.nvidia.com", NODE, "gpu-3"), GPU[4]: ("gpu.nvidia.com", NODE, "gpu-4")}
    pods = [
        PodDevices("ml", "claim-3", claims=(("gpu.nvidia.com", NODE, "gpu-3"),)),
        PodDevices("ml", "claim-4", claims=(("gpu.nvidia.com", NODE, "gpu-4"),)),
        PodDevices("ml", "other-pool", claims=(("gpu.nvidia.com", "other-node", "gpu-3"),)),
    ]
    listed = {("ml", n): pod(n) for n in ("claim-3", "claim-4", "other-pool")}
    got = plan(Faulty(frozenset({GPU[3]}), dra_devices=dra), pods, listed)
    assert [(d.pod.name, d.gpus, d.keep) for d in got] == [("claim-3", (GPU[3],), None)]


@pytest.mark.parametrize(
    ("listed", "faulty", "keep"),
    [
        (pod("x", owners=("DaemonSet",)), Faulty(frozenset({GPU[3]})), p.DAEMONSET),
        (pod("x", mirror=True), Faulty(frozenset({GPU[3]})), p.MIRROR),
        (pod("x", terminating=True), Faulty(frozenset({GPU[3]})), p.TERMINATING),
        (pod("x", phase="Succeeded"), Faulty(frozenset({GPU[3]})), p.FINISHED),
        (pod("x", phase="Failed"), Faulty(frozenset({GPU[3]})), p.FINISHED),
        (None, Faulty(frozenset({GPU[3]})), p.NOT_LISTED),
        (pod("x"), Faulty(frozenset({GPU[3]}), dra_noexecute=frozenset({GPU[3]})), p.DRA_NOEXECUTE),
        (pod("x"), Faulty(frozenset({GPU[3]}), node_noexecute=True), p.NODE_NOEXECUTE),
        # Past the quarantine budget (a fleet-wide false alarm must not take the fleet out of service): the
        # GPU's rule is deferred, or the node's own quarantine is and the GPU has no rule of its own.
        (
            pod("x"),
            Faulty(
                frozenset({GPU[3]}),
                dra_devices={GPU[3]: ("gpu.nvidia.com", NODE, "g3")},
                ruled=frozenset({GPU[3]}),
                deferred=frozenset({GPU[3]}),
                node_tainted=False,
            ),
            p.DEFERRED,
        ),
        (pod("x"), Faulty(frozenset({GPU[3]}), node_deferred=True), p.DEFERRED),
        # The quarantine not in place yet (its write pending or refused): the replacement would land on the
        # same GPU again. A GPU under a blocking rule of its own is held out without the node's taint.
        (pod("x"), Faulty(frozenset({GPU[3]}), node_tainted=False), p.NOT_QUARANTINED),
        (
            pod("x"),
            Faulty(
                frozenset({GPU[3]}),
                node_tainted=False,
                dra_devices={GPU[3]: ("gpu.nvidia.com", NODE, "g3")},
                ruled=frozenset({GPU[3]}),
            ),
            None,
        ),
        (
            pod("x"),
            Faulty(
                frozenset({GPU[3]}),
                node_deferred=True,
                dra_devices={GPU[3]: ("gpu.nvidia.com", NODE, "g3")},
                ruled=frozenset({GPU[3]}),
            ),
            None,
        ),
        (pod("x", tolerations=(Toleration(TAINT_KEY, "Exists"),)), Faulty(frozenset({GPU[3]})), p.TOLERATES),
        (pod("x", tolerations=(Toleration("", "Exists"),)), Faulty(frozenset({GPU[3]})), p.TOLERATES),
        # The taint has no value: Equal to "" tolerates it, as the scheduler matches it.
        (
            pod("x", tolerations=(Toleration(TAINT_KEY, "Equal", "", "NoSchedule"),)),
            Faulty(frozenset({GPU[3]})),
            p.TOLERATES,
        ),
        # A toleration of a value (a fault's reason, which earlier versions put in the taint), another key
        # or another effect does not keep the pod.
        (
            pod("x", tolerations=(Toleration(TAINT_KEY, "Equal", "xid-79"),)),
            Faulty(frozenset({GPU[3]})),
            None,
        ),
        (
            pod("x", tolerations=(Toleration("example.com/other", "Exists"),)),
            Faulty(frozenset({GPU[3]})),
            None,
        ),
        (
            pod("x", tolerations=(Toleration(TAINT_KEY, "Exists", effect="NoExecute"),)),
            Faulty(frozenset({GPU[3]})),
            None,
        ),
        (pod("x", owners=("ReplicaSet",)), Faulty(frozenset({GPU[3]})), None),
        (pod("x", owners=("Job",)), Faulty(frozenset({GPU[3]})), None),
    ],
)
def test_which_pods_holding_a_faulty_gpu_stay(listed: Pod | None, faulty: Faulty, keep: str | None) -> None:
    pods = {("ml", "x"): listed} if listed is not None else {}
    got = plan(faulty, [dp("x", GPU[3])], pods)
    assert [d.keep for d in got] == [keep]
    assert got[0].evict is (keep is None)


def test_a_pod_on_two_gpus_one_under_a_noexecute_rule_is_still_evicted_for_the_other() -> None:
    faulty = Faulty(frozenset({GPU[3], GPU[4]}), dra_noexecute=frozenset({GPU[3]}))
    got = plan(faulty, [dp("x", GPU[3], GPU[4])], {("ml", "x"): pod("x")})
    assert got == [Decision(pod("x"), (GPU[3], GPU[4]))]


def test_a_pod_of_the_same_name_in_another_namespace_is_not_the_kubelets_pod() -> None:
    got = plan(Faulty(frozenset({GPU[3]})), [dp("x", GPU[3], ns="a")], {("b", "x"): pod("x", ns="b")})
    assert [(d.pod.namespace, d.keep) for d in got] == [("a", p.NOT_LISTED)]


def test_a_pod_from_the_api_keeps_what_the_plan_needs() -> None:
    obj = {
        "metadata": {
            "namespace": "ml",
            "name": "x",
            "uid": "u1",
            "ownerReferences": [{"kind": "DaemonSet", "controller": True}, {"kind": "Thing"}],
            "annotations": {"kubernetes.io/config.mirror": "abc"},
            "deletionTimestamp": "2026-12-05T08:00:00Z",
        },
        "spec": {
            "nodeName": NODE,
            "tolerations": [{"key": TAINT_KEY, "operator": "Exists"}, {"effect": "NoExecute"}],
        },
        "status": {"phase": "Running"},
    }
    got = Pod.from_api(obj)
    assert got == Pod(
        "ml",
        "x",
        uid="u1",
        node=NODE,
        phase="Running",
        owners=("DaemonSet",),
        mirror=True,
        terminating=True,
        tolerations=(Toleration(TAINT_KEY, "Exists"), Toleration("", "Equal", "", "NoExecute")),
    )
    assert Pod.from_api({}) == Pod("", "", uid="", node="", phase="")
    equal = {"spec": {"tolerations": [{"key": TAINT_KEY, "operator": "Equal", "value": "xid-79"}]}}
    assert Pod.from_api(equal).tolerations == (Toleration(TAINT_KEY, "Equal", "xid-79", ""),)


def test_a_pod_the_api_does_not_list_does_not_stop_the_plan_for_the_pods_after_it() -> None:
    pods = [dp("gone", GPU[3]), dp("x", GPU[3])]
    got = plan(Faulty(frozenset({GPU[3]})), pods, {("ml", "x"): pod("x")})
    assert [(d.pod.name, d.keep) for d in got] == [("gone", p.NOT_LISTED), ("x", None)]


def test_the_plans_taint_key_is_the_quarantines() -> None:
    assert p.TAINT_KEY == TAINT_KEY


def test_operations_md_explains_every_reason_a_pod_is_kept_and_every_eviction_line() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    section = text.split("## Evicting the pods on a faulty GPU", 1)[1].split("\n## ", 1)[0]
    reasons = [v for k, v in vars(p).items() if k.isupper() and isinstance(v, str) and "/" not in v]
    reasons = [r for r in reasons if r not in (p.GPU_RESOURCE_PREFIX, p.MIRROR_ANNOTATION)]
    assert len(reasons) == 10
    for word in reasons:
        assert f"`{word}`" in section, word
    evictor = (Path(__file__).resolve().parent.parent / "gpuguard" / "eviction" / "evictor.py").read_text()
    import re

    for event in set(re.findall(r'"(eviction\.[a-z_]+)"', evictor)) - {
        "eviction.round_failed",
        "eviction.event_failed",
    }:
        assert f"`{event}`" in section, event


@pytest.mark.parametrize(
    ("toleration", "tolerates"),
    [
        (Toleration(operator="Exists"), True),  # no key: every taint
        (Toleration(), False),  # no key, Equal: none
        (Toleration(key=TAINT_KEY), True),  # Equal to "": the taint has no value
        (Toleration(key=TAINT_KEY, value="xid-79"), False),
        (Toleration(key=TAINT_KEY, operator="Exists", effect="NoExecute"), False),  # another effect
        (Toleration(key="example.com/other", operator="Exists"), False),  # another key
    ],
    ids=[
        "exists, no key",
        "equal, no key",
        "our key, no value",
        "our key, a value",
        "another effect",
        "another key",
    ],
)
def test_a_toleration_matches_the_taint_as_the_scheduler_does(
    toleration: Toleration, tolerates: bool
) -> None:
    assert toleration.tolerates(TAINT_KEY, "NoSchedule") is tolerates


def test_a_pod_is_known_by_its_namespace_and_name() -> None:
    assert Pod("ml", "train-0").key == ("ml", "train-0")


def test_the_mig_slices_a_pod_holds_are_named_by_their_own_uuid_sorted_once() -> None:
    pod_devices = PodDevices(
        "ml",
        "mig",
        devices=(
            ("nvidia.com/mig-1g.10gb", "MIG-b::1"),
            ("nvidia.com/mig-1g.10gb", "MIG-a"),
            ("nvidia.com/mig-1g.10gb", "MIG-b::0"),
            ("nvidia.com/gpu", GPU[0]),
            ("example.com/x", "MIG-c"),
        ),
    )
    assert p.mig_slices(pod_devices) == ("MIG-a", "MIG-b")


def test_a_pod_on_two_faulty_gpus_goes_when_one_of_them_is_held_out() -> None:
    """One GPU has a blocking rule of its own, the other none yet (the node not tainted): a pod is kept as
    not quarantined only when none of its faulty GPUs is held out."""
    faulty = Faulty(frozenset({GPU[0], GPU[1]}), ruled=frozenset({GPU[0]}), node_tainted=False)
    (decision,) = plan(faulty, [dp("both", GPU[0], GPU[1])], {("ml", "both"): pod("both")})
    assert decision.gpus == (GPU[0], GPU[1]) and decision.evict
