"""``megatron-ga check`` on a launch line: the ledger, the stage table, every problem and the notes,
in one pass. Pure Python.

Every rule runs and reports (launch/problems.py); the ledger is printed with whatever the line
fixes, beside the problems (launch/ledger.py); a batch schedule's stages are stepped through as
``megatron-ga schedule`` steps them (launch/stage_table.py), and a stage the run never reaches is a
problem naming the run length that reaches it. A fix that is an edit of the line is applied and the
whole pass run again on the edited line before the fix is printed: a fix the next run would refuse
is completed with what that run needs, and never advised alone.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_ga_ext.core.layout import BatchLayout
from megatron_ga_ext.core.schedule.stages import FLAG as SCHEDULE_FLAG
from megatron_ga_ext.errors import BatchSizeError, GAError, InterleaveError
from megatron_ga_ext.launch.ledger import known_ledger, ledger_sources
from megatron_ga_ext.launch.line import Launch
from megatron_ga_ext.launch.line_layout import MISSING_MICRO_BATCH, read_layout
from megatron_ga_ext.launch.problems import (
    coverage_problems,
    launch_notes,
    line_problems,
    rule_problems,
    upstream_findings,
)
from megatron_ga_ext.launch.registry import registry_problems
from megatron_ga_ext.launch.report import Edit, Found, Note, Problem, Report, problem_of
from megatron_ga_ext.launch.schedule_problems import (
    launch_schedule,
    schedule_order_note,
    stage_problems,
)
from megatron_ga_ext.launch.stage_table import (
    SchedulePlan,
    batch_source,
    schedule_source,
    stage_label,
    stage_table,
    train_length_edit,
    warmup_table,
)
from megatron_ga_ext.launch.view import build_view
from megatron_ga_ext.launch.yaml_cfg import FLAG as YAML_FLAG
from megatron_ga_ext.launch.yaml_cfg import with_yaml

__all__ = ["check_launch", "launch_problems"]

#: How many times a fix is completed with the fixes of what it leaves (each a whole pass over the
#: line).
_FIX_ROUNDS = 4


def check_launch(launch: Launch, world_size: int | None = None) -> Report:
    """The whole report of ``launch``; ``world_size`` stands in where the line leaves the world size
    open.

    Raises UsageError where the line cannot be read at all (no world size, a value that is not a
    number).
    """
    launch, yaml_problems, yaml_notes = with_yaml(launch)
    report = _gather(launch, world_size)
    problems = tuple(_checked_fix(launch, world_size, p, report.problems) for p in report.problems)
    if yaml_notes:
        report = replace(
            report,
            kind=f"{report.kind} with its {YAML_FLAG} file",
            notes=(*yaml_notes, *report.notes),
        )
    return replace(report, problems=(*yaml_problems, *problems))


def _gather(launch: Launch, world_size: int | None) -> Report:
    """Every problem and note of ``launch``, the ledger and the stage table; fixes not yet
    checked."""
    read = read_layout(launch, world_size, missing_ok=True)
    kwargs, decreased = _decreased(launch, dict(read.kwargs))
    found = Found()
    found.add(
        *launch.read_problems, *_read_problems(launch, read.read_problems), *line_problems(launch)
    )
    found.add(
        *registry_problems(build_view(launch, read.kwargs))
    )  # as given: validate_args sees GBS unrounded
    schedule, runs, schedule_problems = launch_schedule(launch, read)
    plan = SchedulePlan(schedule, runs, schedule_source(launch, runs))
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
    notes += [*schedule_order_note(launch, kwargs["seq_length"]), *decreased]
    table, stage = None, None
    if layout is not None and schedule is None:
        table = warmup_table(launch, layout, kwargs)
    if layout is not None and schedule is not None:
        stages = stage_problems(schedule, layout)
        found.add(*stages)
        table, stage, found_more, more_notes = stage_table(
            launch, plan, schedule, layout, clean=not stages
        )
        found.add(*found_more)
        notes += more_notes
    ledger_kwargs = dict(kwargs)
    if runs:
        ledger_kwargs["global_batch_size"] = stage.global_batch_size if stage is not None else None
    unknown_batch = (runs and stage is None) or (schedule is None and _batch_flags(launch))
    ledger, ledger_layout = known_ledger(ledger_kwargs, batch_known=not unknown_batch)
    found.problems = [train_length_edit(p, launch, table) for p in found.problems]
    sources = ledger_sources(kwargs, launch.spelled, batch_source(plan, stage))
    return Report(
        ledger=ledger,
        sources=sources,
        ledger_stage=stage_label(plan, table, stage, kwargs),
        layout=ledger_layout,
        stages=table,
        problems=tuple(found.problems),
        notes=tuple(notes),
        kind=launch.read_as,
    )


def _decreased(launch: Launch, kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[Note]]:
    """--decrease-batch-size-if-needed: Megatron rounds a constant GBS down to a multiple of MBS x
    DP (num_microbatches_calculator.py:369 at core_v0.19.0, ``_round``); the run trains at that
    GBS."""
    if not launch.on("--decrease-batch-size-if-needed") or launch.get(SCHEDULE_FLAG) is not None:
        return kwargs, []
    names = ["global_batch_size", "micro_batch_size", "world_size", "tensor_model_parallel_size"]
    names += ["pipeline_model_parallel_size", "context_parallel_size"]
    values = [v for v in (kwargs.get(name) for name in names) if isinstance(v, int) and v > 0]
    if len(values) < len(names):
        return kwargs, []
    gbs, mbs, world, tp, pp, cp = values
    if world % (tp * pp * cp):
        return kwargs, []
    unit = mbs * (world // (tp * pp * cp))
    running = gbs // unit * unit
    if running in (gbs, 0):
        return kwargs, []
    note = Note(
        severity="careful",
        text=f"--decrease-batch-size-if-needed: Megatron rounds --global-batch-size {gbs} down "
        "to a multiple of "
        f"MBS x DP = {unit} and runs at {running} (num_microbatches_calculator.py:369 at "
        "core_v0.19.0); from "
        f"core_v0.18.2 on, the eval batch (--eval-global-batch-size, {gbs} unless given) must "
        "divide as well.",
    )
    return {**kwargs, "global_batch_size": running}, [note]


def _read_problems(launch: Launch, problems: list[Problem]) -> list[Problem]:
    """What the line leaves out; a missing --micro-batch-size where --batch-size stands for it is
    the registry's ``batch-size-removed`` problem (whose edit gives it)."""
    if launch.get("--batch-size") is None:
        return problems
    return [p for p in problems if p.rule != "micro-batch-size-missing"]


