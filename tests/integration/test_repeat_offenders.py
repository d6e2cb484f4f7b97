"""Repeat offenders against a real kube-apiserver, through the fake NVML library: a GPU whose Xid 79 returns
after two reboots is held (taint `repeat-offender`, label needs-repair, Event, condition), a further reboot
does not release it, `gpuguard status` shows it and `gpuguard release` (as an operator) lifts it; a GPU
whose faults are further apart than the window is never held."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness.kube import GPUS_OK, Admin, Agent, eventually
from tests.integration.fixtures import (  # noqa: F401
    RESYNC,
    admin,
    annotations_of,
    labels,
    start_agent,
)
from tests.integration.test_ecosystem import sample, scrape

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
XID = GPUS_OK + "xid 0 79\n"
UUID = "GPU-it-0"


def gpuguard(control_plane: Any, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as an operator runs it, with the admin's kubeconfig."""
    return subprocess.run(
        [sys.executable, "-m", "gpuguard", *args, "--kubeconfig", str(control_plane.kubeconfig_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )


def condition(admin: Admin, node: str) -> dict[str, Any]:
    conds = admin.node(node).get("status", {}).get("conditions") or []
    return next((c for c in conds if c["type"] == "GPUHealthy"), {})


def reboot(
    admin: Admin,
    start_agent: Any,
    agent: Agent,
    *,
    node: str,
    state: Path,
    boot: str,
    args: tuple[str, ...] = (),
) -> Agent:
    """The node reboots: the agent stops, the kubelet posts a new bootID, the GPUs read healthy, a new agent
    (the same --state-dir on the node's disk) starts."""
    agent.stop()
    admin.set_boot_id(node, boot)
    state.write_text(GPUS_OK)
    host = f"host-rebooted-to-{boot}"
    new, _, _ = start_agent(node=node, state=state, host_boot_id=host, env=RESYNC, args=args)
    return new  # type: ignore[no-any-return]


def test_an_xid_that_returns_after_two_reboots_holds_the_gpu_until_an_operator_releases_it(
    admin: Admin, start_agent: Any, control_plane: Any
) -> None:
    agent, node, state = start_agent(boot_id="boot-a", env=RESYNC)
    state.write_text(XID)
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    for boot in ("boot-b", "boot-c"):
        agent = reboot(admin, start_agent, agent, node=node, state=state, boot=boot)
        eventually(lambda: admin.our_taint(node) is None, 10, what=f"released by the reboot to {boot}")
        state.write_text(XID)  # the Xid returns
        eventually(lambda: admin.our_taint(node), 10, what=f"taint in {boot}")
    taint = eventually(
        lambda: (t := admin.our_taint(node)) and t["value"] == "repeat-offender" and t, 10, what="held"
    )
    assert taint["effect"] == "NoSchedule"
    assert labels(admin, node)["gpuguard.io/needs-repair"] == "true"
    assert labels(admin, node)["gpuguard.io/quarantined"] == "true"  # counts against the budget
    assert json.loads(annotations_of(admin, node)["gpuguard.io/repeat-offenders"]) == {UUID: 3}
    eventually(
        lambda: [e for e in admin.events_for(node) if e["reason"] == "GPURepeatOffender"], 10, what="Event"
    )
    assert eventually(lambda: condition(admin, node).get("reason") == "GPURepeatOffender", 10, what="cond")
    assert agent.events("repeat.escalated")

    # A fourth boot: the GPU reads healthy, the Xid's evidence is gone, and still the GPU is held.
    agent = reboot(admin, start_agent, agent, node=node, state=state, boot="boot-d")
    eventually(
        lambda: annotations_of(admin, node).get("gpuguard.io/boot-id") == "boot-d", 10, what="new boot"
    )
    time.sleep(1.5)  # 7 checks, more than 3x --recover-after, and 5 re-reads
    assert (admin.our_taint(node) or {}).get("value") == "repeat-offender"
    metric = "gpuguard_gpu_repeat_offender"
    assert sample(scrape(agent.port), metric, gpu="0", uuid=UUID) == 3.0  # the new agent's, from the disk

    status = gpuguard(control_plane, "status", "-o", "json")
    assert status.returncode == 0, status.stderr
    row = next(r for r in json.loads(status.stdout) if r["node"] == node)
    assert row["repeat_offenders"] == {UUID: 3} and row["reason"] == "repeat-offender"
    table = gpuguard(control_plane, "status")
    assert "REPEAT-OFFENDERS" in table.stdout and f"{UUID}=3" in table.stdout
    assert "held as repeat offenders" in table.stdout

    released = gpuguard(control_plane, "release", "--node", node, "--gpu", UUID, "--by", "it-operator")
    assert released.returncode == 0, released.stderr
    eventually(lambda: admin.our_taint(node) is None, 10, what="released by the operator")
    n = admin.node(node)
    assert "gpuguard.io/needs-repair" not in (n["metadata"].get("labels") or {})
    gone = {"gpuguard.io/release", "gpuguard.io/repeat-offenders", "gpuguard.io/needs-repair-placed"}
    assert not gone & set(n["metadata"].get("annotations") or {})
    assert [e["by"] for e in agent.events("repeat.released")] == ["it-operator"]
    assert sample(scrape(agent.port), metric, gpu="0", uuid=UUID) is None
    history = json.loads((agent.state_dir / "history.json").read_text())["gpus"][UUID]
    assert history["escalated"] is None and history["releases"][-1]["by"] == "it-operator"
    assert [e["ended"] for e in history["episodes"]] == ["reboot", "reboot", "reboot"]


def test_faults_further_apart_than_the_window_never_hold_the_gpu(admin: Admin, start_agent: Any) -> None:
    """Once a week in 7 days, at the test's scale: a 2 s window, an Xid per boot 3 s apart."""
    window = ("--repeat-window", "2")
    agent, node, state = start_agent(boot_id="boot-0", env=RESYNC, args=window)
    for i in range(1, 5):
        state.write_text(XID)
        eventually(lambda: admin.our_taint(node), 10, what=f"taint {i}")
        time.sleep(3.0)
        agent = reboot(admin, start_agent, agent, node=node, state=state, boot=f"boot-{i}", args=window)
        eventually(lambda: admin.our_taint(node) is None, 10, what=f"released by reboot {i}")
    assert "gpuguard.io/needs-repair" not in labels(admin, node)
    assert not [e for e in admin.events_for(node) if e["reason"] == "GPURepeatOffender"]
    history = json.loads((agent.state_dir / "history.json").read_text())["gpus"][UUID]
    assert len(history["episodes"]) == 4 and history["escalated"] is None
