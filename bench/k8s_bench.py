"""`make bench` against a real API server: etcd + kube-apiserver from hack/testenv, started and stopped here.

- Fault-to-taint latency: the real `gpuguard watch --backend nvml` process (fake libnvidia-ml.so.1, pynvml,
  not a dry run) as the DaemonSet's ServiceAccount; the fault is written to the fake library's state file
  and the clock stops when a watch on the node (admin, fieldSelector metadata.name=<node>) delivers the
  taint. The seed-design baseline (bench/baseline.py) is measured the same way in the same run.
- API load: the API server's audit log (user agent gpuguard/<version>), attributed per node.
- Cost on a healthy node: CPU (utime + stime from /proc) and RSS of one agent over a window after its
  start-up requests.
- Fleet: bench/fleet.py (1,000 reconcilers + writers, a fault burst, a concurrent foreign writer).
- Start-up: process start to /readyz 200; import time of gpuguard.cli.

Run by bench/run.py; prints nothing itself except progress on stderr. The cluster, the agent processes and
the measuring helpers are bench/cluster.py; this file holds only the phases.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.cluster import (
    FLEET_LABEL,
    FOREIGN_LABEL,
    FOREIGN_TAINT,
    GPUS,
    TAINT_KEY,
    WRITE_VERBS,
    AgentProc,
    BaselineProc,
    Cluster,
    audit_code,
    audit_node,
    audit_time,
    describe_requests,
    proc_cpu_seconds,
    proc_status_mb,
    progress,
    rule_watch,
    server_times,
    summary,
    tainted,
    thread_cpu_seconds,
    untainted,
)
from bench.fleet import Fleet
from bench.nvml_bench import gpu_lines
from gpuguard.core.config import GPU_NODE_SELECTOR
from gpuguard.quarantine.gpu.rules import rule_name

ROOT = Path(__file__).resolve().parents[1]

# How long an agent may take to answer /readyz: on a quiet machine about a second (the start-up row), but the
# bench's machine is shared and under a load of hundreds a Python process can take minutes to start.
READY_TIMEOUT = 300.0

# -- item 1 (and part of 3): fault-to-taint latency ----------------------------------------------------------


def latency_phase(
    cl: Cluster,
    *,
    rounds: int = 5,
    xid_rounds: int = 10,
    lanes: int = 10,
    interval: float = 3.0,
    quiet: Callable[[bool], None] = lambda on: None,
) -> dict[str, Any]:
    """`rounds` x `lanes` samples of each of gpuguard ECC, baseline Xid, baseline ECC; `xid_rounds` x `lanes`
    of gpuguard Xid and of the floor, whose goal is a p99 and a ratio of p99s: with 100 samples the p99 is
    the second slowest (nearest rank), not the slowest alone. `quiet` is called with True before the
    gpuguard Xid rounds (milliseconds) and with False after them."""
    work = cl.tmp / "latency"
    work.mkdir()
    xid_nodes = [f"lat-xid-{i}" for i in range(lanes)]
    floor_nodes = [f"lat-floor-{i}" for i in range(lanes)]
    full_nodes = [f"lat-full-{i}" for i in range(lanes)]
    ecc_nodes = [f"lat-ecc-{i}" for i in range(lanes)]
    base_ecc_nodes = [f"base-ecc-{i}" for i in range(lanes)]
    base_xid_nodes = [f"base-xid-{i}" for i in range(lanes)]
    every = xid_nodes + ecc_nodes + base_ecc_nodes + base_xid_nodes + floor_nodes + full_nodes
    cl.make_nodes(every)
    floor = BarePatcher(cl, {n: cl.admin.agent_token(n) for n in floor_nodes + full_nodes})
    cl.on_close(floor.close)
    kubeconfigs = cl.agent_kubeconfigs(every)
    watches = {n: cl.watch(field_selector=f"metadata.name={n}") for n in every}
    since = cl.cp.audit_line_count()
    transitions: list[tuple[str, str, float, float]] = []  # kind, node, wall start, wall end
    tlock = threading.Lock()
    restored: list[str] = []

    def start_round(nodes: list[str], r: int) -> tuple[list[AgentProc], float]:
        """New agent processes after a simulated reboot (a new bootID; a fresh --state-dir, as a new boot
        discards the old one; fake NVML state files without old xid lines). They recover the nodes."""
        agents = []
        for n in nodes:
            if r:
                cl.admin.set_boot_id(n, f"boot-{r}")
            state = work / f"{n}.state"
            state.write_text(gpu_lines(GPUS))
            # --budget-count-spread 0: the GPU nodes counted at start, as every agent has them after its first
            # minute (before, a fault whose room the budget cannot prove lists them in its path).
            args = ("--recover-after", "1", "--budget-count-spread", "0")
            agents.append(cl.agent(n, kubeconfigs[n], state, interval=interval, args=args))
        wall = time.time()
        for a in agents:
            a.wait_ready(READY_TIMEOUT)
        for n in nodes:
            watches[n].wait_current(n, untainted, 15)
        return agents, wall

    def end_round(
        kind: str,
        nodes: list[str],
        agents: list[AgentProc],
        *,
        r: int,
        started: float,
        injected: dict[str, float],
    ) -> None:
        time.sleep(0.5)  # the Event after the last taint
        for a in agents:
            a.stop()
            if a.restored:
                restored.append(a.node)
        end = time.time()
        with tlock:
            for n in nodes:
                if r:
                    transitions.append(
                        ("recovery at agent start (incl. its start-up requests)", n, started, injected[n])
                    )
                transitions.append((kind, n, injected[n], end))

    # Xid, gpuguard, on a quiet machine: Xids are sticky until a reboot, so each round reboots the nodes and
    # starts new agents, then one Xid per node, one node after the other. The floor in the same run, sample
    # for sample just before each Xid: a bare merge patch of the same taint by a minimal client (one
    # keep-alive connection, the DaemonSet's ServiceAccount, so the same authentication, admission policy and
    # priority level), timed to the same kind of watch.
    progress(f"latency: gpuguard Xid and the floor (a bare patch), {xid_rounds} rounds x {lanes} nodes")
    xid_lat: list[float] = []
    floor_lat: list[float] = []
    full_lat: list[float] = []
    # Each Xid sample split at the agent's judgement: its gpu.unhealthy log line (written by the check loop
    # before the state file and the hand-over to the writer thread; structlog's UTC timestamp, the same clock
    # as time.time() here). Before it: the fake library's event, the wake-up, the snapshot, the policy;
    # after it: the state file, the reconcile, the patch and the watch (what the floor does, and more).
    judged: list[float] = []
    to_taint: list[float] = []
    quiet(True)
    for r in range(xid_rounds):
        agents, started = start_round(xid_nodes, r)
        time.sleep(1.0)
        injected: dict[str, float] = {}
        seen: dict[str, float] = {}  # node -> wall time the watch delivered the taint
        for n, fn, gn in zip(xid_nodes, floor_nodes, full_nodes, strict=True):
            for node, full, out in ((fn, False, floor_lat), (gn, True, full_lat)):
                time.sleep(random.uniform(0.05, 0.3))
                # The node's other taints as the watch last delivered them: a merge patch replaces the list
                # whole (as gpuguard's does), and the admission policy lets the token change only its own.
                others = [
                    t
                    for t in (watches[node].objects[node].get("spec") or {}).get("taints") or []
                    if t.get("key") != TAINT_KEY
                ]
                t0 = time.monotonic()
                floor.taint(node, others, full=full)
                out.append(watches[node].wait_change(node, tainted, after=t0, timeout=10) - t0)
                floor.untaint(node, others, full=full)
                watches[node].wait_current(node, untainted, 10)
            time.sleep(random.uniform(0.05, 0.3))
            injected[n] = time.time()
            t0 = time.monotonic()
            with (work / f"{n}.state").open("a") as f:
                f.write(f"xid {r % GPUS} 79\n")
            lat = watches[n].wait_change(n, tainted, after=t0, timeout=10) - t0
            xid_lat.append(lat)
            seen[n] = injected[n] + lat
        for a in agents:
            at = _judged_at(a)
            if at is not None:
                judged.append(at - injected[a.node])
                to_taint.append(seen[a.node] - at)
        end_round("Xid -> taint", xid_nodes, agents, r=r, started=started, injected=injected)
    quiet(False)
    progress(
        f"latency: Xid -> taint {summary(xid_lat)}; the floor {summary(floor_lat)}; load {os.getloadavg()}"
    )

    # ECC (gpuguard, in rounds of new agents again: the flap window would otherwise hold the quarantine), and
    # the seed baseline's ECC and Xid lanes, all at once. Every sample waits a random phase of the 3 s poll.
    progress(
        f"latency: gpuguard ECC ({rounds} rounds x {lanes} nodes), "
        f"baseline ECC and Xid ({lanes} lanes x {rounds})"
    )
    results: dict[str, list[float]] = defaultdict(list)
    errors: list[str] = []

    def inject_and_wait(kind: str, n: str, i: int) -> float:
        state = work / f"{n}.state"
        time.sleep(0.3 + random.uniform(0, interval))
        t0 = time.monotonic()
        if kind.endswith("xid"):
            with state.open("a") as f:
                f.write(f"xid {i % GPUS} 79\n")
        else:
            state.write_text(gpu_lines(GPUS, {i % GPUS: 1}))
        lat = watches[n].wait_change(n, tainted, after=t0, timeout=interval + 15) - t0
        with tlock:
            results[kind].append(lat)
        return lat

    def gpuguard_ecc() -> None:
        try:
            for r in range(rounds):
                agents, started = start_round(ecc_nodes, r)
                injected: dict[str, float] = {}

                def one(n: str, r: int = r, injected: dict[str, float] = injected) -> None:
                    injected[n] = time.time() + 0.3  # sleeps 0.3 s + a random phase before the write
                    inject_and_wait("gpuguard-ecc", n, r)

                with ThreadPoolExecutor(len(ecc_nodes)) as pool:
                    list(pool.map(one, ecc_nodes))
                end_round("ECC -> taint", ecc_nodes, agents, r=r, started=started, injected=injected)
        except Exception as exc:
            errors.append(f"gpuguard ECC: {exc!r}")

    def baseline_lane(kind: str, n: str) -> None:
        try:
            for i in range(rounds):
                watches[n].wait_current(n, untainted, interval + 15)
                inject_and_wait(kind, n, i)
                time.sleep(0.3)
                if kind.endswith("ecc"):
                    (work / f"{n}.state").write_text(gpu_lines(GPUS))
                watches[n].wait_current(n, untainted, interval + 15)
        except Exception as exc:
            errors.append(f"{kind} {n}: {exc!r}")

    baselines: list[BaselineProc] = []
    for n in base_ecc_nodes + base_xid_nodes:
        state = work / f"{n}.state"
        state.write_text(gpu_lines(GPUS))
        b = BaselineProc(
            node=n, kubeconfig=kubeconfigs[n], state=state, log=work / f"{n}.log", interval=interval
        )
        baselines.append(b.start())
        cl.on_close(b.stop)
    for b in baselines:
        b.wait_ready(READY_TIMEOUT)
    threads = [threading.Thread(target=gpuguard_ecc, daemon=True)]
    threads += [
        threading.Thread(target=baseline_lane, args=("baseline-ecc", n), daemon=True) for n in base_ecc_nodes
    ]
    threads += [
        threading.Thread(target=baseline_lane, args=("baseline-xid", n), daemon=True) for n in base_xid_nodes
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for b in baselines:
        b.stop()
    if errors:
        raise RuntimeError("latency lanes failed: " + "; ".join(errors[:5]))
    if restored:
        raise RuntimeError(f"agents restored faults from an earlier run's --state-dir: {restored[:5]}")

    # Requests per transition, from the audit log: gpuguard's requests about the node (and its Events)
    # between the injection and the agent's stop (or between the agent's start and the injection).
    events = cl.audit(since)
    by_node: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_node[audit_node(e)].append(e)
    per_kind: dict[str, list[int]] = defaultdict(list)
    detail: dict[str, Counter[str]] = defaultdict(Counter)
    server: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for kind, n, start, end in transitions:
        inside = [e for e in by_node[n] if start <= audit_time(e) < end]
        per_kind[kind].append(len(inside))
        detail[kind].update(describe_requests(inside))
        server[kind].extend(inside)
    return {
        "lanes": lanes,
        "gpu_nodes": cl.gpu_nodes(),
        "xid": summary(xid_lat),
        "xid_judged": summary(judged) if judged else None,
        "xid_judged_to_taint": summary(to_taint) if to_taint else None,
        "floor": summary(floor_lat),
        "floor_full": summary(full_lat),
        "ecc": summary(results["gpuguard-ecc"]),
        "baseline_xid": summary(results["baseline-xid"]),
        "baseline_ecc": summary(results["baseline-ecc"]),
        "transitions": {
            k: {
                "n": len(v),
                "max": max(v),
                "min": min(v),
                "mean": statistics.fmean(v),
                "requests": dict(detail[k]),
                "server": server_times(server[k]),
            }
            for k, v in per_kind.items()
        },
    }


def rule_of(node: str) -> str:
    """The DeviceTaintRule the agent writes for GPU 3 of `node` (the agent's own naming)."""
    name = rule_name(node, "gpu-3")
    assert name is not None
    return name


def device_phase(cl: Cluster, *, rounds: int = 25, lanes: int = 1, interval: float = 3.0) -> dict[str, Any]:
    """Xid -> DeviceTaintRule visible: `lanes` nodes whose 8 GPUs NVIDIA's DRA driver publishes (a
    ResourceSlice, driver gpu.nvidia.com, pool = the node, `uuid` = the fake NVML GPUs'), agents with the
    default --quarantine auto. Each round reboots the nodes (a new bootID, fresh --state-dir and fake NVML
    state: the new agent deletes the last round's rule, as recovery), then one Xid on GPU 3 per node, one node
    after the other, timed until an admin watch on DeviceTaintRules delivers gpuguard's rule for gpu-3."""
    import kubernetes

    from harness.dra import gpu_uuid, nvidia_slice

    work = cl.tmp / "device"
    work.mkdir()
    nodes = [f"lat-dev-{i}" for i in range(lanes)]
    cl.make_nodes(nodes)
    custom: Any = kubernetes.client.CustomObjectsApi(cl.api)
    for n in nodes:  # the GPUs' uuid attributes are the fake NVML GPUs' UUIDs (gpu_uuid)
        custom.create_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", nvidia_slice(n, GPUS))
    kubeconfigs = cl.agent_kubeconfigs(nodes)
    node_watches = {n: cl.watch(field_selector=f"metadata.name={n}") for n in nodes}
    rules = rule_watch(cl.api)
    cl.on_close(rules.close)
    lat: list[float] = []
    args = ("--recover-after", "1", "--budget-count-spread", "0", "--quarantine", "auto")
    since = cl.cp.audit_line_count()
    windows: list[tuple[str, float, float]] = []  # node, wall time of the Xid, wall time its agent stopped

    def reboot(r: int) -> list[AgentProc]:
        """A new bootID, healthy fake NVML state, new agents (a fresh --state-dir each): the last round's
        rule is deleted by the new agent's recovery; both seen before it returns."""
        agents = []
        for n in nodes:
            cl.admin.set_boot_id(n, f"boot-{r}")
            state = work / f"{n}.state"
            state.write_text("".join(f"gpu {i} uuid={gpu_uuid(n, i)}\n" for i in range(GPUS)))
            agents.append(cl.agent(n, kubeconfigs[n], state, interval=interval, args=args))
        for a in agents:
            a.wait_ready(READY_TIMEOUT)
        for n in nodes:
            rules.wait_current(rule_of(n), absent, 15)
            node_watches[n].wait_current(n, untainted, 15)
        return agents

    progress(f"latency: Xid -> DeviceTaintRule, {rounds} rounds x {lanes} nodes")
    for r in range(rounds):
        agents = reboot(r + 1)
        time.sleep(1.0)
        injected: dict[str, float] = {}
        for n, agent in zip(nodes, agents, strict=True):
            time.sleep(random.uniform(0.05, 0.3))
            injected[n] = time.time()
            t0 = time.monotonic()
            with (work / f"{n}.state").open("a") as f:
                f.write("xid 3 79\n")
            try:
                lat.append(rules.wait_change(rule_of(n), tainted, after=t0, timeout=10) - t0)
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}; the agent's last lines: {agent.lines[-8:]}") from exc
            if tainted(node_watches[n].current.get(n)):
                raise RuntimeError(f"{n}: the node was tainted for a fault of one published GPU")
        time.sleep(1.0)  # the condition after the rule; an order check that listed would come now
        for a in agents:
            a.stop()
        windows += [(n, injected[n], time.time()) for n in nodes]
    for a in reboot(rounds + 1):  # the last round's rules go as every round's did
        a.stop()
    progress(f"latency: Xid -> DeviceTaintRule {summary(lat)}")
    # Requests per transition, as for the node taint: the agent's requests from the Xid until it stopped.
    events = cl.audit(since)
    counts: list[int] = []
    detail: Counter[str] = Counter()
    for n, start, end in windows:
        inside = [e for e in events if audit_node(e) == n and start <= audit_time(e) < end]
        counts.append(len(inside))
        detail.update(describe_requests(inside))
    requests = {
        "n": len(counts),
        "max": max(counts),
        "mean": statistics.fmean(counts),
        "requests": dict(detail),
    }
    return {"nodes": lanes, **summary(lat), "transitions": requests}


