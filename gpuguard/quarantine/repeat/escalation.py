"""Escalation, pure: each GPU's fault episodes from the verdicts (`observe`), which GPUs are repeat offenders
(`repeat_offenders`, `escalate`), an operator's release (`release`) and the fault that holds a repeat
offender's quarantine (`held_faults`). The history itself is `gpuguard.store.history`'s;
`repeat.RepeatOffenders` keeps it across reconciles.

An episode is one quarantine of a GPU, however often a flapping counter blinked within it: it opens with
the GPU's first fault and ends when the GPU has read healthy for --recover-after checks (how: a reboot, a GPU
reset the driver asked for, a counter that went back), or when the node reboots (a fault in a new boot is a
new episode, as the fault record says). A repeat offender is a GPU with at least `limit` episodes whose
first-seen times fall within `window` seconds (and after its last release). It is held for repair: its
quarantine carries the fault `repeat-offender` until an operator releases it, across reboots and resets,
whatever the window says later. `limit` 0 turns escalation off. Defaults (3 in 7 days): GPUd asks for
inspection once an Xid comes back after 2 reboots (its --xid-reboot-threshold, default 2); NVSentinel
escalates after 5 fatal Xids in 24 h or 5 remediations in 7 days. A GPU that faults once per week never
reaches 3 within 7 days. Only episodes with a reason that is the GPU's own count (`counting`): one whose
reasons are all the node's (the fabric that Fabric Manager sets up, NVML itself) is recorded and not counted.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from gpuguard.core.model import REPEAT_OFFENDER, Fault, Verdict
from gpuguard.quarantine.repeat.counting import counted as counts_toward
from gpuguard.quarantine.repeat.counting import kept
from gpuguard.store.history import Episode, GpuHistory, History, Release

DEFAULT_LIMIT = 3
DEFAULT_WINDOW_S = 604800.0
# "At once": every GPU of the node began showing a reason within this many seconds. A node-wide cause reaches
# the GPUs within a pass or two (a failure lasts 3 checks at --interval before it is a fault, each GPU from
# the pass that first read it), and independent faults of every GPU within 30 s are not the GPUs' own. The
# agent takes AT_ONCE_CHECKS passes at its --interval (12 s at the default 3 s): the time a node-wide cause
# takes to reach every GPU scales with how often they are read.
AT_ONCE_S = 30.0
AT_ONCE_CHECKS = 4
# How far after the history's latest time a clock stepped back behind it puts "now" (seconds).
_AFTER = 0.001
# A release's "*": every held GPU of the node.
ALL = "*"


@dataclass(frozen=True)
class Limits:
    """`limit` episodes within `window_s` seconds make a repeat offender; `limit` 0: escalation off. An
    episode counts once `at_once_s` have passed since it opened: until then every GPU may yet show its
    reason at once, which makes it the node's."""

    limit: int = DEFAULT_LIMIT
    window_s: float = DEFAULT_WINDOW_S
    at_once_s: float = AT_ONCE_S


def repeat_offenders(episodes: Mapping[str, Iterable[float]], limits: Limits, now: float) -> dict[str, int]:
    """The repeat offenders: GPU UUID -> its episodes within the window, for those at or over the limit.

    `episodes` maps each GPU UUID to the first-seen times of its fault episodes (seconds)."""
    if limits.limit <= 0:
        return {}
    start = now - limits.window_s
    found: dict[str, int] = {}
    for uuid, times in episodes.items():
        count = sum(1 for t in times if start <= t <= now)
        if count >= limits.limit:
            found[uuid] = count
    return found


def gpu_faults(verdict: Verdict) -> dict[str, tuple[str, ...]]:
    """Each GPU's fault reasons (UUID -> sorted reasons), node faults that name a GPU included; the held
    fault itself (`repeat-offender`) never counts as an episode."""
    out: dict[str, set[str]] = {}
    for f in verdict.faults:
        if f.uuid and f.reason != REPEAT_OFFENDER:
            out.setdefault(f.uuid, set()).add(f.reason)
    return {uuid: tuple(sorted(reasons)) for uuid, reasons in out.items()}


