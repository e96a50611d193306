"""The one rule pass over a launch's settings, and the rules between flags it runs. Pure Python.

:func:`launch_errors` is the pass: each ``--ga-*`` flag's own rule (its declaration in config/flags.py), then
the rules between flags and Megatron's settings below. GAConfig runs it at construction (the flags alone),
install() through ``check_args`` (config/install_check.py, with Megatron's parsed args) and ``megatron-ga check``
on a launch line (launch/problems.py), so a setting is refused the same way wherever it is read.

* :func:`check_loss_mode`: ``--ga-loss-reduction token`` needs ``--calculate-per-token-loss``;
  ``microbatch`` must not have it;
* :func:`check_guards`: schedules that run another number of forward passes need ``--no-ga-guards``;
* :func:`check_checks`: ``--ga-checks async`` cannot skip a step, so not with ``--ga-zero-token-policy skip``;
* :func:`check_noise_scale_layout`: where ``--ga-noise-scale`` can measure;
* :func:`check_lr_scaling`: ``--ga-lr-scaling sqrt|linear`` needs a step batch-size schedule;
* :func:`check_batch_size_warmup_launch` and :func:`check_train_length`: what a schedule needs of the launch;
* :func:`check_warmup_checkpoints`: ``--ga-batch-size-warmup auto`` keeps its stages beside global checkpoints only.

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
from megatron_ga_ext.errors import GAError, OptionError, ScheduleError


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
            f"skips it, {ZERO_TOKEN_POLICY.flag} error (the default) stops the run there."
        )


@dataclass(frozen=True)
class NoiseScaleRefusal:
    """A Megatron setting under which ``--ga-noise-scale`` cannot measure (:func:`check_noise_scale_layout`)."""

    flag: str
    given: Callable[[MegatronArgs], str | None]
    """The setting's value as the message names it ("" for a switch), or None where the launch does not have it."""
    why: str
    fix: str
    """What to do instead of dropping ``--ga-noise-scale``."""


def _not_one(dest: str) -> Callable[[MegatronArgs], str | None]:
    def given(settings: MegatronArgs) -> str | None:
        value = settings.get(dest) or 1
        return None if value == 1 else str(value)

    return given


def _on(dest: str) -> Callable[[MegatronArgs], str | None]:
    return lambda settings: "" if settings.get(dest) else None


def _gtp_shards(settings: MegatronArgs) -> str | None:
    """GTP weight rematerialization: more weight shards than TP ranks (Megatron's gtp_weight_remat_size > 1)."""
    shards, tp = settings.get("tensor_parallel_num_weight_shards") or 0, settings.get("tensor_model_parallel_size") or 1
    return f"{shards} (above --tensor-model-parallel-size {tp})" if int(shards) > int(tp) else None


def _patterns(settings: MegatronArgs) -> str | None:
    patterns = settings.get("ddp_param_name_patterns_for_fp32_local_accumulation") or ()
    return " ".join([patterns] if isinstance(patterns, str) else map(str, patterns)) or None