def _judged_at(agent: AgentProc) -> float | None:
    """The wall time of the agent's first gpu.unhealthy line (its check loop's judgement of the Xid)."""
    for line in agent.events("gpu.unhealthy"):
        stamp = line.get("timestamp")
        if isinstance(stamp, str):
            return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    return None


def absent(v: str | None) -> bool:
    """No such DeviceTaintRule: deleted (None) or never seen by the watch."""
    return v is None or v == "<absent>"


class BarePatcher:
    """The floor's minimal client: one keep-alive HTTPS connection, a bearer token, a JSON merge patch of the
    node's taints and nothing else (no read, no precondition, no Event, no condition)."""

    def __init__(self, cl: Cluster, tokens: dict[str, str]) -> None:
        import http.client
        import ssl
        from urllib.parse import urlparse

        url = urlparse(cl.cp.url)
        ctx = ssl.create_default_context(cafile=str(cl.cp.ca_path))
        self._conn = http.client.HTTPSConnection(
            url.hostname or "127.0.0.1", url.port, context=ctx, timeout=10
        )
        self._tokens = tokens  # each node's own Pod-bound token, as each node's agent has

    def _patch(self, node: str, doc: dict[str, Any]) -> None:
        body = json.dumps(doc)
        self._conn.request(
            "PATCH",
            # fieldManager gpuguard: the admission policy lets the agents' token add no other manager's entry.
            f"/api/v1/nodes/{node}?fieldManager=gpuguard",
            body=body,
            headers={
                "Authorization": f"Bearer {self._tokens[node]}",
                "Content-Type": "application/merge-patch+json",
                "Accept": "application/json",
                "User-Agent": "floor/1",
            },
        )
        resp = self._conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"floor patch {node}: HTTP {resp.status}: {data[:300]!r}")

    def taint(self, node: str, others: list[dict[str, str]], *, full: bool = False) -> None:
        """`full`: gpuguard's whole body, not the taint alone: the label gpuguard.io/quarantined=true (which
        the other agents' budget watches select, so the write is sent to each of them), the annotations
        and the cordon."""
        taints = [*others, {"key": TAINT_KEY, "value": "xid-79", "effect": "NoSchedule"}]
        if not full:
            self._patch(node, {"spec": {"taints": taints}})
            return
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._patch(
            node,
            {
                "metadata": {
                    "labels": {"gpuguard.io/quarantined": "true"},
                    "annotations": {
                        "gpuguard.io/reason": "xid-79: GPU has fallen off the bus (GPU 0, GPU-bench-000)",
                        "gpuguard.io/since": since,
                        "gpuguard.io/boot-id": "boot-0",
                        "gpuguard.io/faults": "xid-79/GPU-bench-000",
                        "gpuguard.io/cordoned": "true",
                    },
                },
                "spec": {"taints": taints, "unschedulable": True},
            },
        )

    def untaint(self, node: str, others: list[dict[str, str]], *, full: bool = False) -> None:
        if not full:
            self._patch(node, {"spec": {"taints": others}})
            return
        keys = (
            "gpuguard.io/reason",
            "gpuguard.io/since",
            "gpuguard.io/boot-id",
            "gpuguard.io/faults",
            "gpuguard.io/cordoned",
        )
        self._patch(
            node,
            {
                "metadata": {
                    "labels": {"gpuguard.io/quarantined": None},
                    "annotations": dict.fromkeys(keys),
                },
                "spec": {"taints": others, "unschedulable": None},
            },
        )

    def close(self) -> None:
        self._conn.close()


