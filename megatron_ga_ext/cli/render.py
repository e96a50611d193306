"""Tables for people: rich on a terminal, plain aligned text otherwise (pipes, CI logs, tests)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

__all__ = ["print_table"]


def print_table(
    title: str, header: Sequence[str], rows: Sequence[Sequence[object]], file: TextIO | None = None
) -> None:
    """Print ``rows`` under ``header``; rich is imported only when writing to a terminal."""
    out = file or sys.stdout
    cells = [[_cell(v) for v in row] for row in rows]
    if out.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for name in header:
            table.add_column(name)
        for row in cells:
            table.add_row(*row)
        Console(file=out).print(table)
        return
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)
    ]
    print(title, file=out)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), file=out)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)
