"""Megatron-LM's training loop (``megatron.training``) as a host loop: its functions the hook table wraps, each onto
an Installation phase (hooks.py's rows with ``host="megatron-lm"``; another host loop gets a module like this one).

* ``parse_args``: the ``--ga-*`` flags, and token mode's ``--calculate-per-token-loss`` (below);
* ``update_train_iters`` / ``get_train_valid_test_num_samples``: the run length under a step schedule;
* ``training_log``: the noise-scale line printed after Megatron's;
* ``save_checkpoint`` / ``load_checkpoint``: the ``--ga-noise-scale`` EMAs kept next to the checkpoint (the sidecar),
  and warmup stages restored before the loop reads them.

Each is only wrapped around the call (the bodies of the last three are not fingerprinted targets).

The parser makes the whole drop-in ``megatron_ga_ext.install()`` at the top of an unmodified training script.

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
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from megatron_ga_ext.config.args import args_provider
from megatron_ga_ext.config.flags import LOSS_REDUCTION
from megatron_ga_ext.config.megatron_args import MegatronArgs
from megatron_ga_ext.integration.calculator import live_step_calculator
from megatron_ga_ext.integration.compat import megatron_view
from megatron_ga_ext.integration.noise_scale_sidecar import loaded_directory, saved_directory
from megatron_ga_ext.logs import get_logger

if TYPE_CHECKING:
    from megatron_ga_ext.integration.installation import Installation

__all__ = [
    "ARGUMENTS",
    "loading_sidecar",
    "parser_module",
    "planned_num_samples",
    "planned_train_iters",
    "printing_after_training_log",
    "saving_sidecar",
    "with_ga_flags",
]

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
    def parse_args(
        extra_args_provider: Callable | None = None, ignore_unknown_args: bool = False
    ) -> argparse.Namespace:
        nonlocal announced
        if not state.active:
            return original(extra_args_provider, ignore_unknown_args)
        args = original(args_provider(extra_args_provider), ignore_unknown_args)
        mode = MegatronArgs.of(args).get(LOSS_REDUCTION.dest) if state.waiting_for_args else state.config.loss_reduction
        if mode == "token" and not args.calculate_per_token_loss:
            args.calculate_per_token_loss = True
            if not announced:
                announced = True
                logger.info(
                    "megatron-ga-ext: %s token turns on --calculate-per-token-loss: every non-padding token of the "
                    "global batch weighs the same (%s microbatch keeps upstream's mean of means)",
                    LOSS_REDUCTION.flag,
                    LOSS_REDUCTION.flag,
                )
        return args

    return parse_args


def planned_train_iters(original: Callable, state: Installation) -> Callable:
    """``--train-samples`` under a step schedule: train_iters = the steps the schedule plans,
    while consumed < train_samples (upstream divides by a constant GBS on 0.16/0.17 and with a rampup). A calculator
    built where no hook saw it is adopted first (calculator_adoption.py): the run length is planned from the
    calculator that runs it."""

    @functools.wraps(original)
    def update_train_iters(args: argparse.Namespace) -> None:
        if state.active:
            state.adopt_live_calculator("Megatron-LM's update_train_iters")
        calculator = live_step_calculator()
        if not state.active or calculator is None or args.train_iters or not args.train_samples:
            return original(args)
        iterations, samples = calculator.plan(args.train_samples)
        args.train_iters = iterations
        logger.info(
            "step batch-size schedule: --train-samples %d takes %d iterations (%d samples)",
            args.train_samples,
            iterations,
            samples,
        )

    return update_train_iters


def planned_num_samples(original: Callable, state: Installation) -> Callable:
    """The training dataset holds every sample the planned steps consume (the last step may pass
    --train-samples)."""

    @functools.wraps(original)
    def get_train_valid_test_num_samples(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        train_samples = megatron_view().train_samples
        planned = state.planned_samples(train_samples)
        if planned is None or result[0] != train_samples:
            return result
        return (max(result[0], planned), *result[1:])

    return get_train_valid_test_num_samples


def printing_after_training_log(original: Callable, state: Installation) -> Callable:
    """``training_log``: the noise-scale line of the iteration printed after it, so it follows Megatron's iteration
    line (the measurement is read in the optimizer step, before). Wiring it makes the meter hold its lines."""

    @functools.wraps(original)
    def training_log(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if state.active:
            state.after_log()
        return result

    training_log.megatron_ga_ext_prints_after = True  # read by the meter (noise_scale_report.py); gone with the patch
    return training_log


def saving_sidecar(original: Callable, state: Installation) -> Callable:
    """``save_checkpoint(iteration, ...)``: the sidecar after it, where Megatron put the checkpoint."""

    @functools.wraps(original)
    def save_checkpoint(iteration: int, *args: Any, **kwargs: Any) -> Any:
        result = original(iteration, *args, **kwargs)
        if state.active:
            state.after_save(
                saved_directory(megatron_view(), bool(kwargs.get("non_persistent_ckpt", False))), iteration
            )
        return result

    return save_checkpoint


def loading_sidecar(original: Callable, state: Installation) -> Callable:
    """``load_checkpoint(model, optimizer, opt_param_scheduler, load_arg='load', ...)``, which returns (iteration,
    flops): the sidecar of that iteration read after it, from where Megatron loaded it."""

    @functools.wraps(original)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        view = megatron_view()
        iteration = result[0] if isinstance(result, tuple) and result else view.iteration
        if state.active and isinstance(iteration, int) and iteration > 0:
            load_arg = kwargs.get("load_arg", args[3] if len(args) > 3 else "load")
            state.after_load(
                loaded_directory(view, load_arg, iteration),
                iteration,
                kwargs.get("opt_param_scheduler", args[2] if len(args) > 2 else None),
                view.consumed_train_samples,
            )
        return result

    return load_checkpoint
