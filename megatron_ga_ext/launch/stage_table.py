"""The stage table of ``megatron-ga check``: a batch schedule's stages stepped through on the
launch's layout, as ``megatron-ga schedule`` steps them (``StepSchedule.table``). Pure Python.

The run's length (--train-samples, or the samples --train-iters steps consume) says which stages it
reaches: the ledger shows the last one; a stage after the run's end is a problem naming the
--train-samples that reaches it (first_sample + 1); a stage a step jumps over is a note. With
--ga-batch-size-warmup auto the table lists the batch sizes the warmup may reach (doubling from
--global-batch-size up to --ga-batch-size-warmup-max).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_ga_ext.config.flags import CONVERT_RAMPUP
from megatron_ga_ext.core.layout import BatchLayout
from megatron_ga_ext.core.numbers import read_int
from megatron_ga_ext.core.schedule.stages import FLAG as SCHEDULE_FLAG
from megatron_ga_ext.core.schedule.step_schedule import StageRow, StepSchedule
from megatron_ga_ext.core.schedule.tables import TABLE_LIMIT, samples_after_steps
from megatron_ga_ext.errors import GAError
from megatron_ga_ext.launch.line import Launch, ga_values
from megatron_ga_ext.launch.report import Edit, Note, Problem, StageTable

__all__ = [
    "SchedulePlan",
    "batch_source",
    "schedule_source",
    "stage_label",
    "stage_table",
    "train_length_edit",
    "warmup_table",
]

#: The iteration-counted learning-rate flags and their sample-counted twins.
_LR_ITERS = (
    ("--lr-decay-iters", "--lr-decay-samples"),
    ("--lr-warmup-iters", "--lr-warmup-samples"),
    ("--lr-wsd-decay-iters", "--lr-wsd-decay-samples"),
)


@dataclass
class SchedulePlan:
    """The launch's step schedule (None without one), whether the run runs it, and its flags as
    given."""

    schedule: StepSchedule | None
    runs: bool
    source: str


def schedule_source(launch: Launch, runs: bool) -> str:
    if launch.get(SCHEDULE_FLAG) is not None:
        return f'{launch.name(SCHEDULE_FLAG)} "{launch.get(SCHEDULE_FLAG)}"'
    ramp = " ".join(launch.values.get("--rampup-batch-size", []))
    gbs = launch.get("--global-batch-size")
    given = f"--rampup-batch-size {ramp} --global-batch-size {gbs}"
    return (
        f"{given} with {CONVERT_RAMPUP.flag}"
        if runs
        else f"{given}, as {CONVERT_RAMPUP.flag} would run it"
    )


def _run_length(
    launch: Launch, schedule: StepSchedule, mbs: int, dp: int
) -> tuple[int | None, str | None]:
    """The run's length in samples and the flag that gives it: --train-samples, or the samples
    --train-iters steps of the schedule consume."""
    samples, iters = launch.get("--train-samples"), launch.get("--train-iters")
    if samples is not None:
        value = read_int(launch.name("--train-samples"), samples)
        return (value, f"--train-samples {value:,}") if value >= 1 else (None, None)
    if iters is not None:
        steps = read_int(launch.name("--train-iters"), iters)
        if steps < 1:
            return None, None
        consumed = samples_after_steps(schedule, mbs, dp, steps)
        return consumed, f"--train-iters {steps:,} (= {consumed:,} samples)"
    return None, None


def stage_table(
    launch: Launch, plan: SchedulePlan, schedule: StepSchedule, layout: BatchLayout, clean: bool
) -> tuple[StageTable, StageRow | None, list[Problem], list[Note]]:
    """The stage table, the stage the ledger shows (the last the run reaches), the stages never
    reached as problems, and notes on stages a step jumps over."""
    mbs, dp, seq = layout.micro_batch_size, layout.data_parallel_size, layout.seq_length
    train_samples, run_length = _run_length(launch, schedule, mbs, dp) if clean else (None, None)
    rows = None
    if clean and schedule.num_stages <= TABLE_LIMIT:
        rows = tuple(schedule.table(mbs, dp, seq_length=seq, train_samples=train_samples))
    table = StageTable(
        source=plan.source,
        runs=plan.runs,
        rows=rows,
        summary=schedule.summary(),
        micro_batch_size=mbs,
        data_parallel_size=dp,
        seq_length=seq,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        virtual_pipeline_size=layout.virtual_pipeline_size,
        train_samples=train_samples,
        run_length=run_length,
        equivalent=_equivalent(launch, schedule, seq),
    )
    if rows is None:
        return table, None, [], []
    reached = [r for r in rows if r.first_step is not None]
    stage = reached[-1] if reached else None
    problems, notes = [], []
    open_rows = schedule.table(mbs, dp, seq_length=seq) if train_samples is not None else rows
    for row, open_row in zip(rows, open_rows):
        if row.first_step is not None:
            continue
        later = any(r.first_step is not None and r.position > row.position for r in rows)
        if later:
            notes.append(
                Note(
                    severity="careful",
                    text=f"{SCHEDULE_FLAG} entry {row.position} {row.entry!r} is never "
                    "trained: the last step of the stage before it passes its threshold and the "
                    "next "
                    f"one's.",
                )
            )
        elif plan.runs and open_row.first_sample is not None:
            problems.append(
                _unreached(row, open_row.first_sample, open_row.first_token, table, stage)
            )
    return table, stage, problems, notes


def warmup_table(
    launch: Launch, layout: BatchLayout, kwargs: dict[str, object]
) -> StageTable | None:
    """--ga-batch-size-warmup auto: the batch sizes it may reach, doubling from --global-batch-size
    up to the cap."""
    values = ga_values(launch)
    cap, start = values.get("batch_size_warmup_max"), kwargs.get("global_batch_size")
    if (
        values.get("batch_size_warmup") != "auto"
        or not isinstance(cap, int)
        or not isinstance(start, int)
    ):
        return None
    sizes = [start]
    while sizes[-1] * 2 <= cap and len(sizes) < 64:
        sizes.append(sizes[-1] * 2)
    flag = launch.name("--ga-batch-size-warmup-max")
    return StageTable(
        source=f"--ga-batch-size-warmup auto, doubling from --global-batch-size {start} up to "
        f"{flag} {cap}",
        runs=True,
        rows=None,
        summary=f"{len(sizes)} batch sizes, each reached when the measured noise scale says so",
        micro_batch_size=layout.micro_batch_size,
        data_parallel_size=layout.data_parallel_size,
        seq_length=layout.seq_length,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        virtual_pipeline_size=layout.virtual_pipeline_size,
        train_samples=None,
        run_length=None,
        warmup=tuple(sizes),
    )


def _equivalent(launch: Launch, schedule: StepSchedule, seq: int | None) -> str | None:
    """A rampup's schedule as --step-batch-size-schedule text (None for a given schedule or a ramp
    too long)."""
    if launch.get(SCHEDULE_FLAG) is not None:
        return None
    try:
        return schedule.to_string(seq)
    except GAError:
        return None


def _unreached(
    row: StageRow,
    first_sample: int,
    first_token: int | None,
    table: StageTable,
    stage: StageRow | None,
) -> Problem:
    """A stage after the run's end, opening at ``first_sample`` (``first_token``): the run length
    that reaches it (one step into it)."""
    needed = first_sample + 1
    tokens = f" = {first_token:,} tokens" if first_token is not None else ""
    trains = (
        f"; its last step trains at GBS {stage.global_batch_size:,}" if stage is not None else ""
    )
    return Problem(
        message=f"{SCHEDULE_FLAG} entry {row.position} {row.entry!r} (GBS "
        f"{row.global_batch_size:,}) is never reached: "
        f"the run ends at {table.run_length} and this stage starts at sample "
        f"{first_sample:,}{tokens}"
        f"{trains}. Give --train-samples {needed:,} or more to reach it, or drop the entry.",
        rule="stage-never-reached",
        flag=SCHEDULE_FLAG,
        value=row.entry,
        fix=f"Give --train-samples {needed:,} or more to reach it, or drop the entry.",
        edit=Edit(give=(("--train-samples", (str(needed),)),), drop=("--train-iters",)),
    )


def stage_label(
    plan: SchedulePlan, table: StageTable | None, stage: StageRow | None, kwargs: dict[str, object]
) -> str | None:
    if plan.schedule is None:
        if table is not None and table.warmup:
            return (
                f"the first of {len(table.warmup)} batch sizes --ga-batch-size-warmup auto "
                "may reach"
            )
        return None
    if not plan.runs:
        return (
            f"the constant --global-batch-size {kwargs['global_batch_size']}: megatron-core "
            ">= 0.18 ignores the rampup"
        )
    if stage is None or table is None or table.rows is None:
        return f"no stage: {plan.source} does not run on this layout (see the problems)"
    count = len(table.rows)
    label = (
        f"stage {stage.position} of {count} (GBS {stage.global_batch_size:,}, from step "
        f"{stage.first_step:,})"
    )
    if table.train_samples is None:
        return f"{label}, the last; no run length is given"
    if stage.position < count:
        return f"{label}, the last stage this run reaches"
    return label


def batch_source(plan: SchedulePlan, stage: StageRow | None) -> str | None:
    if plan.schedule is None or not plan.runs:
        return None
    if stage is None:
        return "no stage runs on this layout (see the problems)"
    return (
        f"stage {stage.position} of {SCHEDULE_FLAG}"
        if plan.source.startswith(SCHEDULE_FLAG)
        else f"stage {stage.position} of the converted rampup"
    )


def train_length_edit(problem: Problem, launch: Launch, table: StageTable | None) -> Problem:
    """--train-iters with a schedule: the edit to samples, each iteration count as the samples that
    many steps of the schedule consume."""
    if (
        problem.rule != "train-length"
        or table is None
        or table.rows is None
        or table.train_samples is None
    ):
        return problem
    edit = Edit(give=(("--train-samples", (str(table.train_samples),)),), drop=("--train-iters",))
    words = [
        f"replace --train-iters {launch.get('--train-iters')} by --train-samples "
        f"{table.train_samples}"
    ]
    schedule = _rows_schedule(table)
    for iters_flag, samples_flag in _LR_ITERS:
        value = launch.get(iters_flag)
        if value is None or value == "0":
            continue
        samples = samples_after_steps(
            schedule,
            table.micro_batch_size,
            table.data_parallel_size,
            read_int(launch.name(iters_flag), value),
        )
        edit += Edit(give=((samples_flag, (str(samples),)),), drop=(iters_flag,))
        words.append(f"{iters_flag} {value} by {samples_flag} {samples}")
    fix = (
        f"{', '.join(words)[0].upper()}{', '.join(words)[1:]} (the samples those steps of the "
        "schedule consume)."
    )
    return replace(problem, fix=fix, edit=edit)


def _rows_schedule(table: StageTable) -> StepSchedule:
    return StepSchedule.from_stages(
        [(r.threshold_samples, r.global_batch_size) for r in table.rows or ()]
    )
