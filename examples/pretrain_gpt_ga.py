"""Megatron-LM's pretrain_gpt.py with megatron-ga-ext. Run it from the Megatron-LM root in its place:

    torchrun ... /path/to/examples/pretrain_gpt_ga.py <pretrain_gpt.py's flags> --calculate-per-token-loss

What changes against upstream's pretrain_gpt.py, and nothing else:
  1. ``megatron_ga_ext.install()`` before Megatron parses its args; it reads them once they are parsed.
  2. the ``--ga-*`` flags (and ``--step-batch-size-schedule`` on releases without it), added after
     whatever ``extra_args_provider`` pretrain_gpt.py passes.
Everything else (model, data, forward_step, loss_func) is upstream's own pretrain_gpt.py, run as the
main program. ``patches/Megatron-LM-d98e8a64ddf3/pretrain_gpt.py.patch`` makes the same two changes in
place, for those who prefer to edit their copy.
"""

import os
import runpy
import sys
from typing import Callable

import megatron_ga_ext


def with_ga_args(parse_args: Callable) -> Callable:
    """Megatron's ``parse_args(extra_args_provider, ignore_unknown_args)`` with the --ga-* flags added."""

    def parse_args_with_ga(extra_args_provider=None, ignore_unknown_args=False):
        return parse_args(megatron_ga_ext.args_provider(extra_args_provider), ignore_unknown_args)

    return parse_args_with_ga


def add_ga_args_to_megatron() -> None:
    """Every caller of Megatron's parse_args (parse_and_validate_args, initialize_megatron) gets the flags.

    Both look ``parse_args`` up where they were imported from, so replacing it in
    ``megatron.training.arguments`` (and in modules that bound it already) reaches them.
    """
    from megatron.training import arguments

    original = arguments.parse_args
    for module in list(sys.modules.values()):
        if getattr(module, "parse_args", None) is original and module.__name__.startswith("megatron."):
            module.parse_args = with_ga_args(original)


def main() -> None:
    # The Megatron-LM root first, as for `python pretrain_gpt.py` run from it: its megatron package (a main
    # checkout's, not an installed megatron-core wheel) and gpt_builders, model_provider.
    sys.path.insert(0, os.getcwd())
    megatron_ga_ext.install()  # change 1
    add_ga_args_to_megatron()  # change 2
    runpy.run_path(os.path.join(os.getcwd(), "pretrain_gpt.py"), run_name="__main__")


if __name__ == "__main__":
    main()