def _batch_flags(launch: Launch) -> bool:
    """The line sets its batch by a schedule or a rampup (so without one that resolves the batch is
    unknown)."""
    return launch.get(SCHEDULE_FLAG) is not None or launch.get("--rampup-batch-size") is not None


def _layout_problem(error: GAError) -> Problem:
    """A rule of the batch arithmetic: the nearest valid global batch is an edit where the error
    names one."""
    if isinstance(error, (BatchSizeError, InterleaveError)):
        problem = problem_of(
            error, "global-batch-size" if isinstance(error, BatchSizeError) else "interleave"
        )
        if problem.flag == "--global-batch-size" and problem.nearest and problem.value is not None:
            given = int(problem.value)
            closest = min(problem.nearest, key=lambda v: (abs(v - given), v))
            return replace(problem, edit=Edit(give=(("--global-batch-size", (str(closest),)),)))
        return problem
    if str(error).startswith("--micro-batch-size None"):
        return problem_of(MISSING_MICRO_BATCH, "micro-batch-size-missing")
    return problem_of(error, "layout")


# -- fixes, checked against every rule
# ------------------------------------------------------------------------


def _checked_fix(
    launch: Launch, world_size: int | None, problem: Problem, before: tuple[Problem, ...]
) -> Problem:
    """``problem`` with its edit applied and the whole pass run again: a fix that leaves a problem
    of its own is completed with that problem's fix (while it has one), and says what it still
    leaves; a fix that does not remove the problem loses its edit (its words stay as the rule wrote
    them)."""
    if problem.edit is None:
        return problem
    seen = {(p.rule, p.flag) for p in before}
    edit, follow = problem.edit, []
    for _ in range(_FIX_ROUNDS):
        try:
            after = _gather(launch.edited(edit), world_size).problems
        except GAError:
            return replace(problem, edit=None)
        if any(_same(p, problem) for p in after):
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


def _same(one: Problem, other: Problem) -> bool:
    """The same problem (one rule id holds several declarations: their fixes tell them apart)."""
    return (one.rule, one.flag, one.value, one.fix) == (
        other.rule,
        other.flag,
        other.value,
        other.fix,
    )


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
    """(the ledger's layout where every rule of it holds, else None; each problem's message) of
    ``launch``."""
    report = check_launch(launch, world_size)
    return report.layout, [p.message for p in report.problems]
