"""The loop: read the GPUs, judge, hand the verdict to the node reconciler, record when it last did so.

The loop polls at `interval` and wakes at once when a backend reports an Xid. Clock, wall clock and the stop
event are injected so tests drive it without sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime

import structlog

from gpuguard.core.config import PolicySettings
from gpuguard.core.metrics import Metrics
from gpuguard.core.model import AgentStatus, Fault, Judgement, SignalMemory, Snapshot, Verdict
from gpuguard.core.signalconfig import SignalConfig
from gpuguard.core.signaltable import SignalTable
from gpuguard.core.xids import CATALOG
from gpuguard.judge.cadence import fitted
from gpuguard.judge.policy import evaluate
from gpuguard.judge.tally import Tally, tally
from gpuguard.nvml.base import Backend, wait_for
from gpuguard.quarantine.node.writers import DRY_RUN_NODE
from gpuguard.quarantine.reconciler import NodeReconciler
from gpuguard.store.baselines import BaselineStore
from gpuguard.store.state import StateStore

log = structlog.get_logger(__name__)

STALL_INTERVALS = 3
# Ignored Xids are logged once per code and window, then counted (every one is in the metric): a storm of
# 10,000 is two lines, not 10,000.
IGNORED_LOG_WINDOW_S = 60.0


class Agent:
    def __init__(
        self,
        *,
        backend: Backend,
        reconciler: NodeReconciler,
        policy: PolicySettings,
        interval: float,
        node_name: str | None,
        dry_run: bool = False,
        metrics: Metrics | None = None,
        state: StateStore | None = None,
        baselines: BaselineStore | None = None,
        flap_window: float = 600.0,
        library_wait: float | None = None,
        call_wait: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
        stop: threading.Event | None = None,
        on_verdict: Callable[[Verdict], None] | None = None,
        signal_config: SignalConfig | None = None,
        uptime: float | None = None,
        recover_after: int | None = None,
    ) -> None:
        """on_verdict: also handed each verdict, after the reconciler (the evictor's `observe`). `baselines`:
        the signals' first-good baselines kept across restarts (None: in this process only, a dry run).
        `recover_after`: the reconciler's --recover-after; a steady node's runs past it hand the writer the
        same Judgement again (None: a new one at every check)."""
        self._backend = backend
        self._on_verdict = on_verdict
        self._reconciler = reconciler
        self._signal_config = signal_config
        # When the host booted, on the agent's clock (`uptime`: seconds since, at construction).
        self._booted_at = None if uptime is None else clock() - uptime
        self._interval = interval
        self._node_name = node_name
        self._log_node = node_name or DRY_RUN_NODE  # the name the node's own lines use, also in a dry run
        self._widened: dict[str, float] = {}
        table = self._fit(policy.signals)
        # The policy measures durations in checks at the agent's own --interval.
        self._policy = replace(policy, signals=table, interval=interval)
        self._dry_run = dry_run
        self._metrics = metrics
        self._state = state
        self._baselines = baselines
        self._flap_window = flap_window
        self._library_wait = library_wait
        # The longest a check waits on one NVML call before it reports the call as hung: the loop is alive
        # while it waits.
        self._call_wait = call_wait
        self._stuck_calls: tuple[str, ...] = ()
        # Per ignored Xid code: when its log window began, and how many were not logged in it.
        self._ignored_logged: dict[int, tuple[float, int]] = {}
        self._library_seen = False
        # Set when the loop stopped because libnvidia-ml.so.1 never became loadable (the CLI exits 3).
        self.no_library = False
        self._restored: Verdict | None = None
        self._clock = clock
        self._wall = wall
        self.stop_event = stop or threading.Event()
        self._wake = threading.Event()
        self._verdict: Verdict | None = None
        self._last_evaluation: tuple[Snapshot, Verdict | None, Verdict, PolicySettings] | None = None
        # When the node's and each GPU's runs with no fault and with no degraded signal began, the flaps,
        # and the judgement they make with the verdict.
        self._tally = Tally()
        self._recover_after = recover_after
        # The node's labels the signal table was last chosen for (the reconciler reads the node).
        self._labels: Mapping[str, str] | None = None
        self._started = clock()
        self._last_check: float | None = None
        self._last_check_wall: datetime | None = None
        self.checks = 0

    # Backends call this from their event thread when an Xid arrives.
    def wakeup(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        """Stop the loop promptly (SIGTERM/SIGINT)."""
        self.stop_event.set()
        self._wake.set()

    def run(self, *, run_for: float | None = None) -> None:
        """Run until the stop event is set (SIGTERM) or `run_for` seconds have passed."""
        self._started = self._clock()
        deadline = None if run_for is None else self._started + run_for
        self.restore()
        self._backend.open(self.wakeup)
        self._reconciler.start()
        log.info("agent.started", node=self._log_node, interval=self._interval, dry_run=self._dry_run)
        try:
            while not self.stop_event.is_set():
                self._safe_check()
                next_poll = self._clock() + self._interval
                if deadline is not None:
                    next_poll = min(next_poll, deadline)
                if not self.stop_event.is_set():
                    # Until the next poll; an Xid or stop() sets _wake and ends it at once. The backend
                    # clears _wake as the next reading begins (nvml: on its reading thread, which reads
                    # meanwhile), so a wake-up that comes during a check is never lost.
                    self._safe_wait(next_poll)
                if deadline is not None and self._clock() >= deadline:
                    break
        finally:
            log.info("agent.stopping", node=self._log_node, checks=self.checks)
            self._reconciler.stop()
            self._backend.close()

    def restore(self) -> None:
        """Load the faults recorded earlier in this boot (an Xid the driver will not deliver again) and the
        signals' first-good baselines (a link down before the restart stays down in the judgement)."""
        if self._verdict is not None:
            return
        sticky = self._state.load() if self._state is not None else ()
        memory = self._baselines.load() if self._baselines is not None else SignalMemory()
        if sticky or memory != SignalMemory():
            self._restored = Verdict(sticky=sticky, signal_memory=memory)

    def check_once(self) -> Verdict:
        t0 = self._clock()
        self._node_rules()
        snapshot = self._backend.snapshot()
        self._check_library(snapshot.init_error)
        self._note_stuck(snapshot.stuck_calls)
        previous = self._verdict
        verdict = self._evaluate(snapshot, previous or self._restored)
        judged_at = self._clock()
        if verdict is not previous or verdict.ignored_xids:
            # The very verdict as before (the remembered evaluation) has no transition to log.
            self._log_transitions(previous, verdict)
        if self._ignored_logged:
            self._flush_ignored(self._clock())
        if self._state is not None:
            # Before the write: a crash now must not lose the fault, nor judge a kernel-log Xid twice.
            self._state.save(verdict.sticky, kernel_seq=snapshot.kernel_seq)
        if self._baselines is not None:
            listed = {uuid for _, uuid, _ in verdict.known if uuid}  # a UUID NVML no longer lists is dropped
            self._baselines.save(verdict.signal_memory, listed)
        now = self._clock()
        self._tally = tally(
            self._tally,
            verdict,
            judged_at=judged_at,
            now=now,
            interval=self._interval,
            flap_window=self._flap_window,
            recover_after=self._recover_after,
        )
        self._verdict = verdict
        self._last_check = now
        self._last_check_wall = self._wall()
        self.checks += 1
        self._reconciler.submit(self._tally.judgement or Judgement(verdict))
        if self._on_verdict is not None:
            self._on_verdict(verdict)
        if self._metrics is not None:
            self._metrics.observe_check(verdict, duration=now - t0, wall=self._last_check_wall.timestamp())
            self._metrics.observe_stuck(len(snapshot.stuck_calls))
            node = self._reconciler.status
            self._metrics.observe_node(
                1 if node.tainted and not node.deferred else 0,
                1 if node.deferred else 0,
                sum(1 for g in node.gpus if not g.deferred),
                sum(1 for g in node.gpus if g.deferred),
            )
        return verdict

    def _node_rules(self) -> None:
        """The node's labels as the reconciler last read them are an input of this check: --signals-config's
        node rules that select them apply from the first check after the read. One log line when the table
        changes."""
        labels = self._reconciler.status.labels
        if self._signal_config is None or labels is None or labels is self._labels:
            return
        self._labels = labels
        table = self._fit(self._signal_config.table(labels))
        if table != self._policy.signals:
            self._policy = replace(self._policy, signals=table)
            log.info(
                "signals.node_rules", node=self._log_node, rules=list(self._signal_config.matching(labels))
            )

    def _fit(self, table: SignalTable) -> SignalTable:
        """The table with the clock signals' windows widened to hold enough checks at --interval."""
        table, widened = fitted(table, self._interval)
        if widened and widened != self._widened:
            log.warning(
                "signals.window_widened", node=self._log_node, interval=self._interval, windows=widened
            )
        self._widened = widened
        return table

    def _evaluate(self, snapshot: Snapshot, basis: Verdict | None) -> Verdict:
        """policy.evaluate, remembered for the last arguments: it is pure (no clock, no I/O), so the same
        snapshot judged against an equal previous verdict gives the same verdict again. On a steady node that
        skips the evaluation at every poll (a fifth of an idle check's CPU, docs/performance.md)."""
        last = self._last_evaluation
        policy = self._policy  # read once: the node's labels may change it from the reconciler's thread
        # A failure lasting or a health signal counted over a window is judged again as time passes, readings
        # unchanged; a table the node's labels changed judges again too.
        timed = basis is not None and basis.pending
        if last is not None and not timed and last[3] is policy:
            if snapshot is last[0] and basis is last[1]:
                return last[2]  # the backend's very snapshot again (nothing read differently): no compare
            if snapshot == last[0] and basis == last[1]:
                return last[2]
        # The signals' windows run on the agent's clock (the backend may return its last snapshot again).
        stamped = replace(snapshot, taken_at=self._clock(), booted_at=self._booted_at)
        verdict = evaluate(stamped, previous=basis, settings=policy)
        if verdict == basis:
            # The same judgement as before: keep the one object, so the next check's memo matches by identity.
            verdict = basis
        self._last_evaluation = (snapshot, basis, verdict, policy)
        return verdict

    def status(self) -> AgentStatus:
        node = self._reconciler.status
        reference = self._last_check if self._last_check is not None else self._started
        alive = self._clock() - reference <= STALL_INTERVALS * self._interval + self._call_wait
        return AgentStatus(
            alive=alive,
            ready=self._last_check is not None and node.reconciled,
            node=self._log_node,  # the name the log lines use: "dry-run" in a dry run without --node
            verdict=self._verdict,
            tainted=node.tainted,
            cordoned=node.cordoned,
            dry_run=self._dry_run,
            last_check=self._last_check_wall,
            gpu_quarantines=node.gpus,
            nvml_stuck_calls=self._stuck_calls,
            api=None if self._dry_run else self._reconciler.api.health,
        )

    def _note_stuck(self, stuck: tuple[str, ...]) -> None:
        """One line when the set of NVML calls stuck past their deadline changes (the backend logs each)."""
        if stuck != self._stuck_calls:
            (log.warning if stuck else log.info)("nvml.stuck_calls", node=self._log_node, calls=list(stuck))
        self._stuck_calls = stuck

    def _check_library(self, init_error: str | None) -> None:
        """Stop the loop when the NVML library has not been loadable for `library_wait` seconds since start:
        only a container restart makes the toolkit inject it (never once NVML has loaded in this process)."""
        if init_error != "LIBRARY_NOT_FOUND":
            self._library_seen = True
            return
        if self._library_wait is None or self._library_seen:
            return
        if self._clock() - self._started >= self._library_wait:
            self.no_library = True
            self.stop()

    def _safe_check(self) -> None:
        try:
            self.check_once()
        except Exception:
            # A bug or an unexpected backend failure must not kill the loop; if it persists, /healthz
            # turns "stalled" and kubelet restarts the agent.
            log.exception("check.failed", node=self._log_node)

    def _safe_wait(self, until: float) -> None:
        try:
            self._backend.wait(until, self._wake)
        except Exception:
            # A pass read ahead failed in a way a check would have logged: log it, and let the next check
            # read again (a wait that returns at once is not a spin: the check is the backend's own pass).
            log.exception("check.failed", node=self._log_node)
            wait_for(until, self._wake, self._clock)

    def _flush_ignored(self, now: float) -> None:
        """One line per code whose window ended with Xids it did not log: how many."""
        for code, (start, unlogged) in list(self._ignored_logged.items()):
            if now - start < IGNORED_LOG_WINDOW_S:
                continue
            del self._ignored_logged[code]
            if unlogged:
                log.info(
                    "xid.ignored_unlogged",
                    node=self._log_node,
                    xid=code,
                    count=unlogged,
                    window_s=IGNORED_LOG_WINDOW_S,
                    bucket=CATALOG.bucket(code),
                )

    def _log_transitions(self, previous: Verdict | None, verdict: Verdict) -> None:
        before = {f.key for f in previous.faults} if previous else set()
        for f in verdict.faults:
            if f.key not in before:
                _log_fault(self._log_node, f)
        now = self._clock()
        for x in verdict.ignored_xids:
            start, unlogged = self._ignored_logged.get(x.code, (-IGNORED_LOG_WINDOW_S, 0))
            if now - start < IGNORED_LOG_WINDOW_S:
                self._ignored_logged[x.code] = (start, unlogged + 1)
                continue
            self._ignored_logged[x.code] = (now, 0)
            log.info(
                "xid.ignored",
                node=self._log_node,
                gpu=x.gpu_index,
                uuid=x.uuid,
                xid=x.code,
                bucket=CATALOG.bucket(x.code),
                gpu_instance=x.gpu_instance,
                compute_instance=x.compute_instance,
            )
        watched_before = {g.uuid: g.xid_watched for g in previous.gpus} if previous else {}
        for g in verdict.gpus:
            if watched_before.get(g.uuid, True) != g.xid_watched:
                # One line per change (and at start for a GPU that is not watched): never blind in silence.
                (log.info if g.xid_watched else log.warning)(
                    "gpu.xid_watch",
                    node=self._log_node,
                    gpu=g.index,
                    uuid=g.uuid,
                    watched=g.xid_watched,
                    why=g.xid_watch_note or None,
                )
        if previous is None:
            return
        was = {g.uuid: g.healthy for g in previous.gpus}
        for g in verdict.gpus:
            if g.healthy and was.get(g.uuid) is False:
                log.info("gpu.recovered", node=self._log_node, gpu=g.index, uuid=g.uuid)
        if previous.node_faults and not verdict.node_faults:
            log.info("node.faults_cleared", node=self._log_node)


def _log_fault(node: str, f: Fault) -> None:
    event = "gpu.unhealthy" if f.uuid is not None else "node.unhealthy"
    log.warning(event, node=node, gpu=f.gpu_index, uuid=f.uuid, reason=f.reason, detail=f.detail)
