"""How faults end without a reboot (docs/design.md, "The node's state machine", -> HEALTHY): the
recovery-action rule (which faults the driver's own NVML_FI_DEV_GET_GPU_RECOVERY_ACTION proves gone), the
reasons a healthy reading proves gone, and the rule for calls past their deadline (gpu-unresponsive,
nvml-unresponsive). Pure, like the policy that calls it."""

from __future__ import annotations

from collections.abc import Iterable

from gpuguard.core.model import (
    ECC,
    GPU_MISSING,
    GPU_UNREADABLE,
    GPU_UNRESPONSIVE,
    NVML_INIT,
    NVML_UNRESPONSIVE,
    RECOVERY_PREFIX,
    REPAIR_HELD,
    REPEAT_OFFENDER,
    RESET_REQUIRED,
    RETIRED_PAGES,
    Fault,
    GpuReading,
    GpuVerdict,
    Snapshot,
    Verdict,
    XidEvent,
)
from gpuguard.core.signaltable import SIGNALS
from gpuguard.judge.streaks import checks

# Recovery actions that end in a reset of the GPU: Xids recorded while the driver asks for one clear when
# the action reads NONE again.
_RESET_ACTIONS = frozenset({1, 4})  # GPU_RESET, DRAIN_AND_RESET
# Reasons whose evidence a healthy reading itself shows gone, without a reboot (see docs/design.md).
_CLEARED_BY_READING = frozenset(
    {ECC, NVML_INIT, RESET_REQUIRED, GPU_UNREADABLE, GPU_UNRESPONSIVE, NVML_UNRESPONSIVE, RETIRED_PAGES}
    # The hold of a repeat offender: gone from the verdict only by an operator's release, which is its proof.
    | {REPEAT_OFFENDER}
    # The repair executor's hold: gone when its record lets the GPU go, after its proof of the reset.
    | {REPAIR_HELD}
) | (frozenset(SIGNALS.names()) - {GPU_MISSING})  # the health signals judge each reading afresh


def cleared_without_reboot(key: str, reset_cleared: frozenset[str] = frozenset()) -> bool:
    """Whether a recorded fault key ("reason/uuid") is proven gone by healthy readings, no reboot needed.

    ECC, NVML init, RESET_REQUIRED, an unreadable or unresponsive GPU (or NVML) and a recovery action clear
    with the reading that shows them gone; an Xid clears so only when a GPU reset the driver asked for
    removed it (`reset_cleared`).
    """
    reason = key.split("/", 1)[0]
    return reason in _CLEARED_BY_READING or reason.startswith(RECOVERY_PREFIX) or key in reset_cleared


def recovery_action(g: GpuReading, prev: GpuVerdict | None) -> int | None:
    """The recovery action to judge: this reading's, or the last one while the field is unreadable."""
    if g.recovery_action is not None:
        return g.recovery_action
    if prev is not None and (g.transient_errors or g.unreadable):
        return prev.recovery_action
    return None


