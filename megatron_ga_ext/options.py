"""Every flag megatron-ga-ext adds or reads, declared once, and the rules that tie them together. Pure Python.

Each flag is one :class:`Option`: its name as the command line spells it, its argparse destination (the
name Megatron's ``args`` uses), type, number of values, default, choices and help. The ``--ga-*`` flags are
declared here, Megatron's and the launcher's in ``flags.py`` (re-exported here). Everything else is
derived from these declarations: ``add_args`` (the ``--ga-*`` flags of a training run), :class:`GAConfig`
and ``GAConfig.from_args``, how ``megatron-ga check`` reads a launch line (``launch.py``), and the flags
table of ``docs/guide.md`` (:func:`flags_table`, checked by a test).

The rules shared by ``check``, ``schedule``, the calculator and ``install()`` live here once:

* :func:`resolve_schedule`: which step batch-size schedule a launch runs (given, converted from a
  rampup, or None for upstream's constant calculator);
* :func:`check_loss_mode`: ``--ga-loss-reduction token`` needs ``--calculate-per-token-loss``;
  ``microbatch`` must not have it;
* :func:`check_guards`: schedules that run another number of forward passes need ``--no-ga-guards``;
* :func:`check_checks`: ``--ga-checks async`` cannot skip a step, so not with ``--ga-zero-token-policy skip``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from megatron_ga_ext.errors import OptionError, ScheduleError, SizeError
from megatron_ga_ext.logs import get_logger
from megatron_ga_ext.flags import (
    LAUNCHER_OPTIONS,
    MEGATRON_OPTIONS,
    NOT_MEGATRON,
    STEP_SCHEDULE,
    VIRTUAL_PIPELINE,
    Option,
    switch,
)
from megatron_ga_ext.schedule_numbers import is_int, read_int

if TYPE_CHECKING:
    from megatron_ga_ext.schedule import StepSchedule

__all__ = [
    "BY_DEST",
    "CHECK_TIMINGS",
    "GA_FIELDS",
    "GA_OPTIONS",
    "LAUNCHER_OPTIONS",
    "MEGATRON_OPTIONS",
    "MODES",
    "NOT_MEGATRON",
    "OPTIONS",
    "STEP_SCHEDULE",
    "VIRTUAL_PIPELINE",
    "ZERO_TOKEN_POLICIES",
    "GAConfig",
    "Option",
    "ScheduleInputs",
    "add_args",
    "args_provider",
    "check_choice",
    "check_checks",
    "check_guards",
    "check_loss_mode",
    "check_train_length",
    "decrease_error",
    "flags_table",
    "rampup_ignored_message",
    "rampup_triple",
    "resolve_schedule",
]

logger = get_logger(__name__)

#: ``--ga-loss-reduction``: every non-padding token weighs the same, or upstream's mean of means.
MODES = ("token", "microbatch")
#: ``--ga-zero-token-policy``: a global batch without a single token.
ZERO_TOKEN_POLICIES = ("error", "skip")
#: ``--ga-checks``: when token mode reads a step's checked count (finalize.py).
CHECK_TIMINGS = ("sync", "async")


# -- the --ga-* flags (ours) ----------------------------------------------------------------------

LOSS_REDUCTION = Option(
    flag="--ga-loss-reduction", dest="ga_loss_reduction", type=str, default="token", choices=MODES,
    help="token: every non-padding token of the global batch weighs the same (needs --calculate-per-token-loss; "
    "checked every step); microbatch: upstream's mean of means, chosen explicitly (without "
    "--calculate-per-token-loss).",
)
ZERO_TOKEN_POLICY = Option(
    flag="--ga-zero-token-policy", dest="ga_zero_token_policy", type=str, default="error", choices=ZERO_TOKEN_POLICIES,
    help="a global batch with 0 non-padding tokens: error (default), or skip (that optimizer step is skipped, "
    "as after an fp16 overflow: a skipped iteration, the learning rate held, a warning).",
)
STRICT = switch(
    "--ga-strict", "ga_strict", default=True, negatable=True,
    help="refuse to patch upstream functions whose source matches no tested release or main commit, whatever the "
    "version string says (--no-ga-strict: warn and patch).",
)
CONVERT_RAMPUP = switch(
    "--ga-convert-rampup", "ga_convert_rampup",
    help="run a given --rampup-batch-size as the exact equivalent step schedule (megatron-core >= 0.18 otherwise "
    "ignores the rampup without a word).",
)
GUARDS = switch(
    "--ga-guards", "ga_guards", default=True, negatable=True,
    help="check every step that each forward/backward call runs num_microbatches micro-batches per model chunk and "
    "that consumed samples advance by the global batch size; --no-ga-guards for schedules that legitimately run "
    "another number of forward passes (--hybrid-context-parallel, packed RL batches).",
)
CHECKS = Option(
    flag="--ga-checks", dest="ga_checks", type=str, default="sync", choices=CHECK_TIMINGS,
    help="token mode: sync (default) reads the step's checked token count once, in finalize, and raises before the "
    "optimizer step; async reads nothing there (gradients scaled by a device 1/max(N, 1), as upstream) and raises a "
    "broken step after the optimizer step or at the next step, naming it (not with --ga-zero-token-policy skip).",
)
#: The flags add_args adds (the schedule flag only where the parser lacks it).
GA_OPTIONS = (LOSS_REDUCTION, ZERO_TOKEN_POLICY, STRICT, CONVERT_RAMPUP, GUARDS, CHECKS)

#: Every flag by its spelling (a negatable switch under both).
OPTIONS: dict[str, Option] = {
    spelling: option
    for option in (*GA_OPTIONS, *MEGATRON_OPTIONS, *LAUNCHER_OPTIONS)
    for spelling in option.spellings
}
BY_DEST: dict[str, Option] = {option.dest: option for option in (*GA_OPTIONS, *MEGATRON_OPTIONS, *LAUNCHER_OPTIONS)}


def check_choice(option: Option, value: object, *, error: type[OptionError] = OptionError) -> None:
    """Raise ``error`` naming ``option`` when ``value`` is not one of its choices."""
    if option.choices and value not in option.choices:
        raise error(f"{option.flag} {value!r} is not one of {', '.join(option.choices)}; pick one of them.")


# -- the config of a training run ---------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class GAConfig:
    """What install() turns on; ``from_args`` reads it from Megatron's parsed args.

    The first five fields are the ``--ga-*`` flags (:data:`GA_OPTIONS`: defaults and choices there); the
    rest are Megatron's own settings the calculator needs where its call does not pass them.
    """

    loss_reduction: str = LOSS_REDUCTION.default
    """``token`` (every non-padding token weighs the same) or ``microbatch`` (upstream's mean of means)."""
    zero_token_policy: str = ZERO_TOKEN_POLICY.default
    """A global batch with 0 tokens: ``error``, or ``skip`` (the optimizer skips that step; a warning)."""
    strict: bool = STRICT.default
    """Refuse upstream functions whose source fingerprint is unknown (else warn and patch)."""
    convert_rampup: bool = CONVERT_RAMPUP.default
    """Turn a given rampup triple into the equivalent step schedule."""
    guards: bool = GUARDS.default
    """Check micro-batch counts and consumed samples every step."""
    checks: str = CHECKS.default
    """When token mode reads a step's checked count: ``sync`` (in finalize) or ``async`` (after the step)."""
    step_batch_size_schedule: str | None = None
    """Megatron's ``--step-batch-size-schedule`` (or the backported flag)."""
    rampup_batch_size: tuple[int, int, int] | None = None
    """Megatron's ``--rampup-batch-size START INCREMENT SAMPLES``."""
    seq_length: int | None = None
    """Tokens per sample: schedule thresholds are tokens when set."""
    pipeline_model_parallel_size: int | None = None
    """PP, for the interleaved-schedule rule and the guards."""
    virtual_pipeline_model_parallel_size: int | None = None
    """VPP as Megatron derives it (``args.virtual_pipeline_model_parallel_size``)."""
    microbatch_group_size_per_vp_stage: int | None = None
    """N of the interleaved schedule (``--microbatch-group-size-per-virtual-pipeline-stage``); None means PP."""

    def __post_init__(self) -> None:
        check_choice(LOSS_REDUCTION, self.loss_reduction)
        check_choice(ZERO_TOKEN_POLICY, self.zero_token_policy)
        check_choice(CHECKS, self.checks)
        check_checks(self.checks, self.zero_token_policy)
        if self.rampup_batch_size is not None:
            object.__setattr__(self, "rampup_batch_size", rampup_triple(self.rampup_batch_size))

    @classmethod
    def from_args(cls, args: Any) -> "GAConfig":
        """From an argparse namespace holding Megatron's flags and the ``--ga-*`` flags (absent ones: defaults)."""
        rampup = getattr(args, "rampup_batch_size", None)
        return cls(
            loss_reduction=getattr(args, LOSS_REDUCTION.dest, LOSS_REDUCTION.default),
            zero_token_policy=getattr(args, ZERO_TOKEN_POLICY.dest, ZERO_TOKEN_POLICY.default),
            strict=getattr(args, STRICT.dest, STRICT.default),
            convert_rampup=getattr(args, CONVERT_RAMPUP.dest, CONVERT_RAMPUP.default),
            guards=getattr(args, GUARDS.dest, GUARDS.default),
            checks=getattr(args, CHECKS.dest, CHECKS.default),
            step_batch_size_schedule=getattr(args, "step_batch_size_schedule", None),
            rampup_batch_size=rampup_triple(rampup) if rampup else None,
            seq_length=getattr(args, "seq_length", None),
            pipeline_model_parallel_size=getattr(args, "pipeline_model_parallel_size", None),
            virtual_pipeline_model_parallel_size=getattr(args, "virtual_pipeline_model_parallel_size", None),
            microbatch_group_size_per_vp_stage=getattr(args, "microbatch_group_size_per_vp_stage", None),
        )


#: GAConfig field of each --ga-* flag.
GA_FIELDS = {
    LOSS_REDUCTION: "loss_reduction",
    ZERO_TOKEN_POLICY: "zero_token_policy",
    STRICT: "strict",
    CONVERT_RAMPUP: "convert_rampup",
    GUARDS: "guards",
    CHECKS: "checks",
}


def rampup_triple(values: Sequence[int | str]) -> tuple[int, int, int]:
    """``--rampup-batch-size START INCREMENT SAMPLES`` as three ints (argparse and launch lines give strings).

    Raises SizeError for another number of values or a value that is not a whole number; the ramp's own
    rules (start >= 1, ...) are :meth:`StepSchedule.from_rampup`'s.
    """
    if isinstance(values, (str, bytes)) or len(values) != 3:
        shown = [values] if isinstance(values, (str, bytes)) else list(values)
        raise SizeError(
            f"--rampup-batch-size takes three values, START INCREMENT SAMPLES (e.g. 16 8 300000); got "
            f"{len(shown)}: {' '.join(map(str, shown))}."
        )
    triple = []
    for name, value in zip(("start batch size", "increment", "ramp-up samples"), values):
        if isinstance(value, str) and is_int(value):
            value = read_int(f"--rampup-batch-size {name}", value, error=SizeError)
        if isinstance(value, bool) or not isinstance(value, int):
            raise SizeError(f"--rampup-batch-size {name} {value!r} is not a whole number.")
        triple.append(value)
    return triple[0], triple[1], triple[2]


# -- argparse ------------------------------------------------------------------------------------


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``--ga-*`` flags, for ``pretrain(..., extra_args_provider=add_args)``; on releases without
    ``--step-batch-size-schedule`` it adds that flag too (the backport)."""
    group = parser.add_argument_group("megatron-ga-ext", "checked batch arithmetic (megatron_ga_ext)")
    for option in GA_OPTIONS:
        _add(group, option)
    if STEP_SCHEDULE.flag not in parser._option_string_actions:
        _add(group, STEP_SCHEDULE)
    return parser


def _add(group: Any, option: Option) -> None:
    if option.type is bool:
        action = argparse.BooleanOptionalAction if option.negatable else "store_true"
        group.add_argument(option.flag, dest=option.dest, action=action, default=option.default, help=option.help)
        return
    group.add_argument(
        option.flag, dest=option.dest, type=option.type, default=option.default, choices=option.choices or None,
        help=option.help,
    )


def args_provider(*others: Callable | None) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """An ``extra_args_provider`` that runs ``others`` (None skipped), then :func:`add_args`."""

    def provide(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for other in others:
            if other is not None:
                parser = other(parser)
        return add_args(parser)

    return provide


def flags_table() -> str:
    """The Markdown table of the flags add_args adds (docs/guide.md holds it; a test compares)."""
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for option in (*GA_OPTIONS, STEP_SCHEDULE):
        rows.append(f"| {_flag_cell(option)} | {_default_cell(option)} | {option.help} |")
    return "\n".join(rows)


def _flag_cell(option: Option) -> str:
    if option.choices:
        return f"`{option.flag} {{{','.join(option.choices)}}}`"
    return " / ".join(f"`{spelling}`" for spelling in option.spellings)


def _default_cell(option: Option) -> str:
    if option.type is bool:
        return "on" if option.default else "off"
    return "" if option.default is None else f"`{option.default}`"


# -- the rules between flags ----------------------------------------------------------------------


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


def decrease_error() -> ScheduleError:
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


# -- the one batch schedule of a launch -----------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class ScheduleInputs:
    """What decides the batch schedule of a launch, and the layout its stages are checked against."""

    step_batch_size_schedule: str | None = None
    rampup_batch_size: Sequence[int | str] | None = None
    global_batch_size: int | None = None
    """The GBS a rampup ends at (a schedule sets its own)."""
    seq_length: int | None = None
    """Tokens per sample: schedule thresholds are tokens when set (pretrain_gpt always sets it)."""
    convert_rampup: bool = False
    rampup_ignored_upstream: bool = False
    """The megatron-core in use drops a rampup (0.18+): :func:`resolve_schedule` warns when it is not converted."""
    micro_batch_size: int | None = None
    data_parallel_size: int | None = None
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    microbatch_group_size_per_vp_stage: int | None = None
    decrease_batch_size_if_needed: bool = False

    @classmethod
    def from_calculator_call(cls, config: GAConfig, arguments: Mapping[str, Any]) -> "ScheduleInputs":
        """From the bound arguments of megatron-core's ``_configure_global_num_microbatches_calculator`` (any
        release) and the config: upstream's arguments win, the config fills in what a release does not pass."""
        return cls(
            step_batch_size_schedule=arguments.get("step_batch_size_schedule") or config.step_batch_size_schedule,
            rampup_batch_size=arguments.get("rampup_batch_size") or config.rampup_batch_size,
            global_batch_size=arguments.get("global_batch_size"),
            seq_length=arguments.get("seq_length") or config.seq_length,
            convert_rampup=config.convert_rampup,
            rampup_ignored_upstream="rampup_batch_size" not in arguments,
            micro_batch_size=arguments.get("micro_batch_size"),
            data_parallel_size=arguments.get("data_parallel_size"),
            pipeline_model_parallel_size=config.pipeline_model_parallel_size or 1,
            virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
            microbatch_group_size_per_vp_stage=config.microbatch_group_size_per_vp_stage,
            decrease_batch_size_if_needed=bool(arguments.get("decrease_batch_size_if_needed")),
        )

    def layout(self) -> dict[str, Any]:
        """The keywords of :meth:`StepSchedule.problems` and the calculator for this launch's layout."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "data_parallel_size": self.data_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "virtual_pipeline_size": self.virtual_pipeline_model_parallel_size,
            "microbatch_group_size_per_vp_stage": self.microbatch_group_size_per_vp_stage,
        }


def resolve_schedule(inputs: ScheduleInputs) -> StepSchedule | None:
    """The step batch-size schedule a launch runs, or None for upstream's constant calculator.

        a schedule                  -> that schedule, read exactly (thresholds in tokens with a seq_length)
        a rampup, converted         -> the exactly equivalent schedule (StepSchedule.from_rampup)
        a rampup, not converted     -> None (upstream's own; 0.18+ drops it: warned when rampup_ignored_upstream)
        neither                     -> None

    Raises ScheduleError for a schedule together with a rampup (they set the same thing) and for
    --decrease-batch-size-if-needed with a schedule; SizeError for a rampup value that is not a whole number;
    and every parse or conversion error of the schedule itself. The stages are checked against the layout
    by :meth:`StepSchedule.problems` (``schedule.problems(**inputs.layout())``), which check, schedule, the
    calculator and install all call with the same layout.
    """
    from megatron_ga_ext.schedule import StepSchedule  # schedule's modules read their flag names from here

    text, rampup = inputs.step_batch_size_schedule, inputs.rampup_batch_size
    if text is not None and rampup is not None:
        raise ScheduleError(
            f"--rampup-batch-size {' '.join(map(str, rampup))} and --step-batch-size-schedule are both given; they "
            f"set the same thing. Keep the schedule (`megatron-ga schedule --from-rampup` prints the rampup's "
            f"equivalent)."
        )
    if text is None and (rampup is None or not inputs.convert_rampup):
        if rampup is not None and inputs.rampup_ignored_upstream:
            logger.warning(rampup_ignored_message(rampup, inputs.global_batch_size))
        return None
    if inputs.decrease_batch_size_if_needed:
        raise decrease_error()
    if text is not None:
        return StepSchedule.parse(text, seq_length=inputs.seq_length)
    if inputs.global_batch_size is None:
        raise SizeError("--global-batch-size is required with --rampup-batch-size: the batch size the ramp ends at.")
    return StepSchedule.from_rampup(*rampup_triple(rampup), inputs.global_batch_size)  # type: ignore[arg-type]
