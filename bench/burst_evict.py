"""The burst's eviction case: a GPU fails under running pods mid-burst (`make e2e` runs it after
bench/burst.py's table; a short version runs in `make test`).

On the same control plane as bench/burst.py (kube-scheduler, kube-controller-manager, kwok), gpuguard nodes
of 8 GPUs (each behind the startup gate until its agent's first check) and the inference Deployment scaled
from 2 replicas to more than those nodes hold, in one step. Once every replica of the scale-up exists and
each of the first few nodes has Ready pods, while the replicas that found no GPU are still Pending (the
burst waits for new nodes), a fatal Xid (79) is written to the fake driver on the GPU of one Ready pod per
such node, and new gpuguard nodes start to join (gated until their first check). Once per mode, each on its
own control plane:
  gpuguard        the agent taints the node (nothing more: --evict none, the default);
  gpuguard+evict  the same agent with --evict gpu-pods, which evicts the pod holding the failed GPU.

Each gpuguard node has a fake kubelet (harness/kubelet.py: the PodResources gRPC API on a unix socket) that
reports the pods the API server has bound to that node, device i -> the i-th pod bound there (a pod keeps its
GPU; one that leaves frees it), so the agent finds the pod that holds the failed GPU as it would on a real
node. Measured per affected pod: the time from the fault (the Xid written to the fake driver) to a new
replica of the Deployment Running on another node (good placements only), and to the eviction; whether the
other pods of the faulty nodes keep their UIDs; and the time from the scale-up to all replicas Running on
good GPUs.

The model, stated: kwok runs every pod it is given, so a pod on a bad GPU looks Running here; in a real
cluster it crash-loops there forever, and as the pod still exists its Deployment makes no replacement
(NoSchedule evicts nothing). Without eviction the pod is therefore never replaced: the run watches it stay
bound for a while after the fault and says "never" (no number is made up), and the burst never reaches all
replicas Running on good GPUs ("stalled"). The replacements are told apart from the scale-up's own pods
because the fault waits until the ReplicaSet has made every replica of the scale-up: a pod made after the
fault replaces an evicted one (the i-th replacement Running is counted for the i-th affected pod; they are
interchangeable).

    python -m bench.burst_evict [--short] [--modes gpuguard,gpuguard+evict]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import kubernetes
import yaml
from kubernetes import utils

from bench import burst
from harness.kube import DEPLOY, eventually
from harness.kubelet import FakeKubelet, gpu_pod

MODES = ("gpuguard", "gpuguard+evict")
QUIET = 5.0  # seconds without a bind or a Ready before a run past its hold time ends


@dataclass(frozen=True)
class Case:
    nodes: int  # gpuguard nodes of 8 GPUs
    fault_nodes: int  # of those, how many lose the GPU of one running pod
    ready_pods: int  # Ready pods each of those has when its GPU fails
    replicas: int  # the scale-up's target: more than the nodes hold, so some are Pending at the fault
    joiners: int  # good nodes that join after the fault, for the Pending replicas and the replacements
    join_every: float  # seconds between two joining nodes
    hold: float  # seconds after the fault a pod not replaced is watched before it counts as never replaced
    timeout: float  # seconds from the scale-up to give up


# 40 nodes hold 320 of 340 replicas: 20 or more Pending at the fault; 3 lose a GPU (and, tainted, the room
# left on them), 6 join: 37 * 8 + 6 * 8 = 344 good GPUs besides the pods the 3 faulty nodes keep.
FULL = Case(
    nodes=40, fault_nodes=3, ready_pods=2, replicas=340, joiners=6, join_every=0.5, hold=30.0, timeout=300.0
)
# 4 nodes hold 32 of 36 replicas; 1 loses a GPU, 2 join: 3 * 8 + 2 * 8 = 40 good GPUs.
SHORT = Case(
    nodes=4, fault_nodes=1, ready_pods=2, replicas=36, joiners=2, join_every=0.5, hold=15.0, timeout=120.0
)


class DeviceWatch(burst.PodWatch):
    """burst.PodWatch, plus each pod's UID, when it was first seen terminating and gone, and its GPU on its
    node; it keeps each node's fake kubelet in step with the API server (device i -> the i-th pod there)."""

    def __init__(self, api: Any, kubelets: dict[str, FakeKubelet]) -> None:
        super().__init__(api)
        self.kubelets = kubelets
        self.uid: dict[str, str] = {}
        self.deleting: dict[str, float] = {}
        self.gone: dict[str, float] = {}
        self.device: dict[str, dict[str, int]] = {}  # node -> pod -> GPU index

    def _observe(self, items: list[dict[str, Any]], now: float) -> None:
        super()._observe(items, now)
        present = set()
        for pod in items:
            meta = pod["metadata"]
            present.add(meta["name"])
            self.uid.setdefault(meta["name"], meta["uid"])
            if meta.get("deletionTimestamp") and meta["name"] not in self.deleting:
                self.deleting[meta["name"]] = now
        for name in self.bound.keys() - present - self.gone.keys():
            self.gone[name] = now
        for name, (node, _) in sorted(self.bound.items(), key=lambda kv: (kv[1][1], kv[0])):
            held = self.device.setdefault(node, {})
            free = sorted(set(range(burst.GPUS_PER_NODE)) - set(held.values()))
            if name in self.gone:
                held.pop(name, None)
            elif name not in held and free:
                held[name] = free[0]
        for node, kubelet in dict(self.kubelets).items():  # a copy: nodes join from other threads
            table = [gpu_pod(burst.NAMESPACE, p, f"GPU-{i}") for p, i in self.device.get(node, {}).items()]
            with kubelet.lock:
                kubelet.pods = table


