"""The end-to-end tier: which Megatron-LM sources it runs on, one launch cache, and the results
table.

Sources (tools/regress.py): ``MEGATRON_LM`` (a checkout, or a .tar.gz of one), else every snapshot
in ``MEGATRON_LM_SNAPSHOTS`` (default ``../shared/upstream``) of a tested source whose Python is
this one. With neither, every test here is skipped with one line saying what to pass (``make e2e``
says it first).

Megatron-LM's training loop through the drop-in (test_pretrain_gpt.py, test_packing.py,
test_resume.py) runs on every source; the features' own launches (noise scale, batch warmup, LR
scaling, faults, FSDP, MoE and MTP) on the newest release and main commit (``newest_source``), since
each source's hooks are held by its fingerprints and the behaviour suite (make matrix) on each.

Each (source, layout) runs a handful of launches, shared by the tests that check them. At the end
the results table is printed, and each source's compatibility row is recorded (tools/results.py,
where ``MEGATRON_GA_RESULTS`` is set: make e2e) for ``make docs`` to render into
docs/compatibility.md.
"""

from __future__ import annotations

import os
import platform
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from megatron_ga_ext.integration.compat import UPSTREAM
from tests.support.pretrain_runs import Run, launch
from tools.compatibility import core_version, hooked_functions, source_name
from tools.regress import NO_SOURCE, sources
from tools.results import record, results_dir

SOURCES = sources([os.environ["MEGATRON_LM"]] if os.environ.get("MEGATRON_LM") else [])


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``source``: every source; ``newest_source``: the newest release and main commit among them
    (faults); ``newest_release``: the first of those (the timing comparison)."""
    for fixture, trees in (
        ("source", SOURCES),
        ("newest_source", _newest(SOURCES)),
        ("newest_release", _newest(SOURCES)[:1]),
    ):
        if fixture in metafunc.fixturenames:
            params = [pytest.param(s, id=source_name(s)) for s in trees] or [
                pytest.param(None, marks=pytest.mark.skip(reason=NO_SOURCE), id="no-source")
            ]
            metafunc.parametrize(fixture, params, scope="session")


def _newest(trees: list[Path]) -> list[Path]:
    """The newest release and the newest main commit (compat.UPSTREAM is ordered); a given checkout
    as it is."""
    named = {source_name(t): t for t in trees}
    known = [u for u in UPSTREAM if u.name in named]
    if not known:
        return trees
    picks = [[u for u in known if u.is_release], [u for u in known if not u.is_release]]
    return [named[group[-1].name] for group in picks if group]


class Launches:
    """Every launch of the session, made once and shared by the tests that read it."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.done: dict[tuple, Run] = {}

    def get(
        self,
        source: Path,
        layout: str,
        name: str,
        flags: list[str],
        *,
        extension: bool = True,
        drop_in: str = "entry",
        env: dict[str, str] | None = None,
        device: str = "cpu",
    ) -> Run:
        key = (source, layout, name)
        if key not in self.done:
            self.done[key] = launch(
                source,
                layout,
                flags,
                extension=extension,
                name=name,
                drop_in=drop_in,
                workdir=self.workdir / source.name / layout,
                env=env,
                device=device,
            )
        return self.done[key]


@pytest.fixture(scope="session")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return _LAUNCHES.setdefault("session", Launches(tmp_path_factory.mktemp("e2e")))


@pytest.fixture(autouse=True)
def _name_the_source(request: pytest.FixtureRequest) -> None:
    """Every test's report names its source, so a failure counts against the right row."""
    params = request.node.callspec.params if hasattr(request.node, "callspec") else {}
    source = params.get("source") or params.get("newest_source") or params.get("newest_release")
    if source is not None:
        request.node.user_properties.append(("source", source_name(source)))


_LAUNCHES: dict[str, Launches] = {}


# -- the results table ----------------------------------------------------------------------------

_ROWS: list[dict] = []
_OUTCOMES: dict[str, list[str]] = defaultdict(list)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        props = dict(report.user_properties)
        source = props.get("source")
        if source:
            _OUTCOMES[source].append(report.outcome)  # one per test, whichever phase failed
        _ROWS.extend(row | {"outcome": report.outcome} for row in props.get("rows", []))


def pytest_terminal_summary(terminalreporter) -> None:
    if not _ROWS:
        return
    columns = (
        "source",
        "layout",
        "mode",
        "case",
        "iterations",
        "samples",
        "lr_end",
        "loss_vs_upstream",
        "N",
        "outcome",
    )
    terminalreporter.section("end-to-end: Megatron-LM pretrain_gpt.py through install()")
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in _ROWS)) for c in columns}
    terminalreporter.write_line("  ".join(c.ljust(widths[c]) for c in columns))
    for row in _ROWS:
        terminalreporter.write_line(
            "  ".join(str(row.get(c, "")).ljust(widths[c]) for c in columns)
        )
    _record_compatibility()


def _record_compatibility() -> None:
    if results_dir() is None:
        return
    import torch  # noqa: F401  (only for its version, in the row)

    done = _LAUNCHES["session"].done if _LAUNCHES else {}
    rows = []
    for source in SOURCES:
        name = source_name(source)
        outcomes = _OUTCOMES.get(name, [])
        if not outcomes:
            continue
        runs = [key for key in done if key[0] == source]
        layouts = sorted({layout for _, layout, _ in runs})
        passed = sum(o == "passed" for o in outcomes)
        cases = sorted({r["case"].split(" at ")[0] for r in _ROWS if r["source"] == name})
        summary = (
            f"{passed} of {len(outcomes)} tests passed, {len(runs)} launches of pretrain_gpt.py "
            f"({', '.join(layouts)}; {', '.join(cases)})"
        )
        rows.append(
            {
                "Source": name,
                "megatron-core": core_version(source),
                "Python, torch": f"Python {platform.python_version()}, torch "
                f"{sys.modules['torch'].__version__}",
                "Hooked functions": hooked_functions(source),
                "End-to-end": summary,
            }
        )
    record("compatibility", rows)
