"""The inventory: which GPU (by UUID) each NVML index names now, read once per enumeration.

A GPU is known by the UUID read at its index in the same pass, never by the index it had: when a GPU falls
off the bus and the driver stops counting it, every later index names another GPU. A GPU kept without a UUID
read this pass (its handle or UUID query failed, or a call on its index hangs) keeps its place only while the
count is the same; once the count changed, any index not identified may name any GPU not yet placed, so
every such GPU stays listed with no reading of its own (never another GPU's values, never missing) until a
pass identifies every index.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import pynvml
import structlog

from gpuguard.nvml.real.common import Device, error_name, handle_key, is_lost, text
from gpuguard.nvml.real.deadline import Hang, Pass
from gpuguard.nvml.real.readings import describe

log = structlog.get_logger(__name__)

# The reading of a GPU not placed after the count changed: a transient error, so neither a fault nor a clear.
UNPLACED = "inventory:NOT_IDENTIFIED_SINCE_THE_COUNT_CHANGED"


def enumerate_gpus(
    count: int,
    p: Pass,
    *,
    known: Sequence[Device],
    changed: bool,
    hung: Callable[[int], Hang | None],
) -> tuple[list[Device], list[tuple[int, str]], bool]:
    """(the GPUs at indices 0..count-1, the indices not identified with why, whether every GPU is placed).
    `known`: the last inventory; `changed`: the count differs from the one `known` was read at."""
    by_index = {d.index: d for d in known if not d.enumeration_error} if not changed else {}
    by_uuid = {d.uuid: d for d in known}
    devices: list[Device] = []
    carried: list[Device] = []  # known GPUs kept at their index without a UUID read this pass
    unidentified: list[tuple[int, str]] = []
    for i in range(count):
        before = by_index.get(i)
        hang = hung(i)
        if hang is not None:
            # A call on this index has not returned: not asked again until it does. A GPU known there
            # stays (never gpu-missing for a hang); one never identified is reported as unresponsive.
            if before is not None:
                carried.append(before)
            else:
                unidentified.append((i, f"{hang.call}:UNRESPONSIVE"))
            continue
        try:
            p.at("nvmlDeviceGetHandleByIndex", index=i)
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        except pynvml.NVMLError as exc:
            # The real driver answers GPU_IS_LOST here for a GPU that fell off the bus: a GPU we knew
            # stays (lost is a fault, not an absence); one we never identified is reported as such.
            if before is not None and is_lost(exc):
                carried.append(replace(before, lost_at_enumeration=True, registered=0, watch_note="gpu lost"))
            elif before is not None:
                # One failed handle query on a GPU we know is not an absence: read again next pass.
                carried.append(replace(before, enumeration_error=f"handle:{error_name(exc)}"))
            else:
                log.warning("nvml.handle_failed", gpu=i, error=error_name(exc))
                unidentified.append((i, f"handle:{error_name(exc)}"))
            continue
        try:
            p.at("nvmlDeviceGetUUID", index=i)
            uuid = text(pynvml.nvmlDeviceGetUUID(handle))
        except pynvml.NVMLError as exc:
            if before is not None and handle_key(before.handle) == handle_key(handle):
                # The same device as before (same handle): keep its identity, read it again next pass.
                lost = is_lost(exc)
                carried.append(
                    replace(before, lost_at_enumeration=lost, enumeration_error=f"uuid:{error_name(exc)}")
                )
            else:
                log.warning("nvml.uuid_failed", gpu=i, error=error_name(exc))
                unidentified.append((i, f"uuid:{error_name(exc)}"))
            continue
        same = by_uuid.get(uuid)
        if same is not None and handle_key(same.handle) == handle_key(handle):
            devices.append(replace(same, index=i, lost_at_enumeration=False, enumeration_error=None))
        else:
            devices.append(describe(i, handle, uuid, p))
    placed = {d.uuid for d in devices}
    carried = [d for d in carried if d.uuid not in placed]  # read at another index this pass
    settled = not changed or not (carried or unidentified)
    if not settled:
        # Which GPU an unidentified index names is unknown: every known GPU not placed stays, unread.
        kept = {d.uuid for d in carried}
        carried += [d for d in known if d.uuid not in placed and d.uuid not in kept]
        carried = [replace(d, lost_at_enumeration=False, enumeration_error=UNPLACED) for d in carried]
        if carried:
            unidentified = []  # reported on the GPUs kept unread instead, each by its own UUID
    return sorted(devices + carried, key=lambda d: d.index), unidentified, settled
