"""One event set's events read into XidEvents: each attributed by the device's UUID (as NVIDIA's device
plugin does), its handle as fallback; and the events a set still holds, drained before it is freed.

NVML delivers an event only to the sets registered before it, so a set given up (its thread hung in a call,
the path rebuilt on a new set) may hold events no other set has: they are drained, not dropped."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pynvml
import structlog

from gpuguard.core.model import XidEvent
from gpuguard.nvml.real.common import EVENT_XID, NO_INSTANCE, Device, error_name, handle_key, text

log = structlog.get_logger(__name__)

Attribute = Callable[[str | None, Any], Device | None]
"""The GPU an event names, by its UUID (None: not readable) or else its handle; None when not known."""


def xid_of(data: Any, *, hung: set[int], attribute: Attribute) -> XidEvent:
    """The Xid an event carries. `hung`: handles of GPUs whose calls hang: no UUID read on those."""
    uuid: str | None = None
    if handle_key(data.device) not in hung:
        try:
            uuid = text(pynvml.nvmlDeviceGetUUID(data.device))
        except pynvml.NVMLError as exc:
            log.debug("nvml.xid_uuid_failed", error=error_name(exc))
    gi = getattr(data, "gpuInstanceId", NO_INSTANCE)
    ci = getattr(data, "computeInstanceId", NO_INSTANCE)
    d = attribute(uuid, data.device)
    x = XidEvent(
        gpu_index=d.index if d else None,
        uuid=d.uuid if d else uuid,
        code=int(data.eventData),
        gpu_instance=None if gi == NO_INSTANCE else int(gi),
        compute_instance=None if ci == NO_INSTANCE else int(ci),
        at=time.monotonic(),  # when it arrived: how the kernel log's report of it is matched
    )
    if d is None:
        log.warning("nvml.xid_unattributed", xid=x.code, uuid=uuid)
    return x


def drain(event_set: Any, on_xid: Callable[[Any], None], *, most: int = 4096) -> int:
    """Read every event the set holds without waiting (at most `most`: a bound, not a path); the Xids go to
    `on_xid`. How many events were read; stops at the first error (TIMEOUT: empty; a set NVML refuses)."""
    read = 0
    while read < most:
        try:
            data = pynvml.nvmlEventSetWait_v2(event_set, 0)
        except pynvml.NVMLError:
            break
        read += 1
        if int(data.eventType) & EVENT_XID:
            on_xid(data)
    return read
