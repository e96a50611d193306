"""Megatron-LM's own parser with the ``--ga-*`` flags, and token mode's ``--calculate-per-token-loss`` turned on, so
the whole drop-in is ``megatron_ga_ext.install()`` at the top of an unmodified training script.

Megatron parses its command line in ``megatron.training.arguments.parse_args(extra_args_provider,
ignore_unknown_args)`` on every tested source: ``parse_and_validate_args`` (0.18 and later) looks it up as a module
global and ``initialize_megatron`` (0.16, 0.17) binds it by name, so replacing it wherever it is bound reaches both.
The replacement runs the script's own ``extra_args_provider`` first, then adds the flags the parser lacks
(``config/args.py``); a script that passes ``megatron_ga_ext.args_provider(...)`` itself keeps working.

Token mode is what installing the extension asks for, and it needs Megatron's per-token loss
(``docs/reduction.md``): without ``--calculate-per-token-loss`` Megatron divides each micro-batch by its own token
count and DDP pre-divides by DP x CP. So a token-mode launch without the flag gets it set on the parsed args,
before Megatron validates them or builds anything from them, and the start-up log says so once.
``--ga-loss-reduction microbatch`` keeps upstream's mean of means.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Callable

from megatron_ga_ext.config.args import args_provider
from megatron_ga_ext.config.flags import LOSS_REDUCTION
from megatron_ga_ext.logs import get_logger

if TYPE_CHECKING:
    from megatron_ga_ext.integration.installation import Installation

__all__ = ["ARGUMENTS", "parser_module", "with_ga_flags"]

logger = get_logger(__name__)

ARGUMENTS = "megatron.training.arguments"

ParseArgs = Callable[..., argparse.Namespace]


def parser_module(state: Installation) -> ModuleType | bool:
    """Megatron-LM's ``megatron.training.arguments``, whose ``parse_args`` the hook table replaces where it is bound;
    False (nothing to do) with megatron-core alone.

    Importing ``megatron.training`` configures the root logger and loads Megatron-LM's whole training loop, so it
    is imported here only for an install() that waits for Megatron's args (the training script imports it next
    anyway); an install() given its config patches the parser only where the script has loaded it already."""
    if ARGUMENTS not in sys.modules:
        if not state.waiting_for_args:
            return False  # a config given outright (a megatron-core loop, verify): no Megatron-LM parse to join
        try:
            return importlib.import_module(ARGUMENTS)
        except ModuleNotFoundError as error:
            if error.name not in ("megatron.training", ARGUMENTS):
                raise  # Megatron-LM's training code is there, but something it imports is not
            return False  # megatron-core alone: Megatron-LM's parser is not there
    return sys.modules[ARGUMENTS]


def with_ga_flags(original: ParseArgs, state: Installation) -> ParseArgs:
    """``parse_args`` with the ``--ga-*`` flags, and ``--calculate-per-token-loss`` on in token mode."""
    announced = False

    @functools.wraps(original)
    def parse_args(extra_args_provider: Callable | None = None, ignore_unknown_args: bool = False) -> argparse.Namespace:
        nonlocal announced
        if not state.active:
            return original(extra_args_provider, ignore_unknown_args)
        args = original(args_provider(extra_args_provider), ignore_unknown_args)
        mode = getattr(args, LOSS_REDUCTION.dest) if state.waiting_for_args else state.config.loss_reduction
        if mode == "token" and not args.calculate_per_token_loss:
            args.calculate_per_token_loss = True
            if not announced:
                announced = True
                logger.info(
                    "megatron-ga-ext: %s token turns on --calculate-per-token-loss: every non-padding token of the "
                    "global batch weighs the same (%s microbatch keeps upstream's mean of means)",
                    LOSS_REDUCTION.flag, LOSS_REDUCTION.flag)
        return args

    return parse_args