# -- item 5: start-up ----------------------------------------------------------------------------------------


def startup_phase(cl: Cluster, runs: int = 5) -> dict[str, Any]:
    node = "startup-0"
    cl.make_nodes([node])
    kubeconfig = cl.agent_kubeconfig(node)
    state = cl.tmp / "startup.state"
    state.write_text(gpu_lines(GPUS))
    ready, listening = [], []
    for _ in range(runs):
        a = cl.agent(node, kubeconfig, state)
        t = a.wait_ready(READY_TIMEOUT)
        ready.append(t - a.t_start)
        listening.append(a.t_listening - a.t_start)
        a.stop()
    # One more run with -X importtime (PYTHONPROFILEIMPORTTIME): where the start-up goes.
    a = cl.agent(node, kubeconfig, state, env={"PYTHONPROFILEIMPORTTIME": "1"})
    a.wait_ready(READY_TIMEOUT)
    a.stop()
    top: list[tuple[int, str]] = []
    for doc in a.events("non-json"):
        line = str(doc.get("line", ""))
        if line.startswith("import time:") and "|" in line:
            parts = line.split("|")
            name = parts[2]
            if parts[1].strip().isdigit() and name.startswith(" ") and not name.startswith("  "):
                top.append((int(parts[1]), name.strip()))
    top.sort(reverse=True)
    return {
        "imports_top": [(name, us / 1000) for us, name in top[:5]],
        "runs": runs,
        "median_s": statistics.median(ready),
        "min_s": min(ready),
        "max_s": max(ready),
        "listening_median_s": statistics.median(listening),
    }