def observe(
    history: History,
    faults: Mapping[str, tuple[str, ...]],
    *,
    streaks: Mapping[str, int],
    recover_after: int,
    boot_id: str,
    reset_cleared: frozenset[str],
    now: float,
    gpus: Collection[str] = (),
    at_once_s: float = AT_ONCE_S,
) -> dict[str, GpuHistory]:
    """The history after one verdict: `faults` (UUID -> reasons, `gpu_faults`) open episodes, or add reasons
    to the open one; a GPU healthy for `recover_after` checks (`streaks`, by UUID) ends its open episode, as a
    reboot (another boot than the episode's), a reset (`reset_cleared`: UUIDs a driver-asked reset cleared)
    or a counter reset. A fault in another boot than its open episode's ends that one (a reboot) and opens a
    new one. After an operator's release in this boot, the faults it was released with open nothing. A reason
    that every GPU of the node (`gpus`, two or more) shows now, each since at most `at_once_s` ago, is
    recorded as the node's on each open episode (`shared`): it never counts."""
    out = dict(history)
    for uuid, reasons in faults.items():
        h = out.get(uuid, GpuHistory())
        opened = h.open
        if opened is not None and _same_boot(opened.boot_id, boot_id):
            if not set(reasons) <= set(opened.reasons):
                merged = kept((*opened.reasons, *reasons))
                out[uuid] = _with_last(h, replace(opened, reasons=merged))
            continue
        if opened is not None:
            h = _with_last(h, replace(opened, ended="reboot", ended_at=now))
        last = h.episodes[-1] if h.episodes else None
        if (
            last is not None
            and last.ended == "operator"
            and _same_boot(last.boot_id, boot_id)
            and set(reasons) <= set(last.reasons)
        ):
            continue  # released with these very faults in this boot: not a new episode
        episode = Episode(reasons=kept(reasons), first_seen=now, boot_id=boot_id)
        out[uuid] = replace(h, episodes=(*h.episodes, episode))
    for uuid, h in history.items():
        opened = h.open
        if opened is None or uuid in faults or streaks.get(uuid, 0) < recover_after:
            continue
        how = "reset" if uuid in reset_cleared else "counter-reset"
        if not _same_boot(opened.boot_id, boot_id):
            how = "reboot"
        out[uuid] = _with_last(h, replace(opened, ended=how, ended_at=now))
    return _node_wide(history, out, faults, gpus, now=now, at_once_s=at_once_s)


def _node_wide(
    before: History,
    after: dict[str, GpuHistory],
    faults: Mapping[str, tuple[str, ...]],
    gpus: Collection[str],
    *,
    now: float,
    at_once_s: float,
) -> dict[str, GpuHistory]:
    """`after` with each reason every GPU shows at once recorded as `shared` on their open episodes."""
    if len(gpus) < 2 or any(u not in faults for u in gpus):
        return after
    common = set.intersection(*(set(faults[u]) for u in gpus))

    def recent(uuid: str, reason: str) -> bool:
        e = after[uuid].open
        if e is None or reason not in e.reasons:
            return False
        was = before.get(uuid, GpuHistory()).open
        gained_now = was is None or was.first_seen != e.first_seen or reason not in was.reasons
        return gained_now or now - e.first_seen <= at_once_s

    for reason in sorted(common):
        if not all(recent(u, reason) for u in gpus):
            continue
        for uuid in gpus:
            e = after[uuid].open
            if e is not None and reason not in e.shared:
                after[uuid] = _with_last(after[uuid], replace(e, shared=(*e.shared, reason)))
    return after


def lag(history: History, now: float) -> float:
    """How far the wall clock `now` is behind the latest time the history holds (0: not behind), plus a
    millisecond so that what comes now is ordered after it. The history outlives the process and the boot,
    and the wall clock may be stepped back between (NTP, a host clock set at boot): an episode stamped "in
    the future" would fall out of the window, and a new one could land before a release it comes after. The
    caller adds the lag to the wall clock from then on, so the history's times only move forward and
    durations still pass: a step back changes no hold and no release; a step forward ages the episodes by
    the step (an hour in a 7-day window)."""
    latest = max((t for h in history.values() for t in _times(h)), default=now)
    return 0.0 if now >= latest else latest - now + _AFTER


def _times(h: GpuHistory) -> Iterable[float]:
    for e in h.episodes:
        yield e.first_seen
        if e.ended_at is not None:
            yield e.ended_at
    for r in h.releases:
        yield r.at
    if h.escalated is not None:
        yield h.escalated


def escalate(history: History, limits: Limits, now: float) -> tuple[dict[str, GpuHistory], dict[str, int]]:
    """The history with the new repeat offenders held (`escalated` set), and those new ones (UUID -> their
    episodes in the window). Only episodes after a GPU's last release count: a release starts it afresh; and
    only those with a reason of the GPU's own (`counting`)."""
    settled = now - limits.at_once_s
    counted = {
        uuid: [e.first_seen for e in _counted(h) if e.first_seen <= settled]
        for uuid, h in history.items()
        if h.escalated is None
    }
    new = repeat_offenders(counted, limits, now)
    out = dict(history)
    for uuid in new:
        out[uuid] = replace(out[uuid], escalated=now)
    return out, new