#: Where --ga-noise-scale cannot measure, beyond DP >= 2; the coverage rows of these flags say so.
# fmt: off
NOISE_SCALE_REFUSALS = (
    NoiseScaleRefusal(
        flag="--context-parallel-size", given=_not_one("context_parallel_size"),
        why="the CP shards of one sequence are parts of one sample, not independent replicas, and a replica's gradient "
        "would need a reduction over CP before the one over DP x CP", fix="--context-parallel-size 1"),
    NoiseScaleRefusal(
        flag="--hybrid-context-parallel", given=_on("hybrid_context_parallel"),
        why="it schedules each step's sub-samples over the DP x CP ranks (megatron/core/datasets/data_schedule.py, "
        "HybridCPDataLoaderWrapper), so a sequence split over a group of data-parallel ranks is part of several "
        "ranks' gradients, which are then not independent replicas", fix="drop --hybrid-context-parallel"),
    NoiseScaleRefusal(
        flag="--tensor-parallel-num-weight-shards", given=_gtp_shards,
        why="GTP spreads the micro-batches over the replicate DP x GTP ranks and reduce-scatters each weight's "
        "gradient over the GTP axis inside the backward pass, so the gradient the meter reads before the data-parallel "
        "reduction already sums several ranks' samples", fix="keep it at --tensor-model-parallel-size (no GTP)"),
    NoiseScaleRefusal(
        flag="--num-distributed-optimizer-instances", given=_not_one("num_distributed_optimizer_instances"),
        why="the reduced gradient is all-reduced across the optimizer instances after the reduce-scatter",
        fix="--num-distributed-optimizer-instances 1"),
    NoiseScaleRefusal(
        flag="--use-megatron-fsdp", given=_on("use_megatron_fsdp"),
        why="Megatron-FSDP keeps the gradients in its own buffer, not the DDP buckets the meter reads; with "
        "optim_grads and optim_grads_params it reduce-scatters them into shards, so no rank holds its replica's "
        "gradient", fix="use Megatron's DDP (with --use-distributed-optimizer if you like)"),
    NoiseScaleRefusal(
        flag="--use-torch-fsdp2", given=_on("use_torch_fsdp2"),
        why="torch FSDP2 reduce-scatters each unit's gradient as each micro-batch's backward ends (Megatron-LM sets "
        "no no_sync for it), so no rank ever holds its replica's gradient of the step", fix="use Megatron's DDP"),
    NoiseScaleRefusal(
        flag="--ddp-param-name-patterns-for-fp32-local-accumulation", given=_patterns,
        why="the parameters it names accumulate into an fp32 main_grad outside the gradient buffer the meter reads "
        "(megatron/core/distributed/param_and_grad_buffer.py), so both norms leave them out, and the pattern all "
        "leaves out every parameter: each estimate would be 0 / 0",
        fix="drop the patterns (--accumulate-allreduce-grads-in-fp32 keeps every main_grad in fp32, in the buffer)"),
    NoiseScaleRefusal(
        flag="--optimizer-cuda-graph", given=_on("optimizer_cuda_graph"),
        why="after its capture Megatron's OptimizerCudaGraphWrapper replays the optimizer step without calling the "
        "extension's step hook, where each measurement is taken and --ga-batch-size-warmup auto decides, so the "
        "meter and the warmup would stop at the capture without a word", fix="drop --optimizer-cuda-graph"),
)
# fmt: on


def check_noise_scale_layout(
    interval: int, *, data_parallel_size: int, settings: Mapping[str, Any] | MegatronArgs
) -> None:
    """Where ``--ga-noise-scale`` can measure: DP >= 2 (it compares replicas), and none of
    :data:`NOISE_SCALE_REFUSALS` (CP 1, one distributed-optimizer instance, Megatron's DDP ...). Raises OptionError
    naming the flag; ``settings`` holds Megatron's args by destination."""
    if not interval:
        return
    settings = MegatronArgs.of(settings)
    if data_parallel_size < 2:
        raise OptionError(
            f"{NOISE_SCALE.flag} {interval} with data-parallel size {data_parallel_size}: the estimate compares each "
            f"replica's gradient with the reduced one, so it needs DP >= 2. Drop {NOISE_SCALE.flag}, or train with "
            f"more data-parallel replicas."
        )
    for refusal in NOISE_SCALE_REFUSALS:
        given = refusal.given(settings)
        if given is not None:
            setting = f"{refusal.flag} {given}" if given else refusal.flag
            raise OptionError(
                f"{NOISE_SCALE.flag} with {setting}: {refusal.why}. Drop {NOISE_SCALE.flag}, or {refusal.fix}."
            )


def check_lr_scaling(lr_scaling: str, schedule: str | None) -> None:
    """``--ga-lr-scaling sqrt|linear`` multiplies the learning rate by (GBS / first GBS) ** 1/2 or ** 1 of a step
    batch-size schedule, so it needs one; ``schedule`` names what sets it (None: nothing). Raises OptionError."""
    check_choice(LR_SCALING, lr_scaling)
    if lr_scaling == "none" or schedule is not None:
        return
    exponent = "1/2" if lr_scaling == "sqrt" else "1"
    raise OptionError(
        f"{LR_SCALING.flag} {lr_scaling} scales the learning rate of each stage of a step batch-size schedule by "
        f"(GBS / first GBS) ** {exponent}, but this launch has no schedule (no --step-batch-size-schedule, no "
        f"--rampup-batch-size with {CONVERT_RAMPUP.flag}), so it would change nothing. Give "
        f"--step-batch-size-schedule (or --rampup-batch-size with {CONVERT_RAMPUP.flag}), or drop {LR_SCALING.flag}."
    )


