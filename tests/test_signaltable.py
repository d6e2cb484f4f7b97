"""gpuguard.core.signaltable: the shipped table loaded the same every time, a signal or product made in
code (a test's, --signals-config's) with nothing it was not given, and the bounds of `changed` and
`expecting`."""

from __future__ import annotations

import pytest

from gpuguard.core.errors import ConfigError
from gpuguard.core.signaltable import SIGNALS, Expected, Signal, SignalTable, check_expected, load


def test_loading_the_shipped_table_again_gives_the_same_table() -> None:
    assert load() == SIGNALS
    assert SIGNALS["fabric-incomplete"].repeat is False  # the fabric's fault is the node's, not the GPU's
    assert SIGNALS["pcie-replays"].repeat is True and SIGNALS["pcie-replays"].repeat_why == ""
    assert (SIGNALS["pcie-replays"].threshold, SIGNALS["pcie-replays"].window_s) == (8.0, 60.0)
    h100 = SIGNALS.products["NVIDIA H100 80GB HBM3"]
    assert (h100.nvlink_links, h100.pcie_width) == (18, 16)


def test_a_signal_made_in_code_says_nothing_it_was_not_given_and_counts_toward_repeats() -> None:
    s = Signal("x", "fault", 1.0, 0.0)
    assert (s.measure, s.reading, s.source, s.dcgm, s.repeat, s.repeat_why) == ("", "", "", "", True, "")
    assert Expected(18, 16).source == ""


def test_a_threshold_up_to_1e15_is_taken_and_past_it_refused() -> None:
    assert SIGNALS.changed("pcie-replays", {"threshold": 1e15}, where="t")["pcie-replays"].threshold == 1e15
    with pytest.raises(ConfigError, match="threshold must be a number"):
        SIGNALS.changed("pcie-replays", {"threshold": 1e15 + 1}, where="t")


def test_a_new_product_gets_what_it_is_given_and_none_expected_of_the_rest() -> None:
    links = SIGNALS.expecting("New GPU", {"nvlink_links": 4}, where="--signals-config s.yaml")
    assert links.products["New GPU"] == Expected(4, 0, source="--signals-config s.yaml")
    width = SIGNALS.expecting("New GPU", {"pcie_width": 8}, where="s.yaml")
    assert width.products["New GPU"] == Expected(0, 8, source="s.yaml")


def test_a_shipped_product_changed_keeps_what_was_not_changed_and_names_the_change_as_its_source() -> None:
    h100 = "NVIDIA H100 80GB HBM3"
    table = SIGNALS.expecting(h100, {"pcie_width": 8}, where="s.yaml")
    assert table.products[h100] == Expected(18, 8, source="s.yaml")
    assert h100 not in SIGNALS.expecting(h100, None, where="s.yaml").products


def test_checked_values_without_a_base_expect_none_of_what_is_not_given() -> None:
    assert check_expected({"nvlink_links": 4}, where="w") == Expected(4, 0)
    assert check_expected({"pcie_width": 16}, where="w") == Expected(0, 16)
    assert check_expected({"nvlink_links": 4, "source": "datasheet"}, where="w").source == "datasheet"


def test_a_product_name_is_one_nvml_could_give() -> None:
    assert "P" * 95 in SIGNALS.expecting("P" * 95, {"pcie_width": 16}, where="w").products
    for bad in ("", "P" * 96, 7):
        with pytest.raises(ConfigError, match="is not a GPU product name"):
            SIGNALS.expecting(bad, {"pcie_width": 16}, where="w")


def test_at_most_256_products_are_expected() -> None:
    table = SignalTable(SIGNALS.signals, tuple((f"GPU {i}", Expected(0, 16)) for i in range(255)))
    full = table.expecting("GPU 255", {"pcie_width": 16}, where="w")
    assert len(full.products) == 256
    assert full.expecting("GPU 0", {"pcie_width": 8}, where="w").products["GPU 0"].pcie_width == 8  # a change
    with pytest.raises(ConfigError, match="more than 256 GPU products"):
        full.expecting("GPU 256", {"pcie_width": 16}, where="w")
