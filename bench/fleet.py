"""The fleet simulation of `make bench` and `make fleet-bench`: many gpuguard agents against one real API
server, cheap enough that 5,000 of them run on two cores beside the API server.

What is real, per simulated node: its own `NodeReconciler` (the product's code: plan, budget gate, writes,
409 re-plans, tenacity retries, the order check) over its own `KubeNodeWriter`, built as the agent builds it
(`running.Connection`, `writers.make_writer`) from a kubeconfig with the node's own Pod-bound ServiceAccount
token (its own keep-alive connection, its own client-side rate limiter; deploy/admission-policy.yaml lets a
token write only its node); its own start-up delay drawn from --startup-jitter; and its first GPU-node count
(the metadata list of quarantine/node/budgetwatch.py's `WatchedBudget._count`, with its token, at a moment
drawn from
--budget-count-spread).

What is simulated:
- no thread per node: the reconciles run on a bounded pool of threads per process ("pool", 32), each node's
  at its start instant from a timer heap (a node is reconciled by one thread at a time); the reconciler's
  own start-up hold is replaced by that instant (a verdict with a fault is not held, as in the agent);
- the budget's watch: one real `WatchedBudget` per process (its watch, its count, its fallback) is the
  `BudgetSource` of all its reconcilers; the other agents' watches are held open by the caller
  (bench/budget_cost.py's `HeldWatches`: one TLS connection each, the agents' selector and Accept header,
  read and dropped), so the API server carries one watch per node as with N agents;
- the counts' answers are read and dropped, not decoded (the API server's work is the same);
- the GPU side: verdicts are built once with `policy.evaluate` and submitted the way the agent's loop
  submits them. Worker processes (`python -m bench.fleet worker ...`) are driven by `Fleet` through JSON
  lines on stdin/stdout; at a given CLOCK_MONOTONIC instant (shared by all processes on Linux) every worker
  submits at once.

The workers count the reconcilers' own log events (conflicts, retries, deferred or rejected writes) and drop
the log lines; the requests themselves are counted from the API server's audit log by the caller.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]

# Log events of gpuguard.quarantine that show API trouble or a write.
COUNTED = (
    "node.conflict",
    "api.unavailable",
    "api.retry",
    "api.available",
    "node.write_deferred",
    "node.write_rejected",
    "node.event_failed",
    "node.tainted",
    "node.fault_added",
    "node.recovered",
)
_METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


# -- worker (its own process) ------------------------------------------------------------------------------


class _Counting:
    """A structlog processor: counts events by name and drops them (the bench keeps no log lines)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.samples: dict[str, str] = {}
        self._lock = threading.Lock()

    def __call__(self, logger: Any, method: str, event: Any) -> Any:
        import structlog

        name = str(event.get("event", ""))
        with self._lock:
            self.counts[name] += 1
            if name not in self.samples and "error" in event:
                self.samples[name] = str(event["error"])[:300]
        raise structlog.DropEvent


def _verdicts(gpus: int = 8) -> dict[str, Any]:
    from gpuguard.core.config import PolicySettings
    from gpuguard.core.model import GpuReading, Snapshot
    from gpuguard.judge.policy import evaluate

    def snap(ecc0: int) -> Snapshot:
        return Snapshot(
            gpus=tuple(
                GpuReading(index=i, uuid=f"GPU-fleet-{i:03d}", ecc_uncorrected=ecc0 if i == 0 else 0)
                for i in range(gpus)
            )
        )

    healthy = evaluate(snap(0), previous=None, settings=PolicySettings())
    ecc = evaluate(snap(1), previous=healthy, settings=PolicySettings())
    assert healthy.healthy and not ecc.healthy
    return {"healthy": healthy, "ecc": ecc}


