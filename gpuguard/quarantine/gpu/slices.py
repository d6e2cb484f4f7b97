"""The node's GPUs as NVIDIA's DRA driver publishes them: the devices of the node's ResourceSlices of the
driver (pool = the node's name), by the GPU's UUID, which is how a fault finds the device its rule selects."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class SliceDevice:
    """One device of a ResourceSlice, as the rule selects it."""

    driver: str
    pool: str
    device: str
    uuid: str


def slice_devices(items: Iterable[Mapping[str, Any]], *, driver: str, node: str) -> dict[str, SliceDevice]:
    """The node's published devices by GPU UUID: the slices of `driver` whose pool is the node's name (as
    NVIDIA's DRA driver publishes them), each device's `uuid` attribute (or `<driver>/uuid`). A device
    without a UUID, or two with the same one, is left out: a rule must name exactly the faulty GPU."""
    found: dict[str, SliceDevice] = {}
    twice: set[str] = set()
    for item in items:
        spec = item.get("spec") or {}
        pool = str((spec.get("pool") or {}).get("name") or "")
        if spec.get("driver") != driver or pool != node:
            continue
        for dev in spec.get("devices") or []:
            attrs = dev.get("attributes") or {}
            attr = attrs.get("uuid") or attrs.get(f"{driver}/uuid") or {}
            uuid = attr.get("string") if isinstance(attr, Mapping) else None
            name = dev.get("name")
            if not isinstance(uuid, str) or not uuid or not isinstance(name, str):
                continue
            if uuid in found:
                twice.add(uuid)
            found[uuid] = SliceDevice(driver=driver, pool=pool, device=name, uuid=uuid)
    for uuid in twice:
        log.warning("device.uuid_ambiguous", node=node, uuid=uuid, note="published twice: node taint")
        del found[uuid]
    return found
