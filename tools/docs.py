"""The generated parts of docs/: `make docs` writes them, `make docs-check` fails where one is not
current.

    python -m tools.docs [--results DIR]   # write every generated part (make docs)
    python -m tools.docs --check           # exit 1 naming each stale part rendered from code alone (make docs-check)

A generated part sits between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``; the prose around
it is kept.

* Rendered from code declarations alone, so the same on every run (docs-check compares them): the
  flags table of docs/guide.md (``doc_tables.flags_table()``), the hook table and the step's
  features of docs/design.md (``doc_design.hook_table()``, ``doc_design.step_table()``), the whole of
  docs/coverage.md (``doc_tables.coverage_doc()``), the text of docs/compatibility.md above its
  table (:data:`COMPATIBILITY_HEADER`) and the critical-batch tables of docs/noise-scale.md (from
  the committed benchmarks/results JSON: benchmarks/critical_batch_report.py).
* Measured: the tables of tools/results.py, rendered from the rows the runs recorded under the
  results directory (default .cache/results). A recorded row replaces the page's row of the same
  key, cell by cell; rows no run recorded (another leg's sources) are kept. Timings and dates move
  from run to run, so docs-check leaves them alone: run `make docs` after `make fuzz` or `make e2e`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from megatron_ga_ext.integration.compat import UPSTREAM

from .doc_tables import coverage_doc, flags_table
from .results import TABLES, Table, cell, recorded, results_dir

ROOT = Path(__file__).resolve().parents[1]
COMPATIBILITY_HEADER = """# Compatibility

