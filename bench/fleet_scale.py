"""The fleet at Kubernetes' scale limit (`make fleet-bench`, default 5,000 nodes): every agent starts at once,
with and without what keeps them gentle on the API server, then a tenth of the fleet faults at one instant.

    python -m bench.fleet_scale --nodes 5000 --processes 8 --out fleet.json

One throwaway control plane (bench/cluster.py: etcd + kube-apiserver, deploy/*.yaml applied, so the agents'
FlowSchema and PriorityLevelConfiguration are in place unless a configuration removes them), N Node objects
labelled as GPU nodes, each with its own Pod-bound ServiceAccount token, and N reconcilers in a few worker
processes (bench/fleet.py: each with its own client, writer, budget and thread, as N agents have). For each
configuration (`CONFIGS`):

- start: every reconciler starts at one CLOCK_MONOTONIC instant and gets a healthy verdict, on nodes that
  have no GPUHealthy condition yet (a new install: one status write per node is due);
- restart: the worker processes are replaced and start again at one instant (a DaemonSet rolled on every
  node at once, or restarted): every node already matches, so any write is a redundant one.

Counted from the API server's audit log (gpuguard's user agent, per node from the token's node name): HTTP
429 rejections, requests, writes per node; from the reconcilers' own log events: retries. The API server's
CPU (utime + stime of its process) and resident memory (VmRSS, sampled every 0.25 s) over each phase, and the
machine's load average.

Then, with the last configuration running: 10% of the fleet gets an ECC verdict at one instant, with the
budget at 5% so that it binds (half of them must step back to the soft taint): the time until the last taint
is visible on an admin watch, and after the order checks (right after each write and 10 s later) how many
nodes hold the full quarantine, which must be exactly the limit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.budget_cost import HeldWatches, budget_cost_phase
from bench.cluster import (
    FLEET_LABEL,
    TAINT_KEY,
    WRITE_VERBS,
    Cluster,
    audit_code,
    audit_node,
    describe_requests,
    proc_cpu_seconds,
    proc_status_mb,
    progress,
    server_times,
    tainted,
)
from bench.fleet import Fleet
from gpuguard.core.config import NodeSettings

ROOT = Path(__file__).resolve().parents[1]

DEPLOY = ROOT / "deploy" / "daemonset.yaml"
CONDITION = "GPUHealthy"

# name -> (the agents' FlowSchema and PriorityLevelConfiguration applied, worker options). "none" is what
# gpuguard did before issue 15: no schema of its own (the built-in "service-accounts" -> workload-low), no
# jitter, no client-side limit. "shipped" is what deploy/daemonset.yaml and the agent's defaults ship.
CONFIGS: dict[str, tuple[bool, dict[str, Any]]] = {
    "none": (False, {"watch": False}),
    "flowschema": (True, {}),
    "jitter": (False, {"jitter": NodeSettings.startup_jitter}),
    "shipped": (
        True,
        {"jitter": NodeSettings.startup_jitter, "qps": NodeSettings.api_qps, "burst": NodeSettings.api_burst},
    ),
}


class ServerSampler:
    """The API server process's CPU seconds and peak resident memory over a phase, and the load average."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._stop = threading.Event()
        self.peak_rss_mb = 0.0
        self.load: list[float] = []
        self.cpu0 = proc_cpu_seconds(pid)
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            self.peak_rss_mb = max(self.peak_rss_mb, proc_status_mb(self.pid, "VmRSS"))
            self.load.append(os.getloadavg()[0])

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(2)
        seconds = time.monotonic() - self.t0
        cpu = proc_cpu_seconds(self.pid) - self.cpu0
        return {
            "wall_s": round(seconds, 2),
            "apiserver_cpu_s": round(cpu, 2),
            "apiserver_cores": round(cpu / max(seconds, 1e-9), 2),
            "apiserver_peak_rss_mb": round(max(self.peak_rss_mb, proc_status_mb(self.pid, "VmRSS")), 1),
            "load1_max": round(max(self.load, default=os.getloadavg()[0]), 2),
            "load1_mean": round(sum(self.load) / len(self.load), 2) if self.load else None,
        }


