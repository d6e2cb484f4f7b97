"""The client-side rate limit of a connection to the API server: client-go's token bucket.

A request takes one token, and a caller that reserves a later request's token says so
(`Client.request(tokens=...)`, the node writer's read-modify-write): a fault's few requests fit in its burst
and wait for nothing, while an agent whose loop goes wrong (a conflict storm, a retry bug) is held to a few
requests a second instead of hammering the API server once per agent of a 5,000-node fleet.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gpuguard.core.errors import ConfigError


class RateLimiter:
    """A token bucket (client-go's client-side limit): on average `qps` requests a second, up to `burst` at
    once. Thread-safe; each caller reserves its token and sleeps for its own share, so requests leave in the
    order they asked. qps 0: no limit."""

    def __init__(
        self,
        qps: float,
        burst: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if qps < 0 or burst < 1:
            raise ConfigError("a rate limit needs qps >= 0 and burst >= 1")
        self.qps, self.burst = qps, burst
        self._clock, self._sleep = clock, sleep
        self._tokens = float(burst)
        self._last = clock()
        self._lock = threading.Lock()
        self.waited = 0.0
        """Seconds callers have slept here in all (the bench reports it)."""

    def acquire(self, tokens: float = 1.0) -> float:
        """Take `tokens`, sleeping until they are there; the seconds slept."""
        if self.qps == 0 or tokens <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.qps)
            self._last = now
            self._tokens -= tokens
            wait = -self._tokens / self.qps if self._tokens < 0 else 0.0
            self.waited += wait
        if wait > 0:
            self._sleep(wait)
        return wait