def apply_recovery_rule(
    sticky: list[Fault],
    prev: Verdict,
    *,
    new_xid_keys: list[str],
    actions: dict[str, int | None],
    now: float,
    interval: float,
) -> tuple[list[Fault], frozenset[str], tuple[tuple[str, float], ...], frozenset[str]]:
    """An Xid recorded while the driver asks for a GPU reset clears when the action reads NONE again.

    "While" includes the next poll: the driver raises the action right after the Xid, and its event wakes
    the agent a moment later. An Xid recorded while the action reads NONE stays pending (since when) up to
    and including the first check one --interval after it, the poll that would have come next: checks that
    other Xids wake meanwhile never use that chance up. Where the field is not supported (action None)
    nothing changes: the Xid needs a reboot, as before. An action that escalates to anything but a reset
    detaches the Xid for good.
    """
    uuid_of = {f.key: f.uuid for f in sticky}
    clearable, pending = set(prev.reset_clearable), {}
    cleared = set(prev.reset_cleared) - set(new_xid_keys)  # recorded again: needs its own evidence
    for key, since in prev.reset_pending:
        if actions.get(uuid_of.get(key) or "") in _RESET_ACTIONS:
            clearable.add(key)
        elif key in uuid_of and checks(since, now, interval) < 2:
            pending[key] = since  # the next poll has not come yet
    for key in new_xid_keys:
        action = actions.get(uuid_of.get(key) or "")
        if action in _RESET_ACTIONS:
            clearable.add(key)
        elif action == 0:
            pending[key] = now
    for key in list(clearable):
        action = actions.get(uuid_of.get(key) or "")
        if key not in uuid_of:
            clearable.discard(key)
        elif action == 0:
            clearable.discard(key)
            cleared.add(key)
        elif action is not None and action not in _RESET_ACTIONS:
            clearable.discard(key)
    sticky = [f for f in sticky if f.key not in cleared]
    kept = tuple((k, t) for k, t in pending.items() if k not in clearable)
    return sticky, frozenset(clearable), kept, frozenset(cleared)


def unresponsive_rule(sticky: list[Fault], snapshot: Snapshot) -> list[Fault]:
    """An NVML call past its deadline is a sticky fault: saved in --state-dir with the others, so an agent
    restarted while the driver still hangs reports it at once. It clears when the calls answer again: the
    GPU's reading answers (gpu-unresponsive), a whole pass answers (nvml-unresponsive, and a GPU NVML could
    not identify)."""
    found = []
    if snapshot.unresponsive is not None:
        found.append(Fault(NVML_UNRESPONSIVE, snapshot.unresponsive))
    for index, error in snapshot.unidentified:
        if error.endswith(":UNRESPONSIVE"):
            call = error.split(":", 1)[0]
            detail = f"{call} has not returned (GPU {index}, not identified)"
            found.append(Fault(GPU_UNRESPONSIVE, detail, gpu_index=index))
    found.extend(
        Fault(GPU_UNRESPONSIVE, g.unresponsive, uuid=g.uuid, gpu_index=g.index)
        for g in snapshot.gpus
        if g.unresponsive is not None
    )
    if not found and not any(f.reason in _UNRESPONSIVE for f in sticky):
        return sticky
    full_pass = snapshot.unresponsive is None and snapshot.init_error is None
    answered = {g.uuid for g in snapshot.gpus if g.unresponsive is None and not g.unreadable}
    keys = {f.key for f in found}

    def gone(f: Fault) -> bool:
        if f.reason not in _UNRESPONSIVE or f.key in keys or not full_pass:
            return False
        return f.uuid is None or f.uuid in answered

    kept = [f for f in sticky if not gone(f)]
    kept += [f for f in found if all(k.key != f.key for k in kept)]
    return kept


_UNRESPONSIVE = frozenset({GPU_UNRESPONSIVE, NVML_UNRESPONSIVE})


def split_xids(
    xids: Iterable[XidEvent], ignored: frozenset[int], blind: set[str]
) -> tuple[tuple[XidEvent, ...], tuple[XidEvent, ...]]:
    """Xids -> (faults, events): an ignored code is an event, but Xid 154 (the driver announcing a recovery
    action) stays a fault on a GPU whose recovery field cannot be read: it is the only word of the action."""

    def fatal_(x: XidEvent) -> bool:
        if x.sxid:  # an NVSwitch's: its own severity, not the Xid catalog's (a "Non-fatal" one is an event)
            return x.kernel is None or x.kernel.severity != "Non-fatal"
        blind_154 = x.code == XID_RECOVERY_ACTION and (x.uuid is None or x.uuid in blind)
        return x.code not in ignored or blind_154

    fatal = tuple(x for x in xids if fatal_(x))
    skipped = tuple(x for x in xids if not fatal_(x))
    return fatal, skipped


XID_RECOVERY_ACTION = 154
