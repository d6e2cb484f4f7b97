"""gpuguard.core.config's parsed values: what a flag's text becomes, once, at the edge."""

from __future__ import annotations

from fractions import Fraction

import pytest

from gpuguard.core.config import Config, NodeSettings, QuarantineLimit
from gpuguard.core.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "count", "percent"),
    [("5", 5, None), ("0", 0, None), ("10%", None, Fraction(10)), ("12.5%", None, Fraction(25, 2))],
)
def test_the_quarantine_limit_is_a_count_or_an_exact_percentage(
    text: str, count: int | None, percent: Fraction | None
) -> None:
    limit = QuarantineLimit.parse(text)
    assert (limit.count, limit.percent) == (count, percent)


@pytest.mark.parametrize("text", ["5", "007", "10%", "12.50%", "100%"])
def test_the_quarantine_limit_reads_as_the_flags_text_in_messages(text: str) -> None:
    assert str(QuarantineLimit.parse(text)) == text
    assert f"(--max-quarantined {QuarantineLimit.parse(text)})" == f"(--max-quarantined {text})"


@pytest.mark.parametrize(
    "text", ["", "%", "-5%", "101%", "100.001%", "1.2345%", "1e3", "1000000", " 5", "5\n"]
)
def test_a_quarantine_limit_that_cannot_work_is_a_config_error_naming_the_flag(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^--max-quarantined must be a count"):
        QuarantineLimit.parse(text)


def test_a_count_limit_does_not_depend_on_the_fleet() -> None:
    assert [QuarantineLimit.parse("3").of(n) for n in (0, 1, 100)] == [3, 3, 3]


def test_the_default_quarantine_limit_is_ten_percent() -> None:
    assert str(NodeSettings().max_quarantined) == "10%"
    assert NodeSettings().max_quarantined.of(375) == 38


@pytest.mark.parametrize(
    "selector",
    [
        "",
        "nvidia.com/gpu.present=true",
        "cloud.google.com/gke-accelerator",  # the label exists
        "nvidia.com/gpu.present=true;cloud.google.com/gke-accelerator;kubernetes.azure.com/accelerator=nvidia",
        "a=b,c;d",
    ],
)
def test_the_gpu_node_selector_takes_existence_terms_and_ored_alternatives(selector: str) -> None:
    cfg = Config(node=NodeSettings(name="gpu-1", gpu_node_selector=selector))
    assert cfg.node.gpu_node_selector == selector


@pytest.mark.parametrize("selector", ["a=b;", ";a", "a!=b", "a in (b)", "a=b||c", "a=b;;c"])
def test_a_gpu_node_selector_it_cannot_list_is_a_config_error(selector: str) -> None:
    with pytest.raises(ConfigError, match="--gpu-node-selector"):
        Config(node=NodeSettings(name="gpu-1", gpu_node_selector=selector))
