"""The rules between flags, shared by ``check``, ``schedule``, the calculator and ``install()``. Pure Python.

* :func:`check_loss_mode`: ``--ga-loss-reduction token`` needs ``--calculate-per-token-loss``;
  ``microbatch`` must not have it;
* :func:`check_guards`: schedules that run another number of forward passes need ``--no-ga-guards``;
* :func:`check_checks`: ``--ga-checks async`` cannot skip a step, so not with ``--ga-zero-token-policy skip``.
"""

from __future__ import annotations

from typing import Sequence

from megatron_ga_ext.config.flags import CHECKS, CONVERT_RAMPUP, GUARDS, LOSS_REDUCTION, ZERO_TOKEN_POLICY, check_choice
from megatron_ga_ext.errors import OptionError, ScheduleError


def check_loss_mode(loss_reduction: str, calculate_per_token_loss: bool, *, explicit: bool = True) -> None:
    """The one rule between ``--ga-loss-reduction`` and Megatron's ``--calculate-per-token-loss``.

    ``token`` needs the flag: without it Megatron divides each micro-batch by its own token count (a mean of
    means) and DDP pre-divides by DP x CP. ``microbatch`` must not have it (with it Megatron runs the token
    mean). ``explicit`` is False when the mode is the default (the message says so). Raises OptionError.
    """
    check_choice(LOSS_REDUCTION, loss_reduction)
    if (loss_reduction == "token") == calculate_per_token_loss:  # every step: the message only when it fails
        return
    given = f"{LOSS_REDUCTION.flag} {loss_reduction}" + ("" if explicit else " (the default)")
    if loss_reduction == "token" and not calculate_per_token_loss:
        raise OptionError(
            f"{given} needs --calculate-per-token-loss: without it Megatron divides each micro-batch by its own "
            f"token count (a mean of means) and DDP pre-divides by DP x CP. Add --calculate-per-token-loss, or "
            f"choose {LOSS_REDUCTION.flag} microbatch for upstream's mean of means."
        )
    if loss_reduction == "microbatch" and calculate_per_token_loss:
        raise OptionError(
            f"{given} is upstream's mean of means, but --calculate-per-token-loss makes Megatron run the token "
            f"mean; drop one of them."
        )


def check_checks(checks: str, zero_token_policy: str) -> None:
    """``--ga-checks async`` reads a step's count only after its optimizer step, so it cannot decide to skip that
    step: it does not go with ``--ga-zero-token-policy skip``. Raises OptionError."""
    if checks == "async" and zero_token_policy == "skip":
        raise OptionError(
            f"{CHECKS.flag} async reads a step's token count only after its optimizer step, so "
            f"{ZERO_TOKEN_POLICY.flag} skip cannot skip a step with 0 tokens. Drop one of them: {CHECKS.flag} sync "
            f"skips it, {ZERO_TOKEN_POLICY.flag} error (the default) stops the run there.")


def check_guards(guards: bool, *, hybrid_context_parallel: bool = False, rl_sequence_packing: bool = False) -> None:
    """Schedules that legitimately run another number of forward passes than num_microbatches need the
    run-time guards off (``--no-ga-guards``): hybrid context parallelism regroups sequences into micro-batches of
    its own, and packed RL batches count bins, not samples. Raises OptionError while the guards are on."""
    if not guards:
        return
    reasons = [flag for flag, on in (("--hybrid-context-parallel", hybrid_context_parallel),
                                     ("--perform-rl-step --rl-use-sequence-packing", rl_sequence_packing)) if on]
    if reasons:
        raise OptionError(
            f"{' and '.join(reasons)} run(s) another number of forward passes per step than num_microbatches = "
            f"GBS / (MBS x DP), and consumed samples do not advance by the global batch size, so the run-time "
            f"guards ({GUARDS.flag}, the default) would stop the run at its first step. Add --no-ga-guards."
        )


def check_train_length(schedule: str | None, train_iters: int | None) -> None:
    """A step schedule needs a run length in samples: with ``--train-iters`` Megatron sizes the LR warmup and
    decay and the dataset with a constant GBS = MBS x DP, not the schedule's batch sizes (UPSTREAM.md §2
    item 2). ``schedule`` names what sets the schedule (None: no schedule). Raises ScheduleError."""
    if schedule is None or not train_iters:
        return
    raise ScheduleError(
        f"{schedule} with --train-iters {train_iters}: Megatron converts LR warmup/decay iterations and the dataset "
        f"size with GBS = MBS x DP, not the schedule's batch sizes, so warmup and decay end early and the dataset "
        f"is undersized. Give --train-samples (and --lr-warmup-samples, --lr-decay-samples) instead."
    )


def decrease_if_needed_error() -> ScheduleError:
    """--decrease-batch-size-if-needed with a step schedule (upstream refuses the pair too)."""
    return ScheduleError(
        "--decrease-batch-size-if-needed cannot be combined with a step batch-size schedule (upstream refuses "
        "it too): the schedule fixes each batch size. Drop --decrease-batch-size-if-needed and make every stage "
        "a multiple of --micro-batch-size x data-parallel size."
    )


def rampup_ignored_message(rampup: Sequence[int | str], global_batch_size: int | None) -> str:
    """What megatron-core >= 0.18 does with a rampup: nothing, without a word."""
    gbs = f" {global_batch_size}" if global_batch_size is not None else ""
    return (
        f"--rampup-batch-size {' '.join(map(str, rampup))} is ignored without a word by megatron-core >= 0.18: the "
        f"run trains at the constant --global-batch-size{gbs}. Pass {CONVERT_RAMPUP.flag} to run the equivalent "
        f"step schedule."
    )


