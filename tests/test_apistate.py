"""quarantine/apistate.py over time, on a clock: the state /healthz shows and the lines an operator reads."""

from __future__ import annotations

from datetime import UTC, datetime

from structlog.testing import capture_logs

from gpuguard.core.errors import PermanentApiError, TransientApiError
from gpuguard.quarantine.apistate import ApiState, Intent
from harness.clock import Clock

PATCH = Intent("patch", "node gpu-1", '{"spec":{"unschedulable":true}}')
READ = Intent("get", "node gpu-1")


def make() -> tuple[ApiState, Clock]:
    clock = Clock(100.0)
    return ApiState("gpu-1", backoff=300.0, outage_every=30.0, clock=clock, wall=clock.wall), clock


def test_a_refusal_blocks_its_intent_for_the_backoff_and_no_other() -> None:
    state, clock = make()
    state.refused(PATCH, PermanentApiError("denied", status=403))
    assert state.blocked(PATCH) and not state.blocked(READ)
    assert not state.blocked(Intent("patch", "node gpu-1", '{"spec":{"unschedulable":false}}'))
    clock.t += 299.9
    assert state.blocked(PATCH) and state.health.state == "refused"
    clock.t += 0.1
    assert not state.blocked(PATCH)
    assert state.health.state == "ok" and state.health.since == datetime.fromtimestamp(400.0, UTC)


def test_health_says_since_when_and_keeps_the_start_of_a_state_it_stays_in() -> None:
    state, clock = make()
    assert (state.health.state, state.health.since, state.health.error) == ("ok", None, None)
    state.unreachable(TransientApiError("timed out"))
    clock.t += 10
    state.unreachable(TransientApiError("connection refused"))
    assert state.health.state == "unreachable" and state.health.error == "connection refused"
    assert state.health.since == datetime.fromtimestamp(100.0, UTC)
    clock.t += 5
    with capture_logs() as logs:
        state.accepted(READ)
    assert [e["event"] for e in logs] == ["api.available"] and logs[0]["down_for_s"] == 15.0
    assert state.health.state == "ok" and state.health.error is None


def test_a_refusal_during_an_outage_ends_the_outage_the_server_answered() -> None:
    state, clock = make()
    state.unreachable(TransientApiError("timed out"))
    clock.t += 3
    with capture_logs() as logs:
        state.refused(PATCH, PermanentApiError("denied", status=403))
    assert [e["event"] for e in logs] == ["api.available", "node.write_rejected"]
    assert state.health.state == "refused" and state.health.error == "denied"


def test_a_refusal_just_after_an_outage_is_retried_in_seconds_then_the_backoff_holds_again() -> None:
    """An API server that has just restarted answers 403 until its RBAC is loaded: the fault's write must not
    wait 5 minutes for that. Past the warm-up, a refusal is a policy's answer again."""
    state, clock = make()
    state.unreachable(TransientApiError("connection refused"))
    clock.t += 10
    state.answered()  # the API server is back
    clock.t += 1
    with capture_logs() as logs:
        state.refused(READ, PermanentApiError("forbidden", status=403))
    assert logs[-1]["retry_in_s"] == 2 and "just come back" in logs[-1]["note"]
    assert state.blocked(READ)
    clock.t += 2
    assert not state.blocked(READ)
    clock.t += 30  # past the warm-up: the same refusal now waits the whole backoff
    state.refused(READ, PermanentApiError("forbidden", status=403))
    clock.t += 299
    assert state.blocked(READ)


def test_a_refusal_that_ends_an_outage_is_retried_in_seconds_too() -> None:
    state, clock = make()
    state.unreachable(TransientApiError("connection refused"))
    clock.t += 10
    state.refused(PATCH, PermanentApiError("forbidden", status=403))
    clock.t += 2
    assert not state.blocked(PATCH)
    state.refused(PATCH, PermanentApiError("forbidden", status=403))  # still within the warm-up
    clock.t += 2
    assert not state.blocked(PATCH)


def test_a_refusal_with_no_outage_before_it_waits_the_whole_backoff() -> None:
    state, clock = make()
    state.refused(PATCH, PermanentApiError("denied", status=403))
    clock.t += 299
    assert state.blocked(PATCH)
