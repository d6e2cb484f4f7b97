"""The CLI as users run it (subprocesses): exit codes, one-line errors without tracebacks, and
`watch --dry-run` on the mock backend showing faults on /healthz within two intervals; and the settings
`watch` takes from its flags and the environment (in process, as click reads them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpuguard import cli
from gpuguard.cli import settings as cli_settings
from gpuguard.core.config import Config
from harness.agentproc import WatchProcess, healthz, wait_until

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("GPUGUARD_") and k != "NODE_NAME"}


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuguard", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**ENV, **(env or {})},
        cwd=ROOT,
    )


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return str(p)


def test_version_prints_the_version() -> None:
    r = run("version")
    assert r.returncode == 0 and r.stdout.startswith("gpuguard 0.")


def test_dash_dash_version_prints_the_version_like_the_version_command() -> None:
    assert run("--version").stdout == run("version").stdout
    assert run("--version").returncode == 0


@pytest.mark.parametrize(
    ("scenario", "at", "fault"),
    [
        (None, "6", "ecc: 2 uncorrected volatile ECC errors (GPU 3"),
        ("examples/ecc-then-xid.yaml", "4", "xid-79: GPU has fallen off the bus (GPU 0"),
        ("examples/gpu-lost.yaml", "2", "gpu-lost: GPU is lost"),
    ],
)
def test_check_at_seconds_shows_the_fault_a_shipped_scenario_has_by_then(
    scenario: str | None, at: str, fault: str
) -> None:
    args = ["check", "--backend", "mock", "--at", at] + (["--scenario", scenario] if scenario else [])
    result = run(*args)
    assert result.returncode == 1, result.stdout + result.stderr
    assert fault in result.stdout
    assert run(*[a for a in args if a not in ("--at", at)]).returncode == 0  # at 0: still healthy


def test_check_at_on_the_nvml_backend_is_a_usage_error() -> None:
    result = run("check", "--at", "5")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "gpuguard: error: --at needs --backend mock: it moves a scenario's clock, not a real GPU's"
    )


def test_the_demos_console_log_fits_a_120_column_terminal_and_loses_nothing() -> None:
    r = run(
        "watch", "--dry-run", "--backend", "mock", "--interval", "0.5", "--run-for", "6.5",
        "--listen", "127.0.0.1:0", "--log-format", "console", env={"COLUMNS": "120"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert max(len(line) for line in lines) <= 120, max(lines, key=len)
    text = " ".join(line.strip() for line in lines)
    for event in (
        "node.dry_run action=taint",
        "transition=node.tainted",
        "xid.ignored",
        "gpu.unhealthy",
        "agent.stopping",
    ):
        assert event in text
    assert '"gpuguard.io/cordoned": "true"' in text  # the whole patch, wrapped, not cut
    assert "None" not in text


def test_check_on_healthy_gpus_exits_0_and_prints_a_table(tmp_path: Path) -> None:
    r = run("check", "--backend", "mock", "--scenario", write(tmp_path, "gpus: 2"))
    assert r.returncode == 0, r.stderr
    assert "GPU-mock-1" in r.stdout and r.stdout.strip().endswith("healthy")


def test_check_on_an_unhealthy_gpu_exits_1(tmp_path: Path) -> None:
    s = write(tmp_path, "gpus: 2\nevents:\n  - {at: 0, gpu: 1, ecc_uncorrected: 2}\n")
    r = run("check", "--backend", "mock", "--scenario", s)
    assert r.returncode == 1
    assert "ecc: 2 uncorrected volatile ECC errors" in r.stdout


def test_check_json_output(tmp_path: Path) -> None:
    s = write(tmp_path, "gpus: 1\nevents:\n  - {at: 0, gpu: 0, lost: true}\n")
    r = run("check", "--backend", "mock", "--scenario", s, "-o", "json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["healthy"] is False and doc["gpus"][0]["reasons"][0].startswith("gpu-lost: ")


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["watch", "--interval", "abc", "--dry-run", "--backend", "mock"], {}, "--interval"),
        (["watch", "--interval", "0.01", "--dry-run", "--backend", "mock"], {}, "--interval must be between"),
        (["watch", "--dry-run", "--backend", "gpu"], {}, "--backend"),
        (["watch", "--dry-run", "--backend", "mock", "--scenario", "/nonexistent.yaml"], {}, "no such file"),
        (
            ["check", "--backend", "mock", "--scenario", "/dev/zero"],
            {},
            "scenario /dev/zero: not a regular file",
        ),
        (["check", "--backend", "mock", "--scenario", "/tmp"], {}, "scenario /tmp: not a regular file"),
        (["watch", "--backend", "mock"], {}, "no node name"),
        (
            ["watch", "--dry-run", "--backend", "mock", "--node", "Bad_Name!"],
            {},
            "not a valid Kubernetes node name",
        ),
        (["watch", "--dry-run", "--backend", "mock", "--listen", "nonsense"], {}, "--listen"),
        (["watch", "--dry-run", "--backend", "mock", "--ignore-xids", "13,x"], {}, "--ignore-xids"),
        (["watch", "--dry-run", "--backend", "mock", "--recover-after", "0"], {}, "--recover-after"),
        (["watch", "--dry-run", "--backend", "mock", "--taint-effect", "Evict"], {}, "--taint-effect"),
        (["watch", "--dry-run", "--backend", "mock", "--gate-taint-key", "a b"], {}, "--gate-taint-key"),
        (
            ["watch", "--dry-run", "--backend", "mock"],
            {"GPUGUARD_GATE_TAINT_KEY": "gpuguard.io/gpu-unhealthy"},
            "GPUGUARD_GATE_TAINT_KEY must not be gpuguard.io/gpu-unhealthy",
        ),
        (["watch", "--dry-run", "--backend", "mock"], {"GPUGUARD_GATE_REMOVAL": "kubelet"}, "--gate-removal"),
        (["watch", "--dry-run", "--scenario", "x.yaml"], {}, "--scenario needs --backend mock"),
        (["watch", "--dry-run", "--backend", "mock"], {"GPUGUARD_INTERVAL": "fast"}, "--interval"),
        (
            ["watch", "--dry-run", "--backend", "mock"],
            {"GPUGUARD_ECC_THRESHOLD": "-1"},
            "GPUGUARD_ECC_THRESHOLD must be >= 0",
        ),
        (["check", "--backend", "mock", "--expected-gpus", "-3"], {}, "--expected-gpus"),
        (["watch", "--dry-run", "--backend", "mock", "--ecc-threshold", "-1"], {}, "--ecc-threshold"),
        (["watch", "--nope"], {}, "No such option"),
        (["frobnicate"], {}, "No such command"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_without_a_traceback(
    args: list[str], env: dict[str, str], message: str
) -> None:
    r = run(*args, env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_scenario_larger_than_4_mib_ends_at_once_with_one_line_and_exit_2(tmp_path: Path) -> None:
    """A scenario is read only up to its bound: /dev/zero grew the process to 4.4 GB in 10 s."""
    big = tmp_path / "big.yaml"
    big.write_bytes(b"gpus: 1\n" + b"#" * (4 << 20))
    started = time.monotonic()
    r = run("check", "--backend", "mock", "--scenario", str(big))
    assert time.monotonic() - started < 10
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (
        r.stderr == f"gpuguard: error: scenario {big}: {(4 << 20) + 8} bytes, more than the 4 MiB allowed\n"
    )


def test_a_malformed_scenario_names_the_event_and_exits_2(tmp_path: Path) -> None:
    s = write(tmp_path, "gpus: 1\nevents:\n  - {at: 1, gpu: 4, xid: 79}\n")
    for cmd in (["check"], ["watch", "--dry-run"]):
        r = run(*cmd, "--backend", "mock", "--scenario", s)
        assert r.returncode == 2
        assert "events[0] (at: 1, gpu: 4): unknown GPU 4" in r.stderr
        assert "Traceback" not in r.stderr


def test_a_port_in_use_is_a_clear_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run("watch", "--dry-run", "--backend", "mock", "--listen", f"127.0.0.1:{port}", "--run-for", "1")
    assert r.returncode == 2 and "Address already in use" in r.stderr
    assert "Traceback" not in r.stderr


@contextmanager
def watching(
    scenario: str, *extra: str, env: dict[str, str] | None = None
) -> Iterator[tuple[WatchProcess, int]]:
    p = WatchProcess("--dry-run", "--backend", "mock", "--scenario", scenario, *extra, env=env).start()
    try:
        yield p, p.wait_listening()
    finally:
        p.stop()


@pytest.mark.parametrize(
    ("event", "reason"),
    [("ecc_uncorrected: 3", "ecc: 3 uncorrected"), ("xid: 79", "xid-79: GPU has fallen off the bus")],
)
def test_watch_dry_run_shows_a_fault_on_healthz_within_two_intervals(
    tmp_path: Path, event: str, reason: str
) -> None:
    s = write(tmp_path, f"gpus: 2\nevents:\n  - {{at: 1.0, gpu: 1, {event}}}\n")
    with watching(s, "--interval", "0.2") as (_, port):
        doc, _ = wait_until(port, lambda d: d["last_check"] is not None, 5)
        assert doc["healthy"] is True and doc["tainted"] is False and doc["dry_run"] is True
        # The event is due 1.0 s after start; allow two intervals (0.4 s) after that.
        doc, _ = wait_until(port, lambda d: not d["healthy"], 3)
        assert not doc["healthy"], doc
        gpu1 = doc["gpus"][1]
        assert gpu1["healthy"] is False and gpu1["reasons"][0].startswith(reason)
        doc, _ = wait_until(port, lambda d: d["tainted"], 1)
        assert doc["tainted"] and doc["cordoned"]


def test_a_dry_run_exports_the_quarantine_it_would_make_under_dry_run_true(tmp_path: Path) -> None:
    s = write(tmp_path, "gpus: 2\nevents:\n  - {at: 0.5, gpu: 1, ecc_uncorrected: 1}\n")
    with watching(s, "--interval", "0.2") as (_, port):
        wait_until(port, lambda d: d["tainted"], 5)
        time.sleep(0.5)  # the gauges follow the next check
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    assert 'gpuguard_node_quarantined{dry_run="true"} 1.0' in text
    assert 'gpuguard_node_quarantine_deferred{dry_run="true"} 0.0' in text
    assert 'dry_run="false"' not in text


def test_watch_dry_run_fault_appears_within_two_intervals_of_its_time(tmp_path: Path) -> None:
    s = write(tmp_path, "gpus: 2\nevents:\n  - {at: 2.0, gpu: 0, ecc_uncorrected: 1}\n")
    with watching(s, "--interval", "0.2") as (_, port):
        wait_until(port, lambda d: d["last_check"] is not None, 5)
        start = time.monotonic()
        doc, _ = wait_until(port, lambda d: not d["healthy"], 5)
        # The server came up just before the first check, so the event is due at most ~2.0 s from `start`.
        assert time.monotonic() - start <= 2.0 + 2 * 0.2 + 0.3
        assert not doc["healthy"]


def test_watch_dry_run_stays_healthy_for_an_ignored_xid(tmp_path: Path) -> None:
    s = write(tmp_path, "gpus: 2\nevents:\n  - {at: 0.3, gpu: 1, xid: 13}\n")
    with watching(s, "--interval", "0.2") as (_, port):
        time.sleep(1.2)
        doc = healthz(port)
        assert doc["healthy"] is True and doc["tainted"] is False and doc["last_check"] is not None


def test_watch_logs_the_exact_change_it_would_make_in_dry_run(tmp_path: Path) -> None:
    s = write(tmp_path, "gpus: 1\nevents:\n  - {at: 0.1, gpu: 0, xid: 48}\n")
    p = WatchProcess(
        *("--dry-run", "--backend", "mock", "--scenario", s, "--interval", "0.1", "--run-for", "1.5"),
        *("--node", "gpu-node-7"),
    ).start()
    assert p.wait(30) == 0, p.lines[-10:]
    events = p.lines
    names = [e["event"] for e in events]
    assert "gpu.unhealthy" in names and "node.tainted" not in names  # nothing written: no line says so
    dry = next(e for e in events if e["event"] == "node.dry_run")
    assert dry["transition"] == "node.tainted" and dry["reason"] == "xid-48"
    patch = dry["patch"]  # structured, not a JSON string inside the JSON line
    assert patch["spec"]["taints"] == [{"key": "gpuguard.io/gpu-unhealthy", "effect": "NoSchedule"}]
    assert patch["spec"]["unschedulable"] is True
    assert dry["node"] == "gpu-node-7"
    assert "check.completed" not in names  # nothing per healthy tick above debug


def test_a_dry_run_logs_each_transition_once_not_as_if_it_were_written(tmp_path: Path) -> None:
    s = write(tmp_path, "gpus: 2\nevents:\n  - {at: 0.1, gpu: 0, xid: 48}\n  - {at: 0.5, gpu: 1, xid: 79}\n")
    p = WatchProcess(
        *("--dry-run", "--backend", "mock", "--scenario", s, "--interval", "0.1", "--run-for", "1.5")
    ).start()
    assert p.wait(30) == 0, p.lines[-10:]
    node_lines = [(e["event"], e.get("transition")) for e in p.lines if e["event"].startswith("node.")]
    assert [x for x in node_lines if x[0] not in ("node.dry_run_condition", "node.dry_run_event")] == [
        ("node.dry_run", "node.tainted"),
        ("node.dry_run", "node.fault_added"),
    ], node_lines
    # A condition's one line is the writer's, with the whole condition: no node.condition beside it.
    assert len([x for x in node_lines if x[0] == "node.dry_run_condition"]) == 3, node_lines
    assert all(isinstance(e["patch"], dict) for e in p.lines if e["event"] == "node.dry_run")


# A review of the agent on a cluster, defect 13: logs.
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
    added = [e for e in lines if e["event"] == "node.dry_run" and e["transition"] == "node.fault_added"]
    assert len(added) == 2
    tainted = [e for e in lines if e["event"] == "node.dry_run" and e["transition"] == "node.tainted"]
    for e in [*added, *tainted]:
        # reason, GPU, UUID and detail are of one and the same fault
        assert e["detail"].startswith(f"{e['reason']}: ") and f"GPU {e['gpu']}, {e['uuid']}" in e["detail"], e
    assert {e["node"] for e in lines if "node" in e} == {"dry-run"}
    patches = [e["patch"] for e in lines if e["event"] == "node.dry_run"]
    assert patches and all(isinstance(p, dict) for p in patches)
    conditions = [e["condition"] for e in lines if e["event"] == "node.dry_run_condition"]
    assert conditions and all(isinstance(c, dict) for c in conditions)


def test_sigterm_stops_watch_promptly_with_exit_0(tmp_path: Path) -> None:
    s = write(tmp_path, "gpus: 1")
    with watching(s, "--interval", "3") as (p, _):
        time.sleep(0.3)
        start = time.monotonic()
        assert p.stop(timeout=5) == 0
        assert time.monotonic() - start < 2.0


def test_env_vars_configure_every_flag(tmp_path: Path) -> None:
    s = write(tmp_path, "gpus: 1\nevents:\n  - {at: 0, gpu: 0, xid: 13}\n")
    r = run("check", env={"GPUGUARD_BACKEND": "mock", "GPUGUARD_SCENARIO": s, "GPUGUARD_FATAL_XIDS": "13"})
    assert r.returncode == 1 and "xid-13" in r.stdout  # 13 made fatal by the env var
    r = run(
        "check",
        env={
            "GPUGUARD_BACKEND": "mock",
            "GPUGUARD_SCENARIO": write(tmp_path, "gpus: 2"),
            "GPUGUARD_EXPECTED_GPUS": "4",
        },
    )
    assert r.returncode == 1 and "expected 4 GPUs" in r.stdout


def watch_config(*args: str) -> Config:
    """The settings `gpuguard watch ARGS` would run with (flags and the environment, as click reads them)."""
    ctx = cli.watch.make_context("watch", list(args))
    with ctx:
        return cli_settings.config(ctx.params, watch=True)


# A review of the agent on a cluster, defect 15: empty environment values.
def test_defect_15_empty_environment_values_behave_like_the_empty_flags(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("GPUGUARD_STATE_DIR", "")
    clean_env.setenv("GPUGUARD_IGNORE_XIDS", "")
    cfg = watch_config("--node", "gpu-1")
    flags = watch_config("--node", "gpu-1", "--state-dir", "", "--ignore-xids", "")
    assert cfg == flags
    assert cfg.state_dir is None and cfg.policy.ignored_xids == frozenset()


# A review of the agent on a cluster, defect 12: the mock backend and the host's state directory.
def test_defect_12_a_mock_run_without_dry_run_keeps_no_state_in_the_hosts_directory(
    clean_env: pytest.MonkeyPatch,
) -> None:
    cfg = watch_config("--backend", "mock", "--node", "gpu-1")
    assert cfg.state_dir is None


# -- wording an operator reads ------------------------------------------------------------------------------


def test_help_fills_a_120_column_terminal_and_wraps_the_ignored_xids_between_codes() -> None:
    from gpuguard.core.config import DEFAULT_IGNORED_XIDS

    wide = run("watch", "--help", env={"COLUMNS": "120"})
    assert wide.returncode == 0
    widths = [len(line) for line in wide.stdout.splitlines()]
    assert 80 < max(widths) <= 120, max(widths)
    narrow = run("watch", "--help", env={"COLUMNS": "80"}).stdout
    assert max(len(line) for line in narrow.splitlines()) <= 80
    listed = " ".join(narrow.split()).split("replaces the default list (")[1].split(")")[0]
    assert listed == ", ".join(map(str, sorted(DEFAULT_IGNORED_XIDS)))  # no code split across two lines


def test_the_listening_line_names_the_address_bound_for_every_interface() -> None:
    r = run(
        "watch",
        "--dry-run",
        "--backend",
        "mock",
        "--run-for",
        "0.3",
        "--listen",
        ":0",
        "--log-format",
        "json",
    )
    assert r.returncode == 0, r.stderr
    line = next(json.loads(x) for x in r.stderr.splitlines() if '"server.listening"' in x)
    assert line["host"] in ("::", "0.0.0.0") and line["port"] > 0


def test_a_dry_run_says_it_keeps_no_state_and_writes_none(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    r = run(
        "watch", "--dry-run", "--backend", "mock", "--run-for", "4", "--interval", "0.2",
        "--state-dir", str(state), "--listen", "127.0.0.1:0", "--log-format", "json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    events = [json.loads(x) for x in r.stderr.splitlines()]
    off = [e for e in events if e["event"] == "state.off"]
    assert len(off) == 1 and off[0]["directory"] == str(state), events[:3]
    assert any(e.get("transition") == "node.tainted" for e in events)  # the demo's fault, 3 s in
    assert list(state.iterdir()) == []


@pytest.mark.parametrize(("flags", "name"), [((), "dry-run"), (("--node", "gpu-3"), "gpu-3")])
def test_healthz_names_the_node_the_log_lines_name(tmp_path: Path, flags: tuple[str, ...], name: str) -> None:
    s = write(tmp_path, "gpus: 1\n")
    with watching(s, "--interval", "0.2", *flags) as (p, port):
        doc, _ = wait_until(port, lambda d: d["last_check"] is not None, 5)
        assert doc["node"] == name
        assert {e["node"] for e in p.lines if e.get("event") == "agent.started"} == {name}


@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        ([], {"GPUGUARD_RUN_FOR": "0"}, "GPUGUARD_RUN_FOR must be > 0"),
        (["--run-for", "0"], {}, "--run-for must be > 0"),
        ([], {"GPUGUARD_NODE_RESYNC": "0"}, "GPUGUARD_NODE_RESYNC must be between 0 and 86400 seconds"),
        ([], {"GPUGUARD_IGNORE_XIDS": "79,x"}, "GPUGUARD_IGNORE_XIDS: 'x' is not an Xid code"),
        ([], {"GPUGUARD_LISTEN": ":70000"}, "GPUGUARD_LISTEN port must be 0..65535"),
        ([], {"NODE_NAME": "Bad_Name"}, "NODE_NAME: 'Bad_Name' is not a valid Kubernetes node name"),
        (
            ["--node", "Bad_Name"],
            {"NODE_NAME": "ok"},
            "--node: 'Bad_Name' is not a valid Kubernetes node name",
        ),
    ],
)
def test_a_value_from_the_environment_is_named_by_its_variable_not_by_the_flag(
    args: list[str], env: dict[str, str], line: str
) -> None:
    r = run("watch", "--dry-run", "--backend", "mock", *args, env=env)
    assert r.returncode == 2
    assert r.stderr.startswith(f"gpuguard: error: {line}"), r.stderr
    assert len(r.stderr.splitlines()) == 1


def _kubeconfig(tmp_path: Path, user: str, server: str = "https://127.0.0.1:1") -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\ncurrent-context: x\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
        f"clusters: [{{name: c, cluster: {{server: '{server}'}}}}]\nusers: [{{name: u, user: {user}}}]\n"
    )
    return path


@pytest.mark.parametrize("bad", ["cert", "key", "other key"])
def test_a_bad_client_certificate_is_one_line_naming_the_file_not_an_ssl_error(
    tmp_path: Path, bad: str
) -> None:
    from harness.fakes import self_signed_pem

    cert_pem, key_pem = self_signed_pem()
    if bad == "cert":
        cert_pem = b"-----BEGIN CERTIFICATE-----\nnot base64 at all\n"
    elif bad == "key":
        key_pem = b"junk"
    else:
        key_pem = self_signed_pem()[1]
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(key_pem)
    path = _kubeconfig(tmp_path, "{client-certificate: cert.pem, client-key: key.pem}")
    r = run("status", "--kubeconfig", str(path))
    assert r.returncode == 2, r.stderr
    cert, key = tmp_path.resolve() / "cert.pem", tmp_path.resolve() / "key.pem"
    prefix = f"gpuguard: error: status: kubeconfig {path}: "
    if bad == "cert":
        assert r.stderr.startswith(f"{prefix}client-certificate {cert}: not a PEM certificate"), r.stderr
    else:
        expected = f"{prefix}client-key {key}: not a PEM private key that matches client-certificate {cert}"
        assert r.stderr.startswith(expected), r.stderr
    assert "_ssl.c" not in r.stderr and "SSLError" not in r.stderr and len(r.stderr.splitlines()) == 1


def test_a_malformed_kubeconfig_names_the_file_and_the_line_not_a_unicode_string(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text("current-context: x\ncontexts: [\n  {name: x\n")
    r = run("status", "--kubeconfig", str(path))
    assert r.returncode == 2
    assert r.stderr == (
        f"gpuguard: error: status: kubeconfig {path}: not valid YAML at line 4, column 1: "
        "expected ',' or '}', but got '<stream end>'\n"
    )


def test_status_with_the_api_server_unreachable_exits_4_and_says_so(tmp_path: Path) -> None:
    """Exit 2 is a usage error; the command was right, the cluster did not answer."""
    r = run("status", "--kubeconfig", str(_kubeconfig(tmp_path, "{token: abc}")))
    assert r.returncode == 4, r.stderr
    assert r.stderr.startswith("gpuguard: error: status: the API server https://127.0.0.1:1 is unreachable: ")
    assert len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr
    assert "4 the API server is unreachable or refused the request" in " ".join(
        run("status", "--help").stdout.split()
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--node", "gpu-1", "--gpu", "GPU 0; rm"), '"gpu" is neither a GPU UUID nor "*"'),
        (("--node", "gpu-1", "--by", "x" * 65), '"by" is not a printable name'),
        (
            (
                "--node",
                "Not_A_Node",
            ),
            "Not_A_Node",
        ),
    ],
)
def test_release_refuses_what_the_agent_would_refuse_before_sending_anything(
    tmp_path: Path, args: tuple[str, ...], said: str
) -> None:
    r = run("release", "--kubeconfig", str(_kubeconfig(tmp_path, "{token: abc}")), *args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("gpuguard: error: release: ") and said in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1


def test_release_with_the_api_server_unreachable_exits_4_and_says_so(tmp_path: Path) -> None:
    r = run("release", "--kubeconfig", str(_kubeconfig(tmp_path, "{token: abc}")), "--node", "gpu-1")
    assert r.returncode == 4, r.stderr
    assert r.stderr.startswith(
        "gpuguard: error: release: the API server https://127.0.0.1:1 is unreachable: "
    )
