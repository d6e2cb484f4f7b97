"""Repeat offenders against a real kube-apiserver, through the fake NVML library: a GPU whose Xid 79 returns
after two reboots is held (taint `repeat-offender`, label needs-repair, Event, condition), a further reboot
does not release it, `gpuguard status` shows it and `gpuguard release` (as an operator) lifts it; a GPU
whose faults are further apart than the window is never held; on a DRA node the GPU's own DeviceTaintRule
holds it the same way; a fabric that never completes (a node's cause) is recorded and holds no GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from gpuguard.quarantine.record import FaultRecord
from harness.dra import gpu_uuid, nvidia_slice
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
    healthy: str = GPUS_OK,
) -> Agent:
    """The node reboots: the agent stops, the kubelet posts a new bootID, the GPUs read healthy, a new agent
    (the same --state-dir on the node's disk) starts."""
    agent.stop()
    admin.set_boot_id(node, boot)
    state.write_text(healthy)
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
    eventually(lambda: admin.tainted_for(node) == "repeat-offender", 10, what="held")
    taint = admin.our_taint(node)
    assert taint is not None
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
    assert admin.tainted_for(node) == "repeat-offender"
    metric = "gpuguard_gpu_repeat_offender"
    assert sample(scrape(agent.port), metric, gpu="0", uuid=UUID) == 3.0  # the new agent's, from the disk

    status = gpuguard(control_plane, "status", "-o", "json")
    assert status.returncode == 0, status.stderr
    row = next(r for r in json.loads(status.stdout)["rows"] if r["node"] == node)
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


def test_on_a_dra_node_the_rule_of_a_gpu_whose_xid_returns_after_two_reboots_holds_it_until_released(
    admin: Admin, start_agent: Any, control_plane: Any, tmp_path: Path
) -> None:
    """The per-GPU quarantine (a ResourceSlice of gpu.nvidia.com in the node's pool): the GPU's own
    DeviceTaintRule says repeat-offender, the next reboot does not delete it, `gpuguard release` does; the
    node itself is never tainted."""
    node = f"repeat-dra-{int(time.time() * 1000) % 100000}"
    admin.make_node(node, boot_id="boot-a")
    custom: Any = kubernetes.client.CustomObjectsApi(admin.api)
    custom.create_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", nvidia_slice(node, gpus=2))
    ok = "".join(f"gpu {i} uuid={gpu_uuid(node, i)}\n" for i in range(2))
    xid = ok + "xid 1 79\n"
    held_uuid, name = gpu_uuid(node, 1), f"gpuguard.{node}.gpu-1"

    def rule() -> dict[str, Any] | None:
        items: list[dict[str, Any]] = (
            custom.list_cluster_custom_object(
                "resource.k8s.io", "v1", "devicetaintrules", label_selector=f"gpuguard.io/node={node}"
            ).get("items")
            or []
        )
        assert [i["metadata"]["name"] for i in items] in ([], [name]), items
        return items[0] if items else None

    def value() -> str | None:
        r = rule()
        return FaultRecord.read(r["metadata"].get("annotations") or {}).primary_reason if r else None

    state = tmp_path / "gpus.state"
    state.write_text(ok)
    agent, _, _ = start_agent(node=node, state=state, env=RESYNC)
    state.write_text(xid)
    eventually(lambda: value() == "xid-79" or None, 10, what="rule")
    for boot in ("boot-b", "boot-c"):
        agent = reboot(admin, start_agent, agent, node=node, state=state, boot=boot, healthy=ok)
        eventually(lambda: rule() is None or None, 10, what=f"rule deleted by the reboot to {boot}")
        state.write_text(xid)  # the Xid returns
        eventually(lambda: value() or None, 10, what=f"rule in {boot}")
    eventually(lambda: value() == "repeat-offender" or None, 10, what="held")
    repair = "gpuguard.io/needs-repair"
    eventually(lambda: labels(admin, node).get(repair) == "true" or None, 10, what="the repair label")
    assert json.loads(annotations_of(admin, node)["gpuguard.io/repeat-offenders"]) == {held_uuid: 3}
    assert admin.our_taint(node) is None and not admin.node(node)["spec"].get("unschedulable")

    # A fourth boot: the GPU reads healthy, and still its rule holds it.
    agent = reboot(admin, start_agent, agent, node=node, state=state, boot="boot-d", healthy=ok)
    eventually(
        lambda: (
            ((rule() or {}).get("metadata", {}).get("annotations") or {}).get("gpuguard.io/boot-id")
            == "boot-d"
            or None
        ),
        10,
        what="the rule carried into the new boot",
    )
    time.sleep(1.5)  # 7 checks, more than 3x --recover-after, and 5 re-reads
    assert value() == "repeat-offender"
    assert not agent.events("device.recovered") and not agent.events("device.rule_write_rejected")

    released = gpuguard(control_plane, "release", "--node", node, "--gpu", held_uuid, "--by", "it-operator")
    assert released.returncode == 0, released.stderr
    eventually(lambda: rule() is None or None, 10, what="rule deleted after the release")
    eventually(lambda: repair not in labels(admin, node) or None, 10, what="the repair label gone")
    assert [e["by"] for e in agent.events("repeat.released")] == ["it-operator"]


FABRIC = "gpu 0 uuid=GPU-it-0 fabric_state=1\ngpu 1 uuid=GPU-it-1 fabric_state=1\n"


def test_a_fabric_that_never_completes_over_four_boots_holds_no_gpu(
    admin: Admin, start_agent: Any, tmp_path: Path
) -> None:
    """Fabric Manager fails at every boot: both GPUs read fabric-incomplete from the start of each boot (no
    grace, the test's scale) and stay quarantined; each boot is a new episode in the history, and no GPU is
    held (quarantine/counting.py). Before, the third boot held both."""
    config = tmp_path / "signals.yaml"
    config.write_text("signals:\n  fabric-incomplete: {window_s: 0}\n")
    args = ("--signals-config", str(config))
    state = tmp_path / "fabric.state"
    state.write_text(FABRIC)  # from the agent's first read: a fabric the fake never reported is unsupported
    agent, node, state = start_agent(boot_id="boot-a", env=RESYNC, args=args, state=state)

    def fabric_taint() -> bool:
        return admin.tainted_for(node) == "fabric-incomplete"

    def opened() -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = agent.events("repeat.episode_opened")
        return events

    eventually(fabric_taint, 10, what="fabric taint")
    for boot in ("boot-b", "boot-c", "boot-d"):
        agent = reboot(
            admin, start_agent, agent, node=node, state=state, boot=boot, args=args, healthy=FABRIC
        )
        eventually(lambda: len(opened()) == 2, 10, what=f"an episode per GPU in {boot}")
        assert all(e["counted"] is False and e["reasons"] == ["fabric-incomplete"] for e in opened())
    time.sleep(1.0)  # more reconciles: a hold would show by now
    assert fabric_taint()
    assert "gpuguard.io/needs-repair" not in labels(admin, node)
    assert "gpuguard.io/repeat-offenders" not in annotations_of(admin, node)
    assert not [e for e in admin.events_for(node) if e["reason"] == "GPURepeatOffender"]
    assert not agent.events("repeat.escalated")
    gpus = json.loads((agent.state_dir / "history.json").read_text())["gpus"]
    for uuid in ("GPU-it-0", "GPU-it-1"):
        assert len(gpus[uuid]["episodes"]) == 4 and gpus[uuid]["escalated"] is None


def test_a_stolen_token_that_removes_a_held_nodes_taint_does_not_free_the_gpu(
    admin: Admin, start_agent: Any, control_plane: Any
) -> None:
    """The attack: the node's own agent token (the policy lets it remove its own gpuguard.io/ taints) took
    the repeat-offender taint off; the agent recorded an operator's override and left the GPU in service. Now
    only a release lifts a hold: the taint is back within a re-read, and after a restart of the agent."""
    from tests.integration.test_admission import MERGE, agent_core

    agent, node, state = start_agent(boot_id="boot-a", env=RESYNC)
    state.write_text(XID)
    eventually(lambda: admin.our_taint(node), 10, what="taint")
    for boot in ("boot-b", "boot-c"):
        agent = reboot(admin, start_agent, agent, node=node, state=state, boot=boot)
        eventually(lambda: admin.our_taint(node) is None, 10, what=f"released by the reboot to {boot}")
        state.write_text(XID)
        eventually(lambda: admin.our_taint(node), 10, what=f"taint in {boot}")
    eventually(lambda: admin.tainted_for(node) == "repeat-offender", 10, what="held")
    core = agent_core(admin, control_plane, node)

    def strip() -> None:
        taints = admin.node(node)["spec"].get("taints") or []
        kept = [t for t in taints if t["key"] != TAINT]
        body = {"spec": {"taints": kept}, "metadata": {"labels": {"gpuguard.io/quarantined": None}}}
        core.patch_node(node, body, **MERGE)  # the label only with the taint (the policy)

    strip()
    eventually(lambda: admin.tainted_for(node) == "repeat-offender", 10, what="put back")
    assert not agent.events("node.taint_removed_by_operator")
    agent.stop()
    strip()
    agent, _, _ = start_agent(node=node, state=state, host_boot_id="host-boot-1", env=RESYNC)
    eventually(lambda: admin.tainted_for(node) == "repeat-offender", 10, what="restart")
    assert labels(admin, node)["gpuguard.io/needs-repair"] == "true"


TAINT = "gpuguard.io/gpu-unhealthy"
