"""The hooks into Megatron-LM's training loop (``megatron.training``), GPTModel and the optimizers Megatron
builds: install() wires them once (a vendored tree at its first calculator hook, when Megatron has parsed its args).

* ``update_train_iters`` / ``get_train_valid_test_num_samples``: the run length under a step schedule;
* the optimizers' ``step``: where each iteration's liveness is checked (liveness.py: the schedule and finalize
  hooks ran), skipped after a zero-token batch (``--ga-zero-token-policy skip``), and where the
  ``--ga-checks async`` verdict of the step and a ``--ga-noise-scale`` measurement are read;
* ``GPTModel.forward``: MoE routes with the loss mask's padding (aux_losses.py);
* ``RerunStateMachine.should_checkpoint_and_exit``: what Megatron decided on a non-finite loss the extension left
  to it (finalize.py);
* ``save_checkpoint`` / ``load_checkpoint``: the ``--ga-noise-scale`` EMAs kept next to the checkpoint
  (noise_scale.py's sidecar); ``training_log``: its log line printed after Megatron's.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from typing import Any, Callable

from megatron_ga_ext.integration.aux_losses import (
    broadcasts_padding_per_token,
    exact_token_counts,
    global_count_mtp_loss,
    padding_mask_forward,
    per_token_padding_expert_bias,
    router_scales_by_tp_cp,
    tp_cp_scaled_z_loss,
)
from megatron_ga_ext.integration.calculator import live_step_calculator
from megatron_ga_ext.integration.compat import MOE_UTILS, MTP, TARGETS, TRAINING, check_targets, megatron_args
from megatron_ga_ext.integration.installation import Installation
from megatron_ga_ext.integration.liveness import StepLiveness
from megatron_ga_ext.integration.noise_scale import printing_after_training_log
from megatron_ga_ext.integration.noise_scale_sidecar import loading_sidecar, saving_sidecar
from megatron_ga_ext.logs import get_logger

__all__ = ["OPTIMIZER_BUILDERS", "describe_decision", "stream_capturing", "wire_gpt_model", "wire_optimizer",
           "wire_rerun_machine", "wire_training"]

logger = get_logger(__name__)


def wire_optimizer(state: Installation) -> None:
    """``--ga-zero-token-policy skip``: the optimizers Megatron builds skip a step whose global batch had no
    tokens (FinalizeModelGrads.skip_step), returning (update_successful=False, None, None) as an fp16 overflow
    does, so Megatron counts a skipped iteration and does not advance the learning rate. Only the returned
    object is wrapped: the builders' own code is untouched (and not fingerprinted)."""
    import megatron.core.optimizer as optimizers

    for name in OPTIMIZER_BUILDERS:
        if hasattr(optimizers, name):
            state.patch(optimizers.__name__, name, lambda original: _skipping_builder(original, state))


OPTIMIZER_BUILDERS = ("get_megatron_optimizer", "get_megatron_muon_optimizer")


