"""Read launches with Megatron-LM's own parser at each source snapshot, and print what the coverage
table makes of them, as JSON: {snapshot: {"flags": [option strings], "refused": {case: [row ids] or
null}}} (null: that parser refuses the line, e.g. a flag it does not define yet).

Run by tests/test_coverage_upstream.py in a subprocess (``python -m
tests.support.coverage_upstream_args``), the cases as JSON on stdin ([[case, flags, GAConfig
kwargs], ...]), the snapshot roots as arguments. Each snapshot's parser is built by
tests/support/snapshot_parser.py.
"""

import argparse
import contextlib
import io
import json
import sys
import warnings

from megatron_ga_ext.config.coverage import Setting, verdict
from megatron_ga_ext.config.ga_config import GAConfig
from tests.support.snapshot_parser import install_stubs, option_strings, parser_of

warnings.filterwarnings("ignore")


def refused(parser: argparse.ArgumentParser, flags: list[str], ga: dict) -> list[str] | None:
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = parser.parse_args(flags)
    except SystemExit:
        return None
    return [row.id for row in verdict(Setting.of(args, GAConfig(**ga))).refused]


def main() -> None:
    cases = json.load(sys.stdin)
    install_stubs()
    out = {}
    for root in sys.argv[1:]:
        parser = parser_of(root)
        out[root] = {
            "flags": option_strings(parser),
            "refused": {case: refused(parser, flags, ga) for case, flags, ga in cases},
        }
    print(json.dumps(out))


main()
