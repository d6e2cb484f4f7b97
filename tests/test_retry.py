"""gpuguard.store.retry: a kept file's writes after one fails, tried again once a backoff has passed on the
injected monotonic clock, never given up; one warning when writes start failing, one line when they resume."""

from __future__ import annotations

import structlog
from structlog.testing import capture_logs

from gpuguard.store import retry
from harness.clock import Clock

FULL = OSError(28, "No space left on device")


def test_a_write_is_due_at_once_while_writes_succeed() -> None:
    r = retry.WriteRetry(structlog.get_logger(), "state", directory="d", clock=Clock(-100.0))
    assert r.due() is True
    r.succeeded()
    assert r.due() is True and r.failures == 0


def test_after_a_failure_the_next_write_is_due_exactly_when_the_backoff_has_passed() -> None:
    clock = Clock(1000.0)
    r = retry.WriteRetry(structlog.get_logger(), "state", directory="d", clock=clock)
    r.failed(FULL)
    clock.t = 1000.0 + retry.FIRST_S - 0.001
    assert r.due() is False
    clock.t = 1000.0 + retry.FIRST_S
    assert r.due() is True


def test_the_backoff_is_five_seconds_doubled_per_failure_up_to_five_minutes() -> None:
    assert (retry.FIRST_S, retry.MOST_S) == (5.0, 300.0)
    clock = Clock()
    r = retry.WriteRetry(structlog.get_logger(), "state", directory="d", clock=clock)
    with capture_logs() as logs:
        for _ in range(40):  # far past the doubling's cap: no overflow, still the most
            r.failed(FULL)
    assert r.failures == 40 and logs[0]["retry_in_s"] == 5.0
    clock.t = 299.999
    assert r.due() is False
    clock.t = 300.0
    assert r.due() is True


def test_writes_failing_are_said_once_with_the_cost_and_resuming_once_with_the_count() -> None:
    r = retry.WriteRetry(structlog.get_logger(), "history", directory="/var/lib/gpuguard", clock=Clock())
    with capture_logs() as logs:
        r.failed(FULL)
        r.failed(FULL)
        r.succeeded()
        r.succeeded()
    assert logs == [
        {
            "event": "history.unavailable",
            "log_level": "warning",
            "directory": "/var/lib/gpuguard",
            "error": "[Errno 28] No space left on device",
            "retry_in_s": 5.0,
            "note": "history kept in memory until a write succeeds: a reboot now forgets repeat offenders",
        },
        {
            "event": "history.resumed",
            "log_level": "info",
            "directory": "/var/lib/gpuguard",
            "failed_writes": 2,
        },
    ]


def test_a_success_starts_the_backoff_over() -> None:
    clock = Clock()
    r = retry.WriteRetry(structlog.get_logger(), "baselines", directory="d", clock=clock)
    for _ in range(3):
        r.failed(FULL)
    r.succeeded()
    assert r.failures == 0 and r.due() is True
    r.failed(FULL)
    clock.t += retry.FIRST_S
    assert r.due() is True


def test_each_kept_file_has_its_own_lines() -> None:
    for kept in ("state", "history", "baselines"):
        r = retry.WriteRetry(structlog.get_logger(), kept, directory="d", clock=Clock())
        with capture_logs() as logs:
            r.failed(FULL)
            r.succeeded()
        assert [e["event"] for e in logs] == [f"{kept}.unavailable", f"{kept}.resumed"]
