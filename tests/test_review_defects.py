"""The defects a review of the node side's state machine found (issue 12), one test each, named after its
number. The ones about what lands on the Node run against the real API server, in
tests/integration/test_review_defects.py; these are the ones about arithmetic, files, logs, sockets and
configuration, which need no cluster."""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.request
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuguard import cli
from gpuguard.cli import settings as cli_settings
from gpuguard.config import Config, NodeSettings, PolicySettings, QuarantineLimit, parse_listen
from gpuguard.kube import kubeconfig
from gpuguard.model import AgentStatus, Fault, GpuReading, Snapshot, XidEvent
from gpuguard.policy import evaluate
from gpuguard.quarantine.node.view import NodeView
from gpuguard.quarantine.node.writers import DryRunNodeWriter
from gpuguard.quarantine.reconciler import NodeReconciler
from gpuguard.server import HealthServer
from gpuguard.state import StateStore, read_boot_id
from tests.agentproc import WatchProcess

ROOT = Path(__file__).resolve().parents[1]
XID = Fault("xid-79", "GPU has fallen off the bus (GPU 1, GPU-b)", uuid="GPU-b", gpu_index=1)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for k in list(os.environ):
        if k.startswith("GPUGUARD_") or k in (
            "NODE_NAME",
            "HTTPS_PROXY",
            "https_proxy",
            "NO_PROXY",
            "no_proxy",
        ):
            monkeypatch.delenv(k)
    yield monkeypatch


def watch_config(*args: str) -> Config:
    """The settings `gpuguard watch ARGS` would run with (flags and the environment, as click reads them)."""
    ctx = cli.watch.make_context("watch", list(args))
    with ctx:
        return cli_settings.config(ctx.params, watch=True)


# -- 4: the budget's GPU nodes and the DaemonSet's ---------------------------------------------------------


def test_defect_04_the_manifests_budget_counts_the_nodes_of_its_node_selector() -> None:
    docs = list(yaml.safe_load_all((ROOT / "deploy/daemonset.yaml").read_text()))
    pod = next(d for d in docs if d and d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    agent = next(c for c in pod["containers"] if c["name"] == "gpuguard")
    env = {e["name"]: e.get("value") for e in agent["env"]}
    selector = ",".join(f"{k}={v}" for k, v in sorted(pod["nodeSelector"].items()))
    assert env["GPUGUARD_GPU_NODE_SELECTOR"] == selector


# -- 5: percentages in floats ------------------------------------------------------------------------------


def test_defect_05_percentage_budgets_are_exact_not_floats() -> None:
    assert QuarantineLimit.parse("8.8%").of(375) == 33  # floats: 34
    wrong = [
        (f"{tenths / 10}%", size)
        for tenths in range(0, 1001)
        for size in range(1, 401)
        if QuarantineLimit.parse(f"{tenths / 10}%").of(size) != -(-(Fraction(tenths, 10) * size) // 100)
    ]
    assert wrong == []


# -- 11: an unreadable boot ID -----------------------------------------------------------------------------


def test_defect_11_an_unreadable_boot_id_never_carries_faults_across_a_reboot(tmp_path: Path) -> None:
    unreadable = str(tmp_path / "no-such-boot-id")
    StateStore(tmp_path / "state", boot_id=read_boot_id(unreadable)).save((XID,))
    # The host rebooted; its boot ID is still unreadable: nothing proves this is the same boot.
    assert StateStore(tmp_path / "state", boot_id=read_boot_id(unreadable)).load() == ()


# -- 12: the mock backend and the host's state directory ---------------------------------------------------


def test_defect_12_a_mock_run_without_dry_run_keeps_no_state_in_the_hosts_directory(
    clean_env: pytest.MonkeyPatch,
) -> None:
    cfg = watch_config("--backend", "mock", "--node", "gpu-1")
    assert cfg.state_dir is None


def test_defect_12_faults_a_mock_run_saved_are_never_restored_by_a_real_run(tmp_path: Path) -> None:
    StateStore(tmp_path, boot_id="boot-1", backend="mock").save((XID,))
    assert StateStore(tmp_path, boot_id="boot-1", backend="nvml").load() == ()


# -- 13: logs ----------------------------------------------------------------------------------------------


def test_defect_13_each_log_line_names_one_fault_one_node_and_a_structured_patch(tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        "gpus: 6\nevents:\n"
        "  - {at: 0.2, gpu: 3, ecc_uncorrected: 2}\n"
        "  - {at: 0.6, gpu: 5, xid: 79}\n"
        "  - {at: 1.0, gpu: 1, ecc_uncorrected: 1}\n"
    )
    p = WatchProcess(
        *(
            "--dry-run",
            "--backend",
            "mock",
            "--scenario",
            str(scenario),
            "--interval",
            "0.1",
            "--run-for",
            "1.8",
        )
    ).start()
    assert p.wait(30) == 0, p.lines[-10:]
    lines = p.lines
    added = [e for e in lines if e["event"] == "node.fault_added"]
    assert len(added) == 2
    for e in [*added, *(e for e in lines if e["event"] == "node.tainted")]:
        # reason, GPU, UUID and detail are of one and the same fault
        assert e["detail"].startswith(f"{e['reason']}: ") and f"GPU {e['gpu']}, {e['uuid']}" in e["detail"], e
    assert {e["node"] for e in lines if "node" in e} == {"dry-run"}
    patches = [e["patch"] for e in lines if e["event"] == "node.dry_run"]
    assert patches and all(isinstance(p, dict) for p in patches)
    conditions = [e["condition"] for e in lines if e["event"] == "node.dry_run_condition"]
    assert conditions and all(isinstance(c, dict) for c in conditions)


def test_defect_13_the_fault_added_line_is_about_the_fault_it_added() -> None:
    writer = DryRunNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b"))
    r = NodeReconciler(writer, NodeSettings(name="gpu-1", dry_run=True))
    healthy = (GpuReading(index=0, uuid="GPU-a"), GpuReading(index=1, uuid="GPU-b"))
    first = evaluate(
        Snapshot(gpus=healthy, xids=(XidEvent(0, "GPU-a", 79),)), previous=None, settings=PolicySettings()
    )
    sick = (healthy[0], GpuReading(index=1, uuid="GPU-b", ecc_uncorrected=4))
    second = evaluate(Snapshot(gpus=sick), previous=first, settings=PolicySettings())
    assert {f.reason for f in second.faults} == {"xid-79", "ecc"}  # the taint still names the Xid
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        for v in (first, second):
            r.submit(v, 0)
            r.reconcile_now()
    added = [e for e in logs if e["event"] == "node.fault_added"]
    assert len(added) == 1
    assert (added[0]["reason"], added[0]["gpu"], added[0]["uuid"]) == ("ecc", 1, "GPU-b")
    assert added[0]["detail"].startswith("ecc: 4 uncorrected")


# -- 14: IPv6 ----------------------------------------------------------------------------------------------

STATUS = AgentStatus(
    alive=True,
    ready=True,
    node="n",
    verdict=None,
    tainted=False,
    cordoned=False,
    dry_run=True,
    last_check=None,
)


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=3) as resp:
        return int(resp.status)


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6(), reason="no IPv6 loopback on this machine")
def test_defect_14_the_server_listens_on_an_ipv6_address() -> None:
    server = HealthServer(lambda: STATUS, **vars(parse_listen("[::1]:0")))
    server.start()
    try:
        assert _get(f"http://[::1]:{server.port}/healthz") == 200
    finally:
        server.stop()


