"""Each kept file's limits, stated once: its writer keeps within them and its reader refuses what is past
them, so a file written is never a file refused at the next start.

Past a limit the writer drops the oldest or least severe entries first, and a fatal fault (one only a reboot
clears: an Xid, a lost or missing GPU, a failed row remap) last of all."""

from __future__ import annotations

from collections.abc import Sequence

from gpuguard.core import files
from gpuguard.core.model import GPU_LOST, GPU_MISSING, ROW_REMAP, SXID_PREFIX, Fault

# state.json: the faults only a reboot clears and the per-GPU quarantine's rules memory. A node has at most a
# few dozen GPUs; 1,024 faults of the longest texts below are about 0.8 MB, under the file's 1 MiB.
STATE_MAX_BYTES = files.MIB
STATE_MAX_FAULTS = 1024
STATE_MAX_RULES = 1024
STATE_MAX_REASON = 64
STATE_MAX_DETAIL = 512
STATE_MAX_UUID = 128
STATE_MAX_TEXT = 512  # a rule's name, a UUID or a fault key in the rules' memory

# history.json (store.history): per GPU, per episode, and the GPUs kept.
HISTORY_MAX_BYTES = files.MIB
HISTORY_MAX_EPISODES = 32
HISTORY_MAX_RELEASES = 8
HISTORY_MAX_GPUS = 64
HISTORY_MAX_REASONS = 3
HISTORY_MAX_TEXT = 64  # reasons, boot IDs, names (a boot ID is 36 characters)
HISTORY_MAX_UUID = 128  # a GPU UUID, MIG's included, is <= 96

# signal-baselines.json (store.baselines); the readings themselves within gpuguard.core.hardware.
BASELINES_MAX_BYTES = 256 * files.KIB
BASELINES_MAX_GPUS = 256
BASELINES_MAX_UUID = 96

# evidence.json (store.evidence): one record per fault and degraded mark as detected, the newest kept. A
# record is cut to these, then its largest sections dropped until it fits EVIDENCE_MAX_RECORD_BYTES, so the
# file stays under EVIDENCE_MAX_BYTES whatever a GPU or a kernel line says.
EVIDENCE_MAX_RECORDS = 64
EVIDENCE_MAX_RECORD_BYTES = 16 * files.KIB
EVIDENCE_MAX_BYTES = EVIDENCE_MAX_RECORDS * EVIDENCE_MAX_RECORD_BYTES + 4 * files.KIB
EVIDENCE_MAX_TEXT = 512  # a detail, a kernel line's words, a pod's name
EVIDENCE_MAX_ITEMS = 32  # entries of one list or mapping (reasons, kernel lines, pods, readings)
EVIDENCE_MAX_DEPTH = 4
EVIDENCE_MAX_VALUES = 1024  # values copied from one record in all: a record of shared references is no storm

_FATAL = frozenset({GPU_LOST, GPU_MISSING, ROW_REMAP})


def fatal(fault: Fault) -> bool:
    """Whether only a reboot clears the fault (the faults the state file exists for)."""
    return fault.reason in _FATAL or fault.reason.startswith(("xid-", SXID_PREFIX))


def kept_faults(faults: Sequence[Fault]) -> tuple[Fault, ...]:
    """The faults the state file keeps, in their order (oldest first): every one while within the limit,
    else the fatal ones and the newest others; fatal ones alone past it, the newest of them. Each one's
    texts cut as the reader cuts them; a fault whose UUID is longer than any GPU's is not kept."""
    faults = [_cut(f) for f in faults if f.uuid is None or len(f.uuid) <= STATE_MAX_UUID]
    if len(faults) <= STATE_MAX_FAULTS:
        return tuple(faults)
    fatal_ones = [i for i, f in enumerate(faults) if fatal(f)][-STATE_MAX_FAULTS:]
    room = STATE_MAX_FAULTS - len(fatal_ones)
    others = [i for i, f in enumerate(faults) if not fatal(f)]
    keep = set(fatal_ones) | set(others[len(others) - room :] if room else ())
    return tuple(f for i, f in enumerate(faults) if i in keep)


def _cut(f: Fault) -> Fault:
    if len(f.reason) <= STATE_MAX_REASON and len(f.detail) <= STATE_MAX_DETAIL:
        return f
    return Fault(f.reason[:STATE_MAX_REASON], f.detail[:STATE_MAX_DETAIL], uuid=f.uuid, gpu_index=f.gpu_index)
