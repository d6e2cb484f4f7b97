"""The chart's repeatLimit and repeatWindowSeconds (issue 30): GPUGUARD_REPEAT_LIMIT and
GPUGUARD_REPEAT_WINDOW when set, nothing when null (the agent's defaults), values the agent accepts, and
mistakes the schema refuses before anything is deployed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpuguard.cli import cli
from gpuguard.core.config import NodeSettings
from harness.agentproc import WatchProcess
from tests.helmtool import CHART, NAMESPACE, ROOT, Docs, Helm, build_helm
from tests.test_helm import _agent, _agent_in, _env

VALUES = ROOT / "deploy" / "helm" / "gpuguard" / "values.yaml"
VARIABLES = {"GPUGUARD_REPEAT_LIMIT", "GPUGUARD_REPEAT_WINDOW"}

# The first run may build helm inside the test session.
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return build_helm(tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="module")
def default_render(helm: Helm) -> Docs:
    return helm.render()


def test_both_values_are_null_by_default_so_the_agent_keeps_its_own_defaults(default_render: Docs) -> None:
    values = yaml.safe_load(VALUES.read_text())
    assert (values["repeatLimit"], values["repeatWindowSeconds"]) == (None, None)
    assert not VARIABLES & set(_env(default_render))


@pytest.mark.parametrize(
    ("values", "changed"),
    [
        (["--set", "repeatLimit=5"], {"GPUGUARD_REPEAT_LIMIT": "5"}),
        (["--set", "repeatLimit=0"], {"GPUGUARD_REPEAT_LIMIT": "0"}),  # off: 0 is a value, not unset
        (["--set", "repeatWindowSeconds=86400"], {"GPUGUARD_REPEAT_WINDOW": "86400"}),
        (["--set", "repeatWindowSeconds=31536000"], {"GPUGUARD_REPEAT_WINDOW": "31536000"}),
        (["--set", "repeatWindowSeconds=0.5"], {"GPUGUARD_REPEAT_WINDOW": "0.5"}),
        (["--set", "repeatLimit=null", "--set", "repeatWindowSeconds=null"], {}),
    ],
    ids=["a limit", "off", "a day", "a year", "half a second", "null"],
)
def test_a_repeat_value_changes_exactly_the_agent_variable_it_names(
    helm: Helm, default_render: Docs, values: list[str], changed: dict[str, str]
) -> None:
    rendered = helm.render(*values)
    assert _env(rendered) == _env(default_render) | changed
    _agent_in(rendered)["env"] = _agent(default_render)["env"]
    assert rendered == default_render


def test_a_values_file_with_both_reaches_the_agent_as_settings_it_accepts(
    helm: Helm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a values file too (numbers there are floats to helm: 31536000 must not become 3.1536e+07), and
    past flag parsing: the agent's own validation runs (a bad value would be exit 2)."""
    values = tmp_path / "values.yaml"
    values.write_text("repeatLimit: 2\nrepeatWindowSeconds: 31536000\n")
    env = {k: v for k, v in _env(helm.render("--values", str(values))).items() if isinstance(v, str)}
    assert (env["GPUGUARD_REPEAT_LIMIT"], env["GPUGUARD_REPEAT_WINDOW"]) == ("2", "31536000")
    for name in VARIABLES:
        monkeypatch.setenv(name, env[name])
    ctx = cli.commands["watch"].make_context("watch", [])
    assert (ctx.params["repeat_limit"], ctx.params["repeat_window"]) == (2, 31536000.0)
    assert (NodeSettings.repeat_limit, NodeSettings.repeat_window) != (2, 31536000.0)  # not the defaults
    monkeypatch.delenv("GPUGUARD_REPEAT_LIMIT")
    monkeypatch.delenv("GPUGUARD_REPEAT_WINDOW")
    p = WatchProcess(
        "--dry-run", "--backend", "mock", "--run-for", "0.5", env=env | {"GPUGUARD_STATE_DIR": str(tmp_path)}
    ).start()
    assert p.wait(60) == 0, p.lines[-10:]


@pytest.mark.parametrize(
    "values",
    [
        ["--set", "repeatLimit=-1"],
        ["--set", "repeatLimit=33"],  # the history keeps 32 episodes per GPU
        ["--set", "repeatLimit=often"],
        ["--set", "repeatWindowSeconds=0"],
        ["--set", "repeatWindowSeconds=31536001"],
        ["--set", "repeatWindowSeconds=a week"],
    ],
    ids=[
        "a negative limit",
        "a limit past the history",
        "a word",
        "no window",
        "past a year",
        "a word window",
    ],
)
def test_the_values_schema_rejects_a_repeat_value_the_agent_would_refuse(
    helm: Helm, values: list[str]
) -> None:
    result = helm.run("template", "gpuguard", str(CHART), "--namespace", NAMESPACE, *values)
    assert result.returncode != 0
    assert "/" + values[1].split("=")[0] in result.stderr
