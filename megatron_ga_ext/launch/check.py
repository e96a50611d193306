"""``megatron-ga check`` on a launch line: the ledger, the stage table, every problem and the notes, in one pass.
Pure Python.

Every rule runs and reports (launch/problems.py); the ledger is printed with whatever the line fixes, beside the
problems (launch/ledger.py); a batch schedule's stages are stepped through as ``megatron-ga schedule`` steps them
(``StepSchedule.table``), and a stage the run never reaches is a problem naming the run length that reaches it. A fix
that is an edit of the line is applied and the whole pass run again on the edited line before the fix is printed: a
fix the next run would refuse is completed with what that run needs, and never advised alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_ga_ext.config.flags import CONVERT_RAMPUP
from megatron_ga_ext.core.layout import BatchLayout
from megatron_ga_ext.core.numbers import read_int
from megatron_ga_ext.core.schedule.stages import FLAG as SCHEDULE_FLAG
from megatron_ga_ext.core.schedule.step_schedule import StageRow, StepSchedule
from megatron_ga_ext.core.schedule.tables import TABLE_LIMIT, samples_after_steps
from megatron_ga_ext.errors import BatchSizeError, GAError, InterleaveError
from megatron_ga_ext.launch.ledger import known_ledger, ledger_sources
from megatron_ga_ext.launch.line import Launch, ga_values
from megatron_ga_ext.launch.line_layout import MISSING_MICRO_BATCH, read_layout
from megatron_ga_ext.launch.problems import (
    coverage_problems,
    launch_notes,
    launch_schedule,
    line_problems,
    rule_problems,
    stage_problems,
    train_length_problems,
    upstream_findings,
)
from megatron_ga_ext.launch.report import Edit, Found, Note, Problem, Report, StageTable, problem_of
from megatron_ga_ext.launch.yaml_cfg import FLAG as YAML_FLAG
from megatron_ga_ext.launch.yaml_cfg import with_yaml

__all__ = ["check_launch", "launch_problems"]

#: How many times a fix is completed with the fixes of what it leaves (each a whole pass over the line).
_FIX_ROUNDS = 4
#: The iteration-counted learning-rate flags and their sample-counted twins.
_LR_ITERS = (
    ("--lr-decay-iters", "--lr-decay-samples"),
    ("--lr-warmup-iters", "--lr-warmup-samples"),
    ("--lr-wsd-decay-iters", "--lr-wsd-decay-samples"),
)


def check_launch(launch: Launch, world_size: int | None = None) -> Report:
    """The whole report of ``launch``; ``world_size`` stands in where the line leaves the world size open.

    Raises UsageError where the line cannot be read at all (no world size, a value that is not a number).
    """
    launch, yaml_problems, yaml_notes = with_yaml(launch)
    report = _gather(launch, world_size)
    problems = tuple(_checked_fix(launch, world_size, p, report.problems) for p in report.problems)
    if yaml_notes:
        report = replace(report, kind=f"{report.kind} with its {YAML_FLAG} file", notes=(*yaml_notes, *report.notes))
    return replace(report, problems=(*yaml_problems, *problems))


@dataclass
class _Schedule:
    schedule: StepSchedule | None
    runs: bool
    source: str


def _gather(launch: Launch, world_size: int | None) -> Report:
    """Every problem and note of ``launch``, the ledger and the stage table; fixes not yet checked."""
    read = read_layout(launch, world_size, missing_ok=True)
    kwargs = dict(read.kwargs)
    found = Found()
    found.add(*launch.read_problems, *read.read_problems, *line_problems(launch), *train_length_problems(launch))
    schedule, runs, schedule_problems = launch_schedule(launch, read)
    plan = _Schedule(schedule, runs, _schedule_source(launch, runs))
    probe = {**kwargs, "global_batch_size": None} if runs else kwargs
    missing = kwargs["micro_batch_size"] is None
    layout, layout_errors = (None, []) if missing else BatchLayout.problems(**probe)
    found.add(*rule_problems(launch, layout), *coverage_problems(launch))
    upstream, upstream_notes = upstream_findings(launch)
    found.add(*upstream)
    found.add(*(problem_of(p, "seq-length") for p in read.seq_problems))
    found.add(*(problem_of(e, "layer-split") for e in read.problems))
    found.add(*(_layout_problem(e) for e in layout_errors))
    found.add(*schedule_problems)
    notes = [*launch_notes(launch), *upstream_notes, *launch.read_notes, *read.read_notes]
    table, stage = None, None
    if layout is not None and schedule is None:
        table = _warmup_table(launch, layout, kwargs)
    if layout is not None and schedule is not None:
        stages = stage_problems(schedule, layout)
        found.add(*stages)
        table, stage, found_more, more_notes = _stage_table(launch, plan, schedule, layout, clean=not stages)
        found.add(*found_more)
        notes += more_notes
    ledger_kwargs = dict(kwargs)
    if runs:
        ledger_kwargs["global_batch_size"] = stage.global_batch_size if stage is not None else None
    unknown_batch = (runs and stage is None) or (schedule is None and _batch_flags(launch))
    ledger, ledger_layout = known_ledger(ledger_kwargs, batch_known=not unknown_batch)
    found.problems = [_train_length_edit(p, launch, table) for p in found.problems]
    sources = ledger_sources(kwargs, launch.spelled, _batch_source(plan, stage))
    return Report(
        ledger=ledger,
        sources=sources,
        ledger_stage=_stage_label(plan, table, stage, kwargs),
        layout=ledger_layout,
        stages=table,
        problems=tuple(found.problems),
        notes=tuple(notes),
        kind=launch.read_as,
    )


def _batch_flags(launch: Launch) -> bool:
    """The line sets its batch by a schedule or a rampup (so without one that resolves the batch is unknown)."""
    return launch.get(SCHEDULE_FLAG) is not None or launch.get("--rampup-batch-size") is not None


def _layout_problem(error: GAError) -> Problem:
    """A rule of the batch arithmetic: the nearest valid global batch is an edit where the error names one."""
    if isinstance(error, (BatchSizeError, InterleaveError)):
        problem = problem_of(error, "global-batch-size" if isinstance(error, BatchSizeError) else "interleave")
        if problem.flag == "--global-batch-size" and problem.nearest and problem.value is not None:
            given = int(problem.value)
            closest = min(problem.nearest, key=lambda v: (abs(v - given), v))
            return replace(problem, edit=Edit(give=(("--global-batch-size", (str(closest),)),)))
        return problem
    if str(error).startswith("--micro-batch-size None"):
        return problem_of(MISSING_MICRO_BATCH, "micro-batch-size-missing")
    return problem_of(error, "layout")


# -- the schedule's stages ------------------------------------------------------------------------------------


def _schedule_source(launch: Launch, runs: bool) -> str:
    if launch.get(SCHEDULE_FLAG) is not None:
        return f'{launch.name(SCHEDULE_FLAG)} "{launch.get(SCHEDULE_FLAG)}"'
    ramp = " ".join(launch.values.get("--rampup-batch-size", []))
    gbs = launch.get("--global-batch-size")
    given = f"--rampup-batch-size {ramp} --global-batch-size {gbs}"
    return f"{given} with {CONVERT_RAMPUP.flag}" if runs else f"{given}, as {CONVERT_RAMPUP.flag} would run it"


def _run_length(launch: Launch, schedule: StepSchedule, mbs: int, dp: int) -> tuple[int | None, str | None]:
    """The run's length in samples and the flag that gives it: --train-samples, or the samples --train-iters steps
    of the schedule consume."""
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


def _stage_table(
    launch: Launch, plan: _Schedule, schedule: StepSchedule, layout: BatchLayout, clean: bool
) -> tuple[StageTable, StageRow | None, list[Problem], list[Note]]:
    """The stage table, the stage the ledger shows (the last the run reaches), the stages never reached as problems,
    and notes on stages a step jumps over."""
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
                    f"trained: the last step of the stage before it passes its threshold and the next "
                    f"one's.",
                )
            )
        elif plan.runs and open_row.first_sample is not None:
            problems.append(_unreached(row, open_row.first_sample, open_row.first_token, table, stage))
    return table, stage, problems, notes


def _warmup_table(launch: Launch, layout: BatchLayout, kwargs: dict[str, object]) -> StageTable | None:
    """--ga-batch-size-warmup auto: the batch sizes it may reach, doubling from --global-batch-size up to the cap."""
    values = ga_values(launch)
    cap, start = values.get("batch_size_warmup_max"), kwargs.get("global_batch_size")
    if values.get("batch_size_warmup") != "auto" or not isinstance(cap, int) or not isinstance(start, int):
        return None
    sizes = [start]
    while sizes[-1] * 2 <= cap and len(sizes) < 64:
        sizes.append(sizes[-1] * 2)
    flag = launch.name("--ga-batch-size-warmup-max")
    return StageTable(
        source=f"--ga-batch-size-warmup auto, doubling from --global-batch-size {start} up to {flag} {cap}",
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
    """A rampup's schedule as --step-batch-size-schedule text (None for a given schedule or a ramp too long)."""
    if launch.get(SCHEDULE_FLAG) is not None:
        return None
    try:
        return schedule.to_string(seq)
    except GAError:
        return None


