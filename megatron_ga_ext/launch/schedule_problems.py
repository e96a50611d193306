"""The problems of a launch's one batch schedule (``megatron-ga check``). Pure Python.

The schedule is the given --step-batch-size-schedule (sorted by threshold, as Megatron sorts it)
or a --rampup-batch-size: converted with --ga-convert-rampup, else ignored by megatron-core >= 0.18
(the schedule --ga-convert-rampup would run is shown). Every entry that does not parse is a
problem, and so is every stage that breaks the batch layout (``StepSchedule.problems``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from megatron_ga_ext.config.flags import CONVERT_RAMPUP
from megatron_ga_ext.config.launch_rules import rampup_ignored_message
from megatron_ga_ext.config.resolve import ScheduleInputs, resolve_schedule
from megatron_ga_ext.core.layout import BatchLayout
from megatron_ga_ext.core.schedule.stages import FLAG as SCHEDULE_FLAG
from megatron_ga_ext.core.schedule.stages import parse_entries, schedule_text_errors
from megatron_ga_ext.core.schedule.step_schedule import StepSchedule
from megatron_ga_ext.errors import GAError
from megatron_ga_ext.launch.line import Launch
from megatron_ga_ext.launch.line_layout import LaunchLayout
from megatron_ga_ext.launch.report import Edit, Note, Problem, problem_of

__all__ = [
    "launch_schedule",
    "schedule_order_note",
    "schedule_text",
    "sorted_schedule",
    "stage_problems",
]


def launch_schedule(
    launch: Launch, read: LaunchLayout
) -> tuple[StepSchedule | None, bool, list[Problem]]:
    """(the step schedule of the launch, whether the run runs it, the problems of its flags): a
    given schedule, a converted rampup; a rampup not converted gives the schedule
    --ga-convert-rampup would run (not run: megatron-core >= 0.18 drops it)."""
    inputs = _schedule_inputs(launch, read)
    problems: list[Problem] = []
    try:
        schedule = resolve_schedule(inputs)
    except GAError as error:
        return None, False, problems + _schedule_errors(inputs, error)
    if (
        inputs.rampup_batch_size is None
        or inputs.convert_rampup
        or inputs.step_batch_size_schedule is not None
    ):
        return schedule, schedule is not None, problems
    shown, ignored = _ignored_rampup(launch, inputs, inputs.rampup_batch_size)
    return shown, False, problems + ignored


def _schedule_errors(inputs: ScheduleInputs, error: GAError) -> list[Problem]:
    """Every entry a given schedule breaks (the parse stops at the first), else ``error``."""
    text = inputs.step_batch_size_schedule
    if (
        text is not None
        and inputs.rampup_batch_size is None
        and not inputs.decrease_batch_size_if_needed
    ):
        errors = schedule_text_errors(text, inputs.seq_length)
        if errors:
            return [
                problem_of(e, "schedule-entry", flag=SCHEDULE_FLAG, value=_entry_of(e))
                for e in errors
            ]
    return [problem_of(error, "schedule")]


def _entry_of(error: GAError) -> str | None:
    text = str(error)
    start = text.find("entry ")
    if start < 0:
        return None
    quoted = text[start:].split("'")
    return quoted[1] if len(quoted) > 2 else None


def schedule_text(launch: Launch) -> str | None:
    """The --step-batch-size-schedule of ``launch`` (its stray words joined: checked as if
    quoted)."""
    text = launch.get(SCHEDULE_FLAG)
    if text is not None and SCHEDULE_FLAG in launch.stray:
        text = " ".join([text, *launch.stray[SCHEDULE_FLAG]])
    return text


def sorted_schedule(text: str | None, seq_length: int | None) -> str | None:
    """The schedule as Megatron runs it where its entries are out of order, else None: upstream's
    parser sorts the entries by threshold (num_microbatches_calculator.py:532 at core_v0.19.0),
    stably, before it checks them."""
    if text is None:
        return None
    try:
        entries = parse_entries(text, seq_length)
    except GAError:
        return None  # schedule-entry reports what does not parse
    ordered = sorted(entries, key=lambda stage: stage.threshold_samples)
    if [s.threshold_samples for s in ordered] == [s.threshold_samples for s in entries]:
        return None
    return " ".join(stage.spelling for stage in ordered)


def schedule_order_note(launch: Launch, seq_length: int | None) -> list[Note]:
    """A note where the schedule is written out of order (Megatron sorts it; check runs it
    sorted)."""
    ordered = sorted_schedule(schedule_text(launch), seq_length)
    if ordered is None:
        return []
    return [
        Note(
            severity="careful",
            text=f"{SCHEDULE_FLAG} is written out of order; Megatron sorts its entries by "
            "threshold "
            f"(num_microbatches_calculator.py:532 at core_v0.19.0) and runs '{ordered}', as the "
            "stages below do.",
        )
    ]


def _schedule_inputs(launch: Launch, read: LaunchLayout) -> ScheduleInputs:
    kwargs = read.kwargs
    text = schedule_text(launch)
    text = sorted_schedule(text, kwargs["seq_length"]) or text
    return ScheduleInputs(
        step_batch_size_schedule=text,
        rampup_batch_size=launch.values.get("--rampup-batch-size"),
        global_batch_size=kwargs["global_batch_size"],
        seq_length=kwargs["seq_length"],
        convert_rampup=launch.on(CONVERT_RAMPUP.flag),
        pipeline_model_parallel_size=kwargs["pipeline_model_parallel_size"],
        virtual_pipeline_model_parallel_size=kwargs["virtual_pipeline_model_parallel_size"],
        microbatch_group_size_per_vp_stage=kwargs["microbatch_group_size_per_vp_stage"],
        decrease_batch_size_if_needed=launch.on("--decrease-batch-size-if-needed"),
    )


def _ignored_rampup(
    launch: Launch, inputs: ScheduleInputs, rampup: Sequence[int | str]
) -> tuple[StepSchedule | None, list[Problem]]:
    """A rampup (``rampup``, the --rampup-batch-size of ``inputs``) without --ga-convert-rampup:
    megatron-core >= 0.18 ignores it without a log line and trains at constant GBS; 0.16 and 0.17
    refuse it with --train-iters. The equivalent schedule, what the run gets with
    --ga-convert-rampup, is shown (and its stages checked)."""
    ignored = rampup_ignored_message(rampup, inputs.global_batch_size)
    iters = launch.get("--train-iters")
    if iters is not None:
        ignored += (
            f" (megatron-core 0.16 and 0.17 stop instead: with --train-iters {iters} they assert "
            '"expected no '
            f'batch-size rampup for iteration-based training".)'
        )
    edit = Edit(give=((CONVERT_RAMPUP.flag, ()),))
    try:
        schedule = resolve_schedule(replace(inputs, convert_rampup=True))
    except GAError as error:
        return None, [
            problem_of(
                f"{ignored} It has no equivalent step schedule either: {error}",
                "rampup-ignored",
                flag="--rampup-batch-size",
                value=" ".join(map(str, rampup)),
            )
        ]
    fix = f"Pass {CONVERT_RAMPUP.flag} to run the equivalent step schedule."
    if not launch.extension:
        ignored = ignored.replace(f" {fix}", "")
        fix, edit = _plain_rampup_fix(schedule, inputs.seq_length)
        ignored += f" {fix}"
    problem = problem_of(
        ignored,
        "rampup-ignored",
        flag="--rampup-batch-size",
        value=" ".join(map(str, rampup)),
        fix=fix,
        edit=edit,
    )
    return schedule, [problem]


def _plain_rampup_fix(schedule: StepSchedule | None, seq_length: int | None) -> tuple[str, Edit]:
    """Without the extension on the line: the rampup's exact equivalent as Megatron's own
    --step-batch-size-schedule (megatron-core >= 0.18), else the drop-in entry with
    --ga-convert-rampup."""
    through = (
        "run the script through the extension (python -m megatron_ga_ext ...) with "
        f"{CONVERT_RAMPUP.flag}"
    )
    try:
        text = schedule.to_string(seq_length) if schedule is not None else None
    except GAError:
        text = None
    if text is None:
        return f"To train the ramp, {through}.", Edit(entry=True, give=((CONVERT_RAMPUP.flag, ()),))
    fix = (
        f'Give --step-batch-size-schedule "{text}" (its exact equivalent, megatron-core >= 0.18) '
        "in place of "
        f"--rampup-batch-size and --global-batch-size; or {through}."
    )
    return fix, Edit(
        give=((SCHEDULE_FLAG, (text,)),), drop=("--rampup-batch-size", "--global-batch-size")
    )


def stage_problems(schedule: StepSchedule, layout: BatchLayout) -> list[Problem]:
    """Every rule each stage of ``schedule`` breaks against ``layout`` (a long ramp: one per rule,
    in closed form)."""
    return [
        problem_of(p.error, "schedule-stage", flag=SCHEDULE_FLAG, value=p.stage.spelling)
        for p in schedule.problems(
            layout.micro_batch_size,
            layout.data_parallel_size,
            layout.pipeline_model_parallel_size,
            layout.virtual_pipeline_size,
            microbatch_group_size_per_vp_stage=layout.microbatch_group_size_per_vp_stage,
            virtual_pipeline_given=layout.named("virtual_pipeline_model_parallel_size"),
        )
    ]