def check_batch_size_warmup_launch(global_batch_size: int | None, cap: int, schedule: str | None) -> None:
    """Where ``--ga-batch-size-warmup auto`` can run: from a constant ``--global-batch-size`` (its first stage) up to
    the cap, without a given schedule (it writes one; its run length in samples is :func:`check_train_length`'s).
    Raises OptionError."""
    if schedule is not None:
        raise OptionError(
            f"{BATCH_SIZE_WARMUP.flag} auto writes the step schedule as it measures, so it does not "
            f"go with {schedule}; drop one of them."
        )
    if global_batch_size is None or global_batch_size > cap:
        raise OptionError(
            f"{BATCH_SIZE_WARMUP.flag} auto starts at --global-batch-size ({global_batch_size}) and "
            f"grows up to {BATCH_SIZE_WARMUP_MAX.flag} {cap}: give a --global-batch-size <= the cap."
        )


def check_warmup_checkpoints(batch_size_warmup: str, non_persistent_ckpt_type: str | None) -> None:
    """``--ga-batch-size-warmup auto`` keeps its stages in a sidecar beside each checkpoint's ``iter_NNNNNNN``
    directory (integration/sidecar.py). A local non-persistent checkpoint
    (``--non-persistent-ckpt-type local``) is per-rank files in Megatron's local checkpoint manager, with no such
    directory: a resume from one would fall back to ``--global-batch-size`` mid-run. Raises OptionError."""
    if batch_size_warmup != "auto" or non_persistent_ckpt_type != "local":
        return
    raise OptionError(
        f"{BATCH_SIZE_WARMUP.flag} auto with --non-persistent-ckpt-type local: the warmup's stages are kept beside "
        f"each checkpoint's iter_NNNNNNN directory, and a local non-persistent checkpoint (per-rank files of "
        f"Megatron's local checkpoint manager) has none, so a resume from it would train at --global-batch-size "
        f"again. Use --non-persistent-ckpt-type global (the stages are kept beside it), or drop "
        f"{BATCH_SIZE_WARMUP.flag}."
    )


def check_trace_path(interval: int, trace: str | None) -> None:
    """``--ga-noise-scale-trace PATH`` is appended to by the last rank at each measured iteration; its directory
    must exist and be writable (and PATH, where it exists, a writable file), or that rank alone raises there and
    the others wait in the next collective. Reads the file system. Raises OptionError."""
    if not interval or not trace:
        return
    directory = os.path.dirname(os.path.abspath(trace))
    problem = None
    if not os.path.isdir(directory):
        problem = f"its directory {directory} does not exist"
    elif os.path.isdir(trace):
        problem = "it is a directory"
    elif not os.access(trace if os.path.exists(trace) else directory, os.W_OK):
        problem = f"{'it' if os.path.exists(trace) else f'its directory {directory}'} is not writable"
    if problem is not None:
        raise OptionError(
            f"{NOISE_SCALE_TRACE.flag} {trace}: {problem}, so the last rank would fail at the first measured "
            f"iteration ({NOISE_SCALE.flag} {interval}) while the other ranks wait. Create the directory (mkdir -p "
            f"{directory}) or give a writable file path."
        )


def check_guards(guards: bool, *, hybrid_context_parallel: bool = False, rl_sequence_packing: bool = False) -> None:
    """Schedules that legitimately run another number of forward passes than num_microbatches need the
    run-time guards off (``--no-ga-guards``): hybrid context parallelism regroups sequences into micro-batches of
    its own, and packed RL batches count bins, not samples. Raises OptionError while the guards are on."""
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
            f"{' and '.join(reasons)} run(s) another number of forward passes per step than num_microbatches = "
            f"GBS / (MBS x DP), and consumed samples do not advance by the global batch size, so the run-time "
            f"guards ({GUARDS.flag}, the default) would stop the run at its first step. Add --no-ga-guards."
        )


