"""``megatron-ga schedule``: the table of a step batch-size schedule, or of a converted rampup.

    megatron-ga schedule "0:768 250B:1536 500B:3072" --micro-batch-size 4 --data-parallel-size 64 \\
        --seq-length 4096 --train-tokens 1T [--json] [--plot schedule.png] [--lr 3e-4 --lr-base-batch-size 768]
    megatron-ga schedule --from-rampup 16 8 300000 --global-batch-size 1024 --micro-batch-size 4 \\
        --data-parallel-size 2

Pure Python: no torch, no megatron; matplotlib is imported only for ``--plot``. The schedule is the options
layer's (``resolve_schedule``), as for ``check``, the calculator and a running job. Bad input raises a typed
error, which the CLI's one error path prints in one line (exit 2). A ramp of more than 10,000 stages is
summarised, not listed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from dataclasses import asdict

from megatron_ga_ext.cli.render import print_table
from megatron_ga_ext.config.resolve import ScheduleInputs, resolve_schedule
from megatron_ga_ext.core.rules import require_positive_int
from megatron_ga_ext.core.schedule.step_schedule import (
    FLAG,
    StageRow,
    StepSchedule,
    parse_count,
    total_samples,
    total_steps,
)
from megatron_ga_ext.core.schedule.tables import TABLE_LIMIT
from megatron_ga_ext.errors import ScheduleWarning, SizeError, UsageError

__all__ = ["configure_parser", "run", "plot_schedule"]

LR_NOTE = (
    "learning rates are hints only: the linear rule (Goyal et al.) holds only under its conditions (same other "
    "hyper-parameters, gradual warmup, not too early in training, below ~8k batch in their sweep); the square-root "
    "rule is another heuristic. Neither is a prescription; tune and watch the loss at each switch."
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``schedule`` command's arguments to ``parser``."""
    parser.add_argument("schedule", nargs="?", help=f'the {FLAG} value, e.g. "0:768 250B:1536 500B:3072"')
    parser.add_argument("--micro-batch-size", metavar="N", required=True)
    parser.add_argument("--data-parallel-size", metavar="N", required=True, help="world / (TP x PP x CP)")
    parser.add_argument("--seq-length", metavar="N",
                        help="tokens per sample; thresholds are then tokens, as pretrain_gpt reads them")
    parser.add_argument("--sample-thresholds", action="store_true",
                        help="with --seq-length, read thresholds as samples (a direct megatron-core caller)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--train-samples", metavar="N", help="run length in samples (suffixes K, M, B, T)")
    length.add_argument("--train-tokens", metavar="N", help="run length in tokens; needs --seq-length")
    parser.add_argument("--from-rampup", nargs=3, metavar=("START", "INCR", "SAMPLES"),
                        help="convert --rampup-batch-size START INCR SAMPLES (needs --global-batch-size)")
    parser.add_argument("--global-batch-size", metavar="N", help="the GBS a --from-rampup ramp ends at")
    parser.add_argument("--pipeline-model-parallel-size", metavar="N", default="1")
    parser.add_argument("--virtual-pipeline-model-parallel-size", metavar="N",
                        help="check each stage against the interleaved schedule's rule")
    parser.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", metavar="N")
    parser.add_argument("--consumed-samples", metavar="N", default="0",
                        help="start from this point (a resumed run); stages already passed are neither checked "
                             "nor run")
    parser.add_argument("--planned-data-parallel-sizes", nargs="+", metavar="N", default=[],
                        help="DP sizes the run will rescale to; stages not yet reached must suit them too")
    parser.add_argument("--warn-future-stages", action="store_true",
                        help="report problems of stages not yet reached as warnings (the run rescales first)")
    parser.add_argument("--lr", type=float, metavar="LR", help="learning rate at --lr-base-batch-size (for hints)")
    parser.add_argument("--lr-base-batch-size", metavar="N", help="the batch size --lr was tuned at")
    parser.add_argument("--json", action="store_true", help="print the schedule and its rows as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw GBS and num_microbatches against tokens")


