"""--signals-config FILE (GPUGUARD_SIGNALS_CONFIG; the chart's `signalsConfig`, a ConfigMap): changes to the
signal table (gpuguard/core/data/signals.json), globally and per node label selector. Parsed and checked once
at start: a bad file is one ConfigError line (exit 2), never a silent default.

```yaml
signals:                                   # every node
  pcie-replays: {threshold: 16, window_s: 60}
  clock-power-brake: {level: ignore}
expected:                                  # per GPU product (the NVML device name), as signals.json's
  NVIDIA H200: {nvlink_links: 18, pcie_width: 16}
  NVIDIA A100-SXM4-40GB: null              # null: no expectation, the baseline alone judges
nodes:                                     # in order, after the global part, where every label matches
  - selector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}
    signals:
      nvlink-down: {level: fault}
  - selector: {pool: single-gpu-vm}        # one GPU of a board, passed to a VM: its NVLinks unused
    expected:
      NVIDIA H100 80GB HBM3: {nvlink_links: 0}
```

GPU models differ (NVLink on HGX, none on PCIe cards): the node rules say so by the labels GPU Feature
Discovery writes. The agent applies them when it first reads its node; before that, and in a dry run
without a cluster, only the global part. `gpuguard check` applies them from its one read of the node
(gpuguard.runtime.checknode), the global part alone without it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuguard.core import files
from gpuguard.core.errors import ConfigError
from gpuguard.core.signaltable import SIGNALS, SignalTable

MAX_BYTES = files.MIB
MAX_RULES = 256
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")

Changes = tuple[tuple[str, tuple[tuple[str, object], ...]], ...]
# Per GPU product: its changed values (as pairs: hashable, as Changes) or None (removed).
ExpectedChanges = tuple[tuple[str, tuple[tuple[str, object], ...] | None], ...]


@dataclass(frozen=True)
class NodeRule:
    selector: tuple[tuple[str, str], ...]
    """Labels a node must all have, with these values."""
    changes: Changes
    expected: ExpectedChanges = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.selector)


@dataclass(frozen=True)
class SignalConfig:
    source: str
    changes: Changes = ()
    rules: tuple[NodeRule, ...] = ()
    expected: ExpectedChanges = ()

    def table(self, labels: Mapping[str, str] | None = None, base: SignalTable = SIGNALS) -> SignalTable:
        """The table for a node with these labels (None: not known, the global part only)."""
        table = _apply(base, self.changes, self.expected, where=self.source)
        for i, rule in enumerate(self.rules):
            if labels is not None and rule.matches(labels):
                table = _apply(table, rule.changes, rule.expected, where=f"{self.source}: nodes[{i}]")
        return table

    def matching(self, labels: Mapping[str, str]) -> tuple[int, ...]:
        """The indices of the node rules these labels select (for the log line)."""
        return tuple(i for i, rule in enumerate(self.rules) if rule.matches(labels))


def _apply(
    table: SignalTable, changes: Changes, expected: ExpectedChanges = (), *, where: str
) -> SignalTable:
    for name, change in changes:
        table = table.changed(name, dict(change), where=where)
    for product, values in expected:
        table = table.expecting(product, None if values is None else dict(values), where=f"{where}: expected")
    return table


def load(path: str | Path) -> SignalConfig:
    """Read and check the file; ConfigError (one line, names the file and the entry) otherwise."""
    text = files.read_text(path, limit=MAX_BYTES, what="signals config", error=ConfigError)
    return parse(text, source=f"--signals-config {path}")


def parse(text: str, *, source: str = "--signals-config") -> SignalConfig:
    doc = files.parse_yaml(text, what=source)
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: expected a mapping with 'signals', 'expected' and/or 'nodes'")
    unknown = set(doc) - {"signals", "expected", "nodes"}
    if unknown:
        raise ConfigError(f"{source}: unknown key {', '.join(sorted(map(repr, map(str, unknown))))}")
    changes = _changes(doc.get("signals"), where=source)
    expected = _expected(doc.get("expected"), where=source)
    raw_rules = doc.get("nodes") or []
    if not isinstance(raw_rules, list) or len(raw_rules) > MAX_RULES:
        raise ConfigError(f"{source}: 'nodes' must be a list of at most {MAX_RULES} rules")
    rules = tuple(_rule(r, where=f"{source}: nodes[{i}]") for i, r in enumerate(raw_rules))
    config = SignalConfig(source=source, changes=changes, rules=rules, expected=expected)
    # Every value checked now, against the shipped table: global, then each rule on its own.
    base = config.table(None)
    for i, rule in enumerate(rules):
        _apply(base, rule.changes, rule.expected, where=f"{source}: nodes[{i}]")
    return config


def _mapping(raw: object, *, where: str, must: str) -> dict[Any, Any]:
    """A section of the file: {} when left out, else a mapping; ConfigError `where: must` otherwise."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: {must}")
    return raw


def _changes(raw: object, *, where: str) -> Changes:
    must = "'signals' must map a signal name to its changes, e.g. nvlink-down: {level: fault}"
    raw = _mapping(raw, where=where, must=must)
    out = []
    for name, change in raw.items():
        if not isinstance(change, dict) or not change:
            raise ConfigError(f"{where}: {name}: expected a mapping of level, threshold and/or window_s")
        out.append((str(name), tuple((str(k), v) for k, v in change.items())))
    changes = tuple(out)
    _apply(SIGNALS, changes, where=where)  # names, keys and values, as early as possible
    return changes


def _expected(raw: object, *, where: str) -> ExpectedChanges:
    must = "'expected' must map a GPU product name to its values, e.g. "
    raw = _mapping(raw, where=where, must=must + "NVIDIA H100 80GB HBM3: {nvlink_links: 18, pcie_width: 16}")
    for product, values in raw.items():  # names and values, as early as possible
        SIGNALS.expecting(product, values, where=f"{where}: expected")
    return tuple((str(p), None if v is None else tuple(v.items())) for p, v in raw.items())


def _rule(raw: object, *, where: str) -> NodeRule:
    if not isinstance(raw, dict) or set(raw) - {"selector", "signals", "expected"}:
        raise ConfigError(f"{where}: expected a mapping with 'selector' and 'signals' and/or 'expected'")
    selector = raw.get("selector")
    if not isinstance(selector, dict) or not selector:
        raise ConfigError(f"{where}: 'selector' must map node label keys to values (every one must match)")
    pairs = []
    for key, value in selector.items():
        if not isinstance(key, str) or not _LABEL_KEY.match(key):
            raise ConfigError(f"{where}: selector key {key!r} is not a label key")
        if not isinstance(value, str) or not _LABEL_VALUE.match(value):
            raise ConfigError(
                f"{where}: selector value {value!r} of {key} is not a label value (quote numbers)"
            )
        pairs.append((key, value))
    return NodeRule(
        selector=tuple(pairs),
        changes=_changes(raw.get("signals"), where=where),
        expected=_expected(raw.get("expected"), where=where),
    )
