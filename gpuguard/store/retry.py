"""A kept file's writes after one fails: tried again with backoff, never given up for the life of the process.

A full disk (ENOSPC), a read-only remount or a directory removed is usually over in minutes; a store that
stopped writing at the first failure would lose every fault recorded after the disk recovered at the next
restart. So a failed write is retried at the store's next save once its backoff has passed (FIRST_S, doubled
per failure up to MOST_S, on a monotonic clock), one warning when writes start failing and one info line when
they resume.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# The first retry after this many seconds, doubled per failure up to MOST_S: a save runs at each check
# (seconds apart), so a broken disk costs one failed write per backoff, not one per check.
FIRST_S = 5.0
MOST_S = 300.0


# Each kept file's lines: the event when its writes start failing, the event when one succeeds again, and
# what the failure costs meanwhile (the note of the first line).
KEPT = {
    "state": ("state.unavailable", "state.resumed", "fault state kept in memory until a write succeeds"),
    "history": (
        "history.unavailable",
        "history.resumed",
        "history kept in memory until a write succeeds: a reboot now forgets repeat offenders",
    ),
    "baselines": (
        "baselines.unavailable",
        "baselines.resumed",
        "baselines kept in memory until a write succeeds: a restarted agent now takes new ones",
    ),
}


class WriteRetry:
    """`log`: the store's logger, `kept` the file's name in KEPT: it logs KEPT's `unavailable` event once
    when writes start failing and its `resumed` event once when one succeeds."""

    def __init__(
        self, log: Any, kept: str, *, directory: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log = log
        self._unavailable, self._resumed, self._note = KEPT[kept]
        self._directory = directory
        self._clock = clock
        self.failures = 0
        self._next = 0.0

    def due(self) -> bool:
        """Whether to try a write now: always while writes succeed, after the backoff once one failed."""
        return not self.failures or self._clock() >= self._next

    def failed(self, exc: OSError) -> None:
        self.failures += 1
        delay = min(MOST_S, FIRST_S * 2 ** min(self.failures - 1, 16))
        self._next = self._clock() + delay
        if self.failures == 1:
            self._log.warning(
                self._unavailable,
                directory=self._directory,
                error=str(exc),
                retry_in_s=delay,
                note=self._note,
            )

    def succeeded(self) -> None:
        if self.failures:
            self._log.info(self._resumed, directory=self._directory, failed_writes=self.failures)
        self.failures = 0
