"""The burst scale-out, end to end (`make e2e`; a short version runs in `make test`).

On the fuller test control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager, kwok: hack/
testenv), an inference Deployment (one GPU per replica, shaped like deploy/examples/inference-preflight.yaml)
scales from 2 replicas to many in one step while
  (a) new GPU nodes join during the burst, some with a bad GPU already,
  (b) existing nodes get a fatal Xid (79) mid-burst,
  (c) one existing node gets an uncorrected ECC error,
once per mode:
  gpuguard  a real agent per GPU node (the nvml backend on the fake library, as the DaemonSet pod's
            ServiceAccount); new nodes register behind the startup gate (gpuguard.io/unverified);
  seed      the seed design (bench/baseline.py: a 3 s poll, no gate) per GPU node;
  none      no agent.

Measured per mode: pods bound to a bad node after its fault was detectable (the Xid or ECC written to the
fake driver; for a joining node with a bad GPU, its registration), pods bound to a joining node before its
agent's first check, the time from the scale-up to all replicas Ready, and the scheduler's throughput.

The model, stated: kwok runs every pod it is given, so a pod on a bad GPU here looks Running; in a real
cluster it crash-loops and never becomes Ready, and a Deployment does not move it (NoSchedule evicts
nothing). "All replicas Ready" therefore counts only pods on good placements, and its target leaves out the
pods bound to a node before its fault existed (no agent can keep those off): a mode that puts pods on
known-bad GPUs never gets there ("stalled").

    python -m bench.burst [--short] [--modes gpuguard,seed,none]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes

from bench.cluster import AgentProc, BaselineProc
from harness import controlplane
from harness.kube import (
    Admin,
    daemon_pod,
    eventually,
    make_gpu_node,
    token_kubeconfig,
)

ROOT = Path(__file__).resolve().parents[1]

NAMESPACE = "inference"
APP = "llm"
GATE = {"key": "gpuguard.io/unverified", "effect": "NoSchedule"}
GPUS_PER_NODE = 8
MODES = ("gpuguard", "seed", "none")
# A pod bound this long after its node's fault was detectable is "late": no detection latency explains it.
# gpuguard's Xid path takes ~0.1 s (docs/performance.md); an ECC error waits for the next poll (3 s).
LATE = 1.0


@dataclass(frozen=True)
class Shape:
    nodes: int  # GPU nodes before the burst
    joiners: int  # nodes that join during it
    bad_joiners: int  # of those, with a bad GPU already
    xid_nodes: int  # existing nodes that get a fatal Xid mid-burst
    replicas: int  # the scale-up's target: more than the existing good GPUs, so the burst needs the joiners
    fault_at: float  # seconds after the scale-up when (b) and (c) happen
    join_every: float  # seconds between two joining nodes, the same in every mode
    timeout: float  # seconds to wait for all replicas Ready


# 40 + 12 nodes of 8 GPUs: 4 existing and 3 joining go bad, (36 + 9) * 8 = 360 good GPUs for 340 replicas;
# 340 is more than the 40 existing nodes hold (320), so the burst needs the joiners in every mode.
FULL = Shape(
    nodes=40, joiners=12, bad_joiners=3, xid_nodes=3, replicas=340, fault_at=0.5, join_every=0.5, timeout=300
)
# 4 + 4 nodes: 2 existing and 1 joining go bad, (2 + 3) * 8 = 40 good GPUs for 36 replicas. 36 is more than
# the 4 existing nodes hold (32), so the burst needs the joiners in every mode: without an agent the pending
# pods go to the first node that joins, the bad one.
SHORT = Shape(
    nodes=4, joiners=4, bad_joiners=1, xid_nodes=1, replicas=36, fault_at=0.0, join_every=0.5, timeout=120
)


def gpu_state(*, lost: bool = False) -> str:
    return "".join(
        f"gpu {i} uuid=GPU-{i}{' lost=1' if lost and i == GPUS_PER_NODE - 1 else ''}\n"
        for i in range(GPUS_PER_NODE)
    )


@dataclass
class Result:
    mode: str
    on_bad_after_fault: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    late_by_kind: dict[str, int] = field(default_factory=dict)
    before_first_check: int = 0
    unavoidable: int = 0
    time_to_ready: float | None = None
    settled: float | None = None  # the last replica on a good GPU Ready: the burst's speed, stalled or not
    binds: int = 0
    bind_span: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.binds / self.bind_span if self.bind_span > 0 else 0.0

    def row(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "pods_on_bad_gpus_after_fault": self.on_bad_after_fault,
            "by_fault": self.by_kind,
            f"by_fault_more_than_{LATE:g}s_after": self.late_by_kind,
            "pods_on_new_nodes_before_first_check": self.before_first_check,
            "pods_bound_before_their_nodes_fault": self.unavoidable,
            "time_to_all_ready_s": None if self.time_to_ready is None else round(self.time_to_ready, 2),
            "last_good_replica_ready_s": None if self.settled is None else round(self.settled, 2),
            "scheduler_pods_per_s": round(self.throughput, 1),
        }


class PodWatch:
    """Every pod of the Deployment: when it was first seen bound (and where), and when first seen Ready."""

    def __init__(self, api: Any) -> None:
        self.core: Any = kubernetes.client.CoreV1Api(api)
        self.bound: dict[str, tuple[str, float]] = {}
        self.ready: dict[str, float] = {}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> PodWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        # A list every 100 ms: simple, and it cannot miss a pod the way a dropped watch would.
        while not self._stop.is_set():
            resp = self.core.list_namespaced_pod(
                NAMESPACE, label_selector=f"app={APP}", _preload_content=False
            )
            now = time.monotonic()
            with self.lock:
                self._observe(json.loads(resp.data)["items"], now)
            self._stop.wait(0.1)

    def _observe(self, items: list[dict[str, Any]], now: float) -> None:
        """One list's pods, seen at `now` (under the lock)."""
        for pod in items:
            name, node = pod["metadata"]["name"], pod["spec"].get("nodeName")
            if node and name not in self.bound:
                self.bound[name] = (node, now)
            conditions = pod.get("status", {}).get("conditions") or []
            if name not in self.ready and any(
                c["type"] == "Ready" and c["status"] == "True" for c in conditions
            ):
                self.ready[name] = now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def deployment(replicas: int) -> dict[str, Any]:
    """deploy/examples/inference-preflight.yaml's shape: one GPU per replica (no initContainer: kwok)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": APP, "namespace": NAMESPACE},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": APP}},
            "template": {
                "metadata": {"labels": {"app": APP}},
                "spec": {
                    "nodeSelector": {"nvidia.com/gpu.present": "true"},
                    "containers": [
                        {
                            "name": "server",
                            "image": "registry.example/llm-server:1",
                            "resources": {"limits": {"nvidia.com/gpu": "1"}},
                        }
                    ],
                },
            },
        },
    }


class Scenario:
    """One mode on its own control plane."""

    def __init__(self, mode: str, shape: Shape, work: Path, log: Callable[[str], None]) -> None:
        self.mode, self.shape, self.work, self.log = mode, shape, work, log
        self.stack = ExitStack()
        self.faulty: dict[str, float] = {}  # node -> monotonic time its fault became detectable
        self.kind: dict[str, str] = {}  # node -> "xid", "ecc" or "joined bad"
        self.first_check: dict[str, float] = {}  # joining node -> its agent's first complete check
        self.joiners: list[str] = []
        self._names = itertools.count()
        self._lock = threading.Lock()  # joining nodes start their agents from threads of their own

    def run(self) -> Result:
        with self.stack:
            cp = controlplane.ControlPlane(
                self.work / "cp", components=controlplane.COMPONENTS, die_with_parent=True
            )
            self.stack.callback(cp.stop)
            cp.start()
            self.cp = cp
            api: Any = kubernetes.config.new_client_from_config(config_file=str(cp.kubeconfig_path))  # type: ignore[no-untyped-call]
            self.stack.enter_context(closing(api))
            self.admin = Admin(api)
            self.admin.apply_deploy_manifests()
            self.admin.core.create_namespace({"metadata": {"name": NAMESPACE}})
            return self._burst(api)

    def _node(self, *, gated: bool) -> str:
        return make_gpu_node(self.admin, gpus=GPUS_PER_NODE, taints=[GATE] if gated else None)

    def _monitor(self, node: str, *, lost: bool = False) -> Path:
        """Start this mode's agent on node; returns its fake driver's state file."""
        state = self.work / f"{node}.state"
        state.write_text(gpu_state(lost=lost))
        if self.mode == "none":
            return state
        ds = eventually(lambda: daemon_pod(self.admin, node), 60, what=f"DaemonSet pod on {node}")
        kubeconfig = token_kubeconfig(
            self.work / f"{node}.kubeconfig",
            server=self.cp.url,
            ca_path=self.cp.ca_path,
            token=self.admin.pod_token(ds["metadata"]["name"]),
        )
        if self.mode == "gpuguard":
            agent = AgentProc(
                node=node, kubeconfig=kubeconfig, state=state, args=self.agent_args(node)
            ).start()
            with self._lock:
                self.stack.callback(agent.close)
            if node in self.joiners:
                # Its first check as the agent reports it (/readyz comes later: after the first reconcile,
                # which lifts the gate).
                self.first_check[node] = agent.wait_first_check(60)
                agent.wait_ready(60)
        else:
            seed = BaselineProc(node=node, kubeconfig=kubeconfig, state=state, log=self.work / f"{node}.log")
            with self._lock:
                self.stack.callback(seed.stop)
            seed.start()
            if node in self.joiners:
                try:
                    seed.wait_ready(60)
                except RuntimeError:
                    # The seed design does not survive a GPU that is lost at its first poll: it never checks.
                    self.log(f"seed: the loop on {node} exited at its first poll")
                else:
                    self.first_check[node] = time.monotonic()
        return state

    def agent_args(self, node: str) -> tuple[str, ...]:
        """The gpuguard agent's flags on node (beyond its node, kubeconfig and fake driver)."""
        return ("--max-quarantined", "100%")

    def _gated(self, node: str) -> bool:
        return any(t["key"] == GATE["key"] for t in self.admin.node(node)["spec"].get("taints") or [])

    def _join(self, bad: bool) -> None:
        node = self._node(gated=self.mode == "gpuguard")
        self.joiners.append(node)
        if bad:
            self.faulty[node] = time.monotonic()  # detectable from its registration on
            self.kind[node] = "joined bad"
        self._monitor(node, lost=bad)

    def _burst(self, api: Any) -> Result:
        shape = self.shape
        gated = self.mode == "gpuguard"
        nodes = [self._node(gated=gated) for _ in range(shape.nodes)]
        states = {n: self._monitor(n) for n in nodes}
        if gated:  # the existing nodes passed their first check before the burst
            eventually(lambda: not any(self._gated(n) for n in nodes), 60, what="the gates lifted")
        apps: Any = kubernetes.client.AppsV1Api(api)
        apps.create_namespaced_deployment(NAMESPACE, deployment(2))
        watch = PodWatch(api).start()
        self.stack.callback(watch.stop)
        eventually(lambda: len(watch.ready) >= 2, 60, what="2 replicas Ready")
        self.log(f"{self.mode}: {len(nodes)} nodes, 2 replicas Ready; scaling to {shape.replicas}")

        t0 = time.monotonic()
        apps.patch_namespaced_deployment_scale(APP, NAMESPACE, {"spec": {"replicas": shape.replicas}})
        xid_nodes, ecc_node = nodes[: shape.xid_nodes], nodes[shape.xid_nodes]

        def faults() -> None:
            time.sleep(shape.fault_at)
            for n in xid_nodes:  # (b) a fatal Xid mid-burst
                states[n].write_text(gpu_state() + f"xid {GPUS_PER_NODE - 1} 79\n")
                self.faulty[n] = time.monotonic()
                self.kind[n] = "xid"
            # (c) uncorrected ECC on one more
            states[ecc_node].write_text(
                gpu_state().replace(f"GPU-{GPUS_PER_NODE - 1}\n", f"GPU-{GPUS_PER_NODE - 1} ecc=1\n")
            )
            self.faulty[ecc_node] = time.monotonic()
            self.kind[ecc_node] = "ecc"

        def joins() -> None:  # (a) new nodes during the burst, the bad ones first
            # On one schedule in every mode: a node joins when it joins, whatever watches it (its agent
            # starts beside it; waiting for one agent must not hold back the next node).
            joining = []
            for i in range(shape.joiners):
                joining.append(
                    threading.Thread(target=self._join, args=(i < shape.bad_joiners,), daemon=True)
                )
                joining[-1].start()
                time.sleep(shape.join_every)
            for t in joining:
                t.join(shape.timeout)

        threads = [threading.Thread(target=f, daemon=True) for f in (faults, joins)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(shape.timeout)
        result = Result(self.mode)
        deadline = t0 + shape.timeout
        last, quiet_since = (-1, -1), time.monotonic()
        while time.monotonic() < deadline:
            if self._tally(watch, t0, result):
                break
            with watch.lock:
                now = (len(watch.bound), len(watch.ready))
            if now != last:
                last, quiet_since = now, time.monotonic()
            elif time.monotonic() - quiet_since > 10:
                break  # every node has joined and nothing moved for 10 s: stalled
            time.sleep(0.2)
        watch.stop()
        self._tally(watch, t0, result)
        return result

    def _tally(self, watch: PodWatch, t0: float, result: Result) -> bool:
        """Fill result from what the watch saw; True once all replicas on good placements are Ready."""
        with watch.lock:
            bound, ready = dict(watch.bound), dict(watch.ready)
        after = unavoidable = early = 0
        by_kind: dict[str, int] = {}
        late: dict[str, int] = {}
        good_ready: list[float] = []
        for pod, (node, at) in bound.items():
            fault = self.faulty.get(node)
            if fault is not None and at >= fault:
                after += 1
                by_kind[self.kind[node]] = by_kind.get(self.kind[node], 0) + 1
                if at >= fault + LATE:
                    late[self.kind[node]] = late.get(self.kind[node], 0) + 1
            elif fault is not None:
                unavoidable += 1
            elif pod in ready:
                good_ready.append(ready[pod])
            if node in self.joiners and at < self.first_check.get(node, float("inf")):
                early += 1
        burst_binds = sorted(at for _, at in bound.values() if at >= t0)
        result.on_bad_after_fault, result.unavoidable, result.before_first_check = after, unavoidable, early
        result.by_kind, result.late_by_kind = by_kind, late
        result.settled = max(good_ready) - t0 if good_ready else None
        result.binds = len(burst_binds)
        result.bind_span = (burst_binds[-1] - t0) if burst_binds else 0.0
        target = self.shape.replicas - unavoidable
        if len(good_ready) >= target and after == 0:
            result.time_to_ready = sorted(good_ready)[target - 1] - t0
            return True
        return False


def table(results: list[Result]) -> str:
    head = (
        "| | pods on bad GPUs (bound after the fault was detectable) | pods on new nodes before their first "
        "check | pods bound before their node's fault | time to all replicas Ready "
        "| last replica on a good GPU Ready | scheduler throughput |"
    )
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in results:
        ready = f"{r.time_to_ready:.1f} s" if r.time_to_ready is not None else "stalled"
        settled = f"{r.settled:.1f} s" if r.settled is not None else "-"
        lines.append(
            f"| {r.mode} | {r.on_bad_after_fault} | {r.before_first_check} | {r.unavoidable} | {ready} | "
            f"{settled} | {r.throughput:.0f} pods/s |"
        )
    return "\n".join(lines)


def run(shape: Shape, modes: tuple[str, ...], log: Callable[[str], None]) -> list[Result]:
    results = []
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix=f"gpuguard-burst-{mode}-") as work:
            started = time.monotonic()
            results.append(Scenario(mode, shape, Path(work), log).run())
            log(f"{mode}: {json.dumps(results[-1].row())} ({time.monotonic() - started:.0f} s)")
    return results


def _iter_modes(text: str) -> Iterator[str]:
    for mode in text.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}: {', '.join(MODES)}")
        yield mode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--short", action="store_true", help=f"the make-test size: {SHORT}")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)
    shape = SHORT if args.short else FULL
    print(f"burst: {shape}", file=sys.stderr)
    results = run(shape, tuple(_iter_modes(args.modes)), lambda m: print(m, file=sys.stderr, flush=True))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
