"""Each reason as a person asks about it: the rule that fired (the Xid catalog's bucket, a health signal's
threshold and window, --ecc-threshold) and what would clear it, for the evidence kept at detection and for
`gpuguard explain`. Pure: a reason and the settings in, plain values out."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpuguard.core import model
from gpuguard.core.model import Fault
from gpuguard.core.signaltable import SignalTable
from gpuguard.core.xids import CATALOG

_STICKY = "sticky for this boot: a reboot (a new boot ID) clears it"
_CLEARS = {
    model.ECC: "the volatile uncorrected ECC count back within --ecc-threshold: a driver reload or a reboot "
    "resets it",
    model.GPU_LOST: _STICKY,
    model.GPU_MISSING: "the GPU listed by NVML again (in this boot, a reboot)",
    model.ROW_REMAP: _STICKY + "; a failed row remap is a repair (RMA) case",
    model.NVML_INIT: "NVML initialising again (the driver loaded, the library found)",
    model.RESET_REQUIRED: "a GPU reset or a reboot: NVML stops answering RESET_REQUIRED",
    model.GPU_UNREADABLE: "the GPU's queries answering again",
    model.GPU_UNRESPONSIVE: "the hung NVML call returning",
    model.NVML_UNRESPONSIVE: "the hung NVML call returning",
    model.RETIRED_PAGES: "a reboot with the pages retired, or a repair (RMA) past the limit",
    model.REPEAT_OFFENDER: "held for repair whatever it reads: only `gpuguard release` by an operator",
}


def rule(reason: str, *, signals: SignalTable, ecc_threshold: int) -> dict[str, Any]:
    """The rule that fired for `reason` ("xid-79", "ecc", "nvlink-errors", ...), as plain values."""
    code = _code(reason, "xid-")
    if code is not None:
        return {
            "rule": "xid",
            "code": code,
            "bucket": CATALOG.bucket(code) or "none given",
            "catalog": CATALOG.describe(code),
            "event_by_default": CATALOG.is_event(code),
        }
    code = _code(reason, model.SXID_PREFIX)
    if code is not None:
        return {"rule": "sxid", "code": code, "severity": "Fatal (a Non-fatal SXid is an event)"}
    if reason == model.ECC:
        return {"rule": "ecc", "threshold": ecc_threshold, "measure": "volatile uncorrected ECC errors"}
    if reason.startswith(model.RECOVERY_PREFIX):
        return {"rule": "recovery-action", "action": reason.removeprefix(model.RECOVERY_PREFIX)}
    if reason in signals.names():
        s = signals[reason]
        return {
            "rule": "signal",
            "signal": s.name,
            "level": s.level,
            "threshold": s.threshold,
            "window_s": s.window_s,
            "measure": s.measure or s.reading,
        }
    return {"rule": reason}


def brief(faults: Iterable[Fault], message: str) -> str:
    """The catalog's bucket of each Xid fault `message` names, for an Event ("xid-79: RESTART_BM"): the rule
    that fired where operators look first; "" when none does."""
    seen: dict[str, str] = {}
    for f in faults:
        code = _code(f.reason, "xid-")
        if code is not None and f.message in message:
            seen[f.reason] = f"{f.reason}: Xid catalog bucket {CATALOG.bucket(code) or 'none given'}"
    return "; ".join(seen.values())


def clears(reason: str, *, signals: SignalTable) -> str:
    """What would clear `reason`, in a sentence."""
    if reason.startswith(("xid-", model.SXID_PREFIX)):
        return _STICKY + "; a GPU reset clears it where the driver's recovery action asked for one"
    if reason.startswith(model.RECOVERY_PREFIX):
        return "the driver's recovery action back to none (after the reset or reboot it asks for)"
    if reason in _CLEARS:
        return _CLEARS[reason]
    if reason in signals.names():
        s = signals[reason]
        if s.window_s:
            return f"the reading back within {s.threshold:g} over a whole window of {s.window_s:g} s"
        return "the reading back to what it should be (its baseline or the product's expected value)"
    return "see docs/design.md for this reason"


def _code(reason: str, prefix: str) -> int | None:
    rest = reason.removeprefix(prefix)
    return int(rest) if rest != reason and rest.isdigit() else None