class Worker:
    """N simulated agents in one process, without a thread per agent (see the module's docstring).

    options (all optional): "jitter" (seconds: each agent's first request waits a delay drawn from
    0..jitter after its first verdict, as `gpuguard watch --startup-jitter` draws it; a verdict with a fault
    does not wait), "qps" and "burst" (the client-side rate limit, as --api-qps/--api-burst; qps 0 or
    absent: none), "max_quarantined" (--max-quarantined), "count_spread" (each agent's first GPU-node count
    at a moment drawn from 0..count_spread after its start, as --budget-count-spread; default the agent's;
    negative: no counts), "pool" (threads that run the reconciles, default 32), "watch" (false: the budget
    is listed by each writer in the path, as before issue 15; default: one WatchedBudget per process),
    "counted" (true: the agents have made their first count, as every agent has an hour after its start:
    no first counts, and the process's WatchedBudget counts at once)."""

    def __init__(self, names: list[tuple[str, str]], options: dict[str, Any] | None = None) -> None:
        import random

        import structlog
        import urllib3

        from gpuguard.core.config import NodeSettings, QuarantineLimit
        from gpuguard.quarantine.node.budget import QuarantineBudget
        from gpuguard.quarantine.node.writers import KubeNodeWriter, make_writer
        from gpuguard.quarantine.reconciler import NodeReconciler
        from gpuguard.runtime.root import Connection

        opts = options or {}
        self.counter = _Counting()
        structlog.configure(processors=[self.counter], cache_logger_on_first_use=False)
        self.verdicts = _verdicts()
        started = time.monotonic()
        self.reconcilers: dict[str, Any] = {}
        self.apis: dict[str, Any] = {}
        self.delays: dict[str, float] = {}
        self.limiters: list[Any] = []
        qps, burst = float(opts.get("qps") or 0), int(opts.get("burst") or 1)
        jitter = float(opts.get("jitter") or 0)
        spec = QuarantineLimit.parse(str(opts.get("max_quarantined", NodeSettings.max_quarantined)))
        base = NodeSettings()
        counted = bool(opts.get("counted", False))
        self.count_spread = -1.0 if counted else float(opts.get("count_spread", base.budget_count_spread))
        self.selector = base.gpu_node_selector
        self.source: Any = None
        for name, kubeconfig in names:
            # qps 0: a limiter that never waits, as --api-qps 0.
            settings = NodeSettings(
                name=name, kubeconfig=kubeconfig, max_quarantined=spec, api_qps=qps, api_burst=burst
            )
            writer = make_writer(settings, Connection(settings))
            assert isinstance(writer, KubeNodeWriter)  # not a dry run: the API server's writer
            api = writer.api
            self.limiters.append(api.rate_limiter)
            self.apis[name] = api
            if self.source is None:
                first = (
                    NodeSettings(name=name, max_quarantined=spec, budget_count_spread=0)
                    if counted
                    else settings
                )
                self.source = self._shared_source(name, writer, first, bool(opts.get("watch", True)))
            budget = QuarantineBudget(self.source or writer, settings)
            self.reconcilers[name] = NodeReconciler(writer, settings, budget=budget)
            self.delays[name] = random.uniform(0, jitter)
        self.created_s = time.monotonic() - started
        # The counts' connections: one keep-alive pool per process, each request with its node's token.
        ca = next(iter(self.apis.values())).creds.ca_file if self.apis else None
        self._count_pool = urllib3.PoolManager(
            num_pools=1, maxsize=8, retries=False, cert_reqs="CERT_REQUIRED", ca_certs=ca
        )
        self._start_at: dict[str, float] = {}
        self._counts_due = 0
        self.counts = Counter[str]()
        self._started: set[str] = set()
        self._running: set[str] = set()
        self._lock = threading.Lock()
        self._heap: list[tuple[float, int, str, str]] = []
        self._seq = 0
        self._timer_wake = threading.Condition(self._lock)
        self._closed = False
        self._exec = ThreadPoolExecutor(int(opts.get("pool") or 32), thread_name_prefix="fleet-reconcile")
        self._timer = threading.Thread(target=self._timer_loop, name="fleet-timer", daemon=True)
        self._timer.start()
        self._loop_stop = threading.Event()
        self._loop: threading.Thread | None = None
        self._streak = 0
        self.rounds = 0
        self.loop_cpu = 0.0
        self._loop_cpu0 = 0.0

    def _shared_source(self, name: str, writer: Any, settings: Any, watch: bool) -> Any:
        """The process's one WatchedBudget (real: its watch, its count, its fallback), shared by its
        reconcilers; None where there is none (watch off, a "100%" budget, or a checkout before it)."""
        if not watch:
            return None
        try:
            from gpuguard.quarantine.node.budgetwatch import watched
        except ImportError:
            return None
        source = watched(settings, writer)
        if source is not None:
            source.start()
        return source

    # -- scheduling ------------------------------------------------------------------------------------

    def _at(self, when: float, name: str, kind: str) -> None:
        import heapq

        with self._lock:
            self._seq += 1
            heapq.heappush(self._heap, (when, self._seq, name, kind))
            self._timer_wake.notify()

    def _timer_loop(self) -> None:
        import heapq

        while True:
            with self._lock:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._timer_wake.wait(wait)
                if self._closed:
                    return
                _, _, name, kind = heapq.heappop(self._heap)
            self._exec.submit(self._count if kind == "count" else self._reconcile, name)

    def _reconcile(self, name: str) -> None:
        """The reconciler's own reconcile, until no verdict is pending; one pool thread per node at a time."""
        r = self.reconcilers[name]
        with self._lock:
            if name in self._running:
                return  # the thread that holds it loops until nothing is pending
            self._running.add(name)
        try:
            while True:
                while not r.wait_idle(0):
                    try:
                        r.reconcile_now()
                    except Exception:
                        self.counts["reconcile_failed"] += 1
                        break
                with self._lock:
                    if r.wait_idle(0) or self._closed:
                        self._running.discard(name)
                        return
        finally:
            with self._lock:
                self._running.discard(name)

    def _count(self, name: str) -> None:
        """The agent's first GPU-node count (quarantine/node/budgetwatch.py's `_count`): the same metadata
        list with the node's token and the agent's user agent, through its rate limiter; the answer is read
        and dropped (decoding thousands of them would starve this process; the API server's work is the
        same)."""
        from gpuguard.kube.client import USER_AGENT

        api = self.apis[name]
        if api.rate_limiter is not None:
            api.rate_limiter.acquire(2.0)
        creds = api.creds
        token = creds.token or (Path(creds.token_file).read_text().strip() if creds.token_file else "")
        query = f"?labelSelector={self.selector}" if self.selector else ""
        try:
            resp = self._count_pool.request(
                "GET",
                creds.server.rstrip("/") + "/api/v1/nodes" + query,
                headers={
                    "Accept": _METADATA_LIST,
                    "User-Agent": USER_AGENT,
                    "Authorization": f"Bearer {token}",
                },
                timeout=30.0,
                preload_content=False,
            )
            for _ in resp.stream(1 << 16):
                pass
            resp.release_conn()
            self.counts[f"count {resp.status}"] += 1
        except Exception as exc:
            self.counts[f"count {type(exc).__name__}"] += 1
        finally:
            with self._lock:
                self._counts_due -= 1
                self._timer_wake.notify_all()

    def drain(self, timeout: float) -> dict[str, Any]:
        """Wait until every scheduled first count has been made (the start's whole load on the server)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._counts_due > 0 and (left := deadline - time.monotonic()) > 0:
                self._timer_wake.wait(min(left, 1.0))
            left_over = self._counts_due
        return {"event": "drained", "at": time.monotonic(), "counts_left": left_over}

    def _hand(self, name: str, verdict: Any, streak: int) -> None:
        """A verdict to a node, as the agent's check loop hands it over: the first one starts the agent
        (its start-up delay; a fault ends the delay at once), and its first count is scheduled."""
        import random

        from gpuguard.core.model import Judgement, Streaks

        r = self.reconcilers[name]
        r.submit(Judgement(verdict, Streaks(healthy=streak)))
        now = time.monotonic()
        if name not in self._started:
            self._started.add(name)
            self._start_at[name] = now + self.delays[name]
            if self.count_spread >= 0 and self.source is not None:
                with self._lock:
                    self._counts_due += 1
                self._at(now + random.uniform(0, self.count_spread), name, "count")
        if r.wait_idle(0):
            return  # nothing to do: the verdict cannot change a decision
        # The reconciler's start-up hold: until its delay is over, unless the verdict has a fault.
        self._at(now if verdict.faults else max(now, self._start_at[name]), name, "reconcile")

    # -- commands --------------------------------------------------------------------------------------

    def submit(
        self, verdict: str, names: Iterable[str] | None, at: float | None, streak: int
    ) -> dict[str, Any]:
        chosen = list(names) if names is not None else list(self.reconcilers)
        targets = [self.reconcilers[n] for n in chosen]
        v = self.verdicts[verdict]
        if at is not None:
            while (left := at - time.monotonic()) > 0:
                time.sleep(min(left, 0.05) if left > 0.002 else 0)
        t0 = time.monotonic()
        for n in chosen:
            self._hand(n, v, streak)
        submitted = time.monotonic()
        deadline = submitted + 600.0
        not_idle = sum(1 for r in targets if not r.wait_idle(max(0.0, deadline - time.monotonic())))
        return {
            "event": "done",
            "n": len(targets),
            "submit_spread_s": submitted - t0,
            "idle_at": time.monotonic(),
            "not_idle": not_idle,
            "reconciled": sum(1 for r in targets if r.status.reconciled),
            "tainted": sum(1 for r in targets if r.status.tainted),
            "deferred": sum(1 for r in targets if r.status.deferred),
            "rate_limited_s": sum(limiter.waited for limiter in self.limiters),
        }

    def start_loop(self, period: float, streak: int | None = None) -> None:
        """Submit a healthy verdict to every node once per `period`, spread evenly over the period, as the
        agents' check loops would (each submit is a healthy check; the streak grows). Resumable."""
        if streak is not None:
            self._streak = streak
        self._loop_stop.clear()
        self._loop_cpu0 = time.process_time()

        def run() -> None:
            names = list(self.reconcilers)
            gap = period / max(1, len(names))
            nxt = time.monotonic()
            while not self._loop_stop.is_set():
                self._streak += 1
                for n in names:
                    self._hand(n, self.verdicts["healthy"], self._streak)
                    nxt += gap
                    if self._loop_stop.wait(max(0.0, nxt - time.monotonic())):
                        return
                self.rounds += 1

        self._loop = threading.Thread(target=run, name="fleet-loop", daemon=True)
        self._loop.start()

    def stop_loop(self) -> dict[str, Any]:
        self._loop_stop.set()
        if self._loop is not None:
            self._loop.join(10)
            self._loop = None
            self.loop_cpu += time.process_time() - self._loop_cpu0
        return {"event": "loop_stopped", "rounds": self.rounds, "cpu_s": self.loop_cpu}

    def stats(self) -> dict[str, Any]:
        return {
            "event": "stats",
            "counts": {k: self.counter.counts.get(k, 0) for k in COUNTED},
            "simulator": dict(self.counts),
            "errors": dict(self.counter.samples),
        }

    def close(self) -> None:
        self._loop_stop.set()
        with self._lock:
            self._closed = True
            self._timer_wake.notify_all()
        for r in self.reconcilers.values():
            r.stop(0.0)
        if self.source is not None:
            self.source.stop()
        self._exec.shutdown(wait=False, cancel_futures=True)


