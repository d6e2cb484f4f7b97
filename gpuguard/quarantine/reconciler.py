"""The reconciler: applies the newest verdict to both quarantines on its own thread, so the GPU checks never
wait for the API server. The node as last read (a cache kept from the answers to its own writes),
optimistic concurrency (every patch carries the resourceVersion it was planned against; a 409 means re-read
and re-plan) and retries of transient failures (`retrypolicy`). The verdict's hand-off is `handoff`'s, the
condition, Events and log lines `nodereport`'s; the budget's state lives in `node.budget.QuarantineBudget`
and the GPUs' in `gpu.quarantine.DeviceQuarantine`: this module only asks them."""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import structlog
import tenacity

from gpuguard.core.config import NodeSettings
from gpuguard.core.errors import ConflictError, NodeUpdateError, PermanentApiError, TransientApiError
from gpuguard.core.metrics import Metrics
from gpuguard.core.model import GpuQuarantine, Judgement, Verdict
from gpuguard.quarantine.apistate import ApiState, Intent
from gpuguard.quarantine.gpu.quarantine import DeviceQuarantine
from gpuguard.quarantine.handoff import Handoff
from gpuguard.quarantine.node.budget import QuarantineBudget
from gpuguard.quarantine.node.degraded import DEGRADED_ACTIONS, plan_degraded
from gpuguard.quarantine.node.plan import plan
from gpuguard.quarantine.node.view import NodeChange, NodeView
from gpuguard.quarantine.node.writers import DRY_RUN_NODE, NodeWriter
from gpuguard.quarantine.nodereport import NodeReport
from gpuguard.quarantine.record import ANN_REASON, ANN_SINCE
from gpuguard.quarantine.repair import asking
from gpuguard.quarantine.repeat.marks import marks, with_marks
from gpuguard.quarantine.repeat.offenders import RepeatOffenders
from gpuguard.quarantine.retrypolicy import node_retrying

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class NodeStatus:
    """What /healthz reports about the node (in a dry run: what gpuguard would have done)."""

    tainted: bool = False
    cordoned: bool = False
    reconciled: bool = False
    deferred: bool = False
    # GPUs held out by DeviceTaintRules (per-GPU quarantine), in device order.
    gpus: tuple[GpuQuarantine, ...] = ()
    # The node's labels as last read: an input of the agent's next check (--signals-config's node rules).
    labels: Mapping[str, str] | None = None