def wire_gpt_model(state: Installation) -> None:
    """Token mode: MoE routes with padding_mask = (loss_mask == 0), with the router's counts made exact, and MTP
    weighs every token by the global count (aux_losses.py says why)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer import multi_token_prediction
    from megatron.core.transformer.moe import router  # binds moe_utils' functions: patched there too

    state.patch_attribute(GPTModel, "forward", lambda original: padding_mask_forward(original, state))
    state.patch(MOE_UTILS, "get_tokens_per_expert_and_token_count", lambda original: exact_token_counts(original, state))
    if not broadcasts_padding_per_token(router.TopKRouter):
        state.patch_attribute(router.TopKRouter, "_apply_expert_bias",
                              lambda original: per_token_padding_expert_bias(original, state))
    if not router_scales_by_tp_cp():
        state.patch(MOE_UTILS, "z_loss_func", lambda original: tp_cp_scaled_z_loss(original, state))
    if hasattr(multi_token_prediction, "process_mtp_loss"):  # 0.17 and later
        state.patch(MTP, "process_mtp_loss", lambda original: global_count_mtp_loss(original, state))


def _skipping_builder(original: Callable, state: Installation) -> Callable:
    @functools.wraps(original)
    def build(*args: Any, **kwargs: Any) -> Any:
        optimizer = original(*args, **kwargs)
        optimizer.step = _skipping_step(optimizer.step, state, optimizer)
        return optimizer

    return build


def _skipping_step(step: Callable, state: Installation, optimizer: Any = None) -> Callable:
    """The optimizer's step: liveness first (the iteration ran the extension's hooks, liveness.py), then the skip
    policy, then under --ga-checks async the step's verdict and liveness, then a --ga-noise-scale measurement. The optimizer outlives an install() with
    another config: the step follows to the installation that replaced the one it was built under."""
    liveness = StepLiveness(state)

    @functools.wraps(step)
    def skipping_step(*args: Any, **kwargs: Any) -> Any:
        live = state.current()
        if live is None:
            return step(*args, **kwargs)
        if liveness.state is not live:
            liveness.follow(live)
        liveness.check(after_step=False)
        finalize = live.finalize
        is_async = live.config.checks == "async"
        if finalize is not None and not is_async:
            finalize.check_deferred()  # a non-finite loss left to Megatron's rerun machine that reached the step
        if finalize is not None and finalize.skip_step:
            finalize.skip_step = False
            return False, None, None
        result = step(*args, **kwargs)
        if stream_capturing():  # Megatron's optimizer CUDA graph captures this step: no host read can be in the graph
            return result
        if finalize is not None:
            finalize.poll()  # --ga-checks async: the step's verdict, if its copy is done (the step's own reads synced)
            if is_async:
                finalize.check_deferred()
        liveness.check(after_step=True)
        if live.noise_scale is not None:
            measurement = live.noise_scale.after_optimizer_step(optimizer)
            if measurement is not None and live.batch_warmup is not None:  # --ga-batch-size-warmup auto
                live.batch_warmup.decide(live.noise_scale.last_row, live_step_calculator())
        return result

    return skipping_step


def stream_capturing() -> bool:
    """The current CUDA stream is capturing a graph (``--optimizer-cuda-graph`` captures the optimizer's step)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def wire_rerun_machine(state: Installation) -> None:
    """Megatron's rerun state machine: where a non-finite loss was left to it (finalize.py), log what it decided."""
    from megatron.core.rerun_state_machine import RerunStateMachine

    state.patch_attribute(RerunStateMachine, "should_checkpoint_and_exit",
                          lambda original: _reporting_decision(original, state))


def _reporting_decision(original: Callable, state: Installation) -> Callable:
    @functools.wraps(original)
    def should_checkpoint_and_exit(machine: Any, *args: Any, **kwargs: Any) -> Any:
        decision = original(machine, *args, **kwargs)
        finalize = state.finalize
        deferred = None if finalize is None or not state.active else finalize.last_deferred
        if deferred is not None:
            finalize.last_deferred = None
            logger.warning("megatron-ga-ext: Megatron's rerun state machine decided on the non-finite loss of "
                           "iteration %s: %s", deferred.iteration, describe_decision(*decision))
        return decision

    return should_checkpoint_and_exit


def describe_decision(checkpoint: bool, exit: bool, exit_code: int) -> str:
    """Megatron's ``should_checkpoint_and_exit()`` in words."""
    if exit:
        return f"{'save a checkpoint and ' if checkpoint else ''}exit with code {exit_code}"
    return "save a checkpoint and go on" if checkpoint else "go on training"


def wire_training(state: Installation) -> bool:
    """Megatron-LM's run length under a step schedule, once ``megatron.training.training`` is loaded
    (False: not loaded yet)."""
    if TRAINING not in sys.modules:
        return False
    targets = tuple(t for t in TARGETS if t.module == TRAINING)
    problems = check_targets(state.version, state.config.strict and not state.waiting_for_args, targets)
    state.compat_problems += problems
    state.patch(TRAINING, "update_train_iters", lambda original: _update_train_iters(original, state))
    state.patch(TRAINING, "get_train_valid_test_num_samples", lambda original: _num_samples(original, state))
    # --ga-noise-scale: the EMAs' sidecar after Megatron's save and load (training.py binds both from checkpointing),
    # and the log line after Megatron's; only wrapped around the call, so the bodies are not fingerprinted targets.
    for name, make in (("save_checkpoint", saving_sidecar), ("load_checkpoint", loading_sidecar),
                       ("training_log", printing_after_training_log)):
        if name in sys.modules[TRAINING].__dict__:
            state.patch(TRAINING, name, lambda original, make=make: make(original, state))
    return True


def _update_train_iters(original: Callable, state: Installation) -> Callable:
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


def _num_samples(original: Callable, state: Installation) -> Callable:
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


DATA_SCHEDULE = "megatron.core.datasets.data_schedule"


def wire_packing_scheduler(state: Installation) -> bool:
    """Megatron's sequence-packing scheduler (``--sequence-packing-scheduler``; main after d98e8a64 runs it in
    ``train_step`` and ``evaluate``): ``wrap_data_iterator`` repacks a step's fetched micro-batches into a count of
    its own, which the schedule is then called with; the count is handed to the micro-batch guard for that call
    (guards.py). Only wrapped around the call, so its body is not a fingerprinted target; imported here (a few ms
    once megatron.core is) so that a megatron-core loop that imports it later gets the wrapped one too."""
    try:
        module = importlib.import_module(DATA_SCHEDULE)
    except ImportError:  # megatron-core 0.16-0.18: no data_schedule module
        return True
    if "wrap_data_iterator" in module.__dict__:  # 0.19: the module, without the scheduler
        state.patch(DATA_SCHEDULE, "wrap_data_iterator", lambda original: _scheduled_count(original, state))
    return True


def _scheduled_count(original: Callable, state: Installation) -> Callable:
    """``wrap_data_iterator(data_iterator, config, num_microbatches, ...)`` -> (iterator, the packed count, tokens,
    squared lengths): the packed count, validated, is the one the next forward/backward call must run."""

    @functools.wraps(original)
    def wrap_data_iterator(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        live = state.current()
        if live is not None and live.config.guards:
            requested = args[2] if len(args) > 2 else kwargs.get("num_microbatches")
            live.counter.schedule(result[1], requested)
        return result

    return wrap_data_iterator