def worker_main(names_file: str, options: str = "{}") -> int:
    """names_file: one "<node> <kubeconfig>" per line (each node has its own Pod-bound token); options: a
    JSON object (Worker's)."""
    names = [(a, b) for a, b in (line.split() for line in Path(names_file).read_text().splitlines() if line)]
    w = Worker(names, json.loads(options))
    out = sys.stdout
    _say(out, {"event": "created", "n": len(names), "seconds": w.created_s})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["cmd"]
        if op == "submit":
            _say(out, w.submit(cmd["verdict"], cmd.get("names"), cmd.get("at"), int(cmd.get("streak", 0))))
        elif op == "loop":
            streak = cmd.get("streak")
            w.start_loop(float(cmd["period"]), None if streak is None else int(streak))
            _say(out, {"event": "looping"})
        elif op == "stop-loop":
            _say(out, w.stop_loop())
        elif op == "stats":
            _say(out, w.stats())
        elif op == "drain":
            _say(out, w.drain(float(cmd.get("timeout", 300))))
        elif op == "exit":
            break
    w.close()
    _say(out, {"event": "bye"})
    return 0


def _say(out: IO[str], doc: dict[str, Any]) -> None:
    out.write(json.dumps(doc) + "\n")
    out.flush()


# -- driver (the bench process) ----------------------------------------------------------------------------