Rendered by `make docs` from the rows `make matrix`, `make e2e` and `make regress MEGATRON_LM=...` record: one row
per Megatron-LM release or main-branch commit. "Hooked functions" compares the source of every upstream function the
extension hooks, and of those whose arithmetic its auxiliary-loss corrections assume, with the fingerprints of the
tested sources, normalised (the AST without docstrings, comments or formatting): strict mode accepts a source whose
hooked functions are all known, whatever its version string. A source that is none of them (a fork) is judged by
behaviour, start-up probes and the corrections' first-call checks ([adopting.md](adopting.md)); `megatron-ga
compat` gives the verdict in an image build.
"Behaviour suite" is the megatron-core tier (install, guards, reduction, the PP 2 x DP 2 schedule through install(),
and upstream's `train_step` with the sequence-packing scheduler where the source runs it) on that source;
"End-to-end" is Megatron-LM's own `pretrain_gpt.py` through the drop-in entry (`python -m megatron_ga_ext`) on the
CPU over gloo (DP 2 and PP 2 x DP 2; token and microbatch mode; constant GBS, a converted rampup, a step schedule or
its backport, checkpoint resume, the PP guard, the sequence-packing scheduler where the source runs it), each check
against `megatron-ga schedule`'s plan and upstream's own `--calculate-per-token-loss` run.

"""


def replace_block(text: str, name: str, body: str, doc: str) -> str:
    """``text`` with the lines between table ``name``'s markers replaced by ``body``."""
    begin, end = f"<!-- table:{name} -->\n", f"\n<!-- /table:{name} -->"
    if begin not in text or end not in text:
        raise ValueError(
            f"{doc} has no {begin.strip()} ... {end.strip()} block; add the two markers where "
            "the table belongs"
        )
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}{body}{end}{tail}"


def block(text: str, name: str) -> str:
    """The lines between table ``name``'s markers ("" where there are none)."""
    begin, end = f"<!-- table:{name} -->\n", f"\n<!-- /table:{name} -->"
    return text.split(begin, 1)[1].split(end, 1)[0] if begin in text and end in text else ""


# -- rendered from code alone ---------------------------------------------------------------------


def _flags(text: str) -> str:
    return replace_block(text, "flags", flags_table(), "docs/guide.md")


def _hooks(text: str) -> str:
    from tools.doc_design import hook_table  # torch: the wrappers the rows name

    return replace_block(text, "hooks", hook_table(), "docs/design.md")


def _step(text: str) -> str:
    from tools.doc_design import step_table  # torch: the features' modules

    return replace_block(text, "step", step_table(), "docs/design.md")


def _critical_batch(text: str) -> str:
    from benchmarks.critical_batch_report import tables

    for name, body in tables().items():
        text = replace_block(text, name, body, "docs/noise-scale.md")
    return text


def _check_rules(text: str) -> str:
    from tools.doc_rules import not_applied_table, rules_table

    text = replace_block(text, "check-rules", rules_table(), "docs/check-rules.md")
    return replace_block(
        text, "check-rules-not-applied", not_applied_table(), "docs/check-rules.md"
    )


def _compatibility_header(text: str) -> str:
    marker = "<!-- table:compatibility -->"
    if marker not in text:
        raise ValueError(f"docs/compatibility.md has no {marker} block")
    return COMPATIBILITY_HEADER + text[text.index(marker) :]


#: page -> the renderings of its parts that follow from code alone.
FIXED: dict[str, tuple[Callable[[str], str], ...]] = {
    "docs/guide.md": (_flags,),
    "docs/check-rules.md": (_check_rules,),
    "docs/coverage.md": (lambda text: coverage_doc(),),
    "docs/design.md": (_hooks, _step),
    "docs/compatibility.md": (_compatibility_header,),
    "docs/noise-scale.md": (_critical_batch,),
}


# -- measured -------------------------------------------------------------------------------------


def merged_table(name: str, body: str, rows: list[dict[str, str]]) -> str:
    """Table ``name`` with the page's rows (``body``) and the recorded ``rows`` merged by key."""
    table = TABLES[name]
    merged = {_key(table, row): row for row in _parse(table, body)}
    for row in rows:
        key = _key(table, row)
        merged[key] = {column: "" for column in table.columns} | merged.get(key, {}) | row
    ordered = list(merged.values())
    if name == "compatibility":  # releases, then main commits, as compat.UPSTREAM orders them
        order = [upstream.name for upstream in UPSTREAM]
        ordered.sort(
            key=lambda row: (
                order.index(row["Source"]) if row["Source"] in order else len(order),
                row["Source"],
            )
        )
    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += [
        "| " + " | ".join(cell(row.get(column, "")) for column in table.columns) + " |"
        for row in ordered
    ]
    return "\n".join(lines)


def _parse(table: Table, body: str) -> list[dict[str, str]]:
    rows = []
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(table.columns) and cells[0] not in (table.columns[0], "---"):
            rows.append(dict(zip(table.columns, cells)))
    return rows


def _key(table: Table, row: dict[str, str]) -> tuple[str, ...]:
    return tuple(row[column] for column in table.columns[: table.keys])


# -- the pages ------------------------------------------------------------------------------------


def fixed(root: Path) -> dict[str, str]:
    """Each page with a part rendered from code alone, as it should read (its measured tables as
    they are)."""
    pages = {}
    for doc, renderings in FIXED.items():
        text = (root / doc).read_text()
        for render in renderings:
            text = render(text)
        pages[doc] = text
    return pages


def stale(root: Path = ROOT) -> list[str]:
    """The pages whose parts rendered from code alone are not current."""
    return [doc for doc, text in fixed(root).items() if (root / doc).read_text() != text]


def write(root: Path = ROOT, results: Path | None = None) -> list[str]:
    """Render every generated part into the pages under ``root``; the pages that changed."""
    pages = fixed(root)
    for name, table in TABLES.items():
        text = pages.get(table.doc) or (root / table.doc).read_text()
        rows = recorded(name, results) if results else []
        pages[table.doc] = replace_block(
            text, name, merged_table(name, block(text, name), rows), table.doc
        )
    changed = [doc for doc, text in pages.items() if (root / doc).read_text() != text]
    for doc in changed:
        (root / doc).write_text(pages[doc])
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.docs", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 where a part rendered from code alone is not current; write nothing",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=results_dir() or ROOT / ".cache" / "results",
        help="the directory the runs recorded their rows in (default: $MEGATRON_GA_RESULTS, else "
        ".cache/results)",
    )
    args = parser.parse_args(argv)
    if args.check:
        pages = stale()
        for doc in pages:
            print(
                f"{doc}: a generated part is not current; run make docs and commit the page",
                file=sys.stderr,
            )
        return 1 if pages else 0
    for doc in write(results=args.results):
        print(f"wrote {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
