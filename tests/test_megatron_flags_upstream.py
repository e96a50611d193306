"""The Megatron flags core/megatron_flags.py declares exist in Megatron-LM's own parser at each
tested release and commit, and the ones it calls "not a Megatron flag" exist in none.

Needs the Megatron-LM source snapshots of this Python's tested sources (tools/regress.py:
../shared/upstream or $MEGATRON_LM_SNAPSHOTS, unpacked once to .cache/megatron-lm); skipped without
them. One subprocess builds every snapshot's parser.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ga_ext.core.megatron_flags import MEGATRON_OPTIONS, NOT_MEGATRON, RULE_OPTIONS
from tests.support.snapshot_parser import release
from tools.regress import NO_SOURCE, sources

ROOT = Path(__file__).resolve().parents[1]

DIRS = sources([])

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not DIRS, reason=NO_SOURCE)]


@pytest.fixture(scope="module")
def parser_flags() -> dict[Path, set[str]]:
    result = subprocess.run(
        [sys.executable, "-m", "tests.support.megatron_parser_flags", *map(str, DIRS)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {
        Path(root): set(flags) for root, flags in json.loads(result.stdout.splitlines()[-1]).items()
    }


def test_every_flag_we_read_is_in_megatrons_parser_from_its_release_on(parser_flags):
    for directory, flags in parser_flags.items():
        for option in (*MEGATRON_OPTIONS, *RULE_OPTIONS):
            if option.since is not None and release(directory) < release(Path(option.since)):
                assert option.flag not in flags, (
                    f"{option.flag} in {directory.name}: its since= is too late"
                )
                continue
            for spelling in option.spellings:
                assert spelling in flags, f"{spelling} is not a flag of {directory.name}"


def test_flags_we_call_not_megatrons_are_in_no_parser(parser_flags):
    assert len(parser_flags) == len(DIRS)
    for directory, flags in parser_flags.items():
        assert not set(NOT_MEGATRON) & flags, directory.name