def import_time(runs: int = 5) -> dict[str, Any]:
    py = sys.executable
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    r = subprocess.run(
        [py, "-X", "importtime", "-c", "import gpuguard.cli"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=True,
    )
    cumulative = next(
        int(line.split("|")[1]) for line in r.stderr.splitlines() if line.rstrip().endswith("| gpuguard.cli")
    )
    r = subprocess.run(
        [py, "-X", "importtime", "-c", "import kubernetes.client"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=True,
    )
    kube = next(
        int(line.split("|")[1])
        for line in r.stderr.splitlines()
        if line.rstrip().endswith("| kubernetes.client")
    )

    def wall(code: str) -> float:
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            subprocess.run([py, "-c", code], check=True, env=env, cwd=ROOT)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    probe = subprocess.run(
        [py, "-c", "import sys, gpuguard.cli; print(int('kubernetes' in sys.modules))"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=True,
    )
    return {
        "importtime_ms": cumulative / 1000,
        "kubernetes_importtime_ms": kube / 1000,
        "wall_ms": wall("import gpuguard.cli") * 1000,
        "bare_ms": wall("pass") * 1000,
        "kubernetes_imported": probe.stdout.strip() == "1",
    }


# -- item 4: the fleet ---------------------------------------------------------------------------------------


def _foreign_writer(api: Any, names: list[str], at: float, out: dict[str, int]) -> None:
    """Admin read-modify-write with the resourceVersion precondition: adds a label and a taint to each node,
    re-reading on every 409, starting at the same instant as gpuguard's burst."""
    import kubernetes

    core: Any = kubernetes.client.CoreV1Api(api)
    lock = threading.Lock()

    def one(name: str) -> None:
        for attempt in range(50):
            node = json.loads(core.read_node(name, _preload_content=False).data)
            taints = [t for t in node["spec"].get("taints") or [] if t.get("key") != FOREIGN_TAINT["key"]]
            body = {
                "metadata": {
                    "resourceVersion": node["metadata"]["resourceVersion"],
                    "labels": {FOREIGN_LABEL: "burst"},
                },
                "spec": {"taints": [*taints, FOREIGN_TAINT]},
            }
            try:
                core.patch_node(
                    name, body, _content_type="application/merge-patch+json", _preload_content=False
                )
                with lock:
                    out["writes"] += 1
                    out["conflicts"] += attempt
                return
            except kubernetes.client.exceptions.ApiException as exc:
                if exc.status != 409:
                    raise
        raise RuntimeError(f"foreign writer gave up on {name}")

    while (left := at - time.monotonic()) > 0:
        time.sleep(min(left, 0.01))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, names))


def _check_nodes(cl: Cluster, names: list[str], faulty: set[str], *, expect_ours: bool) -> dict[str, int]:
    listed = json.loads(cl.core.list_node(label_selector=f"{FLEET_LABEL}=true", _preload_content=False).data)
    nodes = {n["metadata"]["name"]: n for n in listed["items"]}
    out = Counter[str]()
    for name in names:
        n = nodes[name]
        taints = n["spec"].get("taints") or []
        ours = any(t["key"] == TAINT_KEY for t in taints)
        if name in faulty:
            out["foreign_taint_kept"] += any(t == FOREIGN_TAINT for t in taints)
            out["foreign_label_kept"] += n["metadata"].get("labels", {}).get(FOREIGN_LABEL) == "burst"
            out["ours_as_expected"] += ours == expect_ours
        else:
            out["others_untouched"] += not ours and FOREIGN_LABEL not in n["metadata"].get("labels", {})
    return dict(out)


def fleet_phase(
    cl: Cluster, *, nodes: int = 1000, processes: int = 2, fraction: float = 0.1
) -> tuple[Fleet, dict[str, Any]]:
    """Leaves the fleet running and healthy (for the idle window); the caller stops it."""
    names = [f"fleet-{i:04d}" for i in range(nodes)]
    name_set = set(names)
    t0 = time.monotonic()
    cl.make_nodes(names, boot_id=None, labels={FLEET_LABEL: "true"})
    progress(f"fleet: {nodes} nodes created in {time.monotonic() - t0:.1f} s")
    t0 = time.monotonic()
    kubeconfigs = cl.agent_kubeconfigs(names)
    tokens_s = time.monotonic() - t0
    progress(f"fleet: {nodes} Pods and Pod-bound ServiceAccount tokens in {tokens_s:.1f} s")
    watch = cl.watch(label_selector=f"{FLEET_LABEL}=true")
    fleet = Fleet(kubeconfigs, processes=processes, workdir=cl.tmp)
    cl.on_close(fleet.stop)
    created = fleet.start()
    progress(
        f"fleet: {processes} processes x {nodes // processes} reconcilers "
        f"created in {created['seconds']:.1f} s"
    )
    apf0 = cl.apf_levels()

    # Start-up: every reconciler gets its first (healthy) verdict at the same instant and reads its node once.
    since = cl.cp.audit_line_count()
    wall0 = time.time()
    at = time.monotonic() + 0.5
    done = fleet.submit("healthy", at=at, streak=1)
    startup_s = max(d["idle_at"] for d in done) - at
    startup_reconciled = sum(d["reconciled"] for d in done)
    stats_startup = fleet.stats()
    wall1 = time.time()
    startup_events = [e for e in cl.audit(since, start=wall0, end=wall1 + 1) if audit_node(e) in name_set]
    apf1 = cl.apf_levels()
    progress(f"fleet: start-up reconcile of {nodes} nodes in {startup_s:.2f} s")

    # The burst: 10% fault at once while an admin writer adds a label and a taint to the same nodes.
    faulty = names[:: round(1 / fraction)]
    faulty_set = set(faulty)
    since = cl.cp.audit_line_count()
    wall0 = time.time()
    at = time.monotonic() + 1.0
    foreign = {"writes": 0, "conflicts": 0}
    writer = threading.Thread(target=_foreign_writer, args=(cl.api, faulty, at, foreign), daemon=True)
    writer.start()
    done = fleet.submit("ecc", names=faulty, at=at, streak=0)
    seen = watch.wait_all(faulty, tainted, after=at, timeout=120)
    all_visible_s = max(seen.values()) - at
    first_visible_s = min(seen.values()) - at
    writer.join(120)
    time.sleep(1.0)
    wall1 = time.time()
    burst_events = [e for e in cl.audit(since, start=wall0, end=wall1) if audit_node(e) in faulty_set]
    after_burst = _check_nodes(cl, names, set(faulty), expect_ours=True)
    apf2 = cl.apf_levels()
    stats_burst = _delta(fleet.stats(), stats_startup)
    progress(f"fleet: {len(faulty)} taints visible {all_visible_s:.2f} s after the burst; {after_burst}")

    # Recovery (the ECC counters read 0 again for 3 checks), then the fleet is healthy for the idle window.
    since = cl.cp.audit_line_count()
    wall0 = time.time()
    fleet.submit("healthy", names=faulty, streak=3)
    watch.wait_all(faulty, untainted, after=0.0, timeout=120)
    time.sleep(1.0)
    recovery_events = [e for e in cl.audit(since, start=wall0) if audit_node(e) in faulty_set]
    after_recovery = _check_nodes(cl, names, set(faulty), expect_ours=False)
    watch.close()

    # One more healthy verdict for every node before the idle window: whatever start-up left undone (a write
    # refused with 429 is planned again at the next verdict) happens here, so the window sees steady state.
    since = cl.cp.audit_line_count()
    wall0 = time.time()
    fleet.submit("healthy", streak=3)
    time.sleep(1.0)
    settle_events = [e for e in cl.audit(since, start=wall0) if audit_node(e) in name_set]

    writes = Counter(
        audit_node(e)
        for e in burst_events
        if e["verb"] in WRITE_VERBS
        and audit_code(e) < 400
        and (e.get("objectRef") or {}).get("resource") == "nodes"
    )
    per_node = Counter(audit_node(e) for e in burst_events)
    return fleet, {
        "nodes": nodes,
        "processes": processes,
        "faulty": len(faulty),
        "created_s": created["seconds"],
        "startup_s": startup_s,
        "startup_reconciled": startup_reconciled,
        "startup_requests": describe_requests(startup_events),
        "startup_server": server_times(startup_events),
        "startup_apf_rejected": _apf_delta(apf0, apf1, "workload-low", "RejectedRequests"),
        "burst_submit_spread_ms": max(d["submit_spread_s"] for d in done) * 1000,
        "first_visible_s": first_visible_s,
        "all_visible_s": all_visible_s,
        "burst_requests": describe_requests(burst_events),
        "burst_server": server_times(burst_events),
        "burst_apf_rejected": _apf_delta(apf1, apf2, "workload-low", "RejectedRequests"),
        "burst_node_writes_max": max(writes.values()) if writes else 0,
        "burst_node_writes_mean": statistics.fmean(writes[n] for n in faulty),
        "burst_requests_per_node_max": max(per_node.values()) if per_node else 0,
        "burst_requests_per_node_mean": statistics.fmean(per_node[n] for n in faulty),
        "reconciler_log": stats_burst["counts"],
        "reconciler_errors": stats_burst["errors"],
        "foreign": foreign,
        "after_burst": after_burst,
        "after_recovery": after_recovery,
        "recovery_requests": describe_requests(recovery_events),
        "settle_requests": describe_requests(settle_events),
        "startup_log": stats_startup["counts"],
        "apf_seats": cl.apf_seats(),
        "apf_levels": {k: apf2.get(k, {}) for k in ("workload-low", "exempt")},
    }


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    counts = {k: v - before["counts"].get(k, 0) for k, v in after["counts"].items()}
    return {"counts": counts, "errors": after["errors"]}


def _apf_delta(
    before: dict[str, dict[str, str]], after: dict[str, dict[str, str]], level: str, col: str
) -> int:
    try:
        return int(after[level][col]) - int(before[level][col])
    except (KeyError, ValueError):
        return -1


# -- items 2 and 3: the idle window --------------------------------------------------------------------------


HEALTHY_POOL = ("bench.gpuguard.io/pool", "healthy")


class IdleWindow:
    """One agent (8 GPUs, --interval 3) and the whole fleet, healthy, for `seconds`; other phases may run
    meanwhile on other nodes (requests are attributed per node)."""

    def __init__(self, cl: Cluster, fleet: Fleet | None, seconds: float) -> None:
        self.cl, self.fleet, self.seconds = cl, fleet, seconds
        node = "idle-0"
        # Its own budget pool (a label its --gpu-node-selector adds): the latency runs' nodes fault about
        # 100 times in the window, and in the fleet's pool every one of those quarantines would reach this
        # agent through its budget's watch; a healthy fleet has none. Pools are how a fleet of several GPU
        # models gives each its own budget (one Helm release per pool, its nodeSelector).
        cl.make_nodes([node], labels={HEALTHY_POOL[0]: HEALTHY_POOL[1]})
        state = cl.tmp / "idle.state"
        state.write_text(gpu_lines(GPUS))
        self.node = node
        # --budget-count-spread 0: the budget's first GPU-node count at start, with the rest of the start-up
        # (spread over the first minute it would land in the window as if it were steady state).
        self.audit_start = cl.cp.audit_line_count()
        self.agent = cl.agent(
            node,
            cl.agent_kubeconfig(node),
            state,
            interval=3.0,
            args=(
                "--budget-count-spread",
                "0",
                "--gpu-node-selector",
                f"{GPU_NODE_SELECTOR},{HEALTHY_POOL[0]}={HEALTHY_POOL[1]}",
            ),
        )
        self.agent.wait_ready(READY_TIMEOUT)
        # The start-up is over when the budget has listed the quarantined nodes and counted the GPU nodes
        # (two lists; none with an unlimited budget) and the agent's requests have stopped for 3 s: its
        # condition write and the device lists come a few milliseconds after the lists, and the API server
        # writes its audit log in batches (the last bench counted them in the window). At most 30 s.
        deadline = time.monotonic() + 30
        last: tuple[int, float] = (-1, time.monotonic())
        while True:
            started = [e for e in cl.audit(self.audit_start) if audit_node(e) == node]
            if len(started) != last[0]:
                last = (len(started), time.monotonic())
            lists = sum(1 for e in started if e.get("verb") == "list")
            if (lists >= 2 and time.monotonic() - last[1] >= 3.0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        self.startup_requests = describe_requests(started)
        self.since = cl.cp.audit_line_count()
        self.wall0 = time.time()
        self.t0 = time.monotonic()
        self.cpu0 = proc_cpu_seconds(self.agent.pid)
        self.threads0 = thread_cpu_seconds(self.agent.pid)
        self.paused_s = 0.0
        self._paused_at: float | None = None
        if fleet is not None:
            fleet.start_loop(3.0, streak=3)
        progress(f"idle window: {seconds:.0f} s from now, agent pid {self.agent.pid}")

    def quiet(self, on: bool) -> None:
        """Pause the fleet's verdict loop (it keeps about half a core busy) while a wall-clock figure of
        milliseconds is measured; its nodes stay healthy and idle meanwhile."""
        if self.fleet is None:
            return
        if on and self._paused_at is None:
            self.fleet.stop_loop()
            self._paused_at = time.monotonic()
        elif not on and self._paused_at is not None:
            self.paused_s += time.monotonic() - self._paused_at
            self._paused_at = None
            self.fleet.start_loop(3.0)

    def finish(self) -> dict[str, Any]:
        left = self.t0 + self.seconds - time.monotonic()
        if left > 0:
            progress(f"idle window: waiting {left:.0f} s more")
            time.sleep(left)
        cpu1 = proc_cpu_seconds(self.agent.pid)
        threads1 = thread_cpu_seconds(self.agent.pid)
        window = time.monotonic() - self.t0
        rss = proc_status_mb(self.agent.pid, "VmRSS")
        hwm = proc_status_mb(self.agent.pid, "VmHWM")
        wall1 = time.time()
        rounds, loop_cpu = 0, 0.0
        self.quiet(False)
        if self.fleet is not None:
            stopped = self.fleet.stop_loop()
            rounds = min(s["rounds"] for s in stopped)
            loop_cpu = sum(s["cpu_s"] for s in stopped)
        events = self.cl.audit(self.since, start=self.wall0, end=wall1)
        agent_events = [e for e in events if audit_node(e) == self.node]
        fleet_events = [e for e in events if audit_node(e).startswith("fleet-")]
        offsets = sorted(audit_time(e) - self.wall0 for e in fleet_events + agent_events)
        self.agent.stop()
        return {
            "window_s": window,
            "cpu_s": cpu1 - self.cpu0,
            "cpu_s_per_hour": (cpu1 - self.cpu0) * 3600 / window,
            # In the order the threads were created: main (the check loop), then the others.
            "thread_cpu_s": [
                round(threads1[t] - self.threads0.get(t, 0.0), 3)
                for t in sorted(threads1)
                if t in self.threads0
            ],
            "rss_mb": rss,
            "hwm_mb": hwm,
            "agent_requests": len(agent_events),
            "agent_detail": describe_requests(agent_events),
            "agent_requests_per_hour": len(agent_events) * 3600 / window,
            "agent_startup_requests": self.startup_requests,
            "fleet_requests": len(fleet_events),
            "fleet_detail": describe_requests(fleet_events),
            "request_offsets_s": [round(o, 1) for o in offsets[:5]] + [round(o, 1) for o in offsets[-5:]],
            "fleet_rounds": rounds,
            "fleet_paused_s": self.paused_s,
            "fleet_loop_cpu_s": loop_cpu,
            "fleet_cpu_us_per_verdict": loop_cpu / max(1, rounds * len(self.fleet.names)) * 1e6
            if self.fleet is not None
            else 0.0,
        }
