"""``python -m megatron_ga_ext SCRIPT ARGS...``: run a Megatron training script, unmodified, with
the extension installed, as ``python SCRIPT ARGS...`` runs it. Under torchrun: ``torchrun ... -m
megatron_ga_ext pretrain_gpt.py --micro-batch-size 2 ... --ga-loss-reduction token``."""

import os
import runpy
import sys

import megatron_ga_ext

USAGE = (
    "usage: python -m megatron_ga_ext SCRIPT [ARGS...]   (e.g. torchrun --nproc-per-node 8 -m "
    "megatron_ga_ext pretrain_gpt.py --micro-batch-size 2 ...)"
)


def main(argv: list[str]) -> None:
    if not argv or argv[0].startswith("-"):
        raise SystemExit(USAGE)
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        raise SystemExit(f"python -m megatron_ga_ext: {argv[0]}: no such script.\n{USAGE}")
    sys.argv = [script, *argv[1:]]
    sys.path[0] = os.path.dirname(
        script
    )  # as `python SCRIPT` sets it: the script's own imports resolve there
    megatron_ga_ext.install()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