@pytest.mark.skipif(not _has_ipv6(), reason="no IPv6 loopback on this machine")
def test_defect_14_the_default_listen_address_serves_ipv4_and_ipv6_probes() -> None:
    settings = parse_listen(cli.DEFAULT_LISTEN)
    server = HealthServer(lambda: STATUS, host=settings.host, port=0)
    server.start()
    try:
        assert _get(f"http://127.0.0.1:{server.port}/healthz") == 200
        assert _get(f"http://[::1]:{server.port}/healthz") == 200
    finally:
        server.stop()


def test_defect_14_the_chart_does_not_hard_code_an_ipv4_listen_address() -> None:
    template = (ROOT / "deploy/helm/gpuguard/templates/daemonset.yaml").read_text()
    assert "0.0.0.0" not in template


# -- 15: proxies and empty environment values --------------------------------------------------------------


def _kubeconfig(tmp_path: Path, server: str, user: dict[str, Any]) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return str(path)


def test_defect_15_a_plain_kubeconfig_honours_https_proxy_and_no_proxy(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    path = _kubeconfig(tmp_path, "https://api.cluster.example:6443", {"token": "t"})
    clean_env.setenv("HTTPS_PROXY", "http://proxy.corp.example:3128")
    assert kubeconfig.from_kubeconfig(path).proxy == "http://proxy.corp.example:3128"
    clean_env.setenv("NO_PROXY", "localhost,.cluster.example")
    assert kubeconfig.from_kubeconfig(path).proxy is None


def test_defect_15_an_exec_plugin_kubeconfig_honours_no_proxy(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    credential = json.dumps(
        {"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", "status": {"token": "t"}}
    )
    plugin = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": sys.executable,
        "args": ["-c", f"print({credential!r})"],
        "interactiveMode": "Never",
    }
    path = _kubeconfig(tmp_path, "https://10.20.30.40:6443", {"exec": plugin})
    clean_env.setenv("HTTPS_PROXY", "http://proxy.corp.example:3128")
    creds = kubeconfig.from_kubeconfig(path)
    assert creds.proxy == "http://proxy.corp.example:3128"
    assert creds.authorization is not None and creds.authorization() == "Bearer t"
    clean_env.setenv("NO_PROXY", "10.0.0.0/8")
    assert kubeconfig.from_kubeconfig(path).proxy is None


def test_defect_15_empty_environment_values_behave_like_the_empty_flags(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("GPUGUARD_STATE_DIR", "")
    clean_env.setenv("GPUGUARD_IGNORE_XIDS", "")
    cfg = watch_config("--node", "gpu-1")
    flags = watch_config("--node", "gpu-1", "--state-dir", "", "--ignore-xids", "")
    assert cfg == flags
    assert cfg.state_dir is None and cfg.policy.ignored_xids == frozenset()
