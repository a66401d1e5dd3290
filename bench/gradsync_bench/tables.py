"""The Markdown tables of a result document: a title, a header and one templated line a row.

A row's cells are a `str.format` template over the row, e.g.
`"{world_size} | {gradsync[median_ms]:.1f}"`; a field the row lacks (a method that
did not run, a figure an older document lacks) reads "-".
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Row = dict[str, Any]


class _Cells(string.Formatter):
    """`str.format` in which a missing field (key, index or None) formats as "-"."""

    def get_field(self, field_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        try:
            return super().get_field(field_name, args, kwargs)
        except (KeyError, IndexError, TypeError):
            return None, field_name

    def format_field(self, value: Any, format_spec: str) -> Any:
        return "-" if value is None else super().format_field(value, format_spec)


_CELLS = _Cells()


def cells(template: str, row: Mapping[str, Any]) -> str:
    """`template`'s fields filled in from `row` ("-" for each one the row lacks)."""
    return _CELLS.vformat(template, (), row)


def table(title: str, header: str, lines: Iterable[str]) -> list[str]:
    """A titled Markdown table (and the blank lines around it) as lines.

    `header` is the column titles joined by " | ", each of `lines` a row's cells likewise.
    """
    return [
        title,
        "",
        f"| {header} |",
        "|" + "---|" * (header.count(" | ") + 1),
        *(f"| {line} |" for line in lines),
        "",
    ]


def rows_table(title: str, header: str, template: str, rows: Sequence[Row]) -> list[str]:
    """`table` with one line `cells(template, row)` per row; nothing without rows."""
    return table(title, header, (cells(template, row) for row in rows)) if rows else []
