"""The event path's watchdog: a thread that sleeps until the next moment something about the event path is
due (the event thread's heartbeat expires, a retry of the event set or of a registration is due) and then
asks the event path to look (`check`). It makes the event path's repairs independent of the agent's
`--interval`: the check it runs wakes the agent, whose next pass rebuilds what is broken at once.

Idle, it wakes once per heartbeat (the event thread's wait bound), not at a fixed tick.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Watchdog:
    def __init__(
        self,
        *,
        due: Callable[[], float],
        check: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._due = due
        self._check = check
        self._clock = clock
        self._stop = threading.Event()
        self._poke = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="gpuguard-nvml-watchdog", daemon=True)
            self._thread.start()

    def poke(self) -> None:
        """Something's due time moved earlier: look again now."""
        self._poke.set()

    def stop(self) -> None:
        self._stop.set()
        self._poke.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(1.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poke.wait(max(0.0, self._due() - self._clock()))
            self._poke.clear()
            if self._stop.is_set():
                return
            if self._clock() >= self._due():
                self._check()
