"""The generated parts of docs/ (tools/docs.py) and the rows the runs record for them
(tools/results.py)."""

import json
import shutil

import pytest

from tools import docs, results
from tools.doc_tables import flags_table

ROOT = docs.ROOT


@pytest.fixture
def pages(tmp_path):
    """A copy of docs/ to render into: the real pages are never written here."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    return tmp_path


def _outside(text: str, name: str) -> str:
    """The page without table ``name``'s block: the prose a rendering must keep."""
    return text.replace(docs.block(text, name), "")


def test_the_parts_rendered_from_code_are_current():
    """What make docs-check runs: the flags table and the compatibility page's text are what the
    code renders."""
    assert docs.stale() == [], "run make docs and commit the pages"
    assert (
        f"<!-- table:flags -->\n{flags_table()}\n<!-- /table:flags -->"
        in (ROOT / "docs" / "guide.md").read_text()
    )


def test_a_stale_flags_table_is_named_and_rewritten(pages):
    guide = pages / "docs" / "guide.md"
    current = guide.read_text()
    guide.write_text(
        current.replace("| `--ga-guards` / `--no-ga-guards` | on |", "| `--ga-guards` | on |")
    )
    assert docs.stale(pages) == ["docs/guide.md"]
    assert docs.write(pages, results=None) == ["docs/guide.md"]
    assert guide.read_text() == current and docs.stale(pages) == []


def test_a_recorded_row_replaces_its_own_and_the_rest_is_kept(pages, tmp_path):
    doc = pages / "docs" / "reliability.md"
    before = doc.read_text()
    kept = [
        line
        for line in docs.block(before, "fuzz").splitlines()
        if line.startswith("| number spelling |")
    ]
    results.record(
        "fuzz",
        [
            {
                "Surface": "schedule parser",
                "Input": "`parse`",
                "Examples": "7",
                "Slowest example": "1.0 ms",
                "Answers": "accepted 7",
                "Run on": "2030-01-01",
            },
            {
                "Surface": "a new surface",
                "Input": "`x | y`",
                "Examples": "3",
                "Slowest example": "2.0 ms",
                "Answers": "accepted 3",
            },
        ],
        tmp_path / "results",
    )
    assert docs.write(pages, tmp_path / "results") == ["docs/reliability.md"]
    after = doc.read_text()
    table = docs.block(after, "fuzz").splitlines()
    assert (
        table[2] == "| schedule parser | `parse` | 7 | 1.0 ms | accepted 7 | 2030-01-01 |"
    )  # in its place
    assert table[-1].startswith(
        "| a new surface | `x / y` | 3 | 2.0 ms | accepted 3 | 20"
    )  # appended, dated
    assert kept and kept[0] in table
    assert len(table) == len(docs.block(before, "fuzz").splitlines()) + 1
    assert _outside(after, "fuzz") == _outside(before, "fuzz")  # the prose and the other tables


def test_a_partial_row_keeps_the_cells_it_does_not_name(pages, tmp_path):
    """The behaviour suite records one cell of a compatibility row, the end-to-end tier the
    others."""
    directory = tmp_path / "results"
    results.record(
        "compatibility",
        [{"Source": "0.19.2", "Behaviour suite": "1 passed", "Run on": "2030-01-01"}],
        directory,
    )
    results.record(
        "compatibility", [{"Source": "main@abc", "End-to-end": "2 of 2 tests passed"}], directory
    )
    results.record(
        "compatibility", [{"Source": "main@abc", "Behaviour suite": "3 passed"}], directory
    )
    assert [row["Source"] for row in results.recorded("compatibility", directory)] == [
        "0.19.2",
        "main@abc",
    ]
    page = pages / "docs" / "compatibility.md"
    before = _rows(page.read_text())
    docs.write(pages, directory)
    after = _rows(page.read_text())
    assert after["0.19.2"] == before["0.19.2"][:4] + ["1 passed", before["0.19.2"][5], "2030-01-01"]
    assert after["main@abc"][:6] == ["main@abc", "", "", "", "3 passed", "2 of 2 tests passed"]
    assert list(after) == [*before, "main@abc"]  # an unknown source sorts after the tested ones


def _rows(page: str) -> dict[str, list[str]]:
    lines = docs.block(page, "compatibility").splitlines()[2:]
    return {
        cells[0]: cells
        for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)
    }


def test_runs_record_nothing_without_a_results_directory(monkeypatch, tmp_path):
    monkeypatch.delenv(results.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    results.record("fuzz", [{"Surface": "s", "Examples": "1"}])
    assert results.results_dir() is None and list(tmp_path.iterdir()) == []
    monkeypatch.setenv(results.ENV, str(tmp_path / "here"))
    results.record("fuzz", [{"Surface": "s", "Examples": "1"}])
    [path] = (tmp_path / "here" / "fuzz").glob("*.json")
    assert json.loads(path.read_text())["Examples"] == "1"


def test_a_row_with_a_column_its_table_lacks_is_refused(tmp_path):
    with pytest.raises(
        ValueError, match=r"^table 'faults' has no column Surface; its columns: Source, Fault"
    ):
        results.record("faults", [{"Source": "0.19.2", "Fault": "f", "Surface": "s"}], tmp_path)


def test_a_page_without_the_markers_of_its_table_is_an_error(pages):
    doc = pages / "docs" / "performance.md"
    doc.write_text(doc.read_text().replace("<!-- /table:e2e -->", ""))
    with pytest.raises(
        ValueError,
        match=r"^docs/performance.md has no <!-- table:e2e --> \.\.\. <!-- /table:e2e -->",
    ):
        docs.write(pages, None)


def test_ci_runs_the_docs_check_and_no_target_hands_a_test_a_page():
    assert (
        "docs-check: $(STAMP)\n\t$(PY) -m tools.docs --check\n" in (ROOT / "Makefile").read_text()
    )
    targets = '"docs-check fuzz critical-batch-quick oracle patches-check test-bridge"'
    assert targets in (ROOT / ".ci" / "run").read_text()
    assert "_DOC=" not in (ROOT / "Makefile").read_text() + (ROOT / ".ci" / "run").read_text()


def test_a_stale_coverage_page_is_named_and_rewritten(pages):
    page = pages / "docs" / "coverage.md"
    current = page.read_text()
    page.write_text(current.replace("*supported*", "*fine*", 1))
    assert docs.stale(pages) == ["docs/coverage.md"]
    docs.write(pages, results=None)
    assert page.read_text() == current


def test_the_readme_is_a_door_of_at_most_200_lines():
    """The README introduces and links; the detail lives one link away in docs/ (docs/commands.md,
    guide.md)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move detail into docs/"