@dataclass
class Result:
    mode: str
    replicas: int
    affected: list[str] = field(default_factory=list)  # the pods whose GPU failed under them
    bound_at_fault: int = 0  # pods of the Deployment bound when the GPUs failed: mid-burst if < replicas
    replaced_after: list[float] = field(
        default_factory=list
    )  # per replaced pod: fault -> replacement Running
    evicted_after: list[float] = field(default_factory=list)  # per evicted pod: fault -> seen terminating
    still_bound: int = 0  # affected pods still on their bad GPU at the end
    others: int = 0  # the other pods on the faulty nodes at the fault
    kept: int = 0  # of those, still there with the same UID at the end
    watched: float = 0.0  # seconds the run watched after the fault
    all_ready: float | None = None  # scale-up -> all replicas Running on good GPUs

    def row(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "affected_pods": len(self.affected),
            "bound_at_fault": f"{self.bound_at_fault}/{self.replicas}",
            "fault_to_replacement_running_s": [round(t, 2) for t in self.replaced_after],
            "fault_to_evicted_s": [round(t, 2) for t in self.evicted_after],
            "still_on_the_bad_gpu": self.still_bound,
            "other_pods_kept": f"{self.kept}/{self.others}",
            "watched_after_fault_s": round(self.watched, 1),
            "all_replicas_running_on_good_gpus_s": None
            if self.all_ready is None
            else round(self.all_ready, 2),
        }


def _seconds(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values) + " s"


def table(results: list[Result]) -> str:
    head = (
        "| | running pods whose GPU failed mid-burst | fault -> replacement Running on another node, per pod "
        "| fault -> evicted | other pods on those nodes kept (same UID) | all replicas Running on good GPUs |"
    )
    lines = [head, "|---|---|---|---|---|---|"]
    for r in results:
        replaced = _seconds(r.replaced_after) if r.replaced_after else ""
        if len(r.replaced_after) < len(r.affected):
            never = f"never: {r.still_bound} still on the bad GPU {r.watched:.0f} s after the fault"
            replaced = f"{replaced}; {never}" if replaced else never
        lines.append(
            f"| {r.mode} | {len(r.affected)} (Xid 79; {r.bound_at_fault} of {r.replicas} pods bound) "
            f"| {replaced} | {_seconds(r.evicted_after) if r.evicted_after else '-'} | {r.kept}/{r.others} "
            f"| {'stalled' if r.all_ready is None else f'{r.all_ready:.1f} s'} |"
        )
    return "\n".join(lines)