def release(history: History, gpu: str, *, by: str, at: float) -> tuple[dict[str, GpuHistory], list[str]]:
    """The history after an operator's release of `gpu` (a UUID, or ALL): each held GPU it names is no longer
    held, the release recorded (who, when), an open episode ended by the operator. The UUIDs released."""
    out = dict(history)
    released = []
    for uuid, h in history.items():
        if h.escalated is None or gpu not in (ALL, uuid):
            continue
        opened = h.open
        ended = _with_last(h, replace(opened, ended="operator", ended_at=at)) if opened is not None else h
        out[uuid] = replace(
            ended, escalated=None, held_by=None, releases=(*h.releases, Release(by=by, at=at))
        )
        released.append(uuid)
    return out, sorted(released)


def hold(history: History, gpu: str, *, by: str, at: float) -> tuple[dict[str, GpuHistory], bool]:
    """The history after an operator's hold of `gpu` (`gpuguard hold`): held from `at` as a repeat offender
    is, recorded as placed by `by`, until a release. False (unchanged) where it is held already."""
    h = history.get(gpu, GpuHistory())
    if h.escalated is not None:
        return dict(history), False
    return {**history, gpu: replace(h, escalated=at, held_by=by)}, True


def held(history: History) -> dict[str, int]:
    """The GPUs held as repeat offenders, each with its episodes since its last release (a held GPU stays
    held whatever the window says now)."""
    return {uuid: len(_counted(h)) for uuid, h in sorted(history.items()) if h.escalated is not None}


def summary(h: GpuHistory, limits: Limits) -> str:
    """What the held fault says: the episodes counted, their reasons and how each ended, and what ends it."""
    counted = _counted(h)
    if h.held_by is not None and h.escalated is not None:
        return (
            f"held by {h.held_by} since {_date(h.escalated)} (`gpuguard hold`), {len(counted)} fault "
            "episodes since its last release; held for repair until `gpuguard release`"
        )
    days = limits.window_s / 86400
    parts = [f"{'+'.join(e.reasons)} {_date(e.first_seen)} ({e.ended or 'open'})" for e in counted[-4:]]
    more = f"{len(counted) - 4} earlier, " if len(counted) > 4 else ""
    return (
        f"{len(counted)} fault episodes (limit {limits.limit} in {days:g} days): {more}{', '.join(parts)}; "
        "held for repair until `gpuguard release`"
    )


def held_faults(verdict: Verdict, history: History, limits: Limits) -> Verdict:
    """The verdict with a `repeat-offender` fault on each held GPU: its quarantine (node taint or the GPU's
    DeviceTaintRule) stays while it is held, whatever the GPU reads. A held GPU the verdict does not list
    (not seen in this boot) is held as a node fault naming it."""
    held_uuids = {uuid for uuid, h in history.items() if h.escalated is not None}
    if not held_uuids:
        return verdict
    gpus = [
        replace(g, faults=(*g.faults, _fault(g.uuid, history[g.uuid], limits, g.index)))
        if g.uuid in held_uuids
        else g
        for g in verdict.gpus
    ]
    seen = {g.uuid for g in verdict.gpus}
    extra = tuple(_fault(u, history[u], limits, None) for u in sorted(held_uuids - seen))
    return replace(verdict, gpus=tuple(gpus), node_faults=verdict.node_faults + extra)


def _fault(uuid: str, h: GpuHistory, limits: Limits, index: int | None) -> Fault:
    where = f"GPU {index}, {uuid}" if index is not None else uuid
    return Fault(REPEAT_OFFENDER, f"{summary(h, limits)} ({where})", uuid=uuid, gpu_index=index)


def _counted(h: GpuHistory) -> list[Episode]:
    """The episodes that count: after the GPU's last release, with a reason of the GPU's own."""
    return [
        e for e in h.episodes if e.first_seen > h.last_release and counts_toward(e.reasons, shared=e.shared)
    ]


def settling(history: History, limits: Limits, now: float) -> bool:
    """Whether an episode is still within `at_once_s` of opening (escalate counts it only after)."""
    return any(
        h.escalated is None and h.episodes and now - h.episodes[-1].first_seen <= limits.at_once_s
        for h in history.values()
    )


def _with_last(h: GpuHistory, episode: Episode) -> GpuHistory:
    return replace(h, episodes=(*h.episodes[:-1], episode))


def _same_boot(a: str, b: str) -> bool:
    """Unknown boots prove nothing: the same boot unless both are known and differ (as the fault record)."""
    return not a or not b or a == b


def _date(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%MZ")
