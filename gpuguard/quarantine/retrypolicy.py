"""The reconciler's retries of transient API failures: exponential backoff with jitter, a server's
Retry-After honoured (capped at 30 s), a deadline, and a stop when the agent shuts down."""

from __future__ import annotations

import threading
from collections.abc import Callable

import tenacity

from gpuguard.core.errors import TransientApiError


def node_retrying(
    *,
    deadline: float,
    max_wait: float,
    stop: threading.Event,
    sleep: Callable[[float], None],
    before_sleep: Callable[[tenacity.RetryCallState], None],
) -> tenacity.Retrying:
    """Retries of TransientApiError only, re-raised once `deadline` seconds have passed or `stop` is set;
    `sleep` should wait on `stop`, so a shutdown is not held by a backoff."""
    return tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(TransientApiError),
        wait=_Wait(max_wait),
        stop=tenacity.stop_after_delay(deadline) | _StopOn(stop),
        sleep=sleep,
        before_sleep=before_sleep,
        reraise=True,
    )


class _Wait:
    """Exponential backoff with jitter, never shorter than a server's Retry-After (at most 30 s)."""

    def __init__(self, max_wait: float) -> None:
        self._base = tenacity.wait_exponential_jitter(multiplier=0.1, jitter=0.1, max=max_wait)

    def __call__(self, state: tenacity.RetryCallState) -> float:
        base = self._base(state)
        exc = state.outcome.exception() if state.outcome else None
        retry_after = getattr(exc, "retry_after", None)
        if retry_after:
            return max(base, min(float(retry_after), 30.0))
        return base


class _StopOn(tenacity.stop.stop_base):
    """Stop retrying once the agent shuts down."""

    def __init__(self, event: threading.Event) -> None:
        self._event = event

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self._event.is_set()
