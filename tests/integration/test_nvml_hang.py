"""A hung NVML call against the real kube-apiserver and the fake NVML library: an ECC read that
never returns on one GPU, and an Xid 79 on it during the hang."""

from __future__ import annotations

import time
from typing import Any

import pytest

from harness.kube import GPUS_OK, Admin, eventually
from tests.integration.fixtures import admin, start_agent  # noqa: F401

pytestmark = pytest.mark.timeout(240)

HUNG = GPUS_OK + "hang nvmlDeviceGetTotalEccErrors gpu=1\n"


def test_a_hung_call_with_an_xid_during_the_hang_quarantines_and_a_restart_reports_it_at_once(
    admin: Admin, start_agent: Any
) -> None:
    """The node is tainted within the call deadline (1 s here) plus a check and the write; /healthz is 200
    throughout with the stuck call on it; an agent restarted while the driver still hangs (the Xid is not
    delivered again) restores both faults from --state-dir and reports them from its first check."""
    agent, node, state = start_agent(args=("--nvml-call-timeout", "1"))
    t0 = time.monotonic()
    state.write_text(HUNG + "xid 1 79\n")
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    took = time.monotonic() - t0
    assert took < 1 + 3, took
    code, doc = agent.healthz()
    assert code == 200 and doc["nvml_stuck_calls"], doc
    reasons = {r.split(":")[0] for g in doc["gpus"] if g["uuid"] == "GPU-it-1" for r in g["reasons"]}
    assert reasons == {"gpu-unresponsive", "xid-79"}, doc
    assert admin.tainted_for(node) in ("gpu-unresponsive", "xid-79")
    agent.kill()
    state.write_text(HUNG)  # the driver never replays the Xid to a new process
    restarted, _, _ = start_agent(node=node, state=state, args=("--nvml-call-timeout", "1"))
    code, doc = restarted.healthz()
    assert code == 200
    reasons = {r.split(":")[0] for g in doc["gpus"] if g["uuid"] == "GPU-it-1" for r in g["reasons"]}
    assert reasons == {"gpu-unresponsive", "xid-79"}, doc
    assert admin.our_taint(node) is not None
