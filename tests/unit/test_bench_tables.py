"""The bench's Markdown tables (`gradsync_bench.tables`): cell templates and missing fields."""

from __future__ import annotations

import pytest
from gradsync_bench.tables import cells, rows_table, table

pytestmark = pytest.mark.unit


def test_cells_fill_nested_fields_and_dash_the_missing_ones() -> None:
    row = {"world_size": 2, "gradsync": {"median_ms": 12.345}, "ddp-backend": {"x": 0.5}}
    assert cells("{world_size} | {gradsync[median_ms]:.1f}", row) == "2 | 12.3"
    assert cells("{ddp-backend[x]:.0%}", row) == "50%"
    # A method that did not run, a field it lacks, a value of None: "-" whatever the format.
    assert (
        cells("{gloo[median_ms]:.1f} | {gradsync[cpu_s]:.2f} | {none:g}", row | {"none": None})
        == "- | - | -"
    )


def test_a_table_has_title_header_rule_rows_and_a_blank_line() -> None:
    assert table("**T**", "a | b", ["1 | 2"]) == [
        "**T**",
        "",
        "| a | b |",
        "|---|---|",
        "| 1 | 2 |",
        "",
    ]
    rows = [{"a": 1.0, "b": "x"}, {"a": 2.5}]
    assert rows_table("**T**", "a | b", "{a:g} | {b}", rows)[-3:] == [
        "| 1 | x |",
        "| 2.5 | - |",
        "",
    ]
    assert rows_table("**T**", "a | b", "{a:g} | {b}", []) == []
