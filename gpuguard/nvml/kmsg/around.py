"""The kernel log's lines around a moment, for the evidence kept at detection: the driver's own words
(NVRM, nvidia, the Xid and SXid lines and what it logged beside them), read once, bounded, never blocking.

/dev/kmsg opened non-blocking gives the ring buffer from its oldest record, one per read(), then EAGAIN; a
stand-in file gives its bytes. At most READ_MOST bytes are read, the records within `window` seconds of
`around` (the kernel's timestamps and CLOCK_MONOTONIC share the clock since boot) that name the driver are
kept, the last `most` of them."""

from __future__ import annotations

import contextlib
import errno
import os

from gpuguard.nvml.kmsg.reader import READ_SIZE
from gpuguard.nvml.kmsg.records import MAX_TEXT, Malformed, parse_record

READ_MOST = 4 * 1024 * 1024
"""Bytes read at most: the kernel's ring buffer is 1 MiB or less on most hosts (log_buf_len)."""
_DRIVER = ("NVRM", "nvidia", "Xid", "NVSwitch", "nvswitch")


def lines_around(path: str, *, around: float, window: float = 30.0, most: int = 16) -> list[str]:
    """`[seconds] message` of the driver's records within `window` s of `around`; [] when unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    kept: list[str] = []
    left, rest = READ_MOST, b""
    try:
        while left > 0:
            try:
                chunk = os.read(fd, READ_SIZE)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # overwritten while read: go on after them
                break
            if not chunk:
                break
            left -= len(chunk)
            *whole, rest = (rest + chunk).split(b"\n")
            for raw in whole:
                if raw and not raw.startswith(b" "):
                    _keep(raw, kept, around=around, window=window)
                    del kept[:-most]
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    if rest and not rest.startswith(b" "):
        _keep(rest, kept, around=around, window=window)
    return kept[-most:]


def _keep(raw: bytes, kept: list[str], *, around: float, window: float) -> None:
    try:
        record = parse_record(raw)
    except Malformed:
        return
    if abs(record.at - around) <= window and any(w in record.message for w in _DRIVER):
        kept.append(f"[{record.at:12.6f}] {record.message[: MAX_TEXT * 2]}")
