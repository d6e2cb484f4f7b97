"""The fault record both quarantines carry: the node taint in its Node's annotations, a GPU's DeviceTaintRule
in its own. The keys they share (which faults, why, since when, in which boot) and one set of rules for both
(`FaultRecord`): a new fault is merged into the record; a record from an earlier boot suppresses nothing (the
reboot cleared its evidence); a quarantine ends only when every recorded fault's evidence is gone. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from gpuguard.core import validation
from gpuguard.core.model import Fault
from gpuguard.judge.policy import cleared_without_reboot, primary

DOMAIN = "gpuguard.io"
TAINT_KEY = f"{DOMAIN}/gpu-unhealthy"
# gpuguard's node taints carry no value, as Kubernetes' own node condition taints (node.kubernetes.io/
# not-ready): a toleration matches the key with `operator: Exists` (or Equal to ""), whatever the fault. Why
# it is there is in the record (ANN_REASON, ANN_FAULTS) and the conditions. A valued taint of ours (earlier
# versions wrote the fault's reason there) is known by its key and record and loses its value in one patch.
# The second level's taint (degraded GPUs): a PreferNoSchedule node taint, or an effect-None DeviceTaintRule.
DEGRADED_TAINT_KEY = f"{DOMAIN}/gpu-degraded"
ANN_REASON = f"{DOMAIN}/reason"
ANN_SINCE = f"{DOMAIN}/since"
ANN_BOOT_ID = f"{DOMAIN}/boot-id"
ANN_FAULTS = f"{DOMAIN}/faults"
ANN_DEFERRED = f"{DOMAIN}/quarantine-deferred"
_MAX_REASON = 1024


class NodeRef(Protocol):
    """The node a record belongs to, as the GPU quarantine needs it: its name and its current boot
    (`node.view.NodeView` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def boot_id(self) -> str: ...


@dataclass(frozen=True)
class FaultRecord:
    """The recorded fault keys (`gpuguard.io/faults`) and the node's bootID when they were recorded
    (`gpuguard.io/boot-id`), as read from a Node's or a rule's annotations."""

    faults: frozenset[str] = frozenset()
    boot_id: str = ""

    @classmethod
    def read(cls, annotations: Mapping[str, str]) -> FaultRecord:
        raw = annotations.get(ANN_FAULTS, "")
        return cls(
            faults=frozenset(validation.fault_key(k) for k in raw.split(",") if k),
            boot_id=annotations.get(ANN_BOOT_ID, ""),
        )

    def from_earlier_boot(self, boot_id: str) -> bool:
        """Recorded in an earlier boot than the node's current one (`boot_id`): both known and different,
        else nothing is proven."""
        return bool(self.boot_id) and bool(boot_id) and self.boot_id != boot_id

    def current(self, boot_id: str) -> frozenset[str]:
        """The recorded faults of this boot: a record from an earlier boot suppresses nothing (the reboot
        cleared its evidence), so the same fault in a new boot is a new fault."""
        return frozenset() if self.from_earlier_boot(boot_id) else self.faults

    def new(self, faults: Iterable[Fault], *, boot_id: str) -> list[Fault]:
        """The faults this boot's record does not hold. Compared through fault_key on both sides: a hostile
        UUID can neither split a key nor make a recorded fault look new at every check."""
        recorded = self.current(boot_id)
        return [f for f in faults if validation.fault_key(f.key) not in recorded]

    def merge(self, faults: tuple[Fault, ...], *, boot_id: str) -> dict[str, str | None] | None:
        """The annotations that add the new faults to the record (their keys, the reason of all of them), or
        None when nothing is new. A record from an earlier boot is replaced, with the current bootID: a
        fault that recurred after a reboot must not be "proven" gone by the next agent restart."""
        if not self.new(faults, boot_id=boot_id):
            return None
        annotations: dict[str, str | None] = {
            ANN_FAULTS: join_keys(self.current(boot_id) | fault_keys(faults)),
            ANN_REASON: reason_text(faults),
        }
        if self.from_earlier_boot(boot_id):
            annotations[ANN_BOOT_ID] = boot_id
        return annotations

    @property
    def primary_reason(self) -> str | None:
        """The most severe recorded reason (`policy.primary` over the keys), what `gpuguard status` shows;
        None when nothing is recorded."""
        first = primary(Fault(k.split("/", 1)[0], "") for k in self.faults)
        return first.reason if first is not None else None

    def evidence_gone(self, boot_id: str, reset_cleared: frozenset[str] = frozenset()) -> bool:
        """Whether every recorded fault is proven cleared, given that its GPUs now read healthy.

        The healthy reading itself proves some faults gone (policy.cleared_without_reboot: ECC, NVML init, a
        recovery action back to NONE, an Xid a driver-requested GPU reset cleared, `reset_cleared`);
        everything else (an Xid, a lost or missing GPU, a failed row remap) needs a reboot, shown by a bootID
        that differs from the one recorded. An agent restart changes neither.
        """
        if all(cleared_without_reboot(k, reset_cleared) for k in self.faults):
            return True
        return self.from_earlier_boot(boot_id)


class Recorded:
    """What carries a fault record in its annotations, a Node as read (`node.view.NodeView`) or a GPU's rule
    (`gpu.rules.DeviceRule`): the record, read from them."""

    annotations: Mapping[str, str]

    @property
    def record(self) -> FaultRecord:
        return FaultRecord.read(self.annotations)


def new_record(faults: Iterable[Fault], *, since: str, boot_id: str | None = None) -> dict[str, str]:
    """The record a new DeviceTaintRule starts with: its faults' keys and text, since when, and the boot they
    were seen in (`boot_id`: a fault rule's, which a reboot can end; a degraded rule records none)."""
    faults = tuple(faults)
    record = {ANN_FAULTS: join_keys(fault_keys(faults)), ANN_REASON: reason_text(faults), ANN_SINCE: since}
    if boot_id is not None:
        record[ANN_BOOT_ID] = boot_id
    return record


def fault_keys(faults: Iterable[Fault]) -> frozenset[str]:
    return frozenset(validation.fault_key(f.key) for f in faults)


def reason_text(faults: Iterable[Fault]) -> str:
    return validation.clean_text("; ".join(f.message for f in faults), max_bytes=_MAX_REASON)


def join_keys(keys: Iterable[str]) -> str:
    return ",".join(sorted(keys))


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
