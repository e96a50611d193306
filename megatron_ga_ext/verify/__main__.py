"""``python -m megatron_ga_ext.verify``: the same command as ``megatron-ga verify``."""

import argparse
import sys

from megatron_ga_ext.verify.command import configure_parser, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="megatron-ga verify", description=__doc__)
    configure_parser(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
