"""Which faults a reset of the one GPU remedies, shipped as data (core/data/reset_remedies.json), like
the Xid catalog: the fault reasons, and the Xid catalog's buckets, whose remedy is a GPU reset. The repair
executor resets a GPU only when every fault it has is one of these (docs/design.md, "Repair"). Standard
library only."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

from gpuguard.core.xids import CATALOG, XidCatalog

XID_PREFIX = "xid-"  # gpuguard.core.xidevent.xid_reason's


@dataclass(frozen=True)
class ResetRemedies:
    reasons: frozenset[str]
    """Fault reasons a reset remedies (`recovery-gpu-reset`, `reset-required`, ...)."""
    xid_buckets: frozenset[str]
    """Xid catalog buckets whose Xids a reset remedies, where the GPU reports its recovery action."""

    def remedies(self, reason: str, *, recovery_field: bool, catalog: XidCatalog = CATALOG) -> bool:
        """Whether a reset remedies the fault of this reason. An Xid counts only on a GPU whose recovery
        action can be read (`recovery_field`): elsewhere only a reboot clears it (the data says why)."""
        if reason in self.reasons:
            return True
        if not reason.startswith(XID_PREFIX) or not recovery_field:
            return False
        code = reason[len(XID_PREFIX) :]
        return code.isdigit() and catalog.bucket(int(code)) in self.xid_buckets


def load() -> ResetRemedies:
    text = resources.files("gpuguard.core.data").joinpath("reset_remedies.json").read_text("utf-8")
    doc = json.loads(text)
    return ResetRemedies(
        reasons=frozenset(str(r["reason"]) for r in doc["reasons"]),
        xid_buckets=frozenset(str(b["bucket"]) for b in doc["xid_buckets"]),
    )


REMEDIES = load()