class Scenario(burst.Scenario):
    """One mode on its own control plane (burst.Scenario's, its agents and gated nodes)."""

    def __init__(self, mode: str, case: Case, work: Path, log: Callable[[str], None]) -> None:
        shape = burst.Shape(
            nodes=case.nodes,
            joiners=case.joiners,
            bad_joiners=0,
            xid_nodes=case.fault_nodes,
            replicas=case.replicas,
            fault_at=0.0,
            join_every=case.join_every,
            timeout=case.timeout,
        )
        super().__init__("gpuguard", shape, work, log)
        self.case, self.evict, self.label = case, mode == "gpuguard+evict", mode
        self.kubelets: dict[str, FakeKubelet] = {}

    def _monitor(self, node: str, *, lost: bool = False) -> Path:
        with self._lock:  # joining nodes come from threads of their own
            # A short path: a unix socket's is at most 107 bytes.
            kubelet = FakeKubelet(str(self.work / f"k{len(self.kubelets)}.sock")).start()
            self.stack.callback(kubelet.stop)
            self.kubelets[node] = kubelet
        return super()._monitor(node, lost=lost)

    def agent_args(self, node: str) -> tuple[str, ...]:
        evict = ("--evict", "gpu-pods", "--pod-resources-socket", self.kubelets[node].socket_path)
        return (*super().agent_args(node), *(evict if self.evict else ()))

    def _grant_eviction(self) -> None:
        """deploy/eviction/rbac.yaml for the Deployment's namespace, as an operator lists it."""
        text = (DEPLOY / "eviction" / "rbac.yaml").read_text().replace("ml-serving", burst.NAMESPACE)
        for doc in yaml.safe_load_all(text):
            utils.create_from_dict(self.admin.api, doc)  # type: ignore[no-untyped-call]

    def _fault_point(self, watch: DeviceWatch, nodes: list[str]) -> dict[str, tuple[str, int]] | None:
        """node -> (pod, GPU) to fail, once every replica exists and each node has enough Ready pods."""
        with watch.lock:
            if len(watch.uid) < self.case.replicas:
                return None
            chosen = {}
            for node in nodes:
                held = watch.device.get(node, {})
                ready = sorted(
                    (watch.ready[p], p) for p in held if p in watch.ready and p not in watch.deleting
                )
                if len(ready) < self.case.ready_pods:
                    return None
                pod = ready[0][1]
                chosen[node] = (pod, held[pod])
            return chosen

    def _burst(self, api: Any) -> Result:  # type: ignore[override]
        case = self.case
        if self.evict:
            self._grant_eviction()
        nodes = [self._node(gated=True) for _ in range(case.nodes)]
        states = {n: self._monitor(n) for n in nodes}
        eventually(lambda: not any(self._gated(n) for n in nodes), 60, what="the gates lifted")
        apps: Any = kubernetes.client.AppsV1Api(api)
        apps.create_namespaced_deployment(burst.NAMESPACE, burst.deployment(2))
        watch = DeviceWatch(api, self.kubelets)
        watch.start()
        self.stack.callback(watch.stop)
        eventually(lambda: len(watch.ready) >= 2, 60, what="2 replicas Ready")
        self.log(f"{self.label}: {len(nodes)} nodes, 2 replicas Ready; scaling to {case.replicas}")

        t0 = time.monotonic()
        apps.patch_namespaced_deployment_scale(
            burst.APP, burst.NAMESPACE, {"spec": {"replicas": case.replicas}}
        )
        bad = nodes[: case.fault_nodes]
        chosen = eventually(
            lambda: self._fault_point(watch, bad), case.timeout, interval=0.02, what="the fault's moment"
        )
        fault = time.monotonic()
        for node, (_, gpu) in chosen.items():
            states[node].write_text(burst.gpu_state() + f"xid {gpu} 79\n")
        with watch.lock:
            before = set(watch.uid)
            affected = {pod for pod, _ in chosen.values()}
            others = {p: watch.uid[p] for n in bad for p in watch.device.get(n, {}) if p not in affected}
            result = Result(self.label, case.replicas, sorted(affected), len(watch.bound), others=len(others))
        self.log(
            f"{self.label}: Xid 79 under {sorted(chosen.values())} with {result.bound_at_fault} pods bound"
        )
        joining = threading.Thread(target=self._joins, daemon=True)
        joining.start()

        last, quiet_since = (-1, -1), time.monotonic()
        while time.monotonic() < t0 + case.timeout:
            if self._count(
                watch, result, fault=fault, t0=t0, before=before, bad=set(bad), others=set(others)
            ):
                break
            with watch.lock:
                now = (len(watch.bound), len(watch.ready))
            if now != last:
                last, quiet_since = now, time.monotonic()
            elif time.monotonic() - fault > case.hold and time.monotonic() - quiet_since > QUIET:
                break
            time.sleep(0.2)
        joining.join(case.timeout)
        watch.stop()
        self._count(watch, result, fault=fault, t0=t0, before=before, bad=set(bad), others=set(others))
        return result

    def _joins(self) -> None:
        """New good nodes, one every join_every seconds (each while the one before waits for its agent)."""
        joining = []
        for _ in range(self.case.joiners):
            joining.append(threading.Thread(target=self._join, args=(False,), daemon=True))
            joining[-1].start()
            time.sleep(self.case.join_every)
        for t in joining:
            t.join(self.case.timeout)

    def _count(
        self,
        watch: DeviceWatch,
        result: Result,
        *,
        fault: float,
        t0: float,
        before: set[str],
        bad: set[str],
        others: set[str],
    ) -> bool:
        """Fill result from what the watch saw; True once every affected pod is replaced and all replicas
        Run on good GPUs."""
        with watch.lock:
            # A pod leaves when first seen terminating, or gone if no list caught it terminating.
            left = {p: min(t, watch.deleting.get(p, t)) for p, t in {**watch.gone, **watch.deleting}.items()}
            replacements = sorted(
                watch.ready[p]
                for p in watch.uid.keys() - before
                if p in watch.ready and p not in left and watch.bound[p][0] not in bad
            )
            good = sorted(t for p, t in watch.ready.items() if p not in left and p not in result.affected)
            now = time.monotonic()
        result.replaced_after = [t - fault for t in replacements[: len(result.affected)]]
        result.evicted_after = sorted(left[p] - fault for p in result.affected if p in left)
        result.still_bound = sum(p not in left for p in result.affected)
        result.kept = len(others - left.keys())
        result.watched = now - fault
        result.all_ready = good[self.case.replicas - 1] - t0 if len(good) >= self.case.replicas else None
        return len(result.replaced_after) == len(result.affected) and result.all_ready is not None


def run(case: Case, modes: tuple[str, ...], log: Callable[[str], None]) -> list[Result]:
    results = []
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="gpuguard-evict-", dir="/tmp") as work:
            started = time.monotonic()
            # Scenario._burst returns this module's Result through burst.Scenario.run.
            results.append(cast(Result, Scenario(mode, case, Path(work), log).run()))
            log(f"{mode}: {results[-1].row()} ({time.monotonic() - started:.0f} s)")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--short", action="store_true", help=f"the make-test size: {SHORT}")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)
    modes = tuple(args.modes.split(","))
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"unknown mode {sorted(unknown)}: {', '.join(MODES)}")
    case = SHORT if args.short else FULL
    print(f"burst, a GPU fails under running pods: {case}", file=sys.stderr)
    print(table(run(case, modes, lambda m: print(m, file=sys.stderr, flush=True))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
