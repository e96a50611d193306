"""Every problem of a launch line, and its ledger (``megatron-ga check``). Pure Python.

The rules are the ones a run is held to: install()'s own rule pass (config/launch_rules.py: each ``--ga-*``
flag's rule, the loss mode against ``--calculate-per-token-loss``, the guards against schedules that run another
number of forwards, what a schedule needs of the launch, where the noise scale can measure), the one schedule of the
launch, Megatron's parser and layer split (flags it does not define, stray words,
the virtual pipeline), the coverage table's refusals (``config/coverage/``; its limits are
:func:`launch_notes`), and the batch arithmetic of every stage (``core/layout.py``, ``core/schedule/checks.py``).
"""

from __future__ import annotations

from dataclasses import replace

from megatron_ga_ext.config.coverage import Setting, verdict
from megatron_ga_ext.config.flags import CONVERT_RAMPUP, LOSS_REDUCTION
from megatron_ga_ext.config.launch_rules import launch_errors, rampup_ignored_message
from megatron_ga_ext.config.megatron_args import MegatronArgs
from megatron_ga_ext.config.resolve import ScheduleInputs, resolve_schedule
from megatron_ga_ext.core.layout import BatchLayout
from megatron_ga_ext.core.megatron_flags import COVERED_OPTIONS, MEGATRON_OPTIONS, NOT_MEGATRON
from megatron_ga_ext.core.schedule.stages import FLAG as SCHEDULE_FLAG
from megatron_ga_ext.core.schedule.step_schedule import StepSchedule
from megatron_ga_ext.errors import GAError
from megatron_ga_ext.launch.line import Launch, LaunchLayout, ga_values, read_ints, read_layout

__all__ = ["MAX_STAGE_PROBLEMS", "launch_notes", "launch_problems", "launch_setting", "loss_reduction_note"]

MAX_STAGE_PROBLEMS = 5


def launch_problems(launch: Launch, world_size: int | None) -> tuple[BatchLayout | None, list[str]]:
    """The layout of a launch line (None if broken) and every problem found in it.

    Raises UsageError where the line cannot be read at all (the world size, a value that is not a number).
    """
    read = read_layout(launch, world_size)
    kwargs = dict(read.kwargs)
    schedule, schedule_problems = _launch_schedule(launch, read)
    if schedule is not None:
        kwargs["global_batch_size"] = None  # the schedule's stages are checked one by one below
    layout, errors = BatchLayout.problems(**kwargs)
    problems = _line_problems(launch) + _rule_problems(launch, layout) + _coverage_problems(launch)
    problems += read.seq_problems + [str(e) for e in read.problems] + [str(e) for e in errors]
    if layout is not None and schedule is not None:
        stage_problems = _stage_problems(schedule, layout)
        problems += stage_problems
        # The ledger of a schedule is the ledger of its last stage (upstream's nominal GBS), once every stage is valid.
        final = {**kwargs, "global_batch_size": schedule.final_global_batch_size}
        layout = None if stage_problems else BatchLayout(**final)  # type: ignore[arg-type]
    return layout, problems + schedule_problems


def _line_problems(launch: Launch) -> list[str]:
    """What Megatron's parser itself refuses: flags it does not define, words it cannot place; and repeats."""
    problems = [
        f"{launch.name(flag)} is given {len(vals)} times ({', '.join(' '.join(v) for v in vals)}); Megatron keeps "
        f"the last ({' '.join(vals[-1])}). Give it once."
        for flag, vals in launch.repeated.items()
    ]
    for flag, values in launch.not_megatron.items():
        problems.append(
            f"{flag} {' '.join(values)} is not a flag of Megatron's parser (no tested release, core_v0.16.1 to main, "
            f"defines it): Megatron stops with \"unrecognized arguments\". {NOT_MEGATRON[flag]}."
        )
    for flag, words in launch.stray.items():
        problems.append(_stray_problem(launch, flag, words))
    return problems


