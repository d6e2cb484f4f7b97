"""Escalation's pure decision (gpuguard/quarantine/escalation.py)."""

from __future__ import annotations

from gpuguard.quarantine.escalation import Limits, repeat_offenders

DAY = 86400.0
NOW = 100 * DAY


def test_three_faults_within_the_window_escalate() -> None:
    episodes = {"GPU-a": [NOW - 2 * DAY, NOW - DAY, NOW - 60]}
    assert repeat_offenders(episodes, Limits(), NOW) == {"GPU-a": 3}


def test_two_faults_do_not_escalate() -> None:
    assert repeat_offenders({"GPU-a": [NOW - DAY, NOW]}, Limits(), NOW) == {}


def test_a_gpu_that_faults_once_per_week_is_never_escalated() -> None:
    weekly = [NOW - k * 7 * DAY - 1 for k in range(10)]
    assert repeat_offenders({"GPU-a": weekly}, Limits(), NOW) == {}


def test_limit_zero_turns_escalation_off() -> None:
    episodes = {"GPU-a": [NOW - 3, NOW - 2, NOW - 1, NOW]}
    assert repeat_offenders(episodes, Limits(limit=0), NOW) == {}


def test_only_the_offending_gpu_is_named() -> None:
    episodes = {"GPU-a": [NOW - 3, NOW - 2, NOW - 1], "GPU-b": [NOW - 1]}
    assert repeat_offenders(episodes, Limits(), NOW) == {"GPU-a": 3}