class NodeReconciler:
    """Applies the latest verdict to the node on its own thread, so the GPU checks never wait for the API.

    The node is read at start and then kept from the answers to our own writes: a healthy node costs no
    API request at all. While gpuguard holds anything on the node it is read again every --node-resync
    seconds, so what others change under it (the kubelet's new bootID after a reboot, an operator's
    override, an admin's uncordon) is seen. Every write carries the resourceVersion it was planned
    against; a 409 re-reads and re-plans, so another controller's concurrent taints and labels are never
    lost. `budget` None: no budget (every quarantine is full, as in a dry run).
    """

    def __init__(
        self,
        writer: NodeWriter,
        settings: NodeSettings,
        *,
        budget: QuarantineBudget | None = None,
        devices: DeviceQuarantine | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        retry_deadline: float = 60.0,
        max_conflicts: int = 20,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        start_delay: float = 0.0,
        api: ApiState | None = None,
        repeat: RepeatOffenders | None = None,
    ) -> None:
        """start_delay: seconds the first request waits after the first verdict unless a verdict with a
        fault comes first (the start-up jitter, drawn by the caller from --startup-jitter). `api`: what the
        API server answered (refusals and their backoff, outages); its own by default. `repeat`: the GPU
        history and its repeat offenders (None: none kept, nothing held)."""
        self.repeat = repeat
        self._writer = writer
        self._start_delay = start_delay
        self._clock = clock
        # The node's name in every line, also before the first read and in a dry run without --node.
        self._name = settings.name or DRY_RUN_NODE
        self._read_at = -math.inf
        self.budget = budget
        self.devices = devices
        self._metrics = metrics
        self._settings = settings
        self._now = now
        self._retry_deadline = retry_deadline
        self._max_conflicts = max_conflicts
        self._blocked = False
        self._stop = threading.Event()
        self._handoff = Handoff(recover_after=settings.recover_after, stop=self._stop, clock=clock)
        self._report = NodeReport(writer, settings, now=now, set_node=self._set_node)
        self._thread: threading.Thread | None = None
        self._node: NodeView | None = None
        self._status = NodeStatus()
        self.api = api or ApiState(self._name, backoff=settings.refusal_backoff, clock=clock)
        self._read_intent = Intent(
            "get", f"node {self._name}"
        )  # the faults it is read for: see _reconcile_once
        self._intent: Intent | None = None  # the request in flight, named if it is refused
        self.writes = 0

    @property
    def status(self) -> NodeStatus:
        return self._status

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpuguard-node", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 1.5) -> None:
        self._stop.set()
        self._handoff.wake()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, judgement: Judgement) -> None:
        """Hand over the newest judgement (latest wins: an old one is never applied after a newer one).

        One that cannot change any decision (same faults, streaks past --recover-after, the node cached and
        not deferred) does not wake the writer thread: an idle agent costs next to nothing."""
        settling = (
            (self.budget is not None and self.budget.settling)
            or (self.devices is not None and self.devices.settling)
            or (self.repeat is not None and self.repeat.settling)  # an episode waits to count
        )

        def quiet() -> bool:
            node = self._node
            return node is not None and not node.deferred and not settling and not self._resync_due(node)

        self._handoff.submit(judgement, quiet=quiet)

    def wait_idle(self, timeout: float) -> bool:
        """For tests and one-shot runs: block until every submitted verdict has been reconciled."""
        return self._handoff.wait_idle(timeout)

    def reconcile_now(self) -> None:
        """One synchronous reconcile of the latest verdict (the thread's body; also for tests)."""
        generation, sig = self._handoff.begin()
        settled = False
        self._blocked = False
        retrying = node_retrying(
            deadline=self._retry_deadline,
            max_wait=self._settings.retry_max_wait,
            stop=self._stop,
            sleep=self._sleep,
            before_sleep=self._before_sleep,
        )
        try:
            retrying(self._reconcile_once)
            settled = not self._blocked
            if self.devices is not None:
                self.devices.refresh()  # after the node write: nothing added before the taint
        except TransientApiError as exc:
            log.warning(
                "node.write_deferred",
                node=self._name,
                error=str(exc),
                note="no answer within the retries: the change is sent again at the next check",
            )
        except PermanentApiError as exc:
            intent = self._intent or Intent("request", f"for node {self._name}")
            self.api.refused(intent, exc, unwritten=self._unwritten())
        finally:
            if self.repeat is not None:
                self.repeat.flush()  # after the writes: no fsync before the taint
            if not self._status.reconciled and self._node is not None:
                # The first reconcile is over (its device reads, writes, condition and Event too, or their
                # failure): /readyz may say so. Not at the first read: a rollout would count a node ready
                # whose agent has not yet done its first reconcile.
                self._status = replace(self._status, reconciled=True)
            self._handoff.done(generation, sig, settled=settled)

    def _run(self) -> None:
        self._handoff.hold_start(self._start_delay)
        while self._handoff.wait_work():
            try:
                self.reconcile_now()
            except Exception:
                # A bug must not kill the writer thread for good: log it, and the next verdict retries.
                log.exception("node.reconcile_failed", node=self._name)

    def _reconcile_once(self) -> None:
        latest = self._handoff.latest()
        if latest is None:
            return
        verdict, streaks, flapping = latest.verdict, latest.streaks, latest.flapping
        streak, gpu_streaks, degraded_streak = streaks.healthy, streaks.gpus, streaks.clean
        self._intent = None
        # A refused read's backoff holds back that read, not a new fault: the read is known by the faults it
        # is read for, so a verdict with other faults reads (and writes) at once.
        self._read_intent = Intent(
            "get", f"node {self._name}", ",".join(sorted(f.key for f in verdict.faults))
        )
        node = self._node
        if node is None or self._resync_due(node):
            if self.api.blocked(self._read_intent):
                self._blocked = True  # the read was refused recently: do not send it again yet
                return
            node = self._read()
        if self.budget is not None:
            self.budget.begin(node)
        if self.repeat is not None:
            # The GPU history, a release on the node, and the held GPUs' `repeat-offender` faults.
            verdict = self.repeat.apply(node, verdict, streak=streak, gpu_streaks=gpu_streaks)
            if self._metrics is not None:
                index = {g.uuid: g.index for g in verdict.gpus}
                self._metrics.observe_repeat_offenders(self.repeat.held, index)
        if self._settings.repair != "off":
            verdict = asking.hold(node, verdict)  # the GPUs the repair executor holds out of service
        full = verdict
        if self.devices is not None:
            # Per-GPU faults become DeviceTaintRules; the node is planned for what is left (docs/design.md).
            verdict = self.devices.apply(
                node,
                verdict,
                streak=streak,
                flapping=flapping,
                gpu_streaks=gpu_streaks,
                degraded_streaks=streaks.gpus_clean,
            )
        for attempt in range(self._max_conflicts):
            change = self._plan(node, verdict, streak, flapping) or self._degraded(
                node, verdict, degraded_streak
            )
            if change is None:
                change = self._ask(node, full)  # the repair request, once the quarantine is in place
            if change is None:
                self._report.override(node, verdict)
                self._set_node(node)
                self._condition(node, full, flapping, degraded_streak)
                return
            intent = self._intent = self._patch_intent(change)
            if self.api.blocked(intent):
                self._blocked = True  # refused recently: do not hammer it, but do not settle either
                return
            before = node
            try:
                node = self._writer.patch(node, change)
            except ConflictError:
                log.info("node.conflict", node=node.name, resource_version=node.resource_version)
                # A little jitter: two writers that re-read in lockstep would keep colliding.
                self._sleep(random.uniform(0, 0.005 * (attempt + 1)))  # noqa: S311 - jitter, not crypto
                node = self._read()
                continue
            except TransientApiError:
                self._node = None  # the write may or may not have landed: read again next time
                raise
            self.writes += 1
            self.api.accepted(intent)
            self._intent = None  # a refusal after this (the budget's order list) is not this write's
            self._set_node(node)
            self._report.change(before, change, verdict)
            self._condition(node, full, flapping, degraded_streak)
            if change.event is not None:
                self._report.event(node, change.event, verdict)
            if self.budget is not None and self.budget.written(node, change):
                continue  # past the budget's limit: the next plan is the yield
            if change.action not in DEGRADED_ACTIONS and self._degraded(node, verdict, degraded_streak):
                continue  # one pass writes both levels: the degraded marks next
            if change.action != "repair-request" and self._ask(node, full) is not None:
                continue  # the quarantine is in place: the repair request next
            return
        raise TransientApiError(f"node {node.name}: still conflicting after {self._max_conflicts} tries")

    def _plan(self, node: NodeView, verdict: Verdict, streak: int, flapping: bool) -> NodeChange | None:
        if self.budget is not None:
            step_back = self.budget.pending_yield(node)
            if step_back is not None:
                return step_back
        change = plan(
            node,
            verdict,
            healthy_streak=streak,
            settings=self._settings,
            now=self._now(),
            flapping=flapping,
            gate_held=self.devices is not None and self.devices.gate_held,
        )
        if self.budget is not None:
            change = self.budget.gate(node, change, verdict)
        if self.repeat is None:
            return change
        mark = marks(
            node,
            self.repeat.held,
            handled_release=self.repeat.handled_release,
            handled_hold=self.repeat.handled_hold,
            published=self.repeat.published,
            rides=change is not None,
        )
        return with_marks(change, mark)

    def _ask(self, node: NodeView, full: Verdict) -> NodeChange | None:
        """The repair request (`--repair`, quarantine/repair/asking.py)."""
        if self._settings.repair == "off":
            return None
        ruled = asking.in_place(node, full, self.devices.quarantined if self.devices is not None else ())
        return asking.ask(node, full, in_place=ruled, now=self._now())

    def _degraded(self, node: NodeView, verdict: Verdict, degraded_streak: int) -> NodeChange | None:
        """The degraded marks (node/degraded.py): never gated by the budget, never a cordon."""
        return plan_degraded(
            node,
            verdict.degraded,
            clean_streak=degraded_streak,
            recover_after=self._settings.recover_after,
            taint=self._settings.degraded_taint,
        )

    def _resync_due(self, node: NodeView) -> bool:
        if self._clock() - self._read_at < self._settings.node_resync:
            return False  # asked at every check: the rest only when a resync is due
        # Device rules hold state too: the node's new bootID after a reboot is their evidence.
        rules = self.devices is not None and self.devices.holds_rules
        held = self.repeat is not None and bool(self.repeat.held)  # a release is read from the node
        return node.holds_gpuguard_state(self._settings.gate_taint_key) or rules or held

    def _read(self) -> NodeView:
        self._intent = self._read_intent
        try:
            # Every read here is the basis of a plan and its write (a 409 re-read, a resync, the first
            # read): it reserves the write's token of a client-side rate limit.
            node = self._writer.read(reserve_write=True)
        except TransientApiError:
            self._node = None
            raise
        self.api.accepted(self._read_intent)
        self._intent = None
        self._set_node(node)
        return node

    def _patch_intent(self, change: NodeChange) -> Intent:
        """Which marks the write puts on the node, not its bytes: the `since` and `reason` annotations are
        a new time stamp and the faults' detail (an ECC count) at every plan; the fault keys, the taints,
        the cordon and the labels are what is asked for."""
        body = change.patch("")
        annotations = body["metadata"].get("annotations") or {}
        for key in (ANN_SINCE, ANN_REASON):
            if annotations.get(key):
                annotations[key] = "set"
        return Intent("patch", f"node {self._name}", json.dumps(body, sort_keys=True))

    def _set_node(self, node: NodeView) -> None:
        """The node as the API server last answered (a read, or the answer to our write)."""
        if node is not self._node:
            self._read_at = self._clock()
        self._node = node
        self._status = NodeStatus(
            tainted=node.our_taint is not None,
            cordoned=node.unschedulable,
            reconciled=self._status.reconciled,  # set once, at the end of the first reconcile
            deferred=node.deferred,
            gpus=self.devices.quarantined if self.devices is not None else (),
            labels=node.labels,
        )

    def _condition(self, node: NodeView, verdict: Verdict, flapping: bool, degraded_streak: int) -> None:
        tainted = len(self.devices.quarantined) if self.devices is not None else 0
        self._report.condition(node, verdict, flapping, device_tainted=tainted)
        if self._node is not None:  # the GPUHealthy write answers with the node: its resourceVersion
            node = self._node
        self._report.degraded_condition(node, verdict, clean_streak=degraded_streak)
        if self._node is not None:
            node = self._node
        self._report.accelerated_condition(node, verdict, flapping)

    def _unwritten(self) -> tuple[str, ...]:
        """The faults of the latest verdict that are not on the node as last read: what a refusal leaves off
        it, named in the refusal's line so that no fault goes unwritten in silence."""
        latest = self._handoff.latest()
        keys = {f.key for f in latest.verdict.faults} if latest is not None else set()
        on = self._node.recorded_faults if self._node is not None else frozenset()
        return tuple(sorted(keys - on))

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _before_sleep(self, state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        if self._metrics is not None:
            self._metrics.api_retries.inc()
        if isinstance(exc, NodeUpdateError):
            self.api.unreachable(exc)
        log.debug("api.retry", attempt=state.attempt_number, error=str(exc))
