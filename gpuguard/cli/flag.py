"""One flag of gpuguard's commands: its name, environment variable, click type, the settings field it sets
(whose dataclass default is the flag's default), how its text becomes that field's value, and its help; the
click option made from it. The declarations themselves: gpuguard.cli.flags."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


class Finite(click.ParamType[float]):
    """A float that is a number: NaN and infinity are refused here, once for every flag (a NaN compares false
    with every bound, so a range check alone lets it through, as `check --at nan` showed)."""

    name = "float"

    def __init__(self, minimum: float | None = None) -> None:
        self.minimum = minimum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if self.minimum is not None and number < self.minimum:
            self.fail(f"{value!r} is below {self.minimum:g}", param, ctx)
        return number


FINITE = Finite()


def from_environment(group: click.Group) -> None:
    """Every option of every command of `group` also from GPUGUARD_<NAME> (README: every flag from the
    environment), the declared flags' variables kept; a command's own options (`check --at`, `release
    --wait`) get theirs here, so that no option is left out."""
    for command in group.commands.values():
        for param in command.params:
            if not isinstance(param, click.Option) or not param.expose_value or param.envvar:
                continue
            param.envvar = f"GPUGUARD_{(param.name or '').upper()}"
            param.show_envvar = True


class _FromField:
    """The flag's default is its settings field's default (the declarations' default)."""


FROM_FIELD: Any = _FromField()


@dataclass(frozen=True)
class Flag:
    """One flag. `default` is FROM_FIELD (the field's dataclass default, as the flag's text) unless the
    field's default cannot be written as the flag (None: unset, the field keeps its default)."""

    name: str
    help: str
    field: tuple[type[Any], str] | None = None
    """The settings class and field this flag sets; None where settings.py combines it with another."""
    type: Any = str
    parse: Callable[[Any], Any] | None = None
    """The flag's value (after click's type) -> the field's value; None: as it is."""
    text: Callable[[Any], Any] = str
    """The field's default -> the flag's default, where `parse` turns text into the field."""
    default: Any = FROM_FIELD
    is_flag: bool = False
    negate: bool = False
    """A --no-X flag: the field is `not` the flag."""
    hidden: bool = False
    envvars: tuple[str, ...] = ()
    """More environment variables, after GPUGUARD_<FLAG_NAME>."""
    empty_env: bool = False
    """An empty GPUGUARD_<FLAG_NAME> means the empty flag ("no state", "no ignored Xid", "every node"); click
    would take an empty variable for "unset"."""

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        return "GPUGUARD_" + self.dest.upper()

    @property
    def field_default(self) -> Any:
        if self.field is None:
            raise AttributeError(f"{self.name} sets no field")
        cls, name = self.field
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return f.default

    @property
    def click_default(self) -> Any:
        if self.default is not FROM_FIELD:
            return self.default
        value = self.field_default
        if self.negate:
            return not value
        return self.text(value) if self.parse is not None and value is not None else value

    def value(self, given: Any) -> Any:
        """The field's value for the flag's value."""
        if self.negate:
            return not given
        return self.parse(given) if self.parse is not None else given

    def option(self, **override: Any) -> Callable[[F], F]:
        """The click option; `override` for a command whose help differs (check's --node)."""
        default = self.click_default
        kw: dict[str, Any] = {
            "default": default,
            "is_flag": self.is_flag,
            "hidden": self.hidden,
            "help": self.help,
            "envvar": [self.env, *self.envvars] if self.envvars else self.env,
            "show_envvar": True,
        }
        if not self.is_flag:
            kw["type"] = self.type
        if not (self.is_flag or self.hidden or default in (None, "")):
            kw["show_default"] = True
        return click.option(self.name, **(kw | override))
