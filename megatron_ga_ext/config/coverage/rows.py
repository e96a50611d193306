"""The coverage table: every row, by theme, in the order docs/coverage.md lists them. Pure
Python."""

from __future__ import annotations

from megatron_ga_ext.config.coverage.row import Row
from megatron_ga_ext.config.coverage.rows_fsdp import FSDP_ROWS
from megatron_ga_ext.config.coverage.rows_graphs import GRAPH_ROWS
from megatron_ga_ext.config.coverage.rows_moe import MOE_ROWS
from megatron_ga_ext.config.coverage.rows_parallel import PARALLEL_ROWS
from megatron_ga_ext.config.coverage.rows_step import STEP_ROWS

__all__ = ["ROWS"]

ROWS: tuple[Row, ...] = (*GRAPH_ROWS, *MOE_ROWS, *FSDP_ROWS, *PARALLEL_ROWS, *STEP_ROWS)
