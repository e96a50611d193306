"""docs/coverage.md: the coverage table and the off-path list in Markdown (``make docs`` writes it). Pure Python."""

from __future__ import annotations

from megatron_ga_ext.config.coverage.rows import ROWS
from megatron_ga_ext.config.coverage.upstream import upstream_table
from megatron_ga_ext.config.off_path import OFF_PATH, THEMES

__all__ = ["coverage_doc", "coverage_table", "off_path_table"]

DOC_HEADER = """# Coverage: Megatron's features on the loss, gradient, step and schedule path

Rendered by `make docs` from `megatron_ga_ext/config/coverage/` (`coverage_doc()`); `make docs-check` and
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
            f'| <a id="{row.id}"></a>`{row.id}` | {_escape(row.given)} | {row.when} | {row.support} | '
            f"{_escape(text)} | {tests} |"
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
    return (
        f"{DOC_HEADER}\n{coverage_table()}\n\n{UPSTREAM_HEADER}\n{upstream_table()}\n\n{off_path}\n{off_path_table()}\n"
    )


def _escape(text: str) -> str:
    return text.replace("|", "\\|")