def _stray_problem(launch: Launch, flag: str, words: list[str]) -> str:
    given = f"{launch.name(flag)} {' '.join(launch.values[flag])}"
    if flag == SCHEDULE_FLAG and all(":" in w for w in words):
        whole = " ".join([*launch.values[flag], *words])
        return (
            f"{given} is followed by {' '.join(words)}: the schedule was split into words (an unquoted shell "
            f"variable or array?), so Megatron reads only {launch.values[flag][0]!r} and stops with \"unrecognized "
            f"arguments: {' '.join(words)}\". Quote the whole schedule: {flag} \"{whole}\" (its stages are checked "
            f"below as if quoted)."
        )
    return (
        f"{given} is followed by {' '.join(words)}, which no flag takes: Megatron's parser has no positional "
        f"arguments and stops with \"unrecognized arguments: {' '.join(words)}\". Drop them, or quote the value."
    )


def _rule_problems(launch: Launch, layout: BatchLayout | None) -> list[str]:
    """The rule pass install() runs (config/launch_rules.py), over the line's --ga-* flags and Megatron's."""
    return [str(error) for error in launch_errors(ga_values(launch), launch_args(launch, layout))]


def launch_args(launch: Launch, layout: BatchLayout | None) -> MegatronArgs:
    """Megatron's args as the launch line gives them: its flags by destination (the integers as numbers), DP
    from the layout (None where it is broken), and --calculate-per-token-loss as install() leaves it (on in token
    mode, with the extension on the line; without it the loss mode is not ours to check)."""
    values = dict(launch_setting(launch).values)
    values.update(read_ints(launch))
    values.pop("world_size", None)
    values["data_parallel_size"] = None if layout is None else layout.data_parallel_size
    mode = ga_values(launch).get(LOSS_REDUCTION.field, LOSS_REDUCTION.default)
    values["calculate_per_token_loss"] = launch.on("--calculate-per-token-loss") or mode == "token"
    return MegatronArgs(values)


def launch_setting(launch: Launch) -> Setting:
    """The coverage table's view of a launch line: Megatron's flags it gives, by argparse destination (the rest
    read as Megatron's defaults), and the ``--ga-*`` settings."""
    values: dict[str, object] = {}
    for option in (*MEGATRON_OPTIONS, *COVERED_OPTIONS):
        if option.nargs == 0 and option.flag in launch.switches:
            values[option.dest] = launch.on(option.flag)
        elif option.nargs != 0 and option.flag in launch.values:
            given = launch.values[option.flag]
            values[option.dest] = given[0] if option.nargs == 1 else given
    ga = ga_values(launch)
    return Setting(values, **{name: ga[name] for name in ("loss_reduction", "zero_token_policy", "checks",
                                                           "convert_rampup") if name in ga})


def _coverage_problems(launch: Launch) -> list[str]:
    return [row.message() for row in verdict(launch_setting(launch)).refused] if launch.extension else []


def launch_notes(launch: Launch) -> list[str]:
    """What ``check`` says of a launch line beside its problems: its loss reduction, and the limits of the coverage
    table that apply to it (only where the extension is on the line)."""
    notes = [loss_reduction_note(launch)]
    return notes + verdict(launch_setting(launch)).notes() if launch.extension else notes


def loss_reduction_note(launch: Launch) -> str:
    """The launch's loss reduction: what Megatron runs without the extension, or what the extension holds it to."""
    per_token = launch.on("--calculate-per-token-loss")
    mode = launch.get(LOSS_REDUCTION.flag) or LOSS_REDUCTION.default
    if not launch.extension:
        what = ("per-token (--calculate-per-token-loss): every non-padding token of the global batch weighs the same, "
                "unchecked" if per_token else
                "upstream's mean of means: each micro-batch's loss divided by its own token count, then averaged over "
                "micro-batches and DP x CP ranks (add --calculate-per-token-loss for a per-token loss)")
        return (f"loss reduction: {what}. megatron-ga-ext is not on this line (no -m megatron_ga_ext, no --ga-* "
                f"flag), so its rules are not applied.")
    if mode == "token":
        turned = "" if per_token else "; install() turns on --calculate-per-token-loss"
        return f"loss reduction: {LOSS_REDUCTION.flag} token, checked every step by megatron-ga-ext{turned}."
    return f"loss reduction: {LOSS_REDUCTION.flag} microbatch, upstream's mean of means, chosen explicitly."


