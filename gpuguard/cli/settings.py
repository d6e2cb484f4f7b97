"""The settings of a command, built from its flags' values as click parsed them (gpuguard.cli.flags), with the
few rules that combine flags; a validation error names where the bad value came from."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import click

from gpuguard.cli.flags import FLAGS
from gpuguard.core import signalconfig
from gpuguard.core.config import DEFAULT_IGNORED_XIDS, Config, NodeSettings, PolicySettings, parse_xids
from gpuguard.core.errors import ConfigError


def config(values: Mapping[str, Any], *, watch: bool) -> Config:
    """The Config of `watch` (watch=True) or `check` from their parsed flags; ConfigError names the flag,
    or the environment variable the value came from."""
    kubeconfig = values.get("kubeconfig")
    if kubeconfig and not os.path.isfile(kubeconfig):
        # Named, so meant: not a warning and a check judged without the cluster (or an agent that
        # starts and then fails at every request), but a usage error, as `status` makes it.
        raise ConfigError(_named_by_source(f"--kubeconfig {kubeconfig}: no such file"))
    try:
        return _settings(_empty_env_values(values), watch=watch)
    except ConfigError as exc:
        raise ConfigError(_named_by_source(str(exc))) from None


def _settings(values: Mapping[str, Any], *, watch: bool) -> Config:
    # Parsed policy, node, then the rest: with two bad values, the first in this order is the one named.
    fields: dict[type[Any], dict[str, Any]] = {PolicySettings: {}, NodeSettings: {}, Config: {}}
    fields[PolicySettings]["ignored_xids"] = _ignored_xids(values["ignore_xids"], values["fatal_xids"])
    if values.get("signals_config"):
        signals = signalconfig.load(values["signals_config"])  # a bad file stops the start, exit 2
        fields[Config]["signals_config"] = signals
        fields[PolicySettings]["signals"] = signals.table(None)
    for section, settings in fields.items():
        for dest, given in values.items():
            flag = FLAGS.get(dest)
            if flag is None or flag.field is None or flag.field[0] is not section or given is None:
                continue  # another section's, not a settings flag, or unset: the field keeps its default
            settings[flag.field[1]] = flag.value(given)
    if not watch:
        fields[NodeSettings]["dry_run"] = True  # `check` writes nothing
    elif values["backend"] == "mock" and not _given("state_dir"):
        # A mock run keeps no state in the host's directory unless told to: its made-up faults must never
        # be restored by a later real run on that host.
        fields[Config]["state_dir"] = None
    return Config(
        **fields[Config],
        policy=PolicySettings(**fields[PolicySettings]),
        node=NodeSettings(**fields[NodeSettings]),
    )


def _ignored_xids(ignore: str | None, fatal: str) -> frozenset[int]:
    """--ignore-xids (None: the default list) less --fatal-xids."""
    ignored = DEFAULT_IGNORED_XIDS if ignore is None else parse_xids(ignore, flag="--ignore-xids")
    return frozenset(ignored - parse_xids(fatal, flag="--fatal-xids"))


def _empty_env_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """An empty GPUGUARD_<FLAG> of a flag whose empty value means something stands as the empty flag."""
    out = dict(values)
    for name in values:
        if name in FLAGS and FLAGS[name].empty_env and _source(name) == _DEFAULT and _empty_env(name):
            out[name] = ""
    return out


_DEFAULT = click.core.ParameterSource.DEFAULT
_ENVIRONMENT = click.core.ParameterSource.ENVIRONMENT


def _source(name: str) -> click.core.ParameterSource | None:
    ctx = click.get_current_context(silent=True)
    return ctx.get_parameter_source(name) if ctx is not None else None


def _empty_env(name: str) -> bool:
    return FLAGS[name].empty_env and os.environ.get(FLAGS[name].env) == ""


def _given(name: str) -> bool:
    """Whether a flag (or its env variable) was given, rather than left at its default."""
    return _source(name) not in (None, _DEFAULT) or os.environ.get(FLAGS[name].env) == ""


def _named_by_source(message: str) -> str:
    """A validation error names the flag (config.py knows nothing else): where the value came from the
    environment, it names the variable the operator set instead (GPUGUARD_RUN_FOR=0 is not --run-for)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return message
    for param in ctx.command.params:
        name = param.name or ""
        flags = [o for o in getattr(param, "opts", ()) if o.startswith("--")]
        source = ctx.get_parameter_source(name)
        from_env = source == _ENVIRONMENT or (name in FLAGS and source == _DEFAULT and _empty_env(name))
        if not flags or not from_env:
            continue
        envvar = param.envvar
        names = [str(v) for v in envvar] if isinstance(envvar, list | tuple) else [str(envvar)]
        variable = next((v for v in names if v in os.environ), names[0])
        message = re.sub(rf"(?<![\w-]){re.escape(flags[0])}(?![\w-])", variable, message)
    return message
