"""The log lines about one DeviceTaintRule: each names the node, the rule, its device and its GPU's UUID
(bound once, as STYLE.md asks of the node and the GPU), then what happened to it."""

from __future__ import annotations

from typing import cast

import structlog
from structlog.typing import FilteringBoundLogger

from gpuguard.quarantine.gpu.rules import DeviceRule
from gpuguard.quarantine.gpu.slices import SliceDevice

log = structlog.get_logger(__name__)


def rule_log(node: str, rule: DeviceRule, dev: SliceDevice | None = None) -> FilteringBoundLogger:
    """A logger bound to `rule` of `node`: the device and UUID of `dev` (the GPU as its slice publishes it)
    where the line is about a rule just made for it, else as the rule records them. Bound at each line, so
    the configuration of the moment applies (tests capture the lines of objects made before)."""
    device, uuid = (dev.device, dev.uuid) if dev is not None else (rule.device, rule.uuid)
    return cast(FilteringBoundLogger, log.bind(node=node, rule=rule.name, device=device, uuid=uuid))
