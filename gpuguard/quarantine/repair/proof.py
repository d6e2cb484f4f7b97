"""What a reset must leave, pure: the GPU read after it against what was asked (docs/design.md, "Repair")."""

from __future__ import annotations

from gpuguard.nvml.base import GpuAfterReset


def proof_failures(reading: GpuAfterReset, uuid: str) -> tuple[str, ...]:
    """Why the GPU is not proven healthy after its reset ((): proven). The same UUID at that index (another
    GPU answering there is no proof of this one), the driver's recovery action NONE where it reports one,
    no row remap and no page retirement still pending (a reset applies them)."""
    why = []
    if reading.uuid != uuid:
        why.append(f"index answers {reading.uuid}, not {uuid}")
    if reading.recovery_action not in (None, 0):
        why.append(f"recovery action {reading.recovery_action}, not NONE")
    if reading.remap_pending:
        why.append("row remap still pending")
    if reading.retired_pending:
        why.append("page retirement still pending")
    return tuple(why)
