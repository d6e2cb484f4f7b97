"""NVIDIA's Xid catalog, shipped as data (gpuguard/core/data/xid_catalog.json), and the default it gives.

The default follows the catalog's "Resolution Bucket (Immediate Action)": RESTART_APP (the application is
restarted, the GPU keeps serving) and IGNORE (no action) are events: logged and counted, not faults. Every
other bucket, a code the catalog has no bucket for, and a code it does not list at all are faults: an Xid
we cannot place on a node that serves traffic is more likely a new hardware failure mode than a harmless
one. The file also names gpuguard's few deliberate departures from the bucket ("overrides"), each with why.

To update: replace the "codes" list from the page in the file's "source" (or its spreadsheet), set "taken",
and run `make unit` (tests/test_policy.py checks the shape and the defaults the README promises).
Standard library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

# Buckets whose immediate action leaves the GPU in service.
EVENT_BUCKETS = frozenset({"RESTART_APP", "IGNORE"})
# NVML's eventData for an Xid the driver could not name (nvml.h, nvmlEventData_t).
UNKNOWN_XID = 999


@dataclass(frozen=True)
class XidEntry:
    code: int
    mnemonic: str
    immediate_action: str
    """The catalog's "Resolution Bucket (Immediate Action)"; "" where the page gives none."""
    description: str


@dataclass(frozen=True)
class XidCatalog:
    source: str
    taken: str
    entries: dict[int, XidEntry]
    overrides: dict[int, str]
    """Code -> why gpuguard treats it as an event although its bucket is not an event bucket."""

    def is_event(self, code: int) -> bool:
        """The default: True for an event (logged, counted), False for a fault."""
        if code in self.overrides:
            return True
        entry = self.entries.get(code)
        return entry is not None and entry.immediate_action in EVENT_BUCKETS

    def default_ignored(self) -> frozenset[int]:
        return frozenset(c for c in self.entries if self.is_event(c))

    def describe(self, code: int) -> str:
        if code == UNKNOWN_XID:
            return "unknown Xid (NVML reports 999 when the driver does not name the error)"
        entry = self.entries.get(code)
        if entry is None:
            return f"not in NVIDIA's Xid catalog of {self.taken}"
        return entry.mnemonic if entry.description == "Unused" else entry.description

    def bucket(self, code: int) -> str:
        """The immediate-action bucket, for logs: "" where the catalog gives none, "UNLISTED" for no entry."""
        entry = self.entries.get(code)
        return "UNLISTED" if entry is None else entry.immediate_action


def load() -> XidCatalog:
    doc = json.loads(resources.files("gpuguard.core.data").joinpath("xid_catalog.json").read_text("utf-8"))
    entries = {
        int(e["code"]): XidEntry(
            code=int(e["code"]),
            mnemonic=str(e["mnemonic"]),
            immediate_action=str(e["immediate_action"]),
            description=str(e["description"]),
        )
        for e in doc["codes"]
    }
    overrides = {int(o["code"]): str(o["why"]) for o in doc["overrides"]}
    return XidCatalog(
        source=str(doc["source"]), taken=str(doc["taken"]), entries=entries, overrides=overrides
    )


CATALOG = load()
