"""A step schedule as a run steps through it: the row of each stage, and each step.

    per step in a stage of batch B:  S = MBS x DP x (B // (MBS x DP))   (consumed += S)
    steps in it, entered at c:        ceil((end - c) / S),  end = min(next threshold, train_samples)

The last step of a stage may overshoot the next threshold, so a stage starts at its first step's
count, which can be past its threshold, and a stage can be skipped entirely (steps 0).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from megatron_ga_ext.core.lr_factor import lr_factor
from megatron_ga_ext.core.rules import require_positive_int
from megatron_ga_ext.core.schedule.checks import zero_microbatch_error
from megatron_ga_ext.core.schedule.stages import Stage
from megatron_ga_ext.errors import UsageError

__all__ = [
    "TABLE_LIMIT",
    "StageRow",
    "StepInfo",
    "iter_steps",
    "run_totals",
    "samples_after_steps",
    "table",
    "total_samples",
    "total_steps",
]

#: A table lists at most this many stages (a long ramp is summarised instead: see
#: StepSchedule.summary).
TABLE_LIMIT = 10_000


class Stages(Protocol):
    """What the tables read of a schedule (a
    :class:`~megatron_ga_ext.core.schedule.step_schedule.StepSchedule`)."""

    @property
    def seq_length(self) -> int | None: ...

    @property
    def entries(self) -> Sequence[Stage]: ...

    @property
    def num_stages(self) -> int: ...

    def stage_index_at(self, consumed_samples: int) -> int: ...

    def global_batch_size_at(self, consumed_samples: int) -> int: ...

    def summary(self) -> str: ...


@dataclass(kw_only=True, frozen=True)
class StageRow:
    """One stage as a run would see it, for tables, JSON and plots (see StepSchedule.table)."""

    position: int
    entry: str
    threshold_samples: int
    threshold_tokens: int | None
    global_batch_size: int
    num_microbatches: int
    """GBS // (MBS x DP)."""
    first_sample: int | None
    """Consumed samples at the first step that uses this stage (>= threshold); None if never
    used."""
    first_token: int | None
    """first_sample x seq_length: the exact token count where the switch happens."""
    first_step: int | None
    """0-based iteration of that first step, counted from where stepping began
    (``consumed_samples``)."""
    steps: int | None
    """Steps run in this stage; None when open-ended (no train length given)."""
    samples: int | None
    tokens: int | None
    lr_linear: float | None = None
    """Hint only: lr x GBS / base batch size (Goyal et al. linear rule)."""
    lr_sqrt: float | None = None
    """Hint only: lr x sqrt(GBS / base batch size) (square-root rule)."""


@dataclass(kw_only=True, frozen=True)
class StepInfo:
    """One optimizer step: iteration (0-based, from where stepping began), consumed samples before
    it, GBS, M."""

    iteration: int
    consumed_samples: int
    global_batch_size: int
    num_microbatches: int
    samples: int
    """MBS x DP x num_microbatches: what the step adds to consumed_samples."""