def run(args: argparse.Namespace) -> int:
    """Print the table (or JSON) and draw the plot; 0 on success. Bad input raises a GAError."""
    return _run(args)



# -- the work ----------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    mbs = _count("--micro-batch-size", args.micro_batch_size)
    dp = _count("--data-parallel-size", args.data_parallel_size)
    seq = _count("--seq-length", args.seq_length) if args.seq_length is not None else None
    inputs = _inputs(args, mbs, dp, seq)
    schedule = resolve_schedule(inputs)
    assert schedule is not None, "a schedule or a converted ramp is always given"  # _inputs refuses neither
    train_samples = _train_samples(args, seq)
    base = _count("--lr-base-batch-size", args.lr_base_batch_size) if args.lr_base_batch_size else None
    if (args.lr is None) != (base is None):
        raise UsageError("--lr and --lr-base-batch-size go together: the hints scale --lr from the base batch size.")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr {args.lr} must be a positive finite number.")
    consumed = _count("--consumed-samples", args.consumed_samples, minimum=0)
    demoted = _validate(args, schedule, inputs, consumed)
    if schedule.num_stages > TABLE_LIMIT:
        return _summarise(args, schedule, demoted)
    rows = schedule.table(mbs, dp, seq_length=seq, train_samples=train_samples, lr=args.lr, lr_base_batch_size=base,
                          consumed_samples=consumed)
    if args.json:
        print(json.dumps(_as_json(args, schedule, rows, mbs, dp, seq, train_samples, consumed, demoted), indent=2))
    else:
        _print(args, schedule, rows, seq, train_samples, consumed, demoted)
    if args.plot:
        plot_schedule(rows, args.plot, seq_length=seq, train_samples=train_samples)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _count(flag: str, text: str, minimum: int = 1) -> int:
    """A whole number >= ``minimum`` (1 for sizes, 0 for counts), suffixes allowed."""
    value = parse_count(str(text), flag, signed=True)
    if value.denominator != 1:
        raise SizeError(f"{flag} {text!r} is not a whole number; give an integer >= {minimum}.")
    if minimum == 1:
        return require_positive_int(flag, int(value))
    if value < minimum:
        raise SizeError(f"{flag} {int(value)} must be at least {minimum}; give an integer >= {minimum}.")
    return int(value)


