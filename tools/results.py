"""Rows the runs measure, recorded as JSON for `make docs` to render into the docs tables.

    record("fuzz", [{"Surface": ..., "Examples": ...}])   # a run: one JSON file per row
    recorded("fuzz", directory)                           # tools/docs.py: every row recorded for a table

A run records only where ``MEGATRON_GA_RESULTS`` names a directory: the Makefile's fuzz, e2e, matrix
and regress targets set it to .cache/results, which git ignores. A plain pytest run records nothing,
and no run writes a tracked file. Rows whose key columns are equal are one row: a later record's
cells replace the earlier ones, and a partial row (the behaviour suite's one cell of a compatibility
row) keeps the cells it does not name.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: The environment variable that names the results directory.
ENV = "MEGATRON_GA_RESULTS"


@dataclass(frozen=True)
class Table:
    """A measured table of the docs."""

    doc: str
    """The page that holds it, relative to the repository root."""
    columns: tuple[str, ...]
    """Its columns, in order; "Run on" is the date a row was recorded, unless the row gives it."""
    keys: int
    """How many leading columns identify a row."""


TABLES = {
    "compatibility": Table(
        doc="docs/compatibility.md",
        keys=1,
        columns=(
            "Source",
            "megatron-core",
            "Python, torch",
            "Hooked functions",
            "Behaviour suite",
            "End-to-end",
            "Run on",
        ),
    ),
    "fuzz": Table(
        doc="docs/reliability.md",
        keys=1,
        columns=("Surface", "Input", "Examples", "Slowest example", "Answers", "Run on"),
    ),
    "faults": Table(
        doc="docs/reliability.md",
        keys=2,
        columns=("Source", "Fault", "Injected as", "Outcome", "Checkpoints", "Run on"),
    ),
    "resumes": Table(
        doc="docs/reliability.md",
        keys=2,
        columns=("Source", "Case", "Resumed at", "Checked against the uninterrupted run", "Run on"),
    ),
    "e2e": Table(
        doc="docs/performance.md",
        keys=1,
        columns=(
            "Source",
            "Layout",
            "Iterations",
            "Upstream (ms)",
            "Extension (ms)",
            "Async (ms)",
            "Ratio (extension, async)",
            "Losses",
            "Run on",
        ),
    ),
    "verify-fuzz": Table(
        doc="docs/reduction.md",
        keys=3,
        columns=(
            "megatron-core",
            "Seed",
            "Corrections",
            "Draws",
            "Verdict",
            "Worst relative error",
            "Time (s)",
            "Run on",
        ),
    ),
    "noise-scale": Table(
        doc="docs/noise-scale.md",
        keys=2,
        columns=(
            "Source",
            "Layout",
            "Measured",
            "B_simple (EMA) at the last",
            "Resume",
            "Suggested (--suggest)",
            "Run on",
        ),
    ),
    "noise-scale-gpt": Table(
        doc="docs/noise-scale.md",
        keys=2,
        columns=(
            "megatron-core",
            "Layout",
            "Measured steps",
            "norm(g)^2: worst relative error",
            "mean norm(g_r)^2: worst relative error",
            "Against the truth",
            "Run on",
        ),
    ),
}


def results_dir() -> Path | None:
    """The directory ``MEGATRON_GA_RESULTS`` names, or None (record nothing)."""
    value = os.environ.get(ENV)
    return Path(value) if value else None


def record(name: str, rows: list[dict[str, object]], directory: Path | None = None) -> None:
    """Merge each of ``rows`` (column -> value) into its file under ``directory`` (default:
    :func:`results_dir`)."""
    directory = directory or results_dir()
    if directory is None or not rows:
        return
    table = TABLES[name]
    folder = directory / name
    folder.mkdir(parents=True, exist_ok=True)
    for row in rows:
        unknown = set(row) - set(table.columns)
        if unknown:
            raise ValueError(
                f"table {name!r} has no column {', '.join(sorted(unknown))}; its columns: "
                f"{', '.join(table.columns)}"
            )
        cells = {column: cell(value) for column, value in row.items()}
        cells.setdefault("Run on", datetime.date.today().isoformat())
        path = folder / f"{_slug([cells[c] for c in table.columns[: table.keys]])}.json"
        with _locked(folder):  # make fuzz records from two processes
            old = json.loads(path.read_text()) if path.exists() else {}
            partial = path.with_suffix(".partial")
            partial.write_text(json.dumps(old | cells, indent=1, ensure_ascii=False) + "\n")
            partial.replace(path)


def recorded(name: str, directory: Path) -> list[dict[str, str]]:
    """Every row recorded for table ``name`` under ``directory``, oldest first."""
    files = sorted(
        (directory / name).glob("*.json"), key=lambda path: (path.stat().st_mtime, path.name)
    )
    return [json.loads(path.read_text()) for path in files]


def cell(value: object) -> str:
    """A value as one Markdown table cell."""
    return str(value).replace("|", "/").replace("\n", " ")


def _slug(key: list[str]) -> str:
    readable = re.sub(r"[^A-Za-z0-9.@_-]+", "-", " ".join(key)).strip("-")[:80]
    return f"{readable}-{hashlib.sha1(json.dumps(key).encode()).hexdigest()[:8]}"


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with open(folder / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
