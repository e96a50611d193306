"""docs/reliability.md: its tables are written by the runs themselves; the prose around them is kept.

    write("fuzz", rows)            # into $MEGATRON_GA_RELIABILITY_DOC, if set; update(doc, name, rows) for any doc
    update(doc, "fuzz", rows)      # make fuzz: one row per input surface
    update(doc, "faults", rows)    # make e2e: one row per (source, fault), tests/e2e/test_faults.py
    update(doc, "resumes", rows)   # make e2e: one row per (source, case), tests/e2e/test_resume.py
    update(doc, "e2e", rows)       # make e2e: docs/performance.md, one row per source, tests/e2e/test_performance.py

A table lives between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``; a row whose key columns match
an existing row replaces it, other rows (another leg's sources) are kept.
"""

from __future__ import annotations

import datetime
import fcntl
import os
from pathlib import Path

#: name -> (columns, how many leading columns make a row's key)
TABLES = {
    "fuzz": (("Surface", "Input", "Examples", "Slowest example", "Answers", "Run on"), 1),
    "faults": (("Source", "Fault", "Injected as", "Outcome", "Checkpoints", "Run on"), 2),
    "resumes": (("Source", "Case", "Resumed at", "Checked against the uninterrupted run", "Run on"), 2),
    # docs/performance.md, tests/e2e/test_performance.py
    "e2e": (("Source", "Layout", "Iterations", "Upstream (ms)", "Extension (ms)", "Async (ms)",
             "Ratio (extension, async)", "Losses", "Run on"), 1),
}


def write(name: str, rows: list[dict[str, str]]) -> None:
    """:func:`update` the doc ``MEGATRON_GA_RELIABILITY_DOC`` names (make fuzz, make e2e); nothing without it."""
    doc = os.environ.get("MEGATRON_GA_RELIABILITY_DOC")
    if doc and rows:
        update(Path(doc), name, rows)


def update(doc: Path, name: str, rows: list[dict[str, str]]) -> None:
    """Merge ``rows`` (column -> text; "Run on" defaults to today) into table ``name`` of ``doc``, under a lock
    (make fuzz runs two processes)."""
    with open(doc, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        text = _merged(handle.read(), name, rows)
        handle.seek(0)
        handle.truncate()
        handle.write(text)


def _merged(text: str, name: str, rows: list[dict[str, str]]) -> str:
    columns, keys = TABLES[name]
    begin, end = f"<!-- table:{name} -->", f"<!-- /table:{name} -->"
    if begin not in text:
        text += f"\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    body, tail = rest.split(end, 1)
    merged = {tuple(row[c] for c in columns[:keys]): row for row in _rows(body, columns)}
    for row in rows:
        cells = {c: _cell(row.get(c, "")) for c in columns}
        cells["Run on"] = cells["Run on"] or datetime.date.today().isoformat()
        merged[tuple(cells[c] for c in columns[:keys])] = cells
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row[c] for c in columns) + " |" for row in merged.values()]
    return f"{head}{begin}\n" + "\n".join(lines) + f"\n{end}{tail}"


def _rows(body: str, columns: tuple[str, ...]) -> list[dict[str, str]]:
    rows = []
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(columns) and cells[0] not in (columns[0], "---"):
            rows.append(dict(zip(columns, cells)))
    return rows


def _cell(value: object) -> str:
    return str(value).replace("|", "/").replace("\n", " ")