def apiserver_pid(cl: Cluster) -> int:
    state = cl.cp.state
    assert state is not None and state.apiserver_pid is not None, "the control plane is not running"
    return int(state.apiserver_pid)


def flow_control(cl: Cluster, on: bool) -> None:
    """Create or delete the agents' FlowSchema and PriorityLevelConfiguration (deploy/daemonset.yaml's)."""
    import kubernetes
    import yaml

    fc: Any = kubernetes.client.FlowcontrolApiserverV1Api(cl.api)
    docs = {d["kind"]: d for d in yaml.safe_load_all(DEPLOY.read_text()) if d}
    plc, fs = docs["PriorityLevelConfiguration"], docs["FlowSchema"]
    for create, delete, doc in (
        (fc.create_priority_level_configuration, fc.delete_priority_level_configuration, plc),
        (fc.create_flow_schema, fc.delete_flow_schema, fs),
    ):
        try:
            if on:
                create(doc)
            else:
                delete(doc["metadata"]["name"])
        except kubernetes.client.exceptions.ApiException as exc:
            if exc.status not in (404, 409):
                raise
    time.sleep(2.0)  # the API server's APF configuration controller picks the change up


def reset_conditions(cl: Cluster, names: list[str]) -> None:
    """Remove the GPUHealthy condition, so the next start has one status write due on every node."""
    body = {"status": {"conditions": [{"type": CONDITION, "$patch": "delete"}]}}

    def one(name: str) -> None:
        cl.core.patch_node_status(name, body, _preload_content=False)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, names))


def matching(cl: Cluster, names: set[str]) -> set[str]:
    """The fleet's nodes that already match a healthy verdict: GPUHealthy True, nothing of gpuguard's on
    them. A write to one of these is a redundant write."""
    listed = json.loads(cl.core.list_node(label_selector=f"{FLEET_LABEL}=true", _preload_content=False).data)
    out = set()
    for n in listed["items"]:
        conditions = {c["type"]: c["status"] for c in n.get("status", {}).get("conditions") or []}
        ours = [t for t in n["spec"].get("taints") or [] if t["key"].startswith("gpuguard.io/")]
        if conditions.get(CONDITION) == "True" and not ours:
            out.add(n["metadata"]["name"])
    return out & names


def start_phase(
    cl: Cluster, kubeconfigs: dict[str, Path], *, processes: int, options: dict[str, Any], label: str
) -> tuple[Fleet, dict[str, Any]]:
    """Workers created (not counted), then every reconciler started and given a healthy verdict at once."""
    names = set(kubeconfigs)
    fleet = Fleet(kubeconfigs, processes=processes, workdir=cl.tmp, options=options, nice=19)
    cl.on_close(fleet.stop)
    fleet.start(timeout=900)
    matched_before = matching(cl, names)
    since = cl.cp.audit_line_count()
    wall0 = time.time()
    sampler = ServerSampler(apiserver_pid(cl))
    at = time.monotonic() + 1.0
    done = fleet.submit("healthy", at=at, streak=1)
    reconciled_s = max(d["idle_at"] for d in done) - at
    # The agents' first GPU-node counts: waited for when they fall within a few minutes (each is a list of
    # the whole fleet); with the shipped spread (an hour) only those in the phase are made.
    spread = float(options.get("count_spread", NodeSettings.budget_count_spread))
    drained = fleet.drain(600 if spread <= 300 else 0)
    counted_s = max(d["at"] for d in drained) - at
    usage = sampler.stop()
    stats = fleet.stats()
    time.sleep(1.0)
    events = [e for e in cl.audit(since, start=wall0) if audit_node(e) in names]
    rejected = [e for e in events if audit_code(e) == 429]
    node_writes = Counter(
        audit_node(e)
        for e in events
        if e["verb"] in WRITE_VERBS
        and audit_code(e) < 400
        and (e.get("objectRef") or {}).get("resource") == "nodes"
    )
    result = {
        "phase": label,
        "nodes": len(names),
        "reconciled": sum(d["reconciled"] for d in done),
        "not_idle": sum(d["not_idle"] for d in done),
        "all_reconciled_s": round(reconciled_s, 2),
        "start_spread_ms": round(max(d["submit_spread_s"] for d in done) * 1000, 1),
        "http_429": len(rejected),
        "requests": describe_requests(events),
        "server_time": server_times(events) if events else {},
        "node_writes": sum(node_writes.values()),
        "matching_before": len(matched_before),
        "redundant_writes": sum(node_writes[n] for n in matched_before),
        "matching_after": len(matching(cl, names)),
        "nodes_written_more_than_once": sum(1 for n in node_writes.values() if n > 1),
        "client_rate_limited_s": round(sum(d["rate_limited_s"] for d in done), 2),
        "first_counts_done_s": round(counted_s, 2),
        "counts_left": sum(d["counts_left"] for d in drained),
        "reconciler_log": {k: v for k, v in stats["counts"].items() if v},
        "simulator": stats.get("simulator", {}),
        **usage,
    }
    progress(
        f"fleet {label}: {result['reconciled']}/{len(names)} reconciled in {reconciled_s:.1f} s, "
        f"HTTP 429: {len(rejected)}, node writes {result['node_writes']} "
        f"(redundant {result['redundant_writes']}), matching {result['matching_after']}, "
        f"apiserver {usage['apiserver_cpu_s']} CPU-s, peak {usage['apiserver_peak_rss_mb']} MB, "
        f"load max {usage['load1_max']}"
    )
    return fleet, result


