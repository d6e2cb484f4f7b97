"""Which pods to evict for the faulty GPUs (pure): only pods on this node whose containers hold a faulty GPU.

Inputs: the faulty GPUs' UUIDs, the kubelet's PodResources answer (what each pod's containers were given)
and the pods on this node as the API server lists them (spec.nodeName). A pod holds a GPU when one of its
containers has a device-plugin device of an `nvidia.com/` resource whose ID is the GPU's UUID (NVIDIA's device
plugin; `UUID::n` for a time-sliced share of it), or a DRA device (driver, pool, device) that is the GPU's.

Never evicted: DaemonSet pods (the DaemonSet puts them back on the same node), mirror (static) pods (the API
cannot evict them; the kubelet runs them from a file), pods that tolerate gpuguard's taint (they asked to
stay on a sick GPU: a diagnostic or a drain job), pods already terminating or finished, and pods the API
server does not list on this node (gone, or never this node's); nor while the quarantine budget defers
the GPU's quarantine (a fleet-wide false alarm, a bad driver roll-out, must not evict every GPU pod of the
cluster: the budget bounds eviction as it bounds the hard taint), or before it is in place (its replacement
would be placed back on the same GPU). A GPU whose DRA DeviceTaintRule already has
effect NoExecute is left to kube-controller-manager, which evicts its pods itself, and so is every pod while
the node's own gpuguard taint is NoExecute: never two evictions of one pod.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuguard.core.model import PodDevices
from gpuguard.core.validation import PREFIX

# gpuguard's fault taint (gpuguard.quarantine.record.TAINT_KEY; eviction and quarantine are independent
# layers, tests/test_eviction_plan.py checks that the two agree).
TAINT_KEY = f"{PREFIX}gpu-unhealthy"
GPU_RESOURCE_PREFIX = "nvidia.com/"
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"

# Why a pod that holds a faulty GPU is kept: stable words, in log lines and in the test table.
DAEMONSET = "daemonset"
MIRROR = "mirror-pod"
TOLERATES = "tolerates-taint"
TERMINATING = "terminating"
FINISHED = "finished"
NOT_LISTED = "not-on-this-node"
DRA_NOEXECUTE = "dra-noexecute"
NODE_NOEXECUTE = "node-noexecute"
DEFERRED = "quarantine-deferred"
NOT_QUARANTINED = "not-quarantined"


@dataclass(frozen=True)
class Toleration:
    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""

    def tolerates(self, key: str, effect: str) -> bool:
        """As the scheduler matches a toleration to a taint of this key and effect and no value (gpuguard's
        taints carry none): an empty key with Exists tolerates every taint."""
        if self.effect and self.effect != effect:
            return False
        if not self.key:
            return self.operator == "Exists"
        if self.key != key:
            return False
        return self.operator == "Exists" or not self.value


@dataclass(frozen=True)
class Pod:
    """A pod as the API server lists it: what the plan needs of it."""

    namespace: str
    name: str
    uid: str = ""
    node: str = ""
    phase: str = "Running"
    owners: tuple[str, ...] = ()  # the kinds of its controller ownerReferences
    mirror: bool = False
    terminating: bool = False
    tolerations: tuple[Toleration, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @classmethod
    def from_api(cls, obj: Mapping[str, Any]) -> Pod:
        meta = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        return cls(
            namespace=str(meta.get("namespace", "")),
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            node=str(spec.get("nodeName", "")),
            phase=str((obj.get("status") or {}).get("phase", "")),
            owners=tuple(
                str(o.get("kind", "")) for o in meta.get("ownerReferences") or () if o.get("controller")
            ),
            mirror=MIRROR_ANNOTATION in (meta.get("annotations") or {}),
            terminating=meta.get("deletionTimestamp") is not None,
            tolerations=tuple(
                Toleration(
                    key=str(t.get("key") or ""),
                    operator=str(t.get("operator") or "Equal"),
                    value=str(t.get("value") or ""),
                    effect=str(t.get("effect") or ""),
                )
                for t in spec.get("tolerations") or ()
            ),
        )


@dataclass(frozen=True)
class Decision:
    """One pod that holds faulty GPUs: evict it (`keep` None), or keep it and why."""

    pod: Pod
    gpus: tuple[str, ...]
    keep: str | None = None

    @property
    def evict(self) -> bool:
        return self.keep is None


@dataclass(frozen=True)
class Faulty:
    """The faulty GPUs and what the quarantine already does about them."""

    uuids: frozenset[str]
    # DRA: each published GPU's device (driver, pool, device) by UUID (its ResourceSlice's, or its rule's).
    dra_devices: Mapping[str, tuple[str, str, str]] | None = None
    # GPUs whose DeviceTaintRule has effect NoExecute now: kube-controller-manager evicts their pods.
    dra_noexecute: frozenset[str] = frozenset()
    # The effect of gpuguard's node taint (--taint-effect) and whether it is on the node now with NoExecute.
    taint_effect: str = "NoSchedule"
    node_noexecute: bool = False
    # GPUs with a DeviceTaintRule of their own (`dra_devices` names every published GPU, ruled or not).
    ruled: frozenset[str] = frozenset()
    # Past the quarantine budget: GPUs whose DeviceTaintRule is deferred (effect None), and whether the
    # node's own quarantine is (it stands for every faulty GPU without a rule of its own).
    deferred: frozenset[str] = frozenset()
    node_deferred: bool = False
    # gpuguard's taint is on the node now (the reconciler's status; False while its write is pending or
    # refused). A pod evicted before is replaced on the same faulty GPU.
    node_tainted: bool = True

    def not_held_out(self, gpu: str) -> str | None:
        """Why no new pod is kept off this GPU yet (DEFERRED, NOT_QUARANTINED), or None: it has a blocking
        rule of its own, or the node carries the full quarantine."""
        if gpu in self.ruled and gpu not in self.deferred:
            return None
        if self.node_tainted and not self.node_deferred:
            return None
        return DEFERRED if gpu in self.deferred or self.node_deferred else NOT_QUARANTINED


def held(pod: PodDevices, faulty: Faulty) -> tuple[str, ...]:
    """The faulty GPUs this pod's containers hold, sorted."""
    gpus = {
        device.split("::", 1)[0]
        for resource, device in pod.devices
        if resource.startswith(GPU_RESOURCE_PREFIX) and device.split("::", 1)[0] in faulty.uuids
    }
    claims = set(pod.claims)
    for uuid, device in (faulty.dra_devices or {}).items():
        if uuid in faulty.uuids and device in claims:
            gpus.add(uuid)
    return tuple(sorted(gpus))


