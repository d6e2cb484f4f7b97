"""Living beside NVIDIA's GPU Operator (docs/operations.md): its driver container and driver-upgrade
controller unload and reload the kernel driver under a running gpuguard. Through the fake
libnvidia-ml.so.1: while the driver is gone NVML answers DRIVER_NOT_LOADED (init) and its GPUs answer
UNKNOWN; when it is back with fresh (reset) volatile ECC counters, a fault that the reload clears (ecc,
nvml-init) is released by gpuguard itself, and a fault that needs a reboot (a fatal Xid) stays until the
boot ID changes."""

from __future__ import annotations

import time
from typing import Any

import pytest

from harness.kube import GPUS_OK, Admin, eventually
from tests.integration.fixtures import admin, start_agent  # noqa: F401

pytestmark = pytest.mark.timeout(180)

DRIVER_GONE = "init_error DRIVER_NOT_LOADED\n" + GPUS_OK.replace(
    "GPU-it-0", "GPU-it-0 error=UNKNOWN"
).replace("GPU-it-1", "GPU-it-1 error=UNKNOWN")


def taint_value(admin: Admin, node: str) -> str | None:
    return admin.tainted_for(node)


def test_an_ecc_fault_held_through_a_driver_reload_is_released_when_the_reloaded_driver_reads_clean(
    admin: Admin, start_agent: Any
) -> None:
    agent, node, state = start_agent()
    state.write_text(GPUS_OK.replace("GPU-it-1", "GPU-it-1 ecc=2"))
    assert eventually(lambda: taint_value(admin, node), 10, what="ecc taint") == "ecc"
    state.write_text(DRIVER_GONE)  # the upgrade controller unloads the driver
    eventually(lambda: not agent.healthz()[1]["healthy"] and agent.healthz()[1], 10, what="driver gone seen")
    assert admin.our_taint(node) is not None  # still held while the driver is away
    assert admin.node(node)["spec"]["unschedulable"] is True
    state.write_text(GPUS_OK)  # the new driver: volatile ECC counters start at 0
    eventually(lambda: admin.our_taint(node) is None, 20, what="release after the reload")
    assert admin.node(node)["spec"].get("unschedulable") in (None, False)
    assert not [line for line in agent.lines if line.get("level") == "error"]


def test_an_nvml_init_fault_from_a_driver_not_yet_loaded_clears_once_the_driver_container_is_ready(
    admin: Admin, start_agent: Any, tmp_path: Any
) -> None:
    state = tmp_path / "gpus.state"
    state.write_text(DRIVER_GONE)  # the agent starts before the operator's driver container is ready
    agent, node, _ = start_agent(state=state)
    assert eventually(lambda: taint_value(admin, node), 15, what="nvml-init taint") == "nvml-init"
    state.write_text(GPUS_OK)  # the driver container has loaded the driver
    eventually(lambda: admin.our_taint(node) is None, 30, what="release when the driver is ready")
    doc = agent.healthz()[1]
    assert doc["healthy"] is True and doc["tainted"] is False
    assert len(doc["gpus"]) == 2


def test_a_fatal_xid_is_not_released_by_a_driver_reload_only_by_a_reboot(
    admin: Admin, start_agent: Any
) -> None:
    agent, node, state = start_agent()
    state.write_text(GPUS_OK + "xid 1 79\n")
    assert eventually(lambda: taint_value(admin, node), 10, what="xid taint") == "xid-79"
    state.write_text(DRIVER_GONE)
    eventually(lambda: not agent.healthz()[1]["healthy"], 10, what="driver gone seen")
    state.write_text(GPUS_OK)
    time.sleep(2)  # many checks (--interval 0.2) with the reloaded driver reading clean
    doc = agent.healthz()[1]
    assert doc["healthy"] is False and doc["tainted"] is True
    assert [r for g in doc["gpus"] for r in g["reasons"]] == [
        "xid-79: GPU has fallen off the bus (GPU 1, GPU-it-1)"
    ]
    assert taint_value(admin, node) == "xid-79"  # the fault's evidence (this boot) has not changed