SETTLE_TIMEOUT = 600.0


def _quarantines(cl: Cluster, faulty: set[str]) -> tuple[int, int, int]:
    """(fully quarantined, soft-tainted, untainted) among the faulty nodes, from one admin list."""
    listed = json.loads(cl.core.list_node(label_selector=f"{FLEET_LABEL}=true", _preload_content=False).data)
    hard = soft = untainted = 0
    for n in listed["items"]:
        if n["metadata"]["name"] not in faulty:
            continue
        ours = [t for t in n["spec"].get("taints") or [] if t["key"] == TAINT_KEY]
        if not ours:
            untainted += 1
        elif ours[0]["effect"] == "PreferNoSchedule":
            soft += 1
        else:
            hard += 1
    return hard, soft, untainted


def burst_phase(
    cl: Cluster, fleet: Fleet, names: list[str], *, fraction: float, budget_percent: float
) -> dict[str, Any]:
    faulty = names[:: round(1 / fraction)]
    watch = cl.watch(label_selector=f"{FLEET_LABEL}=true")
    limit = math.ceil(len(names) * budget_percent / 100)
    since = cl.cp.audit_line_count()
    wall0 = time.time()
    sampler = ServerSampler(apiserver_pid(cl))
    at = time.monotonic() + 1.0
    done = fleet.submit("ecc", names=faulty, at=at, streak=0)
    seen = watch.wait_all(faulty, tainted, after=at, timeout=600)
    last_taint_s = max(seen.values()) - at
    # The order check runs right after each full quarantine, 10 s later, and at every check while the
    # budget's watch delivers changes: the faulty agents' loops hand over their verdict every 3 s (as
    # --interval 3), until the full quarantines are down to the limit and stay there for two rounds.
    held_rounds, rounds = 0, 0
    hard, soft, untainted = _quarantines(cl, set(faulty))
    while time.monotonic() - at < SETTLE_TIMEOUT:
        time.sleep(3.0)
        fleet.submit("ecc", names=faulty, streak=0)
        rounds += 1
        hard, soft, untainted = _quarantines(cl, set(faulty))
        held_rounds = held_rounds + 1 if hard <= limit and rounds >= 5 else 0
        if held_rounds >= 2:
            break
    settled_s = time.monotonic() - at
    usage = sampler.stop()
    events = [e for e in cl.audit(since, start=wall0) if audit_node(e) in set(faulty)]
    listed = json.loads(cl.core.list_node(label_selector=f"{FLEET_LABEL}=true", _preload_content=False).data)
    labels = Counter(
        n["metadata"].get("labels", {}).get("gpuguard.io/quarantined", "") for n in listed["items"]
    )
    result = {
        "faulty": len(faulty),
        "budget": f"{budget_percent:g}%",
        "limit": limit,
        "last_taint_visible_s": round(last_taint_s, 2),
        "settled_s": round(settled_s, 1),
        "settle_rounds": rounds,
        "first_taint_visible_s": round(min(seen.values()) - at, 2),
        "submit_spread_ms": round(max(d["submit_spread_s"] for d in done) * 1000, 1),
        "hard_tainted": hard,
        "soft_tainted": soft,
        "untainted": untainted,
        "label_quarantined_true": labels.get("true", 0),
        "label_deferred": labels.get("deferred", 0),
        "http_429": sum(1 for e in events if audit_code(e) == 429),
        "requests": describe_requests(events),
        "server_time": server_times(events) if events else {},
        **usage,
    }
    progress(
        f"fleet burst: {len(faulty)} faulty, last taint {last_taint_s:.2f} s; hard {hard} (limit {limit}), "
        f"soft {soft}, untainted {untainted}; 429: {result['http_429']}"
    )
    watch.close()
    return result


