"""Readings + settings -> verdict. Pure: no I/O, no clock, no NVML, no Kubernetes.

Which Xids are faults follows the immediate-action "resolution bucket" of NVIDIA's Xid catalog, shipped as
data (gpuguard.core.xids): RESTART_APP and IGNORE are events by default; every other bucket, and every code
the catalog does not list, is a fault (PolicySettings.ignored_xids carries the default and the overrides).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from gpuguard.core.config import PolicySettings
from gpuguard.core.model import (
    ECC,
    GPU_LOST,
    GPU_MISSING,
    GPU_UNREADABLE,
    GPU_UNRESPONSIVE,
    NVML_INIT,
    NVML_UNRESPONSIVE,
    RECOVERY_ACTIONS,
    REPEAT_OFFENDER,
    RESET_REQUIRED,
    RETIRED_PAGES,
    ROW_REMAP,
    Fault,
    GpuReading,
    GpuVerdict,
    Snapshot,
    Verdict,
    plural,
    recovery_reason,
)
from gpuguard.judge.recovery import (
    apply_recovery_rule,
    cleared_without_reboot,
    recovery_action,
    split_xids,
    unresponsive_rule,
)
from gpuguard.judge.signals import judge
from gpuguard.judge.streaks import checks
from gpuguard.judge.unanswered import failing_since, how_long
from gpuguard.judge.xidfaults import xid_fault

__all__ = ["cleared_without_reboot", "evaluate", "primary", "severity"]


def evaluate(snapshot: Snapshot, *, previous: Verdict | None, settings: PolicySettings) -> Verdict:
    """Judge one snapshot. `previous` carries the device inventory and the sticky faults."""
    prev = previous or Verdict()
    sticky = unresponsive_rule(list(prev.sticky), snapshot)

    if snapshot.init_error is not None:
        node_faults: tuple[Fault, ...] = ()
        if not settings.allow_no_gpu or snapshot.init_error not in _NO_GPU_HERE:
            node_faults = (Fault(NVML_INIT, f"NVML initialization failed: {snapshot.init_error}"),)
        # Xids still come from the kernel log while NVML is down: judged alike, sticky.
        fatal_down, _ = split_xids(snapshot.xids, settings.ignored_xids, set())
        for x in fatal_down:
            _add_sticky(sticky, xid_fault(x))
        # The node's sticky faults (an unattributed Xid, a hung call) stay reported while NVML is down.
        known_now = {u for _, u, _ in prev.known}
        node_faults += tuple(f for f in sticky if f.uuid not in known_now)
        gpus = tuple(
            GpuVerdict(index=i, uuid=u, name=n, present=False, faults=_sticky_for(sticky, u))
            for i, u, n in prev.known
        )
        return replace(
            prev,
            gpus=gpus,
            node_faults=node_faults,
            ignored_xids=(),
            fatal_xids=(),
            sticky=tuple(sticky),
        )

    known = list(prev.known)
    known_uuids = {u for _, u, _ in known}
    for g in snapshot.gpus:
        if g.uuid not in known_uuids:
            known.append((g.index, g.uuid, g.name))
            known_uuids.add(g.uuid)
    seen = len(snapshot.gpus) + len(snapshot.unidentified)
    expected = prev.expected_gpus
    if expected is None:
        expected = settings.expected_gpus if settings.expected_gpus is not None else seen
        if snapshot.stuck_calls:
            expected = settings.expected_gpus  # a pass with a call in flight: not a count to keep

    # Xid 154 is the driver announcing a recovery action, judged as the recovery-* fault it reads; on a GPU
    # whose recovery field cannot be read it is the only word of it, so a fault.
    blind = {g.uuid for g in snapshot.gpus if g.recovery_action is None}
    fatal, ignored = split_xids(snapshot.xids, settings.ignored_xids, blind)
    by_uuid = {g.uuid: g for g in snapshot.gpus}
    prev_by_uuid = {g.uuid: g for g in prev.gpus}
    actions = {g.uuid: recovery_action(g, prev_by_uuid.get(g.uuid)) for g in snapshot.gpus}

    new_xid_keys: list[str] = []
    for x in fatal:
        f = xid_fault(x)
        if all(s.key != f.key for s in sticky):
            new_xid_keys.append(f.key)
        _add_sticky(sticky, f)
    for g in snapshot.gpus:
        for f in _sticky_reading_faults(g):
            _add_sticky(sticky, f)
    for index, uuid, _ in known:
        if uuid not in by_uuid:
            _add_sticky(
                sticky,
                Fault(
                    GPU_MISSING,
                    f"GPU is no longer visible to NVML (GPU {index}, {uuid})",
                    uuid=uuid,
                    gpu_index=index,
                ),
            )
    sticky, clearable, pending, cleared = apply_recovery_rule(
        sticky,
        prev,
        new_xid_keys=new_xid_keys,
        actions=actions,
        now=snapshot.taken_at,
        interval=settings.interval,
    )

    signals = judge(snapshot, previous=prev, table=settings.signals, interval=settings.interval)
    now, interval = snapshot.taken_at, settings.interval
    unreadable = failing_since(
        (g.uuid for g in snapshot.gpus if g.unreadable), dict(prev.unreadable_since), now
    )

    verdicts: list[GpuVerdict] = []
    for index, uuid, name in known:
        reading = by_uuid.get(uuid)
        if reading is None:
            verdicts.append(
                GpuVerdict(
                    index=index,
                    uuid=uuid,
                    name=name,
                    present=False,
                    faults=_sticky_for(sticky, uuid),
                    xid_watched=False,
                    xid_watch_note="gpu not visible",
                )
            )
            continue
        faults = list(_sticky_for(sticky, uuid))
        ecc = _ecc_fault(reading, settings.ecc_threshold, prev_by_uuid.get(uuid))
        if ecc is not None:
            faults.append(ecc)
        faults.extend(_reading_faults(reading, actions[uuid], unreadable.get(uuid), settings, now))
        faults.extend(signals.gpu_faults.get(uuid, ()))
        verdicts.append(
            GpuVerdict(
                index=reading.index,
                uuid=uuid,
                name=reading.name or name,
                faults=_ordered(faults),
                ecc_uncorrected=reading.ecc_uncorrected,
                xid_watched=reading.xid_watched,
                xid_watch_note=reading.xid_watch_note,
                recovery_action=actions[uuid],
                remap_pending=reading.remap_pending,
                retired_pages=reading.retired_pages,
                degraded=signals.gpu_degraded.get(uuid, ()),
                pcie_link=_pcie_link(reading),
            )
        )

    # Sticky faults not tied to an enumerated GPU (an Xid NVML could not attribute) belong to the node.
    node_faults = tuple(f for f in sticky if f.uuid not in known_uuids) + signals.node_faults
    unidentified = failing_since((i for i, _ in snapshot.unidentified), dict(prev.unidentified_since), now)
    for index, error in snapshot.unidentified:
        if error.endswith(":UNRESPONSIVE"):
            continue  # gpu-unresponsive (recovery.unresponsive_rule), not also unreadable
        at_once = {":GPU_IS_LOST": GPU_LOST, ":RESET_REQUIRED": RESET_REQUIRED}
        reason = next((r for suffix, r in at_once.items() if error.endswith(suffix)), None)
        if reason is not None:
            # NVML's own verdict, before we ever learnt the GPU's UUID: a fault at once, on the node. A lost
            # GPU stays lost until a reboot (sticky), even if it answers later: taint and report agree.
            f = Fault(reason, f"NVML counts GPU {index} but cannot identify it ({error})", gpu_index=index)
            node_faults += (f,) if all(n.key != f.key for n in node_faults) else ()
            if reason == GPU_LOST:
                _add_sticky(sticky, f)
        elif checks(unidentified[index], now, interval) >= settings.unreadable_after and all(
            f.reason != GPU_UNREADABLE for f in node_faults
        ):
            lasted = how_long(unidentified[index], now, interval)
            detail = f"NVML counts GPU {index} but cannot identify it {lasted} ({error})"
            node_faults += (Fault(GPU_UNREADABLE, detail, gpu_index=index),)
    node_since = None
    if snapshot.node_error:
        node_since = now if prev.node_error_since is None else prev.node_error_since
        if checks(node_since, now, interval) >= settings.unreadable_after:
            call, _, error = snapshot.node_error.partition(":")
            lasted = how_long(node_since, now, interval)
            node_faults += (Fault(NVML_INIT, f"{call} failed {lasted} ({error})"),)
    missing_known = sum(1 for _, u, _ in known if u not in by_uuid)
    shortfall = (expected or 0) - seen - missing_known
    if shortfall > 0:
        node_faults += (
            Fault(
                GPU_MISSING,
                f"expected {plural(expected or 0, 'GPU')}, NVML reports {seen}",
            ),
        )
    if (
        not known
        and not snapshot.unidentified
        and not snapshot.stuck_calls
        and snapshot.unresponsive is None
        and snapshot.node_error is None
        and not settings.allow_no_gpu
        and all(f.reason != GPU_MISSING for f in node_faults)
    ):
        # A GPU node that shows no GPU is a fault, in watch as in check (the gate is not lifted for it).
        none = "NVML reports no GPUs (pass --allow-no-gpu where that is expected)"
        node_faults += (Fault(GPU_MISSING, none),)
    return Verdict(
        gpus=tuple(verdicts),
        node_faults=node_faults,
        ignored_xids=ignored,
        fatal_xids=fatal,
        known=tuple(known),
        expected_gpus=expected,
        sticky=tuple(sticky),
        reset_clearable=clearable,
        reset_pending=pending,
        reset_cleared=cleared,
        unreadable_since=tuple(unreadable.items()),
        unidentified_since=tuple(unidentified.items()),
        node_error_since=node_since,
        node_degraded=signals.node_degraded,
        signal_memory=signals.memory,
    )


# The init errors --allow-no-gpu reads as "no GPU here" (no library, no driver); a driver that is there and
# broken (RM version mismatch, GPU_IS_LOST, ...) is a fault even then.
_NO_GPU_HERE = frozenset({"LIBRARY_NOT_FOUND", "DRIVER_NOT_LOADED"})


def _reading_faults(
    g: GpuReading, action: int | None, unreadable_since: float | None, settings: PolicySettings, now: float
) -> list[Fault]:
    """Faults that follow the reading (not sticky): a recovery action, RESET_REQUIRED, an unreadable GPU."""
    where = f"(GPU {g.index}, {g.uuid})"
    faults = []
    if action:
        name = RECOVERY_ACTIONS.get(action, f"action {action}").upper().replace("-", "_")
        faults.append(
            Fault(
                recovery_reason(action),
                f"the driver asks for {name} (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION={action}) {where}",
                uuid=g.uuid,
                gpu_index=g.index,
            )
        )
    if not g.lost and any(e.endswith(":RESET_REQUIRED") for e in g.transient_errors):
        faults.append(
            Fault(
                RESET_REQUIRED, f"NVML answers RESET_REQUIRED: the GPU must be reset {where}", g.uuid, g.index
            )
        )
    elif (
        not g.lost
        and unreadable_since is not None
        and checks(unreadable_since, now, settings.interval) >= settings.unreadable_after
    ):
        errors = ", ".join(sorted(set(g.transient_errors))) or "no answer"
        lasted = how_long(unreadable_since, now, settings.interval)
        faults.append(
            Fault(
                GPU_UNREADABLE,
                f"every NVML query failed {lasted} ({errors}) {where}",
                uuid=g.uuid,
                gpu_index=g.index,
            )
        )
    return faults


def _pcie_link(g: GpuReading) -> tuple[int, int] | None:
    gen, width = g.signals.pcie_gen, g.signals.pcie_width
    return (gen, width) if gen is not None and width is not None else None


# Lower sorts first: the primary reason (the taint value) is the most severe fault.
_SEVERITY = {
    # First: a held repeat offender's taint says why it stays (quarantine.escalation).
    REPEAT_OFFENDER: -1,
    NVML_INIT: 0,
    NVML_UNRESPONSIVE: 0,
    GPU_UNRESPONSIVE: 1,
    GPU_LOST: 1,
    GPU_MISSING: 2,
    GPU_UNREADABLE: 2,
    RESET_REQUIRED: 2,
    ECC: 4,
    ROW_REMAP: 5,
    RETIRED_PAGES: 5,
}
_XID_SEVERITY = 3


def severity(fault: Fault) -> int:
    return _SEVERITY.get(fault.reason, _XID_SEVERITY)


def primary(faults: Iterable[Fault]) -> Fault | None:
    """The fault whose reason becomes the taint value: the most severe, then the lowest GPU index."""
    ordered = _ordered(faults)
    return ordered[0] if ordered else None


def _ordered(faults: Iterable[Fault]) -> tuple[Fault, ...]:
    return tuple(
        sorted(
            faults,
            key=lambda f: (severity(f), -1 if f.gpu_index is None else f.gpu_index, f.reason),
        )
    )


def _sticky_reading_faults(g: GpuReading) -> list[Fault]:
    """Faults read from the GPU that only a reboot clears: they stay after the reading changes."""
    faults = []
    if g.lost:
        faults.append(
            Fault(
                GPU_LOST,
                f"GPU is lost, NVML_ERROR_GPU_IS_LOST (GPU {g.index}, {g.uuid})",
                uuid=g.uuid,
                gpu_index=g.index,
            )
        )
    if g.remap_failure:
        faults.append(
            Fault(
                ROW_REMAP,
                f"row remapping failed (GPU {g.index}, {g.uuid})",
                uuid=g.uuid,
                gpu_index=g.index,
            )
        )
    return faults


def _ecc_fault(g: GpuReading, threshold: int, prev: GpuVerdict | None) -> Fault | None:
    if not g.ecc_supported or g.lost:
        return None
    if g.ecc_uncorrected is None:
        # Unreadable this pass (transient NVML error): keep the last judgement rather than flap to healthy.
        if prev is not None:
            return next((f for f in prev.faults if f.reason == ECC), None)
        return None
    if g.ecc_uncorrected > threshold:
        return Fault(
            ECC,
            plural(g.ecc_uncorrected, "uncorrected volatile ECC error")
            + (f" (threshold {threshold})" if threshold else "")
            + f" (GPU {g.index}, {g.uuid})",
            uuid=g.uuid,
            gpu_index=g.index,
        )
    return None


def _add_sticky(sticky: list[Fault], fault: Fault) -> None:
    if all(f.key != fault.key for f in sticky):
        sticky.append(fault)


def _sticky_for(sticky: Iterable[Fault], uuid: str) -> tuple[Fault, ...]:
    return _ordered(f for f in sticky if f.uuid == uuid)