def table(
    schedule: Stages,
    micro_batch_size: int,
    data_parallel_size: int,
    seq_length: int | None = None,
    train_samples: int | None = None,
    lr: float | None = None,
    lr_base_batch_size: int | None = None,
    consumed_samples: int = 0,
) -> list[StageRow]:
    """One row per stage, stepping from ``consumed_samples`` as training does, in O(stages).

    In a stage of batch B (per step S = MBS x DP x (B // (MBS x DP))) entered at consumed c, the run
    takes ceil((end - c) / S) steps, end = min(next threshold, train_samples); the last one may
    overshoot the next threshold, so a stage starts at its first step's count, which can be past its
    threshold, and a stage can be skipped entirely (steps 0). A resumed run starts at the stage in
    force at ``consumed_samples``: stages already passed get steps 0 and are not held to today's MBS
    x DP. ``seq_length`` defaults to the schedule's own. ``lr`` and ``lr_base_batch_size`` add the
    linear and square-root hints. A schedule of more than :data:`TABLE_LIMIT` stages (a long ramp)
    has no table (UsageError). ``StepSchedule.table`` is this function.
    """
    mbs = require_positive_int("--micro-batch-size", micro_batch_size)
    dp = require_positive_int("--data-parallel-size", data_parallel_size)
    seq = (
        schedule.seq_length
        if seq_length is None
        else require_positive_int("--seq-length", seq_length)
    )
    if train_samples is not None:
        require_positive_int("--train-samples", train_samples)
    if lr_base_batch_size is not None:
        require_positive_int("--lr-base-batch-size", lr_base_batch_size)
    schedule.stage_index_at(consumed_samples)  # refuses a negative or non-integer count
    entries = schedule.entries
    if schedule.num_stages > TABLE_LIMIT:
        raise UsageError(
            f"the schedule has {schedule.num_stages:,} stages, more than the {TABLE_LIMIT:,} a "
            "table lists "
            f"({schedule.summary()}); its stages are described, not listed."
        )
    rows, consumed, iteration = [], consumed_samples, 0
    for index, stage in enumerate(entries):
        ends = [entries[index + 1].threshold_samples] if index + 1 < len(entries) else []
        ends += [train_samples] if train_samples is not None else []
        end = min(ends) if ends else None
        per_step = (stage.global_batch_size // (mbs * dp)) * mbs * dp
        used = consumed >= stage.threshold_samples and (end is None or consumed < end)
        if used and per_step == 0:
            raise zero_microbatch_error(stage, mbs, dp)
        steps = (None if end is None else -(-(end - consumed) // per_step)) if used else 0
        first = consumed if used else None
        first_step = iteration if used else None
        rows.append(
            _row(stage, mbs * dp, seq, first, first_step, steps, per_step, lr, lr_base_batch_size)
        )
        if steps:
            consumed, iteration = consumed + steps * per_step, iteration + steps
    return rows


def iter_steps(
    schedule: Stages,
    micro_batch_size: int,
    data_parallel_size: int,
    consumed_samples: int = 0,
    train_samples: int | None = None,
) -> Iterator[StepInfo]:
    """The steps training runs from ``consumed_samples`` on, until ``train_samples`` (or forever).

    Each step uses the stage in force at its start; consumed += MBS x DP x num_microbatches.
    ``StepSchedule.iter_steps`` is this function.
    """
    unit = require_positive_int("--micro-batch-size", micro_batch_size) * require_positive_int(
        "--data-parallel-size", data_parallel_size
    )
    consumed, iteration = consumed_samples, 0
    while train_samples is None or consumed < train_samples:
        batch = schedule.global_batch_size_at(consumed)
        samples = (batch // unit) * unit
        if samples == 0:
            stage = schedule.entries[schedule.stage_index_at(consumed)]
            raise zero_microbatch_error(stage, micro_batch_size, data_parallel_size)
        yield StepInfo(
            iteration=iteration,
            consumed_samples=consumed,
            global_batch_size=batch,
            num_microbatches=batch // unit,
            samples=samples,
        )
        consumed += samples
        iteration += 1


def run_totals(
    schedule: Stages,
    micro_batch_size: int,
    data_parallel_size: int,
    train_samples: int,
    consumed_samples: int = 0,
) -> tuple[int, int]:
    """(steps, samples) of a run from ``consumed_samples`` to ``--train-samples``: one more step
    while consumed < train_samples, as the table counts them, but visiting only the stages the run
    uses (each in closed form), so a long ramp costs its used stages, never more than upstream's own
    per-step loop.
    """
    unit = require_positive_int("--micro-batch-size", micro_batch_size) * require_positive_int(
        "--data-parallel-size", data_parallel_size
    )
    require_positive_int("--train-samples", train_samples)
    entries, consumed, steps = schedule.entries, consumed_samples, 0
    while consumed < train_samples:
        index = schedule.stage_index_at(consumed)
        per_step = entries[index].global_batch_size // unit * unit
        if per_step == 0:
            raise zero_microbatch_error(entries[index], micro_batch_size, data_parallel_size)
        last = index + 1 == schedule.num_stages
        end = train_samples if last else min(train_samples, entries[index + 1].threshold_samples)
        count = -(-(end - consumed) // per_step)
        consumed, steps = consumed + count * per_step, steps + count
    return steps, consumed - consumed_samples


def samples_after_steps(
    schedule: Stages, micro_batch_size: int, data_parallel_size: int, steps: int
) -> int:
    """Consumed samples after ``steps`` steps from 0 (``--train-iters``): each stage it passes in
    closed form, so a long ramp costs its used stages only."""
    unit = require_positive_int("--micro-batch-size", micro_batch_size) * require_positive_int(
        "--data-parallel-size", data_parallel_size
    )
    entries, consumed, left = schedule.entries, 0, steps
    while left > 0:
        index = schedule.stage_index_at(consumed)
        per_step = entries[index].global_batch_size // unit * unit
        if per_step == 0:
            raise zero_microbatch_error(entries[index], micro_batch_size, data_parallel_size)
        taken = left
        if index + 1 < schedule.num_stages:
            taken = min(left, -(-(entries[index + 1].threshold_samples - consumed) // per_step))
        consumed, left = consumed + taken * per_step, left - taken
    return consumed


def total_steps(rows: Sequence[StageRow]) -> int:
    """Steps over all rows of :meth:`StepSchedule.table` (open-ended rows count 0)."""
    return sum(row.steps or 0 for row in rows)


def total_samples(rows: Sequence[StageRow]) -> int:
    """Samples those steps consume (open-ended rows count 0)."""
    return sum(row.samples or 0 for row in rows)


def _row(
    stage: Stage,
    unit: int,
    seq: int | None,
    first: int | None,
    first_step: int | None,
    steps: int | None,
    per_step: int,
    lr: float | None,
    lr_base: int | None,
) -> StageRow:
    samples = None if steps is None else steps * per_step
    lr_linear = lr_sqrt = None
    if lr is not None and lr_base is not None:  # hints only: lr x (GBS / base) ** 1 or ** 1/2
        lr_linear = lr * lr_factor(stage.global_batch_size, lr_base, "linear")
        lr_sqrt = lr * lr_factor(stage.global_batch_size, lr_base, "sqrt")
    return StageRow(
        position=stage.position,
        entry=stage.spelling,
        threshold_samples=stage.threshold_samples,
        threshold_tokens=stage.threshold_tokens
        if stage.threshold_tokens is not None
        else (None if seq is None else stage.threshold_samples * seq),
        global_batch_size=stage.global_batch_size,
        num_microbatches=stage.global_batch_size // unit,
        first_sample=first,
        first_token=None if first is None or seq is None else first * seq,
        first_step=first_step,
        steps=steps,
        samples=samples,
        tokens=None if samples is None or seq is None else samples * seq,
        lr_linear=lr_linear,
        lr_sqrt=lr_sqrt,
    )