def run(
    nodes: int,
    processes: int,
    configs: list[str],
    out: Path | None,
    *,
    watch_cost: bool = False,
    markdown: Path | None = None,
) -> dict[str, Any]:
    t_begin = time.monotonic()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results: dict[str, Any] = {
        "nodes": nodes,
        "processes": processes,
        "configs": {},
        "cpus": os.cpu_count(),
        "started": started,
    }
    cl = Cluster()
    held: HeldWatches | None = None

    def save() -> None:
        if out is not None:
            out.write_text(json.dumps(results, indent=2))
        if markdown is not None:
            markdown.write_text(render_markdown(results))

    try:
        cl.start()
        results["kube_version"] = cl.version
        names = [f"fleet-{i:04d}" for i in range(nodes)]
        t0 = time.monotonic()
        cl.make_nodes(names, boot_id=None, labels={FLEET_LABEL: "true"})
        kubeconfigs = cl.agent_kubeconfigs(names)
        results["setup_s"] = round(time.monotonic() - t0, 1)
        progress(f"fleet: {nodes} nodes, Pods and Pod-bound tokens in {results['setup_s']} s")
        if watch_cost:
            # The API server's cost of N agents' budget watches, 0 against N held (bench/budget_cost.py).
            results["watch_cost"] = budget_cost_phase(cl, names, steps=(0, nodes))
            save()
        # Every agent's budget watch, held for the whole run: each worker process holds one real one
        # (its WatchedBudget), these the rest (bench/fleet.py's docstring).
        pid = apiserver_pid(cl)
        rss0, cpu0, w0 = proc_status_mb(pid, "VmRSS"), proc_cpu_seconds(pid), time.monotonic()
        held = HeldWatches(cl, cl.admin.agent_token(names[0]))
        held.grow(max(0, nodes - processes))
        results["held_watches"] = {
            "held": held.held,
            "open_s": round(time.monotonic() - w0, 1),
            "apiserver_cpu_s": round(proc_cpu_seconds(pid) - cpu0, 2),
            "apiserver_rss_before_mb": round(rss0, 1),
            "apiserver_rss_after_mb": round(proc_status_mb(pid, "VmRSS"), 1),
        }
        progress(f"fleet: {held.held} budget watches held: {results['held_watches']}")
        fleet: Fleet | None = None
        for name in configs:
            schema, options = CONFIGS[name]
            flow_control(cl, schema)
            reset_conditions(cl, names)
            first, start = start_phase(
                cl, kubeconfigs, processes=processes, options=options, label=f"{name} start"
            )
            first.stop()
            results["configs"][name] = {"flowschema": schema, "options": options, "start": start}
            save()
            fleet, restart = start_phase(
                cl, kubeconfigs, processes=processes, options=options, label=f"{name} restart"
            )
            results["configs"][name]["restart"] = restart
            if name != configs[-1]:
                fleet.stop()
            save()
        assert fleet is not None
        # A new fleet with the burst's budget (the option is read when the workers start).
        fleet.stop()
        schema, options = CONFIGS[configs[-1]]
        fleet, _ = start_phase(
            cl,
            kubeconfigs,
            processes=processes,
            options={**options, "max_quarantined": "5%", "counted": True},
            label=f"{configs[-1]} restart (budget 5%)",
        )
        results["burst"] = burst_phase(cl, fleet, names, fraction=0.1, budget_percent=5)
        results["burst"]["config"] = configs[-1]
        held.grow(held.held)
        results["held_watches"]["held_at_end"] = held.held
        fleet.stop()
    finally:
        if held is not None:
            held.close()
        cl.close()
        results["wall_s"] = round(time.monotonic() - t_begin, 1)
        save()
    progress(f"fleet bench: {results['wall_s']} s in all")
    return results