def schedule_source(step_batch_size_schedule: bool, rampup_batch_size: bool, convert_rampup: bool) -> str | None:
    """The flags that give a launch its step batch-size schedule, in words; None without one."""
    if step_batch_size_schedule:
        return "--step-batch-size-schedule"
    if rampup_batch_size and convert_rampup:
        return f"--rampup-batch-size with {CONVERT_RAMPUP.flag}"
    return None


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


#: What megatron-core 0.18 and later log for a rampup (num_microbatches_calculator.py, rank 0) before dropping it.
RAMPUP_DEPRECATED = (
    "rampup_batch_size is deprecated and will be removed in a future release. Use step_batch_size_schedule instead."
)


def rampup_ignored_message(rampup: Sequence[int | str], global_batch_size: int | None) -> str:
    """What megatron-core >= 0.18 does with a rampup: logs a deprecation warning, then ignores it."""
    gbs = f" {global_batch_size}" if global_batch_size is not None else ""
    return (
        f'--rampup-batch-size {" ".join(map(str, rampup))}: megatron-core >= 0.18 logs "{RAMPUP_DEPRECATED}" and '
        f"then ignores the rampup: the run trains at the constant --global-batch-size{gbs} from its first step. "
        f"Pass {CONVERT_RAMPUP.flag} to run the equivalent step schedule."
    )


# -- the one rule pass ---------------------------------------------------------------------------------

Values = Mapping[str, Any]


@dataclass(frozen=True)
class Between:
    """A rule between flags: the ``--ga-*`` fields it reads (it is skipped where one of them breaks its own rule),
    and whether it reads Megatron's settings (skipped without them: GAConfig alone)."""

    name: str
    """A stable id of the rule (``megatron-ga check --json`` reports it as a problem's ``rule``)."""
    reads: tuple[str, ...]
    check: Callable[[Values, MegatronArgs], None]
    needs_args: bool = True


def _schedule(values: Values, settings: MegatronArgs) -> str | None:
    """What gives the launch its step schedule, in words (``--ga-batch-size-warmup auto`` writes one)."""
    if values["batch_size_warmup"] == "auto":
        return f"{BATCH_SIZE_WARMUP.flag} auto"
    return schedule_source(
        bool(settings.step_batch_size_schedule), bool(settings.rampup_batch_size), values["convert_rampup"]
    )


def _noise_scale_mode(values: Values, settings: MegatronArgs) -> None:
    """``--ga-noise-scale K`` needs token mode: the estimator compares token-mean gradients."""
    interval = values["noise_scale"]
    if interval and values["loss_reduction"] != "token":
        raise OptionError(
            f"{NOISE_SCALE.flag} {interval} needs {LOSS_REDUCTION.flag} token: the estimator compares each replica's "
            f"token-mean gradient with the token mean over all N tokens, and upstream's mean of means is neither. "
            f"Use {LOSS_REDUCTION.flag} token, or drop {NOISE_SCALE.flag}."
        )


def _batch_size_warmup(values: Values, settings: MegatronArgs) -> None:
    """``--ga-batch-size-warmup auto`` decides from the measured noise scale, up to a cap."""
    if values["batch_size_warmup"] != "auto":
        return
    if not values["noise_scale"]:
        raise OptionError(
            f"{BATCH_SIZE_WARMUP.flag} auto decides from the measured noise scale: add "
            f"{NOISE_SCALE.flag} K (measure every K-th iteration), or drop {BATCH_SIZE_WARMUP.flag}."
        )
    if values["batch_size_warmup_max"] is None:
        raise OptionError(
            f"{BATCH_SIZE_WARMUP.flag} auto needs {BATCH_SIZE_WARMUP_MAX.flag} (a whole number >= 1, "
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
        bool(settings.step_batch_size_schedule), bool(settings.rampup_batch_size), values["convert_rampup"]
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
    """The one rule pass: every error of the ``--ga-*`` settings ``values`` (by GAConfig field; absent ones read as
    their defaults) and, given Megatron's ``settings``, of the two together. Empty: nothing is refused."""
    return [error for _, error in named_launch_errors(values, settings)]


def named_launch_errors(values: Values, settings: MegatronArgs | None = None) -> list[tuple[str, GAError]]:
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
