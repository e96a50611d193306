"""The coverage table against Megatron-LM's own parser at each tested release and commit: every flag
a row names is a flag of that parser (from its declared release on), and each refusal launch of
tests/test_coverage.py, read by that parser, is refused by the same row.

Needs the Megatron-LM source snapshots of this Python's tested sources (tools/regress.py:
../shared/upstream or $MEGATRON_LM_SNAPSHOTS, unpacked once to .cache/megatron-lm); skipped without
them. One subprocess builds every snapshot's parser.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ga_ext.config.coverage import ROWS
from megatron_ga_ext.config.flags import OPTIONS
from megatron_ga_ext.core.megatron_flags import COVERED_OPTIONS
from tests.support.snapshot_parser import release
from tests.test_coverage import REFUSALS
from tools.regress import NO_SOURCE, sources

ROOT = Path(__file__).resolve().parents[1]

DIRS = sources([])

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not DIRS, reason=NO_SOURCE)]


@pytest.fixture(scope="module")
def upstream() -> dict[Path, dict]:
    cases = [[refusal.id, refusal.flags, refusal.ga] for refusal in REFUSALS]
    result = subprocess.run(
        [sys.executable, "-m", "tests.support.coverage_upstream_args", *map(str, DIRS)],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {Path(root): found for root, found in json.loads(result.stdout.splitlines()[-1]).items()}


def test_every_rows_flag_is_megatrons_from_its_release_on(upstream):
    assert len(upstream) == len(DIRS)
    for directory, found in upstream.items():
        flags = set(found["flags"])
        for flag in {flag for row in ROWS for flag in row.flags} | {
            o.flag for o in COVERED_OPTIONS
        }:
            since = OPTIONS[flag].since
            if since is not None and release(directory.name) < release(since):
                assert flag not in flags, f"{flag} in {directory.name}: its since= is too late"
            else:
                assert flag in flags, f"{flag} is not a flag of {directory.name}"


def test_refusal_launches_read_by_megatrons_parser_are_refused(upstream):
    """Parsed (not yet validated) args: every launch its parser reads is refused by its row; the
    lines of releases that lack a flag (--cuda-graph-modules before 0.18, full_iteration as an impl
    before 0.18) do not parse."""
    for directory, found in upstream.items():
        for refusal in REFUSALS:
            rows = found["refused"][refusal.id]
            if rows is None:
                assert release(directory.name) < (0, 19, 0), (
                    f"{directory.name} cannot read {refusal.id}"
                )
                continue
            assert refusal.row in rows, (directory.name, refusal.id, rows)
