"""The one fake clock of the tests: time that moves only when the test moves it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class Clock:
    """Monotonic seconds the test sets or advances (`clock.t += 3`), read by calling it (`clock()`), as the
    code's injected `clock` is. `wall()` is the same instant as a UTC datetime, `epoch` + t seconds (by
    default t is seconds since the Unix epoch), for code that also takes a `now`; `sleep(seconds)` advances
    the clock instead of waiting and records each wait in `slept`."""

    def __init__(self, t: float = 0.0, *, epoch: datetime = UNIX_EPOCH) -> None:
        self.t = t
        self.epoch = epoch
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def wall(self) -> datetime:
        return self.epoch + timedelta(seconds=self.t)

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += seconds
