"""Every flag of every tested Megatron-LM parser is named by a row of the coverage table
(config/coverage/) or listed off the path with its reason (config/off_path.py): a flag in neither,
one a new source in compat.UPSTREAM adds too, fails here, named. Every tested source whose code runs
on this Python is read (the 3.12 leg reads them all, the 3.11 leg core_v0.16.1: later sources use
Python 3.12's typing).

Needs the Megatron-LM source snapshots (tools/regress.py: ../shared/upstream or
$MEGATRON_LM_SNAPSHOTS, unpacked once to .cache/megatron-lm); skipped without them. One subprocess
builds every snapshot's parser (tests/support/megatron_parser_flags.py).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ga_ext.config.coverage import ROWS, named_by_rows, unclassified
from megatron_ga_ext.config.off_path import OFF_PATH, PENDING, THEMES
from megatron_ga_ext.integration.compat import UPSTREAM
from tools.regress import snapshot_dir, tree

ROOT = Path(__file__).resolve().parents[1]
RUNS_HERE = [u for u in UPSTREAM if tuple(map(int, u.python.split("."))) <= sys.version_info[:2]]
TARBALLS = {u.name: snapshot_dir() / f"megatron-lm-{u.ref}.tar.gz" for u in RUNS_HERE}
PRESENT = {name: path for name, path in TARBALLS.items() if path.exists()}
PLANTED = "--zz-planted-step-flag"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def parsers() -> dict[str, list[str]]:
    """{tested source: the option strings of its Megatron-LM parser}, each tested source that runs
    on this Python and whose snapshot is here."""
    if not PRESENT:
        pytest.skip(f"no Megatron-LM snapshot of a tested source in {snapshot_dir()}")
    roots = {name: tree(path) for name, path in PRESENT.items()}
    result = subprocess.run(
        [sys.executable, "-m", "tests.support.megatron_parser_flags", *map(str, roots.values())],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    return {name: found[str(root)] for name, root in roots.items()}


def unlisted(parsers: dict[str, list[str]]) -> dict[str, list[str]]:
    """{source: its flags in neither list}, the pending ones aside; sources without any left out."""
    missing = {
        name: [flag for flag in unclassified(flags) if flag not in PENDING]
        for name, flags in parsers.items()
    }
    return {name: flags for name, flags in missing.items() if flags}


def report(missing: dict[str, list[str]]) -> str:
    lines = [f"{name}: {', '.join(flags)}" for name, flags in missing.items()]
    return (
        "flags of a tested Megatron parser that neither a coverage row (config/coverage/) nor "
        "the off-path list (config/off_path.py) names; read each flag's help and its use "
        "upstream, then give it a row or a reason:\n" + "\n".join(lines)
    )


def test_every_flag_of_every_tested_parser_is_in_a_row_or_off_the_path(parsers):
    missing = unlisted(parsers)
    assert not missing, report(missing)


def test_a_planted_flag_fails_the_check_and_is_named(parsers):
    """A flag no list names, added to a real parser's flags, makes the test above fail with its
    name."""
    name, flags = next(iter(parsers.items()))
    planted = {name: [*flags, PLANTED]}
    assert unclassified(planted[name]) == [PLANTED]
    assert unlisted(planted) == {name: [PLANTED]}
    with pytest.raises(AssertionError, match=f"{name}: {PLANTED}"):
        test_every_flag_of_every_tested_parser_is_in_a_row_or_off_the_path(planted)


def test_a_planted_flag_of_a_new_source_fails_too(parsers):
    """A source not yet tested brings its own flags: they are checked the same way, not against the
    old sources'."""
    newest = parsers[list(parsers)[-1]]
    missing = unlisted({**parsers, "main@0123456789ab": [*newest, PLANTED]})
    assert missing == {"main@0123456789ab": [PLANTED]}


def test_every_tested_source_has_its_snapshot():
    if not PRESENT:
        pytest.skip(f"no Megatron-LM snapshot of a tested source in {snapshot_dir()}")
    assert PRESENT == TARBALLS, (
        f"tested sources without a snapshot: {sorted(set(TARBALLS) - set(PRESENT))}"
    )


def test_pending_flags_are_in_a_tested_parser_and_in_neither_list(parsers):
    everywhere = {flag for flags in parsers.values() for flag in flags}
    for flag, change in PENDING.items():
        assert flag in everywhere, (
            f"{flag} (pending: {change}) is no flag of a tested parser: drop it from PENDING"
        )
        assert flag not in named_by_rows() and flag not in OFF_PATH, (
            f"{flag} is classified now: drop it from PENDING"
        )


def test_every_listed_flag_is_a_flag_of_a_tested_parser(parsers):
    """Both lists name real flags: a typo would leave the real flag unclassified and the test above
    would say so, but a name no parser has is dead weight (a flag upstream removed stays while an
    older tested source has it)."""
    if len(parsers) < len(UPSTREAM):
        pytest.skip("not every tested source runs on this Python")
    everywhere = {flag for flags in parsers.values() for flag in flags}
    assert sorted(set(OFF_PATH) - everywhere) == []
    row_flags = {flag for row in ROWS for flag in row.flags}
    assert sorted(row_flags - everywhere) == []


# -- the off-path list itself (no snapshot needed) -------------------------------------------------


@pytest.mark.parametrize("theme", THEMES, ids=lambda theme: theme.name)
def test_each_theme_gives_one_sentence_and_spells_its_flags(theme):
    assert theme.reason and theme.reason.endswith(".") and "\n" not in theme.reason
    assert theme.flags and all(flag.startswith("-") and " " not in flag for flag in theme.flags)


def test_a_flag_is_off_the_path_once_and_never_in_a_row_as_well():
    listed = [flag for theme in THEMES for flag in theme.flags]
    assert len(listed) == len(set(listed)) == len(OFF_PATH)
    assert sorted(set(OFF_PATH) & named_by_rows()) == []
    assert not set(PENDING) & (set(OFF_PATH) | named_by_rows())
