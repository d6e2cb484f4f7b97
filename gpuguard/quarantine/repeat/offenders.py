"""Repeat offenders across reconciles: the GPU history (`gpuguard.store.history`, read once at start), kept up
to date from each verdict the reconciler applies (`escalation.observe`, `escalation.escalate`), an operator's
release read from the node (`release`), and the verdict the quarantines are planned for: each held GPU carries
the fault `repeat-offender` (`escalation.held_faults`), so its node taint or DeviceTaintRule stays across
reboots and resets, and counts against the budget like any quarantine.

The history is written after the reconcile's writes (`flush`), never before the taint: a fault's path costs
no fsync. A release is the exception: written before the write that removes its annotation, so that no crash
loses it. One thread (the reconciler's) calls every method.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import structlog

from gpuguard.core.model import Verdict
from gpuguard.quarantine.node.view import NodeView
from gpuguard.quarantine.repeat import counting, escalation, hold, published
from gpuguard.quarantine.repeat.escalation import Limits
from gpuguard.quarantine.repeat.release import ANN_RELEASE, parse
from gpuguard.store.history import GpuHistory, HistoryStore, bounded

log = structlog.get_logger(__name__)


class RepeatOffenders:
    """`limits.limit` 0: escalation off (the history is still kept; nothing is held)."""

    def __init__(
        self,
        store: HistoryStore,
        limits: Limits,
        *,
        recover_after: int,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._limits = limits
        self._recover_after = recover_after
        self._wall = wall
        self._behind = 0.0  # seconds the wall clock was found behind the history (a clock stepped back)
        self._history: dict[str, GpuHistory] = store.load()
        self._saved = self._history
        self._escalated_once = False
        # An episode too new to count at the last apply (escalation.settling): escalate again once it is not.
        self._settling = False
        # The release and hold annotations' texts last handled: removed by the next node write, handled once.
        self.handled_release: str | None = None
        self.handled_hold: str | None = None
        self._published: tuple[Mapping[str, GpuHistory] | None, str | None] = (None, None)

    @property
    def history(self) -> Mapping[str, GpuHistory]:
        return self._history

    @property
    def published(self) -> tuple[str, str | None]:
        """The node annotation that shows the history (`published`), and its value for the history now."""
        if self._published[0] is not self._history:
            self._published = (self._history, published.summary(self._history))
        return published.ANN_HISTORY, self._published[1]

    @property
    def settling(self) -> bool:
        """Whether an episode waits to count (the reconciler then applies again without a change)."""
        return self._settling

    @property
    def held(self) -> dict[str, int]:
        """The GPUs held as repeat offenders (UUID -> fault episodes since their last release)."""
        return escalation.held(self._history) if self._limits.limit > 0 else {}

    def apply(
        self, node: NodeView, verdict: Verdict, *, streak: int, gpu_streaks: Mapping[str, int] | None
    ) -> Verdict:
        """Record the verdict's episodes, handle a release on the node, hold the repeat offenders; the
        verdict the quarantines are planned for (the held GPUs' faults added)."""
        now = self._now(node.name)
        self._release(node, now)
        self._hold(node, now, gpus={g.uuid for g in verdict.gpus if g.uuid})
        faults = escalation.gpu_faults(verdict)
        known = set(self._history) | set(faults)
        own = gpu_streaks or {}
        streaks = {u: max(streak, own.get(u, 0)) if gpu_streaks is not None else streak for u in known}
        cleared = frozenset(k.split("/", 1)[1] for k in verdict.reset_cleared if "/" in k)
        before = self._history
        history = escalation.observe(
            before,
            faults,
            streaks=streaks,
            recover_after=self._recover_after,
            boot_id=node.boot_id,
            reset_cleared=cleared,
            now=now,
            gpus=[g.uuid for g in verdict.gpus if g.uuid],
            at_once_s=self._limits.at_once_s,
        )
        new: dict[str, int] = {}
        # Only a new episode (or the first verdict, a history read from the disk) can make a new repeat
        # offender: the count in the window only falls with time. Most reconciles change nothing here.
        changed = {u: h for u, h in history.items() if before.get(u) is not h}
        recheck = self._settling
        if changed or not self._escalated_once or recheck:
            self._log_episodes(node.name, before, history)
            if self._limits.limit > 0:
                part, new = escalation.escalate(
                    changed if self._escalated_once and not recheck else history, self._limits, now
                )
                history = {**history, **part}
            history = bounded(history, changed=changed if self._escalated_once else None)
            self._escalated_once = True
        for uuid, count in new.items():
            log.warning(
                "repeat.escalated",
                node=node.name,
                uuid=uuid,
                episodes=count,
                limit=self._limits.limit,
                window_s=self._limits.window_s,
                note="held for repair: not released by reboots or resets until `gpuguard release`",
            )
        self._history = history
        self._settling = self._limits.limit > 0 and escalation.settling(history, self._limits, now)
        if self._limits.limit <= 0:
            return verdict
        return escalation.held_faults(verdict, history, self._limits)

    def _now(self, node: str) -> float:
        """The wall clock, moved forward by as much as it was ever found behind the history (a step back)."""
        now = self._wall() + self._behind
        lag = escalation.lag(self._history, now)
        if lag:
            self._behind += lag
            log.warning(
                "repeat.clock_behind",
                node=node,
                behind_s=round(lag, 3),
                note="the wall clock is behind the GPU history's latest time (a clock stepped back): its "
                "times are taken that much later, so no episode, hold or release is reordered",
            )
        return now + lag

    def flush(self) -> None:
        """Write the history if it changed (after the reconcile's node writes). Never raises."""
        changed = self._history is not self._saved and self._history != self._saved
        if changed and not self._store.save(self._history) and self._store.path is not None:
            return  # not written (a full disk): saved again at a later flush, after the store's backoff
        self._saved = self._history

    def _release(self, node: NodeView, now: float) -> None:
        text = node.annotations.get(ANN_RELEASE)
        if text is None or text == self.handled_release:
            return
        self.handled_release = text
        try:
            request = parse(text, now=now)
        except ValueError as exc:
            log.warning("repeat.release_refused", node=node.name, error=str(exc), annotation=text[:200])
            return
        # Recorded at the node's time, the clock of the episodes it is compared with: the annotation's `at`
        # (the releasing machine's clock, or a release applied late) before an episode would count that
        # episode again at the next start and hold the GPU again.
        at = max(request.at, now)
        self._history, released = escalation.release(self._history, request.gpu, by=request.by, at=at)
        # On disk before the write that removes the annotation: an agent killed in between must not
        # forget a release the node no longer shows (the GPU would be held again).
        self.flush()
        if not released:  # a mistyped UUID, a GPU not held: the log is all the operator will see
            held = sorted(self.held)
            log.warning("repeat.release_matched_none", node=node.name, gpu=request.gpu, held=held)
            return
        log.warning(
            "repeat.released",
            node=node.name,
            gpu=request.gpu,
            by=request.by,
            released=released,
            note="the escalation lifted; a fault still present keeps its own quarantine",
        )

    def _hold(self, node: NodeView, now: float, *, gpus: set[str]) -> None:
        """An operator's hold on the node (`gpuguard hold`): the GPU held as a repeat offender is, if it is
        one of this node's (or in its history) and escalation is on; refused with a log line otherwise."""
        text = node.annotations.get(hold.ANN_HOLD)
        if text is None or text == self.handled_hold:
            return
        self.handled_hold = text
        try:
            request = hold.parse(text, now=now)
        except ValueError as exc:
            log.warning("repeat.hold_refused", node=node.name, error=str(exc), annotation=text[:200])
            return
        why = None
        if self._limits.limit <= 0:
            why = "repeat offenders are off (--repeat-limit 0): nothing is held"
        elif request.gpu not in gpus and request.gpu not in self._history:
            why = f"no GPU {request.gpu} on this node (its GPUs: {', '.join(sorted(gpus)) or 'none'})"
        if why is not None:
            log.warning("repeat.hold_refused", node=node.name, gpu=request.gpu, error=why)
            return
        self._history, placed = escalation.hold(
            self._history, request.gpu, by=request.by, at=max(request.at, now)
        )
        self.flush()  # on disk before the write that removes the annotation, as a release
        log.warning(
            "repeat.held" if placed else "repeat.hold_already_held",
            node=node.name,
            gpu=request.gpu,
            by=request.by,
            note="held for repair: not released by reboots or resets until `gpuguard release`",
        )

    def _log_episodes(
        self, node: str, before: Mapping[str, GpuHistory], after: Mapping[str, GpuHistory]
    ) -> None:
        for uuid, h in after.items():
            old = before.get(uuid, GpuHistory()).open
            new = h.open
            if old is not None and (new is None or new.first_seen != old.first_seen):
                ended = next((e for e in h.episodes if e.first_seen == old.first_seen and e.ended), None)
                how = ended.ended if ended is not None else None
                log.info("repeat.episode_ended", node=node, uuid=uuid, how=how, reasons=list(old.reasons))
            if new is not None and (old is None or new.first_seen != old.first_seen):
                log.info(
                    "repeat.episode_opened",
                    node=node,
                    uuid=uuid,
                    reasons=list(new.reasons),
                    counted=counting.counted(new.reasons, shared=new.shared),
                )
