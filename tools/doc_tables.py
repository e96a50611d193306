"""The Markdown that ``make docs`` renders from the package's declarations, kept out of the
installed package: the whole of docs/coverage.md (the coverage rows, upstream's own defects, the
flags off the path) and the ``--ga-*`` flags table of docs/guide.md. tools/docs.py writes them;
tests/test_coverage.py and tests/test_docs.py compare."""

from __future__ import annotations

from megatron_ga_ext.config.coverage.rows import ROWS
from megatron_ga_ext.config.flags import GA_OPTIONS
from megatron_ga_ext.config.off_path import OFF_PATH, THEMES
from megatron_ga_ext.core.megatron_flags import STEP_SCHEDULE, Option

__all__ = ["coverage_doc", "coverage_table", "flags_table", "off_path_table", "upstream_table"]

DOC_HEADER = """# Coverage: Megatron's features on the loss, gradient, step and schedule path

Rendered by `make docs` from `megatron_ga_ext/config/coverage/` (tools/doc_tables.py); `make docs-check` and
tests/test_coverage.py check that this file is its rendering. *supported*: every check of every step runs, and the
test named proves it. *limited*: it runs, with the limit stated (logged at start-up; `megatron-ga check` gives it as
one line, `careful:` or `info:` first, linking to its row here). *refused*: `install()` stops at start-up with a
`CoverageError` and `megatron-ga check` reports a problem (the refusal's test:
`tests/test_coverage.py::test_refused_rows_stop_install_and_check[<row>]`).
"""


def coverage_table() -> str:
    """The table of :data:`ROWS` in Markdown."""
    lines = [
        "| row | flags | when | behaviour | what holds, the limit, or why refused | test |",
        "|---|---|---|---|---|---|",
    ]
    for row in ROWS:
        text = row.text + (f" {row.instead}" if row.instead else "")
        tests = "<br>".join(str(p) for p in row.proofs)
        if row.support == "refused":
            tests = f"`tests/test_coverage.py::test_refused_rows_stop_install_and_check[{row.id}]`"
        lines.append(
            f'| <a id="{row.id}"></a>`{row.id}` | {_escape(row.given)} | {row.when} | '
            f"{row.support} | {_escape(text)} | {tests} |"
        )
    return "\n".join(lines)


OFF_PATH_HEADER = """## Flags off the path

{count} flags of the tested Megatron parsers are off the loss, gradient, step and batch path, each listed under the
reason it is off (`megatron_ga_ext/config/off_path.py`). `tests/test_coverage_complete.py` fails on a flag of a tested
parser that neither a row above nor this list names (one a new source adds, too); `make regress` lists those of a
checkout.
"""


def off_path_table() -> str:
    """The themes of config/off_path.py in Markdown: each with its reason and its flags."""
    lines = ["| theme | reason | flags |", "|---|---|---|"]
    for theme in THEMES:
        flags = ", ".join(f"`{flag}`" for flag in theme.flags)
        lines.append(f"| {theme.name} ({len(theme.flags)}) | {_escape(theme.reason)} | {flags} |")
    return "\n".join(lines)


UPSTREAM_HEADER = """## Without the extension: upstream's own defects

Where a row records a defect of upstream Megatron itself, a launch *without* megatron-ga-ext (no `-m megatron_ga_ext`,
no `--ga-*` flag) meets it as it is. `megatron-ga check` says so from these declarations (the `upstream` field of a
row): a problem where the gradients change (`wrong`), a note where they may (`careful`), each with the fix; a fix that
is an edit of the line is checked against every rule before it is printed.
"""


def coverage_doc() -> str:
    """docs/coverage.md."""
    off_path = OFF_PATH_HEADER.format(count=len(OFF_PATH))
    parts = (DOC_HEADER, coverage_table(), "", UPSTREAM_HEADER, upstream_table(), "", off_path)
    return "\n".join((*parts, off_path_table())) + "\n"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def upstream_table() -> str:
    """The Markdown table of every upstream defect the rows record (docs/coverage.md)."""
    lines = [
        "| row | without megatron-ga-ext | what upstream does | check says | the fix |",
        "|---|---|---|---|---|",
    ]
    for row in ROWS:
        for trap in row.upstream:
            said = "a problem (`wrong`)" if trap.severity == "wrong" else "a note (`careful`)"
            lines.append(
                f"| [`{row.id}`](#{row.id}) | {trap.given} | {trap.effect} | {said} | {trap.fix} |"
            )
    return "\n".join(lines)


def flags_table() -> str:
    """The Markdown table of the flags add_args adds (docs/guide.md holds it; a test compares)."""
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for option in (*GA_OPTIONS, STEP_SCHEDULE):
        rows.append(f"| {_flag_cell(option)} | {_default_cell(option)} | {option.help} |")
    return "\n".join(rows)


def _flag_cell(option: Option) -> str:
    if option.choices:
        return f"`{option.flag} {{{','.join(option.choices)}}}`"
    return " / ".join(f"`{spelling}`" for spelling in option.spellings)


def _default_cell(option: Option) -> str:
    if option.type is bool:
        return "on" if option.default else "off"
    return "" if option.default is None else f"`{option.default}`"
