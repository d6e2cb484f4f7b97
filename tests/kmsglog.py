"""The kernel-log stand-in: a file (or FIFO) of records in /dev/kmsg's format, as the driver writes them."""

from __future__ import annotations

import time
from pathlib import Path


class KernelLog:
    """Appends records `priority,sequence,timestamp_us,flags;message` with a continuation line, as
    /dev/kmsg returns them; sequence numbers count up from `first`, timestamps are CLOCK_MONOTONIC's."""

    def __init__(self, path: Path, *, first: int = 100) -> None:
        self.path = path
        self.seq = first
        path.touch()

    def record(self, message: str, *, at: float | None = None, priority: int = 3) -> int:
        """Append one record; its sequence number."""
        self.seq += 1
        ts = int((time.monotonic() if at is None else at) * 1e6)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(f"{priority},{self.seq},{ts},-;{message}\n SUBSYSTEM=pci\n DEVICE=+pci:{self.seq}\n")
        return self.seq

    def xid(
        self, pci: str, code: int, *, at: float | None = None, text: str = "GPU has fallen off the bus."
    ) -> int:
        return self.record(f"NVRM: Xid (PCI:{pci}): {code}, pid=1234, name=python, {text}", at=at)

    def sxid(self, pci: str, code: int, severity: str = "Fatal", text: str = "Link 30 LTSSM Fault Up") -> int:
        return self.record(f"nvidia-nvswitch0: SXid (PCI:{pci}.0): {code}, {severity}, {text}")

    def raw(self, data: bytes) -> None:
        with self.path.open("ab") as f:
            f.write(data)