def _yes(ok: bool) -> str:
    return "met" if ok else "**MISSED**"


def render_markdown(r: dict[str, Any]) -> str:
    """A self-contained section for docs/performance.md: each figure beside its goal, met or MISSED, the
    machine's load, the duration, and what is real and what is simulated."""
    n = r["nodes"]
    lines = [
        f"## The fleet at {n:,} nodes (`make fleet-bench`, {r.get('started', '?')})",
        "",
        f"`python -m bench.fleet_scale --nodes {n}`: one throwaway control plane (Kubernetes "
        f"{r.get('kube_version', '?')}, etcd + kube-apiserver, deploy/*.yaml applied) on this machine "
        f"({r.get('cpus', '?')} CPUs), {n:,} GPU Node objects each with its own Pod and Pod-bound token "
        f"(set up in {r.get('setup_s', '?')} s), the simulated agents in {r['processes']} worker "
        f"processes at nice 19. The whole bench took {r.get('wall_s', '?')} s. The load average is the "
        "machine's, shared with other sessions' work.",
        "",
        "Real: per node the product's `NodeReconciler` and `KubeNodeWriter` with its own client, token, "
        "connection and client-side rate limiter, its start-up delay drawn from `--startup-jitter`, its "
        "first GPU-node count (the metadata list) drawn from `--budget-count-spread`; one budget watch per "
        "node on the API server. Simulated: the reconciles run on 32 threads per worker process at each "
        "node's start instant (no thread per node); one real `WatchedBudget` per process serves its nodes' "
        "budgets, the other nodes' watches are held open by a raw TLS reader (one connection each, the "
        "agents' selector and Accept header, one token for all); count answers are read and dropped, not "
        "decoded; the GPU side is a verdict handed over, not NVML (bench/fleet.py).",
        "",
        "| measurement | result | goal | |",
        "|---|---|---|---|",
    ]
    held = r.get("held_watches")
    if held:
        lines.append(
            f"| budget watches held | {held['held']:,} (+{r['processes']} of the workers), opened in "
            f"{held['open_s']} s; API server RSS {held['apiserver_rss_before_mb']} -> "
            f"{held['apiserver_rss_after_mb']} MB | one per node | |"
        )
    for name, c in r.get("configs", {}).items():
        opts = c.get("options", {})
        how = (
            f"FlowSchema {'on' if c.get('flowschema') else 'off'}, jitter {opts.get('jitter', 0):g} s, "
            f"client limit {opts.get('qps', 0):g}/s burst {opts.get('burst', '-')}"
        )
        for phase in ("start", "restart"):
            p = c.get(phase)
            if not p:
                continue
            shipped = name == "shipped"
            ok = (
                p["reconciled"] == p["nodes"]
                and p["http_429"] == 0
                and p["redundant_writes"] == 0
                and p["not_idle"] == 0
            )
            counts = sum(v for k, v in p.get("simulator", {}).items() if k.startswith("count"))
            result = (
                f"{p['reconciled']:,}/{p['nodes']:,} reconciled in {p['all_reconciled_s']} s; HTTP 429: "
                f"{p['http_429']}; node writes {p['node_writes']:,} (to a node that already matched: "
                f"{p['redundant_writes']}); first GPU-node counts made in the phase: {counts:,}; requests "
                f"{_requests(p['requests'])}; API server {p['apiserver_cpu_s']} CPU-s "
                f"({p['apiserver_cores']} cores) in {p['wall_s']} s, peak RSS "
                f"{p['apiserver_peak_rss_mb']} MB; "
                f"load mean {p['load1_mean']}, max {p['load1_max']}"
            )
            goal = "all reconcile, 0 x 429, 0 redundant writes" if shipped else "reference"
            lines.append(f"| {name} {phase} ({how}) | {result} | {goal} | {_yes(ok) if shipped else ''} |")
    b = r.get("burst")
    if b:
        exact = b["hard_tainted"] == b["limit"] and b["untainted"] == 0
        lines.append(
            f"| burst: {b['faulty']} of {n:,} fault at one instant, budget {b['budget']} (limit "
            f"{b['limit']}), {b.get('config', '')} | all tainted: "
            f"{b['faulty'] - b['untainted']}/{b['faulty']}; full {b['hard_tainted']}, soft "
            f"{b['soft_tainted']}; last taint visible {b['last_taint_visible_s']} s, order settled at "
            f"{b.get('settled_s', '?')} s "
            f"(first {b['first_taint_visible_s']} s); HTTP 429: {b['http_429']}; API server "
            f"{b['apiserver_cpu_s']} CPU-s ({b['apiserver_cores']} cores), peak RSS "
            f"{b['apiserver_peak_rss_mb']} MB; load mean {b['load1_mean']}, max {b['load1_max']} | all "
            f"tainted, full = limit, 0 x 429 | {_yes(exact and b['http_429'] == 0)} |"
        )
    wc = r.get("watch_cost")
    if wc and len(wc.get("rows", [])) >= 2:
        a0, a1 = wc["rows"][0], wc["rows"][-1]
        dw = max(1, a1["watches"] - a0["watches"])
        lines.append(
            f"| API server with 0 / {a1['watches']:,} watches held: RSS | {a0['rss_mb']:.0f} / "
            f"{a1['rss_mb']:.0f} MB ({(a1['rss_mb'] - a0['rss_mb']) * 1024 / dw:.0f} KB a watch); Go heap "
            f"{a0['heap_inuse_mb']:.0f} / {a1['heap_inuse_mb']:.0f} MB | measured | |"
        )
        lines.append(
            f"| idle CPU / under {a1['status_events_per_s']:.0f} node status updates a second / under "
            f"{a1['quarantine_events_per_s']:.0f} quarantine label changes a second | "
            f"{a0['idle_cores']:.3f} / {a0['status_cores']:.3f} / {a0['quarantine_cores']:.3f} cores with 0 "
            f"watches; {a1['idle_cores']:.3f} / {a1['status_cores']:.3f} / {a1['quarantine_cores']:.3f} with "
            f"{a1['watches']:,} | measured | |"
        )
    lines.append("")
    return "\n".join(lines)


def _requests(requests: dict[str, int]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in requests.items()) or "none"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--configs", default="none,shipped", help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None, help="a markdown section for docs/performance.md")
    ap.add_argument(
        "--watch-cost",
        action="store_true",
        help="first measure the API server's cost of 0 and N held budget watches (bench/budget_cost.py)",
    )
    ap.add_argument(
        "--jitter", type=float, default=None, help="the start-up jitter of the configurations that have one"
    )
    ap.add_argument("--render", type=Path, default=None, help="only write --markdown from this --out file")
    args = ap.parse_args(argv)
    if args.render is not None:
        if args.markdown is None:
            ap.error("--render needs --markdown")
        args.markdown.write_text(render_markdown(json.loads(args.render.read_text())))
        return 0
    if args.jitter is not None:
        for _, options in CONFIGS.values():
            if "jitter" in options:
                options["jitter"] = args.jitter
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown or not configs:
        ap.error(f"unknown configurations: {sorted(unknown)}")
    run(args.nodes, args.processes, configs, args.out, watch_cost=args.watch_cost, markdown=args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
