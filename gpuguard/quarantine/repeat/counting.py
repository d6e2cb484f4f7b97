"""Which fault reasons count toward a GPU's repeat limit (gpuguard.quarantine.repeat.escalation), as data.

Only a GPU's own faults count. A cause that is the node's, not the GPU's hardware, reaches every GPU of the
node at once: a Fabric Manager that fails (a node service that sets up the NVLink fabric) makes all 8 GPUs
of an HGX node read fabric-incomplete, and three such failures must not send 8 good GPUs to repair. Where
each decision lives: a signal's `repeat` field in gpuguard/core/data/signals.json (the fabric-* signals say
false, with their source), and the small table below for the built-in reasons. Everything else counts: every
fatal Xid of NVIDIA's Xid catalog names the GPU that raised it (the catalog has no node-scope bucket; NVLink
Xids such as 74 or 144-150 are the GPU's own link), and ecc, row-remap, gpu-lost, gpu-missing with a UUID,
gpu-unreadable, gpu-unresponsive, reset-required and the driver's recovery actions are read from one GPU.

The same holds for any reason every GPU of the node shows at once (within Limits.at_once_s of each other,
escalation.observe records it as the episode's `shared`): three outages in which every GPU answers UNKNOWN
(gpu-unreadable on all 8) are the node's NVML or driver, not 8 repeat offenders. A node of one GPU has no
such evidence: its faults count.

An episode whose reasons are all non-counting is still recorded in the history (evidence for the operator);
it is only left out of the count. An episode that gains a counting reason later (fabric-incomplete, then Xid
79 in the same boot) counts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpuguard.core.model import NVML_INIT, NVML_UNRESPONSIVE, RECOVERY_PREFIX, REPEAT_OFFENDER
from gpuguard.core.signaltable import SIGNALS, SignalTable
from gpuguard.store.history import MAX_REASONS

# Built-in reasons that never count, each with why and its source. nvml-init and nvml-unresponsive carry no
# GPU UUID today (node faults), so they never reach a GPU's history; they are listed so that a UUID added to
# them later cannot make them count.
NOT_COUNTED: Mapping[str, str] = {
    NVML_INIT: (
        "the node's NVML or driver (nvmlInit failing, an RM/driver version mismatch after a driver upgrade, "
        "a node-wide call failing): NVML's nvmlInit_v2 return codes name the driver, not a GPU"
    ),
    NVML_UNRESPONSIVE: "a node-wide NVML call past its deadline (nvml.real.deadline): the driver, not a GPU",
    f"{RECOVERY_PREFIX}recover-imex-domain": (
        "nvml.h NVML_GPU_RECOVERY_ACTION_RECOVER_IMEX_DOMAIN: the multi-node NVLink (IMEX) domain is to be "
        "recovered, a fabric-wide action, not this GPU's repair"
    ),
    REPEAT_OFFENDER: "the hold itself (escalation.held_faults): never an episode of its own",
}


def counts(reason: str, table: SignalTable = SIGNALS) -> bool:
    """Whether a fault with this reason counts toward its GPU's repeat limit."""
    if reason in NOT_COUNTED:
        return False
    if reason in table.names():
        return table[reason].repeat
    return True


def counted(reasons: Iterable[str], table: SignalTable = SIGNALS, *, shared: Iterable[str] = ()) -> bool:
    """Whether an episode with these reasons counts: at least one of them does, and is not one every GPU of
    the node showed at once (`shared`, escalation.observe): such a cause is the node's."""
    node = set(shared)
    return any(counts(r, table) and r not in node for r in reasons)


def kept(reasons: Iterable[str], table: SignalTable = SIGNALS) -> tuple[str, ...]:
    """The reasons an episode keeps (the history keeps MAX_REASONS), sorted: the counting ones first, so that
    an episode cut short never loses the reason that makes it count (three fabric reasons and Xid 79)."""
    ranked = sorted(set(reasons), key=lambda r: (not counts(r, table), r))
    return tuple(sorted(ranked[:MAX_REASONS]))
