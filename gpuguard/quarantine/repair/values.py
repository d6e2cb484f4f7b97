"""The two annotations a repair is told in, pure: the agent's request (`gpuguard.io/repair-request`: one GPU,
its owner node, a deadline) and the executor's record (`gpuguard.io/repair-state`: each GPU's phase on the
ladder, in which boot, and when it was reset). Both are read as untrusted text: a value that is not exactly
the shape gpuguard writes is no request, and an unreadable record holds nothing and starts from nothing."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from gpuguard.core.validation import PREFIX

ANN_REQUEST = f"{PREFIX}repair-request"
ANN_STATE = f"{PREFIX}repair-state"
# An operator's veto: while the node carries it (any value), the executor resets nothing there. Neither the
# agent's token nor the executor's may write it (deploy/admission-policy-repair.yaml).
ANN_VETO = f"{PREFIX}repair-veto"

# The ladder's phases (docs/design.md, "Repair"): what the executor last did with a GPU.
DRAINING, IDLE, RESETTING, VALIDATING = "draining", "idle", "resetting", "validating"
PROVEN, FAILED, REBOOT, NEEDS_REPAIR, VETOED = (
    "proven",
    "failed",
    "reboot-requested",
    "needs-repair",
    "vetoed",
)
PHASES = (DRAINING, IDLE, RESETTING, VALIDATING, PROVEN, FAILED, REBOOT, NEEDS_REPAIR, VETOED)
# Phases in which the GPU stays out of service whatever it reads: under way, or a proof that failed. In the
# boot they were written in only: a reboot is the next step's remedy.
HOLDING = frozenset({DRAINING, IDLE, RESETTING, VALIDATING, FAILED, REBOOT, NEEDS_REPAIR})
UNDER_WAY = frozenset({DRAINING, IDLE, RESETTING, VALIDATING})

# The agent's request asks for this long (written again once less than half is left): its deadline less this
# is when it was asked, which tells a request written before a proven reset from a fault that came back.
REQUEST_TTL_S = 3600
# A request lives at most this long: the admission policy cannot read a clock, so the executor bounds it.
MAX_TTL_S = 6 * 3600
MAX_GPUS = 16  # entries kept in the record, the most recently changed first
MAX_RESETS = 4  # reset times kept per GPU: the window looks back at the last one
_UUID = re.compile(r"GPU-[0-9A-Za-z-]{1,90}")
_NODE = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_TIME = "%Y-%m-%dT%H:%M:%SZ"


def stamp(t: datetime) -> str:
    return t.astimezone(UTC).strftime(_TIME)


def parse_time(text: object) -> datetime | None:
    if not isinstance(text, str) or len(text) != 20:
        return None
    try:
        return datetime.strptime(text, _TIME).replace(tzinfo=UTC)
    except ValueError:
        return None


def _compact(doc: Any) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Request:
    """Reset this GPU of node `owner`, if it can be done before `deadline`."""

    uuid: str
    owner: str
    deadline: datetime

    @property
    def asked(self) -> datetime:
        """When the agent wrote it (the deadline is always REQUEST_TTL_S after)."""
        return self.deadline - timedelta(seconds=REQUEST_TTL_S)

    def value(self) -> str:
        """The annotation's exact value (the admission policy matches this shape)."""
        return _compact({"deadline": stamp(self.deadline), "owner": self.owner, "uuid": self.uuid})


def parse_request(text: str | None, *, node: str, now: datetime) -> tuple[Request | None, str]:
    """The request on `node`, or None and why not: not gpuguard's shape, another node's, past its deadline,
    or a deadline further than MAX_TTL_S ahead (a request that would never expire)."""
    if not text:
        return None, "none"
    try:
        doc = json.loads(text)
    except ValueError:
        return None, "unreadable"
    if not isinstance(doc, dict) or set(doc) != {"deadline", "owner", "uuid"}:
        return None, "unreadable"
    uuid, owner, deadline = doc["uuid"], doc["owner"], parse_time(doc["deadline"])
    if not isinstance(uuid, str) or not _UUID.fullmatch(uuid) or deadline is None:
        return None, "unreadable"
    if not isinstance(owner, str) or not _NODE.fullmatch(owner) or owner != node:
        return None, "not-this-node"
    if deadline <= now:
        return None, "expired"
    if deadline > now + timedelta(seconds=MAX_TTL_S):
        return None, "deadline-too-far"
    return Request(uuid, owner, deadline), "ok"


@dataclass(frozen=True)
class Entry:
    """One GPU on the ladder: its phase, since when, in which boot, and its last resets."""

    phase: str
    at: datetime
    boot: str
    resets: tuple[datetime, ...] = ()
    why: str = ""

    def holds(self, boot: str) -> bool:
        """Whether this entry keeps the GPU out of service on a node in `boot`."""
        return self.phase in HOLDING and self.boot == boot

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"phase": self.phase, "at": stamp(self.at), "boot": self.boot}
        if self.resets:
            doc["resets"] = [stamp(t) for t in self.resets[-MAX_RESETS:]]
        if self.why:
            doc["why"] = self.why[:200]
        return doc


@dataclass(frozen=True)
class Record:
    """The executor's record on the node: UUID -> Entry."""

    entries: Mapping[str, Entry] = field(default_factory=dict)

    def get(self, uuid: str) -> Entry | None:
        return self.entries.get(uuid)

    def held(self, boot: str) -> frozenset[str]:
        return frozenset(u for u, e in self.entries.items() if e.holds(boot))

    def put(self, uuid: str, entry: Entry) -> Record:
        kept = sorted(((u, e) for u, e in self.entries.items() if u != uuid), key=lambda p: p[1].at)
        kept = kept[-(MAX_GPUS - 1) :]
        return Record({**dict(kept), uuid: entry})

    def step(
        self, uuid: str, phase: str, *, at: datetime, boot: str, why: str = "", reset: bool = False
    ) -> Record:
        old = self.entries.get(uuid)
        resets = old.resets if old is not None else ()
        if reset:
            resets = (*resets, at)[-MAX_RESETS:]
        return self.put(uuid, Entry(phase, at, boot, resets, why))

    def value(self) -> str:
        return _compact({u: e.to_doc() for u, e in self.entries.items()})


def parse_record(text: str | None) -> Record:
    """The record, or an empty one when absent or unreadable (entries that are not gpuguard's are dropped)."""
    try:
        doc = json.loads(text or "{}")
    except ValueError:
        return Record()
    if not isinstance(doc, dict):
        return Record()
    entries: dict[str, Entry] = {}
    for uuid, e in list(doc.items())[:MAX_GPUS]:
        if not isinstance(uuid, str) or not _UUID.fullmatch(uuid) or not isinstance(e, dict):
            continue
        at, phase, boot = parse_time(e.get("at")), e.get("phase"), e.get("boot")
        if at is None or phase not in PHASES or not isinstance(boot, str):
            continue
        times = [parse_time(r) for r in (e.get("resets") or [])[:MAX_RESETS]]
        resets = tuple(t for t in times if t is not None)
        why = e.get("why") if isinstance(e.get("why"), str) else ""
        entries[uuid] = Entry(str(phase), at, boot[:64], resets, str(why)[:200])
    return Record(entries)