def _inputs(args: argparse.Namespace, mbs: int, dp: int, seq: int | None) -> ScheduleInputs:
    """The command's schedule (given, or --from-rampup converted) and layout, for options.resolve_schedule."""
    if args.sample_thresholds and args.from_rampup is not None:
        raise UsageError("--sample-thresholds applies to a given schedule, not --from-rampup: a converted ramp prints "
                         "both its sample and (with --seq-length) its token string. Drop --sample-thresholds.")
    if args.sample_thresholds and seq is None:
        raise UsageError("--sample-thresholds goes with --seq-length: without it thresholds are samples already. "
                         "Drop --sample-thresholds, or add --seq-length.")
    rampup, gbs = None, None
    if args.from_rampup is not None:
        if args.schedule is not None:
            raise UsageError(f"give either a schedule or --from-rampup, not both (got {args.schedule!r}).")
        if args.global_batch_size is None:
            raise UsageError("--from-rampup needs --global-batch-size: the batch size the ramp ends at.")
        start, increment = (_count(f"--from-rampup {n}", v) for n, v in zip(("START", "INCR"), args.from_rampup))
        rampup = (start, increment, _count("--from-rampup SAMPLES", args.from_rampup[2], minimum=0))
        gbs = _count("--global-batch-size", args.global_batch_size)
    elif args.schedule is None:
        raise UsageError('give a schedule, e.g. megatron-ga schedule "0:256 1M:512" ..., or --from-rampup.')
    elif args.global_batch_size is not None:
        raise UsageError(f"--global-batch-size goes with --from-rampup only; {FLAG} sets the batch sizes itself.")
    thresholds_in_tokens = seq is not None and not args.sample_thresholds
    group = args.microbatch_group_size_per_virtual_pipeline_stage
    return ScheduleInputs(
        step_batch_size_schedule=args.schedule, rampup_batch_size=rampup, global_batch_size=gbs,
        seq_length=seq if thresholds_in_tokens else None, convert_rampup=True, micro_batch_size=mbs,
        data_parallel_size=dp,
        pipeline_model_parallel_size=_count("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
        virtual_pipeline_model_parallel_size=_count("--virtual-pipeline-model-parallel-size",
                                                    args.virtual_pipeline_model_parallel_size)
        if args.virtual_pipeline_model_parallel_size else None,
        microbatch_group_size_per_vp_stage=_count("--microbatch-group-size-per-virtual-pipeline-stage", group)
        if group else None,
    )


def _train_samples(args: argparse.Namespace, seq: int | None) -> int | None:
    if args.train_samples is not None:
        return _count("--train-samples", args.train_samples)
    if args.train_tokens is None:
        return None
    if seq is None:
        raise UsageError("--train-tokens needs --seq-length to count samples; or give --train-samples.")
    tokens = _count("--train-tokens", args.train_tokens)
    return -(-tokens // seq)  # the run ends at the first step reaching the token count


def _validate(args: argparse.Namespace, schedule: StepSchedule, inputs: ScheduleInputs, consumed: int) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ScheduleWarning)
        demoted = schedule.validate(
            **inputs.layout(), consumed_samples=consumed,
            planned_data_parallel_sizes=[_count("--planned-data-parallel-sizes", d)
                                         for d in args.planned_data_parallel_sizes],
            strict_future=not args.warn_future_stages,
        )
    return [str(p.error) for p in demoted]


def _summarise(args: argparse.Namespace, schedule: StepSchedule, demoted: list[str]) -> int:
    """A schedule of more than TABLE_LIMIT stages (a long ramp): described, not listed."""
    if args.plot:
        raise UsageError(f"--plot draws a table of stages; this schedule has {schedule.num_stages:,}, more than "
                         f"the {TABLE_LIMIT:,} listed.")
    note = (f"{schedule.num_stages:,} stages: too many to list or to write as {FLAG}; run the ramp with "
            f"--ga-convert-rampup. Every stage is checked (in closed form) against the layout.")
    if args.json:
        print(json.dumps({"schedule": None, "summary": schedule.summary(), "stages_count": schedule.num_stages,
                          "stages": None, "note": note, "warnings": demoted}, indent=2))
    else:
        print(f"{_source(args)} is this step schedule: {schedule.summary()}")
        print(f"  {note}")
        for text in demoted:
            print(f"warning: {text}", file=sys.stderr)
    return 0


def _source(args: argparse.Namespace) -> str:
    start, increment, ramp = args.from_rampup
    return f"--rampup-batch-size {start} {increment} {ramp} --global-batch-size {args.global_batch_size}"


# -- output ------------------------------------------------------------------------------------


def _header(args: argparse.Namespace, schedule: StepSchedule, seq: int | None) -> list[str]:
    lines = []
    if args.from_rampup is not None:
        lines.append(f"{_source(args)} is this step schedule ({schedule.num_stages} stages):")
        if seq is not None:
            lines.append(f"  pretrain_gpt (thresholds in tokens, --seq-length {seq}):")
            lines.append(f'    {FLAG} "{schedule.to_string(seq_length=seq)}"')
            lines.append("  megatron-core callers passing seq_length=None (thresholds in samples):")
        else:
            lines.append("  thresholds in samples, for megatron-core callers passing seq_length=None; pretrain_gpt "
                         "reads thresholds as tokens: add --seq-length for its string:")
        lines.append(f'    {FLAG} "{schedule.samples_string()}"')
    else:
        unit = f"tokens, --seq-length {schedule.seq_length}" if schedule.seq_length else "samples"
        lines.append(f'{FLAG} "{schedule}" (thresholds in {unit})')
    return lines


_COLUMNS = [
    ("#", "position"), ("entry", "entry"), ("GBS", "global_batch_size"), ("micro-batches", "num_microbatches"),
    ("from sample", "threshold_samples"), ("first sample", "first_sample"), ("first token", "first_token"),
    ("first step", "first_step"), ("steps", "steps"), ("tokens", "tokens"),
]


def _print(
    args: argparse.Namespace,
    schedule: StepSchedule,
    rows: list[StageRow],
    seq: int | None,
    train_samples: int | None,
    consumed: int,
    demoted: list[str],
) -> None:
    for line in _header(args, schedule, seq):
        print(line)
    columns = [c for c in _COLUMNS if seq is not None or c[1] not in ("first_token", "tokens")]
    if seq is None:
        columns.append(("samples", "samples"))
    if args.lr is not None:
        columns += [("lr linear (hint)", "lr_linear"), ("lr sqrt (hint)", "lr_sqrt")]
    table = [[getattr(row, key) for _, key in columns] for row in rows]
    title = f"stages for MBS {args.micro_batch_size} x DP {args.data_parallel_size}"
    print_table(title, [c[0] for c in columns], table)
    start = f" from --consumed-samples {consumed:,} to" if consumed else " for"
    if train_samples is not None:
        steps = total_steps(rows)
        end = consumed + total_samples(rows)
        tokens = f" = {end * seq:,} tokens" if seq is not None else ""
        print(f"{steps:,} steps{start} --train-samples {train_samples:,}; the last step ends at {end:,} "
              f"samples{tokens}.")
    passed = [r.position for r in rows if r.first_sample is None and r.threshold_samples < consumed]
    if passed and any(r.first_sample is not None for r in rows):
        print(f"note: stage(s) {', '.join(map(str, passed))} already passed at --consumed-samples {consumed:,}.")
    skipped = [r.position for r in rows if r.steps == 0 and r.first_sample is None and r.threshold_samples > consumed
               and _before_end(r, rows)]
    if skipped:
        print(f"note: stage(s) {', '.join(map(str, skipped))} are never used: a step overshoots past them.")
    if args.lr is not None:
        print(f"note: {LR_NOTE}")
    for text in demoted:
        print(f"warning: {text}", file=sys.stderr)


def _before_end(row: StageRow, rows: list[StageRow]) -> bool:
    """True if a later stage runs, so this stage was jumped over rather than left after the run's end."""
    return any(r.steps and r.position > row.position for r in rows)


def _as_json(
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


def plot_schedule(
    rows: list[StageRow], path: str, seq_length: int | None = None, train_samples: int | None = None
) -> None:
    """Draw GBS and num_microbatches (steps) against tokens, or samples without a seq_length, to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'megatron-ga-ext[plot]'.") from None
    scale = seq_length or 1
    used = [r for r in rows if r.first_sample is not None] or rows[:1]
    xs = [(r.first_sample if r.first_sample is not None else r.threshold_samples) * scale for r in used]
    last = used[-1]
    end = train_samples or (last.first_sample or last.threshold_samples) * 1.25 or 1
    end_x = max(end * scale, xs[-1] + 1)
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5), dpi=100)
    top.step(xs + [end_x], [r.global_batch_size for r in used] + [last.global_batch_size], where="post", color="C0")
    top.set_ylabel("global batch size")
    bottom.step(xs + [end_x], [r.num_microbatches for r in used] + [last.num_microbatches], where="post", color="C1")
    bottom.set_ylabel("num_microbatches")
    bottom.set_xlabel("tokens consumed" if seq_length else "samples consumed")
    for axis in (top, bottom):
        axis.grid(True, alpha=0.3)
    top.set_title("step batch-size schedule")
    figure.tight_layout()
    try:
        figure.savefig(path)
    except OSError as error:
        raise UsageError(f"--plot {path}: cannot write the figure ({error.strerror or error}).") from None
    finally:
        plt.close(figure)

