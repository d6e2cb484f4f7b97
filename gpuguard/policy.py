"""Readings + settings -> verdict. Pure: no I/O, no clock, no NVML, no Kubernetes.

Which Xids are faults follows the immediate-action "resolution bucket" of NVIDIA's Xid catalog, shipped as
data (gpuguard.xidcatalog): RESTART_APP and IGNORE are events by default; every other bucket, and every code
the catalog does not list, is a fault (PolicySettings.ignored_xids carries the default and the overrides).
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuguard.config import PolicySettings
from gpuguard.model import (
    ECC,
    GPU_LOST,
    GPU_MISSING,
    NVML_INIT,
    ROW_REMAP,
    Fault,
    GpuReading,
    GpuVerdict,
    Snapshot,
    Verdict,
    XidEvent,
    xid_reason,
)
from gpuguard.xidcatalog import CATALOG


def describe_xid(code: int) -> str:
    return CATALOG.describe(code)


def evaluate(snapshot: Snapshot, *, previous: Verdict | None, settings: PolicySettings) -> Verdict:
    """Judge one snapshot. `previous` carries the device inventory and the sticky faults."""
    prev = previous or Verdict()
    sticky = list(prev.sticky)

    if snapshot.init_error is not None:
        node_faults: tuple[Fault, ...] = ()
        if not settings.allow_no_gpu:
            node_faults = (Fault(NVML_INIT, f"NVML initialization failed: {snapshot.init_error}"),)
        gpus = tuple(
            GpuVerdict(index=i, uuid=u, name=n, present=False, faults=_sticky_for(sticky, u))
            for i, u, n in prev.known
        )
        return Verdict(
            gpus=gpus,
            node_faults=node_faults,
            known=prev.known,
            expected_gpus=prev.expected_gpus,
            sticky=tuple(sticky),
        )

    known = list(prev.known)
    known_uuids = {u for _, u, _ in known}
    for g in snapshot.gpus:
        if g.uuid not in known_uuids:
            known.append((g.index, g.uuid, g.name))
            known_uuids.add(g.uuid)
    expected = prev.expected_gpus
    if expected is None:
        expected = settings.expected_gpus if settings.expected_gpus is not None else len(snapshot.gpus)

    fatal, ignored = _split_xids(snapshot.xids, settings.ignored_xids)
    by_uuid = {g.uuid: g for g in snapshot.gpus}
    prev_by_uuid = {g.uuid: g for g in prev.gpus}

    for x in fatal:
        _add_sticky(
            sticky,
            Fault(
                xid_reason(x.code),
                f"{describe_xid(x.code)} (GPU {x.gpu_index}, {x.uuid})",
                uuid=x.uuid,
                gpu_index=x.gpu_index,
            ),
        )
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
                )
            )
            continue
        faults = list(_sticky_for(sticky, uuid))
        ecc = _ecc_fault(reading, settings.ecc_threshold, prev_by_uuid.get(uuid))
        if ecc is not None:
            faults.append(ecc)
        verdicts.append(
            GpuVerdict(
                index=reading.index,
                uuid=uuid,
                name=reading.name or name,
                faults=_ordered(faults),
                ecc_uncorrected=reading.ecc_uncorrected,
            )
        )

    # Sticky faults on a device we never enumerated (an Xid from an unknown handle) belong to the node.
    node_faults = tuple(f for f in sticky if f.uuid not in known_uuids)
    missing_known = sum(1 for _, u, _ in known if u not in by_uuid)
    shortfall = expected - len(snapshot.gpus) - missing_known
    if shortfall > 0:
        node_faults += (
            Fault(
                GPU_MISSING,
                f"expected {expected} GPUs, NVML reports {len(snapshot.gpus)}",
            ),
        )
    return Verdict(
        gpus=tuple(verdicts),
        node_faults=node_faults,
        ignored_xids=ignored,
        fatal_xids=fatal,
        known=tuple(known),
        expected_gpus=expected,
        sticky=tuple(sticky),
    )


# Lower sorts first: the primary reason (the taint value) is the most severe fault.
_SEVERITY = {NVML_INIT: 0, GPU_LOST: 1, GPU_MISSING: 2, ECC: 4, ROW_REMAP: 5}
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


def _split_xids(
    xids: Iterable[XidEvent], ignored: frozenset[int]
) -> tuple[tuple[XidEvent, ...], tuple[XidEvent, ...]]:
    fatal = tuple(x for x in xids if x.code not in ignored)
    skipped = tuple(x for x in xids if x.code in ignored)
    return fatal, skipped


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
            f"{g.ecc_uncorrected} uncorrected volatile ECC errors"
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
