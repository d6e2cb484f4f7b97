"""The kernel log read on a thread of its own: independent of NVML (a hung or failing NVML never stops it),
every read bounded, nothing it reads able to crash it.

/dev/kmsg opened read-only and non-blocking gives the ring buffer from its oldest record, one record per
read(), then EAGAIN until the next: the first EAGAIN (a stand-in file's or FIFO's end) ends the replay of
what the kernel logged before the agent started. The thread then sleeps in poll() on the log and a stop
pipe: an idle node wakes it only for a new record (a stand-in file, which poll() always calls readable,
is read again every `poll_s`). EPIPE means records were overwritten before they were read (counted as
`lost`); a record that cannot be parsed or is longer than MAX_RECORD is counted (`malformed`,
`oversized`) and skipped.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import stat
import threading
import time
from collections.abc import Callable

import structlog

from gpuguard.nvml.kmsg.records import MAX_RECORD, KernelXid, Malformed, parse_record, parse_xid

log = structlog.get_logger(__name__)

Deliver = Callable[[KernelXid, "float | None"], None]
"""An Xid read, with when it arrived on the agent's clock (None: replayed from before the start)."""

READ_SIZE = 16384
"""Bytes asked of one read(): above any record the kernel keeps (a read() shorter than a record is EINVAL)."""
READS_PER_TURN = 4096
"""Reads before the thread looks at stop again: a log that never runs dry still lets it stop."""
REOPEN_S = 30.0
"""A log that cannot be opened (not there yet, no permission) is tried again this often, logged once."""


class KernelLogReader:
    def __init__(
        self,
        path: str,
        *,
        on_skipped: Callable[[str], None] = lambda why: None,
        poll_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`on_skipped(why)`: one record not judged ("malformed", "oversized", "lost"): a metric."""
        self._path = path
        self._on_skipped = on_skipped
        self._poll_s = poll_s
        self._clock = clock
        self._stop = threading.Event()
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._regular = False
        self._buf = b""
        self._discarding = False
        self._replaying = True
        self._after: int | None = None
        self._last_seq = -1
        self._deliver: Deliver = lambda x, at: None
        self.failed_open = False
        self.replayed = threading.Event()
        """Set once the records logged before the start have been read (the log ran dry once)."""

    def start(self, deliver: Deliver, *, after: int | None) -> None:
        """Read on a daemon thread; records up to sequence `after` (judged before a restart) are skipped."""
        self._deliver = deliver
        self._after = after
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="kmsg-reader", daemon=True)
        self._thread.start()

    def read_once(self, deliver: Deliver) -> None:
        """Every record the log holds now, read on the caller's thread, then closed (`gpuguard check`: the
        Xids since boot). A log that cannot be opened is logged (`kmsg.unavailable`) and reads nothing."""
        self._deliver = deliver
        if self._fd is None and not self._open():
            return
        try:
            while self.read_available() == READS_PER_TURN:
                pass
        finally:
            if self._fd is not None:
                os.close(self._fd)
            self._fd = None

    def stop(self) -> None:
        self._stop.set()
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        for fd in (self._fd, self._wake_r, self._wake_w):
            if fd is not None and fd >= 0:
                os.close(fd)
        self._fd, self._wake_r, self._wake_w = None, -1, -1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._fd is None and not self._open():
                    self._stop.wait(REOPEN_S)
                    continue
                if not self.read_available():
                    self._idle()
            except Exception:
                # Never a crash: a bug here costs this source, not the agent (NVML's events go on).
                log.exception("kmsg.read_failed", path=self._path)
                self._stop.wait(self._poll_s)

    def _open(self) -> bool:
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            mode = os.fstat(fd).st_mode
        except OSError as exc:
            if not self.failed_open:
                log.warning("kmsg.unavailable", path=self._path, error=str(exc), retry_s=REOPEN_S)
            self.failed_open = True
            return False
        if not (stat.S_ISCHR(mode) or stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            os.close(fd)
            log.warning("kmsg.unavailable", path=self._path, error="not a character device, file or FIFO")
            self.failed_open = True
            return False
        self._fd, self._regular = fd, stat.S_ISREG(mode)
        log.info("kmsg.opened", path=self._path, after=self._after)
        return True

    def read_available(self) -> int:
        """Read what the log holds now (at most READS_PER_TURN reads); how many reads returned data."""
        assert self._fd is not None
        got = 0
        for _ in range(READS_PER_TURN):
            try:
                chunk = os.read(self._fd, READ_SIZE)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten before read: the next read goes on after them
                    self._on_skipped("lost")
                    continue
                if exc.errno == errno.EINVAL:  # a record longer than READ_SIZE: kmsg will not move past it
                    self._on_skipped("oversized")
                    os.lseek(self._fd, 0, os.SEEK_END)
                    continue
                raise
            if not chunk:
                break
            got += 1
            self._take(chunk)
        if got < READS_PER_TURN:
            self._replaying = False  # the log ran dry once: from here on every record is new
            self.replayed.set()
        return got

    def _take(self, chunk: bytes) -> None:
        self._buf += chunk
        while True:
            end = self._buf.find(b"\n")
            if end < 0:
                if len(self._buf) > MAX_RECORD:
                    self._buf = b""
                    if not self._discarding:
                        self._on_skipped("oversized")
                    self._discarding = True
                return
            line, self._buf = self._buf[:end], self._buf[end + 1 :]
            if self._discarding:
                self._discarding = False  # the rest of an oversized record
                continue
            if len(line) > MAX_RECORD:
                self._on_skipped("oversized")
            elif line.strip() and not line.startswith(b" "):  # continuation lines: the record's dictionary
                self._line(line)

    def _line(self, line: bytes) -> None:
        try:
            record = parse_record(line)
        except Malformed:
            self._on_skipped("malformed")
            return
        if record.seq <= self._last_seq or (self._after is not None and record.seq <= self._after):
            return  # judged before this start, or read already
        self._last_seq = record.seq
        xid = parse_xid(record)
        if xid is not None:
            self._deliver(xid, None if self._replaying else self._clock())

    def _idle(self) -> None:
        assert self._fd is not None
        if self._regular:
            self._stop.wait(self._poll_s)  # a stand-in file: poll() would call it readable for ever
            return
        p = select.poll()
        p.register(self._fd, select.POLLIN)
        p.register(self._wake_r, select.POLLIN)
        ready = p.poll(None)
        if any(fd == self._fd and ev & select.POLLHUP and not ev & select.POLLIN for fd, ev in ready):
            self._stop.wait(self._poll_s)  # a FIFO with no writer: hangs up until one opens it
