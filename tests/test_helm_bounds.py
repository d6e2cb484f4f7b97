"""One source of truth for the agent's settings: whatever `helm template` renders, the agent starts with, and
what the agent would refuse (exit 2 on every node: a fleet-wide crash loop) helm refuses before anything is
deployed. Every agent setting of the chart is rendered at and past its bounds, as `--set` and
`--set-string` pass it, and helm's answer is compared with the agent's own validation (the settings that
`gpuguard watch` builds from the variables the chart renders: gpuguard.cli.settings)."""

from __future__ import annotations

import os

import click
import pytest

from gpuguard.cli import cli, settings
from gpuguard.core.errors import ConfigError
from tests.helmtool import CHART, NAMESPACE, Helm, build_helm

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return build_helm(tmp_path_factory.mktemp("helm-home"))


def agent_accepts(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether `gpuguard watch` starts with these variables (flag parsing and the settings' validation)."""
    with monkeypatch.context() as m:
        for name in [k for k in os.environ if k.startswith("GPUGUARD_")]:
            m.delenv(name)
        for name, value in env.items():
            m.setenv(name, value)
        try:
            ctx = cli.commands["watch"].make_context("watch", ["--dry-run"])
            with ctx:
                settings.config(ctx.params, watch=True)
        except (click.ClickException, ConfigError):
            return False
    return True


def rendered_env(helm: Helm, args: list[str]) -> dict[str, str] | None:
    """The agent's GPUGUARD_ variables as the chart renders them; None where helm refuses the values."""
    result = helm.run("template", "gpuguard", str(CHART), "--namespace", NAMESPACE, *args)
    if result.returncode != 0:
        return None
    import yaml

    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    (daemonset,) = [d for d in docs if d["kind"] == "DaemonSet"]
    env = daemonset["spec"]["template"]["spec"]["containers"][0]["env"]
    return {e["name"]: e["value"] for e in env if e["name"].startswith("GPUGUARD_") and "value" in e}


GATE, FAULT = "example.com/gpu-unverified", "gpuguard.io/gpu-unhealthy"
# (a value, the variable it sets, its text as the agent reads it): each at a bound and just past it.
BOUNDS: list[tuple[list[str], str, str]] = [
    (["--set", "interval=0.05"], "GPUGUARD_INTERVAL", "0.05"),
    (["--set", "interval=0.049"], "GPUGUARD_INTERVAL", "0.049"),
    (["--set-string", "interval=0"], "GPUGUARD_INTERVAL", "0"),
    (["--set", "interval=0"], "GPUGUARD_INTERVAL", "0"),
    (["--set", "interval=3600"], "GPUGUARD_INTERVAL", "3600"),
    (["--set", "interval=3600.5"], "GPUGUARD_INTERVAL", "3600.5"),
    (["--set-string", "interval=3601"], "GPUGUARD_INTERVAL", "3601"),
    (["--set", "recovery.recoverAfter=1"], "GPUGUARD_RECOVER_AFTER", "1"),
    (["--set", "recovery.recoverAfter=0"], "GPUGUARD_RECOVER_AFTER", "0"),
    (["--set", "budget.maxQuarantined=0"], "GPUGUARD_MAX_QUARANTINED", "0"),
    (["--set", "budget.maxQuarantined=999999"], "GPUGUARD_MAX_QUARANTINED", "999999"),
    (["--set", "budget.maxQuarantined=1000000"], "GPUGUARD_MAX_QUARANTINED", "1000000"),
    (["--set", "budget.maxQuarantined=100%"], "GPUGUARD_MAX_QUARANTINED", "100%"),
    (["--set", "budget.maxQuarantined=100.000%"], "GPUGUARD_MAX_QUARANTINED", "100.000%"),
    (["--set", "budget.maxQuarantined=100.001%"], "GPUGUARD_MAX_QUARANTINED", "100.001%"),
    (["--set", "budget.maxQuarantined=150%"], "GPUGUARD_MAX_QUARANTINED", "150%"),
    (["--set", "budget.maxQuarantined=999.999%"], "GPUGUARD_MAX_QUARANTINED", "999.999%"),
    (["--set", "budget.maxQuarantined=12.5%"], "GPUGUARD_MAX_QUARANTINED", "12.5%"),
    (["--set", "budget.maxQuarantined=0.0001%"], "GPUGUARD_MAX_QUARANTINED", "0.0001%"),
    (["--set", "flapWindow=0"], "GPUGUARD_FLAP_WINDOW", "0"),
    (["--set", "flapWindow=604800"], "GPUGUARD_FLAP_WINDOW", "604800"),
    (["--set", "flapWindow=604801"], "GPUGUARD_FLAP_WINDOW", "604801"),
    (["--set", "flapWindow=999999"], "GPUGUARD_FLAP_WINDOW", "999999"),
    (["--set", "flapWindow=604800.5"], "GPUGUARD_FLAP_WINDOW", "604800.5"),
    (["--set-string", "flapWindow=999999"], "GPUGUARD_FLAP_WINDOW", "999999"),
    (["--set", "repeatLimit=0"], "GPUGUARD_REPEAT_LIMIT", "0"),
    (["--set", "repeatLimit=32"], "GPUGUARD_REPEAT_LIMIT", "32"),
    (["--set", "repeatLimit=33"], "GPUGUARD_REPEAT_LIMIT", "33"),
    (["--set", "repeatWindowSeconds=31536000"], "GPUGUARD_REPEAT_WINDOW", "31536000"),
    (["--set", "repeatWindowSeconds=31536001"], "GPUGUARD_REPEAT_WINDOW", "31536001"),
    (["--set", "repeatWindowSeconds=0"], "GPUGUARD_REPEAT_WINDOW", "0"),
    (["--set", "repeatWindowSeconds=0.5"], "GPUGUARD_REPEAT_WINDOW", "0.5"),
    (["--set-string", "repeatWindowSeconds=0.0"], "GPUGUARD_REPEAT_WINDOW", "0.0"),
    (["--set", "ignoredXids={999999}"], "GPUGUARD_IGNORE_XIDS", "999999"),
    (["--set", "ignoredXids={1000000}"], "GPUGUARD_IGNORE_XIDS", "1000000"),
    (["--set", "ignoredXids={99999999999}"], "GPUGUARD_IGNORE_XIDS", "99999999999"),
    (["--set", "fatalXids={999999}"], "GPUGUARD_FATAL_XIDS", "999999"),
    (["--set", "fatalXids={1000000}"], "GPUGUARD_FATAL_XIDS", "1000000"),
    (["--set", "eccThreshold=0"], "GPUGUARD_ECC_THRESHOLD", "0"),
    (["--set", "eccThreshold=-1"], "GPUGUARD_ECC_THRESHOLD", "-1"),
    (["--set", "apiServer.startupJitter=0"], "GPUGUARD_STARTUP_JITTER", "0"),
    (["--set", "apiServer.startupJitter=3600"], "GPUGUARD_STARTUP_JITTER", "3600"),
    (["--set", "apiServer.startupJitter=3601"], "GPUGUARD_STARTUP_JITTER", "3601"),
    (["--set", "apiServer.startupJitter=3600.5"], "GPUGUARD_STARTUP_JITTER", "3600.5"),
    (["--set", "apiServer.qps=0"], "GPUGUARD_API_QPS", "0"),
    (["--set", "apiServer.qps=1000"], "GPUGUARD_API_QPS", "1000"),
    (["--set", "apiServer.qps=1000.5"], "GPUGUARD_API_QPS", "1000.5"),
    (["--set-string", "apiServer.qps=1001"], "GPUGUARD_API_QPS", "1001"),
    (["--set", "apiServer.burst=1"], "GPUGUARD_API_BURST", "1"),
    (["--set", "apiServer.burst=0"], "GPUGUARD_API_BURST", "0"),
    (["--set", "apiServer.burst=1000"], "GPUGUARD_API_BURST", "1000"),
    (["--set", "apiServer.burst=1001"], "GPUGUARD_API_BURST", "1001"),
    (["--set", f"gate.taintKey={GATE}"], "GPUGUARD_GATE_TAINT_KEY", GATE),
    (["--set", f"gate.taintKey={FAULT}"], "GPUGUARD_GATE_TAINT_KEY", FAULT),
    (["--set", "quarantine.draDriver=" + "a" * 63], "GPUGUARD_DRA_DRIVER", "a" * 63),
    (["--set", "quarantine.draDriver=" + "a" * 64], "GPUGUARD_DRA_DRIVER", "a" * 64),
]  # fmt: skip


@pytest.mark.parametrize(("values", "variable", "text"), BOUNDS, ids=[" ".join(b[0]) for b in BOUNDS])
def test_helm_refuses_exactly_the_values_the_agent_would_refuse(
    helm: Helm, monkeypatch: pytest.MonkeyPatch, values: list[str], variable: str, text: str
) -> None:
    agent = agent_accepts({variable: text}, monkeypatch)
    env = rendered_env(helm, values)
    assert (env is not None) == agent, (
        f"helm {'accepts' if env is not None else 'refuses'}, the agent does not"
    )
    if env is not None:
        assert env[variable] == text or float(env[variable]) == float(text)
        assert agent_accepts(env, monkeypatch), env  # and the whole render starts


def test_the_chart_refuses_port_0_which_the_agent_accepts_on_purpose(
    helm: Helm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one difference: a container port must be 1..65535 (--listen :0 is any free port, for tests)."""
    assert agent_accepts({"GPUGUARD_LISTEN": ":0"}, monkeypatch)
    assert rendered_env(helm, ["--set", "metrics.port=0"]) is None


def test_a_refused_string_number_names_the_value_and_the_agents_bounds(helm: Helm) -> None:
    result = helm.run("template", "gpuguard", str(CHART), "--set-string", "interval=0")
    assert result.returncode != 0
    assert "interval: 0 is not between 0.05 and 3600" in result.stderr, result.stderr