def _launch_schedule(launch: Launch, read: LaunchLayout) -> tuple[StepSchedule | None, list[str]]:
    """The step schedule the launch runs (options.resolve_schedule), or the rampup's equivalent to show; and
    the problems of its flags."""
    inputs = _schedule_inputs(launch, read)
    problems = _schedule_flag_problems(launch, inputs)
    try:
        schedule = resolve_schedule(inputs)
    except GAError as error:
        return None, problems + [str(error)]
    if inputs.rampup_batch_size is None or inputs.convert_rampup or inputs.step_batch_size_schedule is not None:
        return schedule, problems
    return _ignored_rampup(inputs)


def _schedule_inputs(launch: Launch, read: LaunchLayout) -> ScheduleInputs:
    text = launch.get(SCHEDULE_FLAG)
    if text is not None and SCHEDULE_FLAG in launch.stray:
        text = " ".join([text, *launch.stray[SCHEDULE_FLAG]])  # checked as if quoted (reported above)
    kwargs = read.kwargs
    return ScheduleInputs(
        step_batch_size_schedule=text,
        rampup_batch_size=launch.values.get("--rampup-batch-size"),
        global_batch_size=kwargs["global_batch_size"],  # type: ignore[arg-type]
        seq_length=kwargs["seq_length"],  # type: ignore[arg-type]
        convert_rampup=launch.on(CONVERT_RAMPUP.flag),
        pipeline_model_parallel_size=kwargs["pipeline_model_parallel_size"],  # type: ignore[arg-type]
        virtual_pipeline_model_parallel_size=kwargs["virtual_pipeline_model_parallel_size"],  # type: ignore[arg-type]
        microbatch_group_size_per_vp_stage=kwargs["microbatch_group_size_per_vp_stage"],  # type: ignore[arg-type]
        decrease_batch_size_if_needed=launch.on("--decrease-batch-size-if-needed"),
    )


def _ignored_rampup(inputs: ScheduleInputs) -> tuple[StepSchedule | None, list[str]]:
    """A rampup without --ga-convert-rampup: megatron-core >= 0.18 trains at constant GBS. Show the equivalent
    schedule (and check its stages), which is what the run gets with --ga-convert-rampup."""
    rampup = inputs.rampup_batch_size
    ignored = rampup_ignored_message(rampup, inputs.global_batch_size)  # type: ignore[arg-type]
    try:
        schedule = resolve_schedule(replace(inputs, convert_rampup=True))
    except GAError as error:
        return None, [f"{ignored} It has no equivalent step schedule either: {error}"]
    seq_length = inputs.seq_length
    try:
        text = schedule.to_string(seq_length)  # type: ignore[union-attr]
    except GAError:
        return schedule, [f"{ignored} Its equivalent step schedule has {schedule.summary()}; too many stages to "  # type: ignore[union-attr]
                          f"write as {SCHEDULE_FLAG}, so {CONVERT_RAMPUP.flag} is the way to run it."]
    unit = "tokens" if seq_length else "samples (add --seq-length: pretrain_gpt reads thresholds as tokens)"
    return schedule, [
        f"{ignored} Or replace it with the equivalent schedule ({len(schedule.stages)} stages, thresholds in "  # type: ignore[union-attr]
        f"{unit}), dropping --global-batch-size and --rampup-batch-size: {SCHEDULE_FLAG} \"{text}\""
    ]


def _schedule_flag_problems(launch: Launch, inputs: ScheduleInputs) -> list[str]:
    problems = []
    if inputs.step_batch_size_schedule is not None and launch.get("--global-batch-size") is not None:
        problems.append(
            f"--global-batch-size is given together with {SCHEDULE_FLAG}; Megatron refuses the pair "
            f"(the schedule sets the batch size). Drop --global-batch-size."
        )
    return problems


def _stage_problems(schedule: StepSchedule, layout: BatchLayout) -> list[str]:
    problems = [str(p.error) for p in schedule.problems(
        layout.micro_batch_size, layout.data_parallel_size, layout.pipeline_model_parallel_size,
        layout.virtual_pipeline_size, microbatch_group_size_per_vp_stage=layout.microbatch_group_size_per_vp_stage,
        virtual_pipeline_given=layout.named("virtual_pipeline_model_parallel_size"),
    )]
    if len(problems) > MAX_STAGE_PROBLEMS:
        hidden = len(problems) - MAX_STAGE_PROBLEMS
        problems[MAX_STAGE_PROBLEMS:] = [
            f"... and {hidden} more stage(s) like these; megatron-ga schedule lists every stage."]
    return problems
