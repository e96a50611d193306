"""The ``schedule`` command's stage table, as text or JSON: one row per stage, for a given schedule,
a converted rampup and a ``--suggest``-ed one alike (``core/schedule/tables.py`` computes the rows).

With ``--lr`` the rows add the hints lr x (GBS / --lr-base-batch-size) ** 1 (linear) and ** 1/2
(sqrt).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict

from megatron_ga_ext.cli.render import print_table
from megatron_ga_ext.core.schedule.step_schedule import (
    StageRow,
    StepSchedule,
    total_samples,
    total_steps,
)

__all__ = ["LR_NOTE", "print_stages", "stages_json"]

LR_NOTE = (
    "learning rates are hints only: the linear rule (Goyal et al.) holds only under its "
    "conditions (same other hyper-parameters, gradual warmup, not too early in training, "
    "below ~8k batch in their sweep); the square-root rule is another heuristic. Neither "
    "is a prescription; tune and watch the loss at each switch."
)

#: The table's columns: (heading, StageRow field).
_COLUMNS = [
    ("#", "position"),
    ("entry", "entry"),
    ("GBS", "global_batch_size"),
    ("micro-batches", "num_microbatches"),
    ("from sample", "threshold_samples"),
    ("first sample", "first_sample"),
    ("first token", "first_token"),
    ("first step", "first_step"),
    ("steps", "steps"),
    ("tokens", "tokens"),
]


def print_stages(
    rows: Sequence[StageRow],
    *,
    title: str,
    seq: int | None,
    train_samples: int | None,
    consumed: int = 0,
    demoted: Sequence[str] = (),
    header: Sequence[str] = (),
    lr: bool = False,
    bubble: Callable[[StageRow], float] | None = None,
    run_length: str | None = None,
) -> None:
    """``header``'s lines, the table of ``rows``, the run's length, notes on stages passed or
    skipped, and the schedule's warnings (on stderr). ``bubble`` adds each stage's pipeline bubble
    (PP > 1); ``run_length`` names the flag the run's length comes from (default ``--train-samples
    N``). ``schedule`` and ``check`` print their stage tables here."""
    for line in header:
        print(line)
    columns = [c for c in _COLUMNS if seq is not None or c[1] not in ("first_token", "tokens")]
    if seq is None:
        columns.append(("samples", "samples"))
    if lr:
        columns += [("lr linear (hint)", "lr_linear"), ("lr sqrt (hint)", "lr_sqrt")]
    table = [[getattr(row, key) for _, key in columns] for row in rows]
    headings = [c[0] for c in columns]
    if bubble is not None:
        headings.append("bubble")
        for cells, row in zip(table, rows):
            cells.append(bubble(row))
    print_table(title, headings, table)
    start = f" from --consumed-samples {consumed:,} to" if consumed else " for"
    if train_samples is not None:
        steps = total_steps(rows)
        end = consumed + total_samples(rows)
        tokens = f" = {end * seq:,} tokens" if seq is not None else ""
        length = run_length or f"--train-samples {train_samples:,}"
        print(f"{steps:,} steps{start} {length}; the last step ends at {end:,} samples{tokens}.")
    passed = [r.position for r in rows if r.first_sample is None and r.threshold_samples < consumed]
    if passed and any(r.first_sample is not None for r in rows):
        print(
            f"note: stage(s) {', '.join(map(str, passed))} already passed at --consumed-samples "
            f"{consumed:,}."
        )
    skipped = [
        r.position
        for r in rows
        if r.steps == 0
        and r.first_sample is None
        and r.threshold_samples > consumed
        and _before_end(r, rows)
    ]
    if skipped:
        print(
            f"note: stage(s) {', '.join(map(str, skipped))} are never used: a step overshoots "
            "past them."
        )
    if lr:
        print(f"note: {LR_NOTE}")
    for text in demoted:
        print(f"warning: {text}", file=sys.stderr)


def _before_end(row: StageRow, rows: Sequence[StageRow]) -> bool:
    """True if a later stage runs, so this stage was jumped over rather than left after the run's
    end."""
    return any(r.steps and r.position > row.position for r in rows)


def stages_json(
    args: argparse.Namespace,
    schedule: StepSchedule,
    rows: list[StageRow],
    mbs: int,
    dp: int,
    seq: int | None,
    train_samples: int | None,
    consumed: int,
    demoted: list[str],
) -> dict:
    """The schedule (its strings in samples and tokens), the layout, the run's length and the rows,
    as JSON."""
    return {
        "schedule": str(schedule),
        "schedule_samples": schedule.samples_string(),
        "schedule_tokens": schedule.to_string(seq_length=seq) if seq is not None else None,
        "thresholds_in": "tokens" if schedule.seq_length else "samples",
        "micro_batch_size": mbs,
        "data_parallel_size": dp,
        "seq_length": seq,
        "train_samples": train_samples,
        "consumed_samples": consumed,
        "iterations": total_steps(rows) if train_samples is not None else None,
        "samples_at_end": consumed + total_samples(rows) if train_samples is not None else None,
        "stages": [asdict(row) for row in rows],
        "warnings": demoted,
        "lr_note": LR_NOTE if args.lr is not None else None,
    }