def mig_slices(pod: PodDevices) -> tuple[str, ...]:
    """The MIG slices an NVIDIA resource gave this pod. NVIDIA's device plugin names a slice by its own UUID
    (MIG-...), not its GPU's, and gpuguard does not read the slices' UUIDs: `held` cannot tell whether one
    is on a faulty GPU, so such a pod is reported, never evicted on a guess."""
    ids = {d.split("::", 1)[0] for r, d in pod.devices if r.startswith(GPU_RESOURCE_PREFIX)}
    return tuple(sorted(d for d in ids if d.startswith("MIG-")))


def plan(
    faulty: Faulty, resources: Iterable[PodDevices], pods: Mapping[tuple[str, str], Pod]
) -> list[Decision]:
    """A decision for every pod that holds a faulty GPU, in the kubelet's order; pods that hold none are not
    mentioned. `pods`: the pods the API server lists on this node, by (namespace, name)."""
    decisions: list[Decision] = []
    if not faulty.uuids:
        return decisions
    for devices in resources:
        gpus = held(devices, faulty)
        if not gpus:
            continue
        pod = pods.get((devices.namespace, devices.name))
        if pod is None:
            decisions.append(Decision(Pod(devices.namespace, devices.name), gpus, NOT_LISTED))
            continue
        decisions.append(Decision(pod, gpus, _keep(pod, gpus, faulty)))
    return decisions


def _keep(pod: Pod, gpus: tuple[str, ...], faulty: Faulty) -> str | None:
    if pod.terminating:
        return TERMINATING
    if pod.phase in ("Succeeded", "Failed"):
        return FINISHED
    if pod.mirror:
        return MIRROR
    if "DaemonSet" in pod.owners:
        return DAEMONSET
    if any(t.tolerates(TAINT_KEY, faulty.taint_effect) for t in pod.tolerations):
        return TOLERATES
    why = [faulty.not_held_out(g) for g in gpus]
    if all(why):
        return DEFERRED if DEFERRED in why else NOT_QUARANTINED
    if faulty.node_noexecute:
        return NODE_NOEXECUTE
    if all(g in faulty.dra_noexecute for g in gpus):
        return DRA_NOEXECUTE
    return None
