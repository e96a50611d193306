"""The coverage table: Megatron's flags on the loss, gradient, step or schedule path, and what the
extension does under each. Pure Python.

A row is a flag, where it matters with a value, the loss mode or another ``--ga-*`` flag, and one
behaviour:

* ``supported``: every check of every step runs, and a test proves it (Megatron-LM's own loop in
  tests/e2e, a ``megatron-ga verify`` layout);
* ``limited``: it runs, with the limit stated (in the start-up log, and by ``megatron-ga check`` as
  a note);
* ``refused``: install() stops at start-up with a :class:`CoverageError` and ``check`` reports a
  problem, naming the flag, why the extension cannot keep its guarantee there, and what to do
  instead.

Each row was decided by reading Megatron-LM at the tested sources (core_v0.16.1 ... main): the
training loop's wrappers (``FullCudaGraphWrapper``, ``OptimizerCudaGraphWrapper``), pretrain_gpt's
``build_schedule_plan`` path, the router and the data-parallel wrappers. :func:`verdict` applies the
table to one launch; tools/doc_tables.py renders it (docs/coverage.md, written by ``make docs``);
tests/test_coverage.py holds every row to its test or its refusal.

Every other flag of a tested parser is off the path, with its reason, in config/off_path.py.
:func:`unclassified` lists the flags of a parser that neither names (tests/test_coverage_complete.py
requires none for every tested source; ``make regress`` lists them for a checkout).

The package, by job: ``row`` (Setting, Row, Proof), ``conditions`` (what the rows look at),
``proofs`` (the tests that prove rows), ``rows_graphs``, ``rows_moe``, ``rows_fsdp``,
``rows_parallel``, ``rows_step`` (the rows by theme), ``rows`` (the table), ``verdict`` (applying
it).
"""

from __future__ import annotations

from megatron_ga_ext.config.coverage.row import Proof, Row, Setting
from megatron_ga_ext.config.coverage.rows import ROWS
from megatron_ga_ext.config.coverage.verdict import (
    Verdict,
    enforce,
    named_by_rows,
    unclassified,
    verdict,
)

__all__ = [
    "ROWS",
    "Proof",
    "Row",
    "Setting",
    "Verdict",
    "enforce",
    "named_by_rows",
    "unclassified",
    "verdict",
]