def _unreached(
    row: StageRow, first_sample: int, first_token: int | None, table: StageTable, stage: StageRow | None
) -> Problem:
    """A stage after the run's end, opening at ``first_sample`` (``first_token``): the run length that reaches it
    (one step into it)."""
    needed = first_sample + 1
    tokens = f" = {first_token:,} tokens" if first_token is not None else ""
    trains = f"; its last step trains at GBS {stage.global_batch_size:,}" if stage is not None else ""
    return Problem(
        message=f"{SCHEDULE_FLAG} entry {row.position} {row.entry!r} (GBS {row.global_batch_size:,}) is never reached: "
        f"the run ends at {table.run_length} and this stage starts at sample {first_sample:,}{tokens}"
        f"{trains}. Give --train-samples {needed:,} or more to reach it, or drop the entry.",
        rule="stage-never-reached",
        flag=SCHEDULE_FLAG,
        value=row.entry,
        fix=f"Give --train-samples {needed:,} or more to reach it, or drop the entry.",
    )


def _stage_label(
    plan: _Schedule, table: StageTable | None, stage: StageRow | None, kwargs: dict[str, object]
) -> str | None:
    if plan.schedule is None:
        if table is not None and table.warmup:
            return f"the first of {len(table.warmup)} batch sizes --ga-batch-size-warmup auto may reach"
        return None
    if not plan.runs:
        return (
            f"the constant --global-batch-size {kwargs['global_batch_size']}: megatron-core >= 0.18 ignores the rampup"
        )
    if stage is None or table is None or table.rows is None:
        return f"no stage: {plan.source} does not run on this layout (see the problems)"
    count = len(table.rows)
    label = f"stage {stage.position} of {count} (GBS {stage.global_batch_size:,}, from step {stage.first_step:,})"
    if table.train_samples is None:
        return f"{label}, the last; no run length is given"
    if stage.position < count:
        return f"{label}, the last stage this run reaches"
    return label


