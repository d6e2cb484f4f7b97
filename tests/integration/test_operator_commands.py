"""`gpuguard release` and `gpuguard uninstall` on the real API server, where they write: release reads the
node before it writes (nothing held is refused, a pending release is not overwritten without --force,
--wait follows the node until the agent handled it), and uninstall removes only what gpuguard placed, warns
while gpuguard's DaemonSet exists and ends with a summary. The session's cluster has the DaemonSet of
deploy/daemonset.yaml applied (the `admin` fixture) but no kubelet: no agent runs, so the tests play it."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from harness.kube import ROOT, Admin
from tests.integration.fixtures import admin, unique  # noqa: F401

HELD = {
    "gpuguard.io/repeat-offenders": json.dumps({"GPU-aaaa": 3}),
    "gpuguard.io/needs-repair-placed": "true",
}


def gpuguard(control_plane: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROOT / ".venv" / "bin" / "gpuguard"), *args, "--kubeconfig", str(control_plane.kubeconfig_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _held_node(admin: Admin, name: str) -> None:
    admin.make_node(name)
    admin.patch_node(
        name, {"metadata": {"annotations": HELD, "labels": {"gpuguard.io/needs-repair": "true"}}}
    )


def _release_annotation(admin: Admin, name: str) -> Any:
    text = admin.node(name)["metadata"].get("annotations", {}).get("gpuguard.io/release")
    return json.loads(text) if text else None


def test_release_of_a_gpu_not_held_writes_nothing_and_exits_2(admin: Admin, control_plane: Any) -> None:
    name = unique("release-none")
    _held_node(admin, name)
    r = gpuguard(control_plane, "release", "--node", name, "--gpu", "GPU-aaab")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr == f"gpuguard: error: release: nothing held on GPU-aaab of {name} (held: GPU-aaaa)\n"
    assert _release_annotation(admin, name) is None
    bare = unique("release-bare")
    admin.make_node(bare)
    r = gpuguard(control_plane, "release", "--node", bare)
    assert r.returncode == 2
    assert r.stderr == (
        f"gpuguard: error: release: nothing held on {bare}: no GPU of it is a repeat offender\n"
    )
    r = gpuguard(control_plane, "release", "--node", unique("no-such-node"))
    assert r.returncode == 2 and "release: no node named no-such-node" in r.stderr, r.stderr


def test_a_pending_release_is_not_overwritten_without_force(admin: Admin, control_plane: Any) -> None:
    name = unique("release-pending")
    _held_node(admin, name)
    first = gpuguard(control_plane, "release", "--node", name, "--gpu", "GPU-aaaa", "--by", "alice")
    assert first.returncode == 0, first.stderr
    assert first.stdout == (
        f"{name}: release of GPU-aaaa by alice written; the agent lifts the hold at its next re-read\n"
    )
    second = gpuguard(control_plane, "release", "--node", name, "--by", "bob")
    assert second.returncode == 2
    assert second.stderr.startswith(f"gpuguard: error: release: a release is already pending on {name} (")
    assert second.stderr.endswith("not yet handled by its agent; --force replaces it\n")
    assert _release_annotation(admin, name)["by"] == "alice"
    forced = gpuguard(control_plane, "release", "--node", name, "--by", "bob", "--force")
    assert forced.returncode == 0, forced.stderr
    assert _release_annotation(admin, name) == {**_release_annotation(admin, name), "by": "bob", "gpu": "*"}


def test_release_wait_returns_once_the_agent_lifted_the_hold_and_times_out_without_one(
    admin: Admin,
    control_plane: Any,
) -> None:
    name = unique("release-wait")
    _held_node(admin, name)

    def agent() -> None:  # what the node's agent does at its next re-read
        time.sleep(1.5)
        gone = dict.fromkeys(["gpuguard.io/release", *HELD])
        admin.patch_node(
            name, {"metadata": {"annotations": gone, "labels": {"gpuguard.io/needs-repair": None}}}
        )

    thread = threading.Thread(target=agent)
    thread.start()
    r = gpuguard(control_plane, "release", "--node", name, "--wait", "--timeout", "30")
    thread.join()
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == f"{name}: the agent lifted the hold on every held GPU"

    stuck = unique("release-stuck")
    _held_node(admin, stuck)
    r = gpuguard(control_plane, "release", "--node", stuck, "--wait", "--timeout", "1")
    assert r.returncode == 1
    assert r.stderr.startswith(f"{stuck}: the agent has not handled the release within 1 s")


def test_uninstall_keeps_an_operators_gpu_unhealthy_taint_warns_while_the_daemonset_exists_and_sums_up(
    admin: Admin,
    control_plane: Any,
) -> None:
    ops, ours = unique("ops-rma"), unique("ours")
    rma = {"key": "gpuguard.io/gpu-unhealthy", "value": "rma-123", "effect": "NoSchedule"}
    admin.make_node(ops, taints=[rma], labels={"gpuguard.io/needs-repair": "true"})
    admin.make_node(ours, taints=[{**rma, "value": "ecc"}])
    admin.patch_node(ours, {"metadata": {"annotations": {"gpuguard.io/since": "2026-12-01T00:00:00Z"}}})
    r = gpuguard(control_plane, "uninstall", "--node", ops, "--node", ours)
    assert r.returncode == 0, r.stderr
    assert r.stderr == (
        "gpuguard: warning: uninstall: the DaemonSet gpuguard/gpuguard still exists: its agents put back "
        "what this removes; remove it first (helm uninstall, or kubectl delete on deploy/daemonset.yaml)\n"
    )
    assert r.stdout.splitlines() == [
        f"{ops}: clean: nothing of gpuguard's",
        f"{ops}: kept taint gpuguard.io/gpu-unhealthy=rma-123:NoSchedule, label gpuguard.io/needs-repair "
        "(an operator's, not gpuguard's)",
        f"{ours}: removed taint gpuguard.io/gpu-unhealthy, annotation gpuguard.io/since",
        "uninstall: removed gpuguard's marks from 1 of 2 nodes, deleted 0 device taint rules, kept 2 "
        "operator's marks",
    ]
    # docs/operations.md shows this output, names aside.
    doc = (ROOT / "docs" / "operations.md").read_text().split("gpuguard uninstall --all\n```\n", 1)[1]
    shown = doc.split("```text\n", 1)[1].split("```", 1)[0]
    assert shown == (r.stderr + r.stdout).replace(ops, "ops-rma-0").replace(ours, "ours-1")
    assert rma in admin.node(ops)["spec"]["taints"]
    assert admin.node(ops)["metadata"]["labels"]["gpuguard.io/needs-repair"] == "true"
    assert all(t["key"] != rma["key"] for t in admin.node(ours)["spec"].get("taints") or [])


def test_a_kubeconfig_that_skips_tls_verification_is_one_warning_line_not_one_per_request(
    control_plane: Any, tmp_path: Path
) -> None:
    doc = yaml.safe_load(control_plane.kubeconfig_path.read_text())
    for entry in doc["clusters"]:
        entry["cluster"].pop("certificate-authority-data", None)
        entry["cluster"]["insecure-skip-tls-verify"] = True
    path = tmp_path / "insecure"
    path.write_text(yaml.safe_dump(doc))
    r = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "gpuguard"), "status", "--kubeconfig", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == (
        "gpuguard: warning: status: the API server's certificate is not verified "
        "(insecure-skip-tls-verify in the kubeconfig)\n"
    )
