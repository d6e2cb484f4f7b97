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


class WriteRetry:
    """`log`: the store's logger; it logs the event `unavailable` once when writes start failing and
    `resumed` once when one succeeds (each store names its own, e.g. `state.unavailable`, `state.resumed`)."""

    def __init__(
        self,
        log: Any,
        *,
        unavailable: str,
        resumed: str,
        directory: str,
        note: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._unavailable, self._resumed = unavailable, resumed
        self._directory = directory
        self._note = note
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