class Fleet:
    """Spawns the worker processes and sends them commands; every call waits for every worker's answer."""

    def __init__(
        self,
        kubeconfigs: dict[str, Path],
        *,
        processes: int,
        workdir: Path,
        options: dict[str, Any] | None = None,
        nice: int = 0,
    ) -> None:
        """nice: the workers' niceness; the 5,000-node bench runs them at 19, so that the simulated agents,
        which in a cluster run on their own nodes, do not take the API server's CPU on this machine."""
        self.options = options or {}
        self.nice = nice
        self.names = list(kubeconfigs)
        self.kubeconfigs = kubeconfigs
        self.procs: list[subprocess.Popen[str]] = []
        self.owned: list[set[str]] = []
        self._logs: list[IO[bytes]] = []
        self.workdir = workdir
        self.processes = processes

    def start(self, timeout: float = 300.0) -> dict[str, Any]:
        started = time.monotonic()
        for i in range(self.processes):
            part = self.names[i :: self.processes]
            names_file = self.workdir / f"fleet-{i}.names"
            names_file.write_text("".join(f"{n} {self.kubeconfigs[n]}\n" for n in part))
            log = (self.workdir / f"fleet-{i}.stderr").open("wb")
            self._logs.append(log)
            p = subprocess.Popen(
                [
                    *(["nice", "-n", str(self.nice)] if self.nice else []),
                    *(
                        sys.executable,
                        "-m",
                        "bench.fleet",
                        "worker",
                        str(names_file),
                        json.dumps(self.options),
                    ),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=ROOT,
            )
            self.procs.append(p)
            self.owned.append(set(part))
        answers = self._collect("created", timeout)
        return {
            "seconds": time.monotonic() - started,
            "per_process_s": [a["seconds"] for a in answers],
            "threads_per_process": [a["n"] for a in answers],
        }

    def submit(
        self, verdict: str, *, names: Iterable[str] | None = None, at: float | None = None, streak: int = 0
    ) -> list[dict[str, Any]]:
        wanted = set(names) if names is not None else None
        for p, owned in zip(self.procs, self.owned, strict=True):
            mine = None if wanted is None else sorted(owned & wanted)
            self._send(p, {"cmd": "submit", "verdict": verdict, "names": mine, "at": at, "streak": streak})
        return self._collect("done", 300)

    def start_loop(self, period: float, streak: int | None = None) -> None:
        for p in self.procs:
            self._send(p, {"cmd": "loop", "period": period, "streak": streak})
        self._collect("looping", 30)

    def stop_loop(self) -> list[dict[str, Any]]:
        for p in self.procs:
            self._send(p, {"cmd": "stop-loop"})
        return self._collect("loop_stopped", 30)

    def drain(self, timeout: float = 300.0) -> list[dict[str, Any]]:
        """Wait until every worker has made the first counts it scheduled."""
        for p in self.procs:
            self._send(p, {"cmd": "drain", "timeout": timeout})
        return self._collect("drained", timeout + 30)

    def stats(self) -> dict[str, Any]:
        for p in self.procs:
            self._send(p, {"cmd": "stats"})
        total: Counter[str] = Counter()
        simulator: Counter[str] = Counter()
        errors: dict[str, str] = {}
        for a in self._collect("stats", 30):
            total.update(a["counts"])
            simulator.update(a.get("simulator", {}))
            errors.update(a["errors"])
        return {"counts": dict(total), "simulator": dict(simulator), "errors": errors}

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    self._send(p, {"cmd": "exit"})
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for log in self._logs:
            log.close()

    def stderr_tail(self) -> str:
        out = []
        for i in range(len(self.procs)):
            text = (self.workdir / f"fleet-{i}.stderr").read_text(errors="replace")
            out.append("\n".join(text.splitlines()[-20:]))
        return "\n".join(out)

    @staticmethod
    def _send(p: subprocess.Popen[str], doc: dict[str, Any]) -> None:
        assert p.stdin is not None
        p.stdin.write(json.dumps(doc) + "\n")
        p.stdin.flush()

    def _collect(self, event: str, timeout: float) -> list[dict[str, Any]]:
        answers: list[dict[str, Any] | None] = [None] * len(self.procs)

        def read(i: int, p: subprocess.Popen[str]) -> None:
            assert p.stdout is not None
            line = p.stdout.readline()
            if line:
                answers[i] = json.loads(line)

        threads = [threading.Thread(target=read, args=(i, p), daemon=True) for i, p in enumerate(self.procs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        if any(a is None or a.get("event") != event for a in answers):
            raise RuntimeError(f"fleet workers did not answer {event!r}: {answers}\n{self.stderr_tail()}")
        return [a for a in answers if a is not None]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="a fleet worker process (started by bench/k8s_bench.py)")
    ap.add_argument("role", choices=["worker"])
    ap.add_argument("names_file")
    ap.add_argument("options", nargs="?", default="{}")
    args = ap.parse_args(argv)
    return worker_main(args.names_file, args.options)


if __name__ == "__main__":
    raise SystemExit(main())
