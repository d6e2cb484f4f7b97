"""gpuguard.cli.flags: each flag declared once, its default its settings field's, written nowhere else."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpuguard.cli import cli, settings
from gpuguard.cli.flag import FROM_FIELD
from gpuguard.cli.flags import FLAGS, GPU_FLAGS, WATCH_FLAGS
from gpuguard.core.config import Config, NodeSettings, PolicySettings

CLI_PACKAGE = Path(__file__).resolve().parents[1] / "gpuguard" / "cli"
# Defaults a command may write itself: "unset" (None), a switch that is off, an empty list, and the output
# format of `check` and `status`, which is no setting.
LITERAL_DEFAULTS = (None, False, "", "table")
# A command's own option that shares a declared flag's name: `release --node` names the node to release,
# `hold --node` and `history --node` the node of the GPUs to hold or show.
OWN_OPTIONS = {("release", "node"), ("hold", "node"), ("history", "node")} | {
    # the repair executor's settings are its own (core/repairconfig.py), not the agent's
    ("repair-executor", name)
    for name in (
        "node",
        "repair",
        "kubeconfig",
        "pod_resources_socket",
        "dra_driver",
        "log_format",
        "metrics_port",
    )
}


def test_every_flag_of_a_command_is_a_declared_flag_with_its_declared_default_and_variable() -> None:
    for command in cli.commands.values():
        for param in command.params:
            if param.name not in FLAGS or (command.name, param.name) in OWN_OPTIONS:
                continue  # -o, --at, uninstall's own --node/--all: not settings
            flag = FLAGS[param.name]
            assert param.default == flag.click_default, (command.name, flag.name)
            envvar = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or [])
            assert envvar[0] == flag.env, (command.name, flag.name)


@pytest.mark.parametrize("name", sorted(n for n, f in FLAGS.items() if f.default is FROM_FIELD))
def test_a_flags_default_is_its_settings_fields_default(name: str) -> None:
    """The field's default becomes the flag's: the parsed value of the default flag is the field's default."""
    flag = FLAGS[name]
    assert flag.value(flag.click_default) == flag.field_default


def test_the_settings_built_from_no_flags_are_the_dataclass_defaults() -> None:
    """`gpuguard watch --dry-run --node n` is NodeSettings(), PolicySettings() and Config() but for the
    flags it names and the state directory (the DaemonSet's, which Config() leaves unset)."""
    ctx = cli.commands["watch"].make_context("watch", ["--dry-run", "--node", "n"])
    with ctx:
        cfg = settings.config(ctx.params, watch=True)
    assert cfg.node == NodeSettings(name="n", dry_run=True)
    assert cfg.policy == PolicySettings()
    assert cfg == Config(node=cfg.node, state_dir=FLAGS["state_dir"].click_default)


def test_the_commands_take_the_declared_flags_in_the_declared_order() -> None:
    def declared(command: str) -> list[str]:
        params = cli.commands[command].params
        return [p.name or "" for p in params if p.name in FLAGS and (command, p.name) not in OWN_OPTIONS]

    assert declared("watch") == list(WATCH_FLAGS)
    assert declared("check") == [*GPU_FLAGS, "node", "kubeconfig", "expected_gpus_label"]
    assert declared("status") == declared("release") == ["kubeconfig"]
    assert declared("uninstall") == ["kubeconfig", "dry_run"]  # its own --dry-run, the same variable


def test_no_default_is_written_in_the_cli_package_but_none_off_empty_and_the_output_format() -> None:
    """A default lives in gpuguard.core.config (a dataclass field, or a named constant there); the CLI names
    it.
    A literal here would be a second copy that can drift from the settings the rest of gpuguard assumes."""
    written = []
    for path in sorted(CLI_PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            value = node.value if isinstance(node, ast.keyword) and node.arg == "default" else None
            if isinstance(value, ast.Constant) and value.value not in LITERAL_DEFAULTS:
                written.append(f"{path.name}:{value.lineno}: default={value.value!r}")
    assert written == []