def _batch_source(plan: _Schedule, stage: StageRow | None) -> str | None:
    if plan.schedule is None or not plan.runs:
        return None
    if stage is None:
        return "no stage runs on this layout (see the problems)"
    return (
        f"stage {stage.position} of {SCHEDULE_FLAG}"
        if plan.source.startswith(SCHEDULE_FLAG)
        else f"stage {stage.position} of the converted rampup"
    )


def _train_length_edit(problem: Problem, launch: Launch, table: StageTable | None) -> Problem:
    """--train-iters with a schedule: the edit to samples, each iteration count as the samples that many steps of
    the schedule consume."""
    if problem.rule != "train-length" or table is None or table.rows is None or table.train_samples is None:
        return problem
    edit = Edit(give=(("--train-samples", (str(table.train_samples),)),), drop=("--train-iters",))
    words = [f"replace --train-iters {launch.get('--train-iters')} by --train-samples {table.train_samples}"]
    schedule = _rows_schedule(table)
    for iters_flag, samples_flag in _LR_ITERS:
        value = launch.get(iters_flag)
        if value is None or value == "0":
            continue
        samples = samples_after_steps(
            schedule, table.micro_batch_size, table.data_parallel_size, read_int(launch.name(iters_flag), value)
        )
        edit += Edit(give=((samples_flag, (str(samples),)),), drop=(iters_flag,))
        words.append(f"{iters_flag} {value} by {samples_flag} {samples}")
    fix = f"{', '.join(words)[0].upper()}{', '.join(words)[1:]} (the samples those steps of the schedule consume)."
    return replace(problem, fix=fix, edit=edit)


def _rows_schedule(table: StageTable) -> StepSchedule:
    return StepSchedule.from_stages([(r.threshold_samples, r.global_batch_size) for r in table.rows or ()])


# -- fixes, checked against every rule ------------------------------------------------------------------------


def _checked_fix(launch: Launch, world_size: int | None, problem: Problem, before: tuple[Problem, ...]) -> Problem:
    """``problem`` with its edit applied and the whole pass run again: a fix that leaves a problem of its own is
    completed with that problem's fix (while it has one), and says what it still leaves; a fix that does not remove
    the problem loses its edit (its words stay as the rule wrote them)."""
    if problem.edit is None:
        return problem
    seen = {(p.rule, p.flag) for p in before}
    edit, follow = problem.edit, []
    for _ in range(_FIX_ROUNDS):
        try:
            after = _gather(launch.edited(edit), world_size).problems
        except GAError:
            return replace(problem, edit=None)
        if any(p.rule == problem.rule and p.flag == problem.flag for p in after):
            return replace(problem, edit=None)
        new = [p for p in after if (p.rule, p.flag) not in seen]
        if not new:
            break
        follow += new
        seen |= {(p.rule, p.flag) for p in new}
        edits = [p.edit for p in new if p.edit is not None]
        if len(edits) < len(new):
            break
        for more in edits:
            edit += more
    return _completed(problem, edit, follow)


def _completed(problem: Problem, edit: Edit, follow: list[Problem]) -> Problem:
    if not follow:
        return replace(problem, edit=edit)
    fixed = [p.fix for p in follow if p.edit is not None and p.fix]
    left = [p.message for p in follow if p.edit is None]
    message, fix = problem.message, problem.fix or ""
    if fixed:
        message += f" Then also: {' '.join(fixed)}"
        fix += f" Then also: {' '.join(fixed)}"
    if left:
        message += f" (That change alone still leaves: {' '.join(left)})"
    return replace(problem, message=message, fix=fix or None, edit=edit)


def launch_problems(launch: Launch, world_size: int | None) -> tuple[BatchLayout | None, list[str]]:
    """(the ledger's layout where every rule of it holds, else None; each problem's message) of ``launch``."""
    report = check_launch(launch, world_size)
    return report.layout, [p.message for p in report.problems]
