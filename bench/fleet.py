"""The fleet simulation of `make bench`: many gpuguard node writers against one real API server.

Each simulated node has what a real agent has on the API side: its own `NodeReconciler` (with its own thread)
over its own `KubeNodeWriter`, whose client comes from its own `load_api_client` call on a kubeconfig with the
node's own Pod-bound ServiceAccount token (deploy/admission-policy.yaml lets a token write only its node). The
GPU side is not simulated per node: verdicts are built once with `policy.evaluate` and submitted the way the
agent's loop submits them. Reconcilers are spread over a few worker processes (`python -m bench.fleet worker
...`), driven by `Fleet` through JSON lines on stdin/stdout; at a given CLOCK_MONOTONIC instant (shared by all
processes on Linux) every worker submits at once.

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
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Log events of gpuguard.node that show API trouble or a write.
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
    from gpuguard.config import PolicySettings
    from gpuguard.model import GpuReading, Snapshot
    from gpuguard.policy import evaluate

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
    """options (all optional): "jitter" (seconds: each reconciler's start delay is drawn from 0..jitter, as
    `gpuguard watch --startup-jitter` draws it), "qps" and "burst" (the client-side rate limit, as
    --api-qps/--api-burst; qps 0 or absent: none), "max_quarantined" (--max-quarantined)."""

    def __init__(self, names: list[tuple[str, str]], options: dict[str, Any] | None = None) -> None:
        import inspect
        import random

        import structlog

        from gpuguard.config import NodeSettings
        from gpuguard.node.budget import QuarantineBudget
        from gpuguard.node.reconciler import NodeReconciler
        from gpuguard.node.writers import KubeNodeWriter, load_api_client

        opts = options or {}
        self.counter = _Counting()
        structlog.configure(processors=[self.counter], cache_logger_on_first_use=False)
        self.verdicts = _verdicts()
        started = time.monotonic()
        self.reconcilers: dict[str, Any] = {}
        self.limiters: list[Any] = []
        qps, burst = float(opts.get("qps") or 0), int(opts.get("burst") or 1)
        jitter = float(opts.get("jitter") or 0)
        # An older checkout (make bench compares against main) has neither setting.
        has_delay = "start_delay" in inspect.signature(NodeReconciler).parameters
        for name, kubeconfig in names:
            api = load_api_client(kubeconfig, rate_limit=(qps, burst)) if qps else load_api_client(kubeconfig)
            if getattr(api, "rate_limiter", None) is not None:
                self.limiters.append(api.rate_limiter)
            writer = KubeNodeWriter(name, api=api, timeout=10.0)
            settings = NodeSettings(name=name, max_quarantined=str(opts.get("max_quarantined", "10%")))
            budget = QuarantineBudget(writer, settings)
            extra: dict[str, Any] = {"start_delay": random.uniform(0, jitter)} if has_delay else {}
            self.reconcilers[name] = NodeReconciler(writer, settings, budget=budget, **extra)
        # Threads started now, not at the instant (thousands of thread starts would spread the instant over
        # seconds): a reconciler's start-up delay counts from its first verdict, as an agent's first check
        # comes right after its start.
        for r in self.reconcilers.values():
            r.start()
        self.created_s = time.monotonic() - started
        self._loop_stop = threading.Event()
        self._loop: threading.Thread | None = None
        self._streak = 0
        self.rounds = 0
        self.loop_cpu = 0.0
        self._loop_cpu0 = 0.0

    def submit(
        self, verdict: str, names: Iterable[str] | None, at: float | None, streak: int
    ) -> dict[str, Any]:
        targets = (
            [self.reconcilers[n] for n in names] if names is not None else list(self.reconcilers.values())
        )
        v = self.verdicts[verdict]
        if at is not None:
            while (left := at - time.monotonic()) > 0:
                time.sleep(min(left, 0.05) if left > 0.002 else 0)
        t0 = time.monotonic()
        for r in targets:
            r.submit(v, streak)
        submitted = time.monotonic()
        not_idle = sum(1 for r in targets if not r.wait_idle(120.0))
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
        """Submit a healthy verdict to every reconciler once per `period`, spread evenly over the period, as
        the agents' check loops would (each submit is a healthy check; the streak grows). Resumable."""
        if streak is not None:
            self._streak = streak
        self._loop_stop.clear()
        self._loop_cpu0 = time.process_time()

        def run() -> None:
            rs = list(self.reconcilers.values())
            gap = period / max(1, len(rs))
            nxt = time.monotonic()
            while not self._loop_stop.is_set():
                self._streak += 1
                for r in rs:
                    r.submit(self.verdicts["healthy"], self._streak)
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
            "errors": dict(self.counter.samples),
        }

    def close(self) -> None:
        self._loop_stop.set()
        for r in self.reconcilers.values():
            r.stop(0.1)


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

    def stats(self) -> dict[str, Any]:
        for p in self.procs:
            self._send(p, {"cmd": "stats"})
        total: Counter[str] = Counter()
        errors: dict[str, str] = {}
        for a in self._collect("stats", 30):
            total.update(a["counts"])
            errors.update(a["errors"])
        return {"counts": dict(total), "errors": errors}

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
