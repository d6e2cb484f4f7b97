"""docs/operations.md shows the repairer examples exactly as deploy/examples/ ships them (the files that
tests/integration/test_repairer_examples.py checks against their CRDs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from gpuguard.quarantine.record import DEGRADED_TAINT_KEY, TAINT_KEY

ROOT = Path(__file__).resolve().parents[1]


def _blocks() -> list[object]:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("### medik8s and the node readiness controller", 1)[1].split("\n## ", 1)[0]
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, re.S)]


@pytest.mark.parametrize("name", ["node-healthcheck.yaml", "node-readiness-rule.yaml"])
def test_the_page_shows_the_example_as_shipped(name: str) -> None:
    shipped = yaml.safe_load((ROOT / "deploy" / "examples" / name).read_text())
    assert shipped in _blocks()


def test_the_cluster_autoscaler_section_names_both_taint_keys_as_status_taints() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("## Beside Cluster Autoscaler", 1)[1].split("\n## ", 1)[0]
    flags = re.findall(r"--status-taint=(\S+)", section)
    assert flags == [TAINT_KEY, DEGRADED_TAINT_KEY]
