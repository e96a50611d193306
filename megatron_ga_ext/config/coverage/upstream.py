"""Upstream's own defects the coverage rows record, as a launch without the extension meets them.
Pure Python.

Each is declared once, on its row (:class:`~megatron_ga_ext.config.coverage.row.Upstream`);
``megatron-ga check`` reports the ones a launch meets and docs/coverage.md lists them all
(tools/doc_tables.py).
"""

from __future__ import annotations

from megatron_ga_ext.config.coverage.row import Row, Setting, Upstream
from megatron_ga_ext.config.coverage.rows import ROWS

__all__ = ["upstream_traps"]


def upstream_traps(setting: Setting) -> list[tuple[Row, Upstream]]:
    """Each upstream defect of :data:`ROWS` a launch without the extension meets, with its row."""
    return [(row, trap) for row in ROWS for trap in row.upstream if trap.applies(setting)]
