"""The one rule pass over a launch's settings, and the rules between flags it runs. Pure Python.

:func:`launch_errors` is the pass: each ``--ga-*`` flag's own rule (its declaration in config/flags.py), then
the rules between flags and Megatron's settings below. GAConfig runs it at construction (the flags
alone), install() through ``check_args`` (config/install_check.py, with Megatron's parsed args) and
``megatron-ga check`` on a launch line (launch/problems.py), so a setting is refused the same way
wherever it is read.

* :func:`check_loss_mode`: ``--ga-loss-reduction token`` needs ``--calculate-per-token-loss``;
  ``microbatch`` must not have it;
* :func:`check_guards`: schedules that run another number of forward passes need ``--no-ga-guards``;
* :func:`check_checks`: ``--ga-checks async`` cannot skip a step, so not with
  ``--ga-zero-token-policy skip``;
* :func:`check_noise_scale_layout`: where ``--ga-noise-scale`` can measure
  (config/noise_scale_layout.py);
* :func:`check_lr_scaling`: ``--ga-lr-scaling sqrt|linear`` needs a step batch-size schedule;
* :func:`check_batch_size_warmup_launch` and :func:`check_train_length`: what a schedule needs of
  the launch;
* :func:`check_warmup_checkpoints`: ``--ga-batch-size-warmup auto`` keeps its stages beside global
  checkpoints only.

:func:`check_trace_path` reads the file system, so install() runs it on the training machine (config/install_check.py),
not on a launch line read elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_ga_ext.config.flags import (
    BATCH_SIZE_WARMUP,
    BATCH_SIZE_WARMUP_MAX,
    CHECKS,
    CONVERT_RAMPUP,
    GA_OPTIONS,
    GUARDS,
    LOSS_REDUCTION,
    LR_SCALING,
    NOISE_SCALE,
    NOISE_SCALE_TRACE,
    ZERO_TOKEN_POLICY,
    check_choice,
    flag_errors,
)
from megatron_ga_ext.config.megatron_args import MegatronArgs
from megatron_ga_ext.config.noise_scale_layout import check_noise_scale_layout
from megatron_ga_ext.errors import GAError, OptionError, ScheduleError


def check_loss_mode(
    loss_reduction: str, calculate_per_token_loss: bool, *, explicit: bool = True
) -> None:
    """The one rule between ``--ga-loss-reduction`` and Megatron's ``--calculate-per-token-loss``.

    ``token`` needs the flag: without it Megatron divides each micro-batch by its own token count (a
    mean of means) and DDP pre-divides by DP x CP. ``microbatch`` must not have it (with it Megatron
    runs the token mean). ``explicit`` is False when the mode is the default (the message says so).
    Raises OptionError.
    """
    check_choice(LOSS_REDUCTION, loss_reduction)
    if (
        loss_reduction == "token"
    ) == calculate_per_token_loss:  # every step: the message only when it fails
        return
    given = f"{LOSS_REDUCTION.flag} {loss_reduction}" + ("" if explicit else " (the default)")
    if loss_reduction == "token" and not calculate_per_token_loss:
        raise OptionError(
            f"{given} needs --calculate-per-token-loss: without it Megatron divides each "
            "micro-batch by its own token count (a mean of means) and DDP pre-divides by DP x "
            "CP. Add --calculate-per-token-loss, or "
            f"choose {LOSS_REDUCTION.flag} microbatch for upstream's mean of means."
        )
    if loss_reduction == "microbatch" and calculate_per_token_loss:
        raise OptionError(
            f"{given} is upstream's mean of means, but --calculate-per-token-loss makes Megatron "
            "run the token "
            f"mean; drop one of them."
        )


def check_checks(checks: str, zero_token_policy: str) -> None:
    """``--ga-checks async`` reads a step's count only after its optimizer step, so it cannot decide
    to skip that step: it does not go with ``--ga-zero-token-policy skip``. Raises OptionError."""
    if checks == "async" and zero_token_policy == "skip":
        raise OptionError(
            f"{CHECKS.flag} async reads a step's token count only after its optimizer step, so "
            f"{ZERO_TOKEN_POLICY.flag} skip cannot skip a step with 0 tokens. Drop one "
            f"of them: {CHECKS.flag} sync skips it, {ZERO_TOKEN_POLICY.flag} error (the "
            "default) stops the run there."
        )


def check_lr_scaling(lr_scaling: str, schedule: str | None) -> None:
    """``--ga-lr-scaling sqrt|linear`` multiplies the learning rate by (GBS / first GBS) ** 1/2 or
    ** 1 of a step batch-size schedule, so it needs one; ``schedule`` names what sets it (None:
    nothing). Raises OptionError."""
    check_choice(LR_SCALING, lr_scaling)
    if lr_scaling == "none" or schedule is not None:
        return
    exponent = "1/2" if lr_scaling == "sqrt" else "1"
    raise OptionError(
        f"{LR_SCALING.flag} {lr_scaling} scales the learning rate of each stage of a step "
        "batch-size schedule by "
        f"(GBS / first GBS) ** {exponent}, but this launch has no schedule (no "
        "--step-batch-size-schedule, no "
        f"--rampup-batch-size with {CONVERT_RAMPUP.flag}), so it would change nothing. Give "
        "--step-batch-size-schedule (or --rampup-batch-size with "
        f"{CONVERT_RAMPUP.flag}), or drop {LR_SCALING.flag}."
    )


def check_batch_size_warmup_launch(
    global_batch_size: int | None, cap: int, schedule: str | None
) -> None:
    """Where ``--ga-batch-size-warmup auto`` can run: from a constant ``--global-batch-size`` (its
    first stage) up to the cap, without a given schedule (it writes one; its run length in samples
    is :func:`check_train_length`'s). Raises OptionError."""
    if schedule is not None:
        raise OptionError(
            f"{BATCH_SIZE_WARMUP.flag} auto writes the step schedule as it measures, so it does "
            "not "
            f"go with {schedule}; drop one of them."
        )
    if global_batch_size is None or global_batch_size > cap:
        raise OptionError(
            f"{BATCH_SIZE_WARMUP.flag} auto starts at --global-batch-size ({global_batch_size}) "
            "and "
            f"grows up to {BATCH_SIZE_WARMUP_MAX.flag} {cap}: give a --global-batch-size <= the "
            "cap."
        )


def check_warmup_checkpoints(batch_size_warmup: str, non_persistent_ckpt_type: str | None) -> None:
    """``--ga-batch-size-warmup auto`` keeps its stages in a sidecar beside each checkpoint's
    ``iter_NNNNNNN`` directory (integration/sidecar.py). A local non-persistent checkpoint
    (``--non-persistent-ckpt-type local``) is per-rank files in Megatron's local checkpoint manager,
    with no such directory: a resume from one would fall back to ``--global-batch-size`` mid-run.
    Raises OptionError."""
    if batch_size_warmup != "auto" or non_persistent_ckpt_type != "local":
        return
    raise OptionError(
        f"{BATCH_SIZE_WARMUP.flag} auto with --non-persistent-ckpt-type local: the warmup's "
        "stages are kept beside each checkpoint's iter_NNNNNNN directory, and a local "
        "non-persistent checkpoint (per-rank files of Megatron's local checkpoint "
        "manager) has none, so a resume from it would train at --global-batch-size "
        "again. Use --non-persistent-ckpt-type global (the stages are kept beside it), "
        "or drop "
        f"{BATCH_SIZE_WARMUP.flag}."
    )


def check_trace_path(interval: int, trace: str | None) -> None:
    """``--ga-noise-scale-trace PATH`` is appended to by the last rank at each measured iteration;
    its directory must exist and be writable (and PATH, where it exists, a writable file), or that
    rank alone raises there and the others wait in the next collective. Reads the file system.
    Raises OptionError."""
    if not interval or not trace:
        return
    directory = os.path.dirname(os.path.abspath(trace))
    problem = None
    if not os.path.isdir(directory):
        problem = f"its directory {directory} does not exist"
    elif os.path.isdir(trace):
        problem = "it is a directory"
    elif not os.access(trace if os.path.exists(trace) else directory, os.W_OK):
        problem = (
            f"{'it' if os.path.exists(trace) else f'its directory {directory}'} is not writable"
        )
    if problem is not None:
        raise OptionError(
            f"{NOISE_SCALE_TRACE.flag} {trace}: {problem}, so the last rank would fail at the "
            "first measured "
            f"iteration ({NOISE_SCALE.flag} {interval}) while the other ranks wait. Create the "
            "directory (mkdir -p "
            f"{directory}) or give a writable file path."
        )


def check_guards(
    guards: bool, *, hybrid_context_parallel: bool = False, rl_sequence_packing: bool = False
) -> None:
    """Schedules that legitimately run another number of forward passes than num_microbatches need
    the run-time guards off (``--no-ga-guards``): hybrid context parallelism regroups sequences into
    micro-batches of its own, and packed RL batches count bins, not samples. Raises OptionError
    while the guards are on."""
    if not guards:
        return
    reasons = [
        flag
        for flag, on in (
            ("--hybrid-context-parallel", hybrid_context_parallel),
            ("--perform-rl-step --rl-use-sequence-packing", rl_sequence_packing),
        )
        if on
    ]
    if reasons:
        raise OptionError(
            f"{' and '.join(reasons)} run(s) another number of forward passes per step than "
            "num_microbatches = GBS / (MBS x DP), and consumed samples do not advance by the "
            "global batch size, so the run-time "
            f"guards ({GUARDS.flag}, the default) would stop the run at its first step. Add "
            "--no-ga-guards."
        )


def schedule_source(
    step_batch_size_schedule: bool, rampup_batch_size: bool, convert_rampup: bool
) -> str | None:
    """The flags that give a launch its step batch-size schedule, in words; None without one."""
    if step_batch_size_schedule:
        return "--step-batch-size-schedule"
    if rampup_batch_size and convert_rampup:
        return f"--rampup-batch-size with {CONVERT_RAMPUP.flag}"
    return None


def check_train_length(schedule: str | None, train_iters: int | None) -> None:
    """A step schedule needs a run length in samples: with ``--train-iters`` Megatron sizes the LR
    warmup and decay and the dataset with GBS = MBS x DP, not the schedule's (training.py:2561-2569,
    :5428 at main d98e8a64). ``schedule`` names what sets the schedule (None: no schedule). Raises
    ScheduleError."""
    if schedule is None or not train_iters:
        return
    raise ScheduleError(
        f"{schedule} with --train-iters {train_iters}: Megatron converts LR warmup/decay "
        "iterations and the dataset size with GBS = MBS x DP, not the schedule's batch sizes, so "
        "warmup and decay end early and the dataset is undersized. Give --train-samples "
        "(and --lr-warmup-samples, --lr-decay-samples) instead."
    )


def decrease_if_needed_error() -> ScheduleError:
    """--decrease-batch-size-if-needed with a step schedule (upstream refuses the pair too)."""
    return ScheduleError(
        "--decrease-batch-size-if-needed cannot be combined with a step batch-size schedule "
        "(upstream refuses it too): the schedule fixes each batch size. Drop "
        "--decrease-batch-size-if-needed and make every stage a multiple of "
        "--micro-batch-size x data-parallel size."
    )


def rampup_ignored_message(rampup: Sequence[int | str], global_batch_size: int | None) -> str:
    """megatron-core >= 0.18's training path ignores a rampup and logs nothing (pretrain() does not
    pass it on)."""
    gbs = f" {global_batch_size}" if global_batch_size is not None else ""
    return (
        f"--rampup-batch-size {' '.join(map(str, rampup))}: megatron-core >= 0.18 ignores the "
        "rampup on the training path and logs nothing (pretrain() no longer passes it to the "
        "calculator: global_vars.py:127 at "
        f"core_v0.19.0): the run trains at the constant --global-batch-size{gbs} from its first "
        "step. "
        f"Pass {CONVERT_RAMPUP.flag} to run the equivalent step schedule."
    )


# -- the one rule pass
# ---------------------------------------------------------------------------------

Values = Mapping[str, Any]


@dataclass(frozen=True)
class Between:
    """A rule between flags: the ``--ga-*`` fields it reads (it is skipped where one of them breaks
    its own rule), and whether it reads Megatron's settings (skipped without them: GAConfig
    alone)."""

    name: str
    """A stable id of the rule (``megatron-ga check --json`` reports it as a problem's ``rule``)."""
    reads: tuple[str, ...]
    check: Callable[[Values, MegatronArgs], None]
    needs_args: bool = True


def _schedule(values: Values, settings: MegatronArgs) -> str | None:
    """What gives the launch its step schedule, in words (``--ga-batch-size-warmup auto`` writes
    one)."""
    if values["batch_size_warmup"] == "auto":
        return f"{BATCH_SIZE_WARMUP.flag} auto"
    return schedule_source(
        bool(settings.step_batch_size_schedule),
        bool(settings.rampup_batch_size),
        values["convert_rampup"],
    )


def _noise_scale_mode(values: Values, settings: MegatronArgs) -> None:
    """``--ga-noise-scale K`` needs token mode: the estimator compares token-mean gradients."""
    interval = values["noise_scale"]
    if interval and values["loss_reduction"] != "token":
        raise OptionError(
            f"{NOISE_SCALE.flag} {interval} needs {LOSS_REDUCTION.flag} token: the estimator "
            "compares each replica's token-mean gradient with the token mean over all N tokens, "
            "and upstream's mean of means is neither. "
            f"Use {LOSS_REDUCTION.flag} token, or drop {NOISE_SCALE.flag}."
        )


def _batch_size_warmup(values: Values, settings: MegatronArgs) -> None:
    """``--ga-batch-size-warmup auto`` decides from the measured noise scale, up to a cap."""
    if values["batch_size_warmup"] != "auto":
        return
    if not values["noise_scale"]:
        raise OptionError(
            f"{BATCH_SIZE_WARMUP.flag} auto decides from the measured noise scale: add "
            f"{NOISE_SCALE.flag} K (measure every K-th iteration), or drop "
            f"{BATCH_SIZE_WARMUP.flag}."
        )
    if values["batch_size_warmup_max"] is None:
        raise OptionError(
            f"{BATCH_SIZE_WARMUP.flag} auto needs {BATCH_SIZE_WARMUP_MAX.flag} (a whole number "
            ">= 1, "
            f"the global batch size it may grow to), not None."
        )


def _loss_mode(values: Values, settings: MegatronArgs) -> None:
    per_token = settings.calculate_per_token_loss
    if per_token is not None:
        mode = values["loss_reduction"]
        check_loss_mode(mode, per_token, explicit=mode != LOSS_REDUCTION.default)


def _warmup_launch(values: Values, settings: MegatronArgs) -> None:
    cap = values["batch_size_warmup_max"]
    if values["batch_size_warmup"] != "auto" or cap is None:
        return
    given = schedule_source(
        bool(settings.step_batch_size_schedule),
        bool(settings.rampup_batch_size),
        values["convert_rampup"],
    )
    given = given or ("--rampup-batch-size" if settings.rampup_batch_size else None)
    check_batch_size_warmup_launch(settings.global_batch_size, cap, given)


def _noise_scale_layout(values: Values, settings: MegatronArgs) -> None:
    dp = settings.data_parallel_size
    if dp is not None:
        check_noise_scale_layout(values["noise_scale"], data_parallel_size=dp, settings=settings)


#: Every rule between flags, in the order their errors are reported.
# fmt: off
BETWEEN = (
    Between("checks", ("checks", "zero_token_policy"),
            lambda v, s: check_checks(v["checks"], v["zero_token_policy"]), needs_args=False),
    Between("noise-scale-mode", ("noise_scale", "loss_reduction"), _noise_scale_mode, needs_args=False),
    Between("batch-size-warmup", ("batch_size_warmup", "noise_scale", "batch_size_warmup_max"), _batch_size_warmup,
            needs_args=False),
    Between("loss-mode", ("loss_reduction",), _loss_mode),
    Between("warmup-launch", ("batch_size_warmup", "batch_size_warmup_max", "convert_rampup"), _warmup_launch),
    Between("train-length", ("batch_size_warmup", "convert_rampup"),
            lambda v, s: check_train_length(_schedule(v, s), s.train_iters)),
    Between("lr-scaling", ("lr_scaling", "batch_size_warmup", "convert_rampup"),
            lambda v, s: check_lr_scaling(v["lr_scaling"], _schedule(v, s))),
    Between("noise-scale-layout", ("noise_scale",), _noise_scale_layout),
    Between("warmup-checkpoints", ("batch_size_warmup",),
            lambda v, s: check_warmup_checkpoints(v["batch_size_warmup"], s.get("non_persistent_ckpt_type"))),
    Between("guards", ("guards",), lambda v, s: check_guards(
        v["guards"], hybrid_context_parallel=s.hybrid_context_parallel, rl_sequence_packing=s.rl_sequence_packing)),
)
# fmt: on


def launch_errors(values: Values, settings: MegatronArgs | None = None) -> list[GAError]:
    """The one rule pass: every error of the ``--ga-*`` settings ``values`` (by GAConfig field;
    absent ones read as their defaults) and, given Megatron's ``settings``, of the two together.
    Empty: nothing is refused."""
    return [error for _, error in named_launch_errors(values, settings)]


def named_launch_errors(
    values: Values, settings: MegatronArgs | None = None
) -> list[tuple[str, GAError]]:
    """:func:`launch_errors` with the rule of each: ``flag:<field>`` for a flag's own rule, else its
    :class:`Between`'s name."""
    errors = flag_errors(values)
    full = {option.field: values.get(option.field, option.default) for option in GA_OPTIONS}
    found: list[tuple[str, GAError]] = [(f"flag:{field}", error) for field, error in errors.items()]
    for rule in BETWEEN:
        if (rule.needs_args and settings is None) or any(field in errors for field in rule.reads):
            continue
        try:
            rule.check(full, settings or MegatronArgs())
        except GAError as error:
            found.append((rule.name, error))
    return found


def check_launch(values: Values, settings: MegatronArgs | None = None) -> None:
    """Raise the first error of :func:`launch_errors`."""
    errors = launch_errors(values, settings)
    if errors:
        raise errors[0]
