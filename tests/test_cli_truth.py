"""The operator's commands tell the truth: a kubeconfig whose login cannot work is exit 2 naming the plugin
and the file (not a stray `ERROR:root:` line and an anonymous request), every flag of every command reads
GPUGUARD_<FLAG>, a number that is not finite is refused, and a kubeconfig named but missing is exit 2."""

from __future__ import annotations

import os
from pathlib import Path

import click
import pytest

from gpuguard import cli
from tests.test_cli import run

EXEC_USER = "{exec: {apiVersion: client.authentication.k8s.io/v1beta1, command: %s, args: [token]}}"


def _kubeconfig(tmp_path: Path, user: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\ncurrent-context: x\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        f"users: [{{name: u, user: {user}}}]\n"
    )
    return path


COMMANDS = [("status",), ("release", "--node", "gpu-1"), ("uninstall", "--all")]


@pytest.mark.parametrize("plugin", ["aws", "gke-gcloud-auth-plugin"])
@pytest.mark.parametrize("command", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_missing_exec_login_plugin_is_exit_2_naming_the_plugin_and_the_kubeconfig(
    tmp_path: Path, plugin: str, command: tuple[str, ...]
) -> None:
    path = _kubeconfig(tmp_path, EXEC_USER % plugin)
    empty = tmp_path / "bin"
    empty.mkdir()
    r = run(*command, "--kubeconfig", str(path), env={"PATH": str(empty)})
    assert r.returncode == 2, r.stderr
    assert r.stderr == (
        f"gpuguard: error: {command[0]}: kubeconfig {path}: the exec login plugin {plugin!r} is not "
        "installed (not found on PATH); install it (e.g. the cloud's CLI) or use a kubeconfig with a token "
        "or a client certificate\n"
    )


def test_a_failing_exec_login_plugin_is_exit_2_with_its_message_and_no_anonymous_request(
    tmp_path: Path,
) -> None:
    plugin = tmp_path / "login"
    plugin.write_text("#!/bin/sh\necho 'Unable to locate credentials' >&2\nexit 255\n")
    plugin.chmod(0o755)
    path = _kubeconfig(tmp_path, EXEC_USER % "./login")
    r = run("status", "--kubeconfig", str(path))
    assert r.returncode == 2, r.stderr
    assert r.stderr == (
        f"gpuguard: error: status: kubeconfig {path}: the exec login plugin './login' failed: "
        "exec: process returned 255. Unable to locate credentials\n"
    )
    assert "ERROR:root" not in r.stderr and "unreachable" not in r.stderr


def _params() -> list[tuple[str, click.Parameter]]:
    return [
        (name, p)
        for name, command in cli.cli.commands.items()
        for p in command.params
        if p.expose_value and isinstance(p, click.Option)
    ]


@pytest.mark.parametrize(("command", "param"), _params(), ids=[f"{c} {p.name}" for c, p in _params()])
def test_every_flag_of_every_command_reads_gpuguard_flag_from_the_environment(
    command: str, param: click.Parameter
) -> None:
    envvar = param.envvar if isinstance(param.envvar, list | tuple) else [param.envvar]
    assert envvar[0] == f"GPUGUARD_{(param.name or '').upper()}", (command, param.opts)


def test_gpuguard_fail_on_degraded_from_the_environment_is_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("GPUGUARD_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("GPUGUARD_FAIL_ON_DEGRADED", "1")
    assert cli.cli.commands["check"].make_context("check", []).params["fail_on_degraded"] is True


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "infinity"])
@pytest.mark.parametrize(
    "args",
    [
        ("check", "--backend", "mock", "--at", "{}"),
        ("watch", "--dry-run", "--backend", "mock", "--run-for", "{}"),
        ("watch", "--dry-run", "--backend", "mock", "--flap-window", "{}"),
        ("watch", "--dry-run", "--backend", "mock", "--api-qps", "{}"),
        ("release", "--node", "n1", "--wait", "--timeout", "{}"),
    ],
    ids=["check --at", "watch --run-for", "watch --flap-window", "watch --api-qps", "release --timeout"],
)
def test_a_number_that_is_not_finite_is_refused_in_one_line(args: tuple[str, ...], value: str) -> None:
    r = run(*[a.format(value) for a in args], timeout=20)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("gpuguard: error: ") and "not a finite number" in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1


def test_a_number_that_is_not_finite_in_the_environment_is_refused_naming_the_variable() -> None:
    r = run("check", "--backend", "mock", env={"GPUGUARD_AT": "nan"})
    assert r.returncode == 2 and "GPUGUARD_AT" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


@pytest.mark.parametrize("command", ["check", "watch"])
def test_a_kubeconfig_named_but_missing_is_exit_2(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    extra = ("--run-for", "1") if command == "watch" else ()
    r = run(command, "--backend", "mock", "--node", "n1", "--kubeconfig", str(missing), *extra)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr == f"gpuguard: error: --kubeconfig {missing}: no such file\n"


def test_uninstalls_one_rule_is_written_the_same_in_the_readme_and_operations_md() -> None:
    from gpuguard.cli.uninstall import RULE
    from tests.test_cli import ROOT

    for doc in ("README.md", "docs/operations.md"):
        assert RULE in " ".join((ROOT / doc).read_text().split()), doc


def test_check_says_how_many_gpus_of_how_many_are_unhealthy() -> None:
    r = run("check", "--backend", "mock", "--at", "6")
    assert r.returncode == 1
    assert r.stdout.splitlines()[-1] == "UNHEALTHY: 2 of 8 GPUs unhealthy"


def test_the_demo_ends_with_one_line_saying_what_it_would_have_done() -> None:
    r = run(
        "watch", "--dry-run", "--backend", "mock", "--interval", "0.5", "--run-for", "6.5",
        "--listen", "127.0.0.1:0", "--log-format", "json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    import json

    last = json.loads(r.stderr.splitlines()[-1])
    assert last["event"] == "agent.dry_run_summary"
    assert last["summary"] == "would taint and cordon node dry-run (2 of 8 GPUs unhealthy); wrote nothing"
