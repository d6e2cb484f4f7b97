"""/dev/kmsg's records and the NVIDIA driver's Xid and SXid lines in them, parsed. Pure: bytes in, values out.

A record (Documentation/ABI/testing/dev-kmsg) is `priority,sequence,timestamp_us,flags[,...];message`,
then optional continuation lines that begin with a space (` SUBSYSTEM=pci`); one read() of /dev/kmsg
returns exactly one. Non-printable bytes of the message arrive escaped as `\\xNN`. The driver's lines:

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.
    NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception ...
    nvidia-nvswitch3: SXid (PCI:0000:c1:00.0): 20034, Fatal, Link 30 LTSSM Fault Up
    nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 37 egress non-posted PRIV error
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuguard.core.model import KernelLine
from gpuguard.core.xids import CATALOG

MAX_RECORD = 8192
"""Bytes of one record, continuation lines included. The kernel bounds a message to about 1 KiB (and
refuses a read() shorter than the record); a stand-in's longer line is oversized, counted and skipped."""
MAX_TEXT = 240
"""Characters of the driver's words kept in the fault's detail (it goes into a node annotation)."""

_HEADER = re.compile(rb"^(\d{1,10}),(\d{1,20}),(\d{1,20}),[^;,]*(?:,[^;]*)?;")
# The PCI address: "PCI:0000:3b:00" (Xid), "PCI:0000:c1:00.0" (SXid), "0000:3b:00" on old drivers; MIG adds
# " GPU-I:05" after it on some drivers.
_PCI = r"(?:PCI:)?([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.[0-7])?[^)]*"
_XID = re.compile(rf"NVRM: Xid \({_PCI}\): (\d{{1,6}})(?:, (.*))?$")
_SXID = re.compile(rf"SXid \({_PCI}\): (\d{{1,6}})(?:, (Fatal|Non-fatal))?(?:, (.*))?$")
_PID = re.compile(r"pid='?(\d+|<unknown>)'?, name=([^,]*), ?(.*)$")


class Malformed(ValueError):
    """A record that is not in /dev/kmsg's format (counted and skipped)."""


@dataclass(frozen=True)
class Record:
    seq: int
    at: float
    """timestamp_us in seconds: since boot, the kernel's monotonic clock."""
    message: str


def parse_record(raw: bytes) -> Record:
    """One record (continuation lines dropped). Raises Malformed."""
    line = raw.split(b"\n", 1)[0]
    m = _HEADER.match(line)
    if m is None:
        raise Malformed("no priority,sequence,timestamp,flags; header")
    message = line[m.end() :].decode("utf-8", "backslashreplace")
    return Record(seq=int(m.group(2)), at=int(m.group(3)) / 1e6, message=message)


def pci_address(domain: str, bus: str, device: str) -> str:
    """The one spelling both sources are matched in: "0000:3b:00"."""
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}"


def nvml_pci_address(bus_id: str) -> str | None:
    """NVML's busId ("00000000:3B:00.0") in the same spelling; None when it does not parse."""
    m = re.fullmatch(r"([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.[0-7])?", bus_id.strip())
    return pci_address(*m.groups()) if m else None


@dataclass(frozen=True)
class KernelXid:
    code: int
    sxid: bool
    line: KernelLine


def parse_xid(record: Record) -> KernelXid | None:
    """The Xid or SXid a record carries; None for any other line."""
    msg = record.message
    if "Xid (" not in msg:
        return None
    if m := _XID.search(msg):
        pci, code, rest = pci_address(*m.group(1, 2, 3)), int(m.group(4)), m.group(5) or ""
        pid: int | None = None
        process: str | None = None
        if p := _PID.match(rest):
            pid = int(p.group(1)) if p.group(1).isdigit() else None
            process = None if p.group(2) in ("<unknown>", "") else p.group(2)
            rest = p.group(3)
        line = KernelLine(record.seq, record.at, pci, pid, process, _printable(rest))
        return KernelXid(code, False, line)
    if m := _SXID.search(msg):
        pci, code = pci_address(*m.group(1, 2, 3)), int(m.group(4))
        line = KernelLine(record.seq, record.at, pci, text=_printable(m.group(6) or ""), severity=m.group(5))
        return KernelXid(code, True, line)
    return None


def driver_record(seq: int, at: float, pci: str, code: int, *, sxid: bool = False) -> bytes:
    """One record as the driver has the kernel log it (the stand-ins' side: the mock, the tests):
    `pci` in the one spelling ("0000:3b:00"), `at` seconds on CLOCK_MONOTONIC."""
    if sxid:
        message = f"nvidia-nvswitch0: SXid (PCI:{pci}.0): {code}, Fatal, Link 30 LTSSM Fault Up"
    else:
        words = CATALOG.describe(code)
        message = f"NVRM: Xid (PCI:{pci}): {code}, pid=1234, name=python, {words}"
    return f"3,{seq},{int(at * 1e6)},-;{message}\n SUBSYSTEM=pci\n".encode()


def _printable(text: str) -> str:
    kept = "".join(c if c.isprintable() else "?" for c in text.strip())
    return kept if len(kept) <= MAX_TEXT else kept[: MAX_TEXT - 3] + "..."
