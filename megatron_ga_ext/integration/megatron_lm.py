"""Megatron-LM's training loop (``megatron.training``) as a host loop: its functions the hook table wraps, each onto
an Installation phase (hooks.py's rows with ``host="megatron-lm"``; another host loop gets a module like this one).

* ``update_train_iters`` / ``get_train_valid_test_num_samples``: the run length under a step schedule;
* ``training_log``: the noise-scale line printed after Megatron's;
* ``save_checkpoint`` / ``load_checkpoint``: the ``--ga-noise-scale`` EMAs kept next to the checkpoint (the sidecar),
  and warmup stages restored before the loop reads them.

Each is only wrapped around the call (the bodies of the last three are not fingerprinted targets).
"""

from __future__ import annotations

import argparse
import functools
from typing import TYPE_CHECKING, Any, Callable

from megatron_ga_ext.integration.calculator import live_step_calculator
from megatron_ga_ext.integration.compat import megatron_args
from megatron_ga_ext.logs import get_logger

if TYPE_CHECKING:
    from megatron_ga_ext.integration.installation import Installation

__all__ = ["loading_sidecar", "planned_num_samples", "planned_train_iters", "printing_after_training_log",
           "saving_sidecar"]

logger = get_logger(__name__)


def planned_train_iters(original: Callable, state: Installation) -> Callable:
    """``--train-samples`` under a step schedule: train_iters = the steps the schedule plans,
    while consumed < train_samples (upstream divides by a constant GBS on 0.16/0.17 and with a rampup)."""

    @functools.wraps(original)
    def update_train_iters(args: argparse.Namespace) -> None:
        calculator = live_step_calculator()
        if not state.active or calculator is None or args.train_iters or not args.train_samples:
            return original(args)
        iterations, samples = calculator.plan(args.train_samples)
        args.train_iters = iterations
        logger.info("step batch-size schedule: --train-samples %d takes %d iterations (%d samples)",
                    args.train_samples, iterations, samples)

    return update_train_iters


def planned_num_samples(original: Callable, state: Installation) -> Callable:
    """The training dataset holds every sample the planned steps consume (the last step may pass
    --train-samples)."""

    @functools.wraps(original)
    def get_train_valid_test_num_samples(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        calculator = live_step_calculator()
        train_samples = getattr(megatron_args(), "train_samples", None)
        if not state.active or calculator is None or not train_samples or result[0] != train_samples:
            return result
        # --ga-batch-size-warmup auto: the last step of a schedule decided later may pass by up to the cap
        margin = state.batch_warmup.cap if state.batch_warmup is not None else 0
        return (max(result[0], calculator.plan(train_samples)[1] + margin), *result[1:])

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

    training_log.megatron_ga_ext_prints_after = True  # read by the meter (noise_scale.py); gone with the patch
    return training_log


def saving_sidecar(original: Callable, state: Installation) -> Callable:
    """``save_checkpoint(iteration, ...)``: the sidecar after it."""

    @functools.wraps(original)
    def save_checkpoint(iteration: int, *args: Any, **kwargs: Any) -> Any:
        result = original(iteration, *args, **kwargs)
        if state.active:
            state.after_save(iteration, bool(kwargs.get("non_persistent_ckpt", False)))
        return result

    return save_checkpoint


def loading_sidecar(original: Callable, state: Installation) -> Callable:
    """``load_checkpoint(model, optimizer, opt_param_scheduler, load_arg='load', ...)``, which returns (iteration,
    flops): the sidecar of that iteration read after it."""

    @functools.wraps(original)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if state.active:
            iteration = result[0] if isinstance(result, tuple) and result else getattr(megatron_args(), "iteration", 0)
            state.after_load(iteration, kwargs.get("load_arg", args[3] if len(args) > 3 else "load"),
                             kwargs.get("opt_param_scheduler", args[2] if len(args) > 2 else None))
        return result

    return load_checkpoint
