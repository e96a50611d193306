"""``megatron-ga schedule``: the table of a step batch-size schedule, or of a converted rampup.

    megatron-ga schedule "0:768 250B:1536 500B:3072" --micro-batch-size 4 --data-parallel-size 64 \\
        --seq-length 4096 --train-tokens 1T [--json] [--plot schedule.png] [--lr 3e-4
        --lr-base-batch-size 768]
    megatron-ga schedule --from-rampup 16 8 300000 --global-batch-size 1024 --micro-batch-size 4 \\
        --data-parallel-size 2
    megatron-ga schedule --suggest trace.json --micro-batch-size 2 --data-parallel-size 64 \\
        --max-global-batch-size 8192 [--global-batch-size 128] [--trust 1.5] [--lr-warmup-samples
        2M] \\ [--lr-decay-samples 100M --lr-wsd-decay-samples 20M] [--plot suggest.png]

This module holds the parser and the table of a given or converted schedule; ``--suggest`` (a
schedule from a measured noise-scale trace) is science/cli/suggest.py, the stage table's text and
JSON cli/stage_table.py, ``--plot`` cli/plots.py, the numbers' checks cli/schedule_args.py. Pure
Python: no torch, no megatron; matplotlib is imported only for ``--plot``. The schedule is the
config layer's (``resolve_schedule``), as for ``check``, the calculator and a running job. Bad input
raises a typed error, which the CLI's one error path prints in one line (exit 2). A ramp of more
than 10,000 stages is summarised, not listed.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from megatron_ga_ext.cli import plots
from megatron_ga_ext.cli.schedule_args import count, lr_hints, run_length
from megatron_ga_ext.cli.stage_table import print_stages, stages_json
from megatron_ga_ext.config.resolve import ScheduleInputs, resolve_schedule
from megatron_ga_ext.core.schedule.step_schedule import FLAG, StepSchedule
from megatron_ga_ext.core.schedule.tables import TABLE_LIMIT
from megatron_ga_ext.errors import ScheduleWarning, UsageError

__all__ = ["SUGGEST_ONLY", "configure_parser", "run"]

#: The flags that only ``--suggest`` reads: (dest, flag).
SUGGEST_ONLY = (
    ("max_global_batch_size", "--max-global-batch-size"),
    ("trust", "--trust"),
    ("lr_warmup_samples", "--lr-warmup-samples"),
    ("lr_decay_samples", "--lr-decay-samples"),
    ("lr_wsd_decay_samples", "--lr-wsd-decay-samples"),
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``schedule`` command's arguments to ``parser``."""
    parser.add_argument(
        "schedule", nargs="?", help=f'the {FLAG} value, e.g. "0:768 250B:1536 500B:3072"'
    )
    parser.add_argument("--micro-batch-size", metavar="N", required=True)
    parser.add_argument(
        "--data-parallel-size", metavar="N", required=True, help="world / (TP x PP x CP)"
    )
    parser.add_argument(
        "--seq-length",
        metavar="N",
        help="tokens per sample; thresholds are then tokens, as pretrain_gpt reads them",
    )
    parser.add_argument(
        "--sample-thresholds",
        action="store_true",
        help="with --seq-length, read thresholds as samples (a direct megatron-core caller)",
    )
    length = parser.add_mutually_exclusive_group()
    length.add_argument(
        "--train-samples", metavar="N", help="run length in samples (suffixes K, M, B, T)"
    )
    length.add_argument(
        "--train-tokens", metavar="N", help="run length in tokens; needs --seq-length"
    )
    parser.add_argument(
        "--from-rampup",
        nargs=3,
        metavar=("START", "INCR", "SAMPLES"),
        help="convert --rampup-batch-size START INCR SAMPLES (needs --global-batch-size)",
    )
    parser.add_argument(
        "--global-batch-size",
        metavar="N",
        help="the GBS a --from-rampup ramp ends at; with --suggest, the first stage (default MBS "
        "x DP)",
    )
    parser.add_argument("--pipeline-model-parallel-size", metavar="N", default="1")
    parser.add_argument(
        "--virtual-pipeline-model-parallel-size",
        metavar="N",
        help="check each stage against the interleaved schedule's rule",
    )
    parser.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", metavar="N")
    parser.add_argument(
        "--consumed-samples",
        metavar="N",
        default="0",
        help="start from this point (a resumed run); stages already passed are neither checked "
        "nor run",
    )
    parser.add_argument(
        "--planned-data-parallel-sizes",
        nargs="+",
        metavar="N",
        default=[],
        help="DP sizes the run will rescale to; stages not yet reached must suit them too",
    )
    parser.add_argument(
        "--warn-future-stages",
        action="store_true",
        help="report problems of stages not yet reached as warnings (the run rescales first)",
    )
    parser.add_argument(
        "--lr", type=float, metavar="LR", help="learning rate at --lr-base-batch-size (for hints)"
    )
    parser.add_argument(
        "--lr-base-batch-size", metavar="N", help="the batch size --lr was tuned at"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the schedule and its rows as JSON"
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw GBS and num_microbatches against tokens (with --suggest: the measured trace "
        "against the schedule)",
    )
    suggest = parser.add_argument_group(
        "--suggest: a schedule from a measured critical batch (docs/noise-scale.md)"
    )
    suggest.add_argument(
        "--suggest",
        metavar="TRACE",
        help="a noise-scale trace (JSON or JSON Lines rows of consumed_samples and "
        "b_simple_samples), "
        "a --ga-noise-scale run's log or its --tensorboard-dir: print the schedule that doubles "
        "GBS where trust x B_simple passes 2 x GBS",
    )
    suggest.add_argument(
        "--max-global-batch-size", metavar="N", help="the cap: GBS doubles only while 2 x GBS <= N"
    )
    suggest.add_argument(
        "--trust",
        metavar="F",
        help="multiply the measured B_simple by F before comparing (default 1: the estimate as "
        "it is; on the real-text sweep of docs/noise-scale.md B_simple ran 1.8-2.5x above the "
        "measured critical batch, B_crit / B_simple 0.48: the 18 runs of the fit, GBS 4-128; a "
        "129k-parameter byte-level GPT at 4-12 tokens per parameter, targets 2.93-2.52 "
        "nats/byte around a byte-bigram model's 2.64)",
    )
    suggest.add_argument(
        "--lr-warmup-samples", metavar="N", help="no change before N consumed samples"
    )
    suggest.add_argument(
        "--lr-decay-samples",
        metavar="N",
        help="where the LR decay ends (with --lr-wsd-decay-samples)",
    )
    suggest.add_argument(
        "--lr-wsd-decay-samples",
        metavar="N",
        help="the final decay's length: no change from --lr-decay-samples - N on",
    )


def run(args: argparse.Namespace) -> int:
    """Print the table (or JSON) and draw the plot; 0 on success. Bad input raises a GAError."""
    if args.suggest is not None:  # the batch-size science (science/), loaded only for --suggest
        from megatron_ga_ext.science.cli.suggest import run_suggest

        return run_suggest(args)
    for dest, flag in SUGGEST_ONLY:
        if getattr(args, dest) is not None:
            raise UsageError(
                f"{flag} goes with --suggest TRACE.json; without it there is no trace to follow."
            )
    mbs = count("--micro-batch-size", args.micro_batch_size)
    dp = count("--data-parallel-size", args.data_parallel_size)
    seq = count("--seq-length", args.seq_length) if args.seq_length is not None else None
    inputs = _inputs(args, mbs, dp, seq)
    schedule = resolve_schedule(inputs)
    if schedule is None:  # _inputs refuses a command without a schedule or a ramp first
        raise UsageError(
            "give --step-batch-size-schedule, or --rampup-batch-size with --global-batch-size."
        )
    train_samples = run_length(args, seq)
    lr, base = lr_hints(args)
    consumed = count("--consumed-samples", args.consumed_samples, minimum=0)
    demoted = _validate(args, schedule, inputs, consumed)
    if schedule.num_stages > TABLE_LIMIT:
        return _summarise(args, schedule, demoted)
    rows = schedule.table(
        mbs,
        dp,
        seq_length=seq,
        train_samples=train_samples,
        lr=lr,
        lr_base_batch_size=base,
        consumed_samples=consumed,
    )
    if args.json:
        print(
            json.dumps(
                stages_json(args, schedule, rows, mbs, dp, seq, train_samples, consumed, demoted),
                indent=2,
            )
        )
    else:
        pp, vpp = (
            inputs.pipeline_model_parallel_size,
            inputs.virtual_pipeline_model_parallel_size or 1,
        )
        print_stages(
            rows,
            title=f"stages for MBS {args.micro_batch_size} x DP {args.data_parallel_size}",
            seq=seq,
            train_samples=train_samples,
            consumed=consumed,
            demoted=demoted,
            header=_header(args, schedule, seq),
            lr=args.lr is not None,
            bubble=(lambda r: (pp - 1) / (vpp * r.num_microbatches + pp - 1)) if pp > 1 else None,
        )
    if args.plot:
        plots.plot_schedule(
            rows,
            args.plot,
            seq_length=seq,
            train_samples=train_samples,
            micro_batch_size=mbs,
            data_parallel_size=dp,
        )
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _inputs(args: argparse.Namespace, mbs: int, dp: int, seq: int | None) -> ScheduleInputs:
    """The command's schedule (given, or --from-rampup converted) and layout, for
    options.resolve_schedule."""
    if args.sample_thresholds and args.from_rampup is not None:
        raise UsageError(
            "--sample-thresholds applies to a given schedule, not --from-rampup: a converted "
            "ramp prints both its sample and (with --seq-length) its token string. Drop "
            "--sample-thresholds."
        )
    if args.sample_thresholds and seq is None:
        raise UsageError(
            "--sample-thresholds goes with --seq-length: without it thresholds are samples "
            "already. Drop --sample-thresholds, or add --seq-length."
        )
    rampup, gbs = None, None
    if args.from_rampup is not None:
        if args.schedule is not None:
            raise UsageError(
                f"give either a schedule or --from-rampup, not both (got {args.schedule!r})."
            )
        if args.global_batch_size is None:
            raise UsageError(
                "--from-rampup needs --global-batch-size: the batch size the ramp ends at."
            )
        start, increment = (
            count(f"--from-rampup {n}", v) for n, v in zip(("START", "INCR"), args.from_rampup)
        )
        rampup = (start, increment, count("--from-rampup SAMPLES", args.from_rampup[2], minimum=0))
        gbs = count("--global-batch-size", args.global_batch_size)
    elif args.schedule is None:
        raise UsageError(
            'give a schedule, e.g. megatron-ga schedule "0:256 1M:512" ..., or --from-rampup.'
        )
    elif args.global_batch_size is not None:
        raise UsageError(
            f"--global-batch-size goes with --from-rampup only; {FLAG} sets the batch sizes itself."
        )
    thresholds_in_tokens = seq is not None and not args.sample_thresholds
    group = args.microbatch_group_size_per_virtual_pipeline_stage
    return ScheduleInputs(
        step_batch_size_schedule=args.schedule,
        rampup_batch_size=rampup,
        global_batch_size=gbs,
        seq_length=seq if thresholds_in_tokens else None,
        convert_rampup=True,
        micro_batch_size=mbs,
        data_parallel_size=dp,
        pipeline_model_parallel_size=count(
            "--pipeline-model-parallel-size", args.pipeline_model_parallel_size
        ),
        virtual_pipeline_model_parallel_size=count(
            "--virtual-pipeline-model-parallel-size", args.virtual_pipeline_model_parallel_size
        )
        if args.virtual_pipeline_model_parallel_size
        else None,
        microbatch_group_size_per_vp_stage=count(
            "--microbatch-group-size-per-virtual-pipeline-stage", group
        )
        if group
        else None,
    )


def _validate(
    args: argparse.Namespace, schedule: StepSchedule, inputs: ScheduleInputs, consumed: int
) -> list[str]:
    """Raise the schedule's first broken rule on the command's layout; the problems demoted to
    warnings (--warn-future-stages), as text."""
    mbs, dp = inputs.micro_batch_size, inputs.data_parallel_size
    if mbs is None or dp is None:  # _inputs counts both from the command's flags
        raise UsageError("give --micro-batch-size and --data-parallel-size.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ScheduleWarning)
        demoted = schedule.validate(
            micro_batch_size=mbs,
            data_parallel_size=dp,
            pipeline_model_parallel_size=inputs.pipeline_model_parallel_size,
            virtual_pipeline_size=inputs.virtual_pipeline_model_parallel_size,
            microbatch_group_size_per_vp_stage=inputs.microbatch_group_size_per_vp_stage,
            consumed_samples=consumed,
            planned_data_parallel_sizes=[
                count("--planned-data-parallel-sizes", d) for d in args.planned_data_parallel_sizes
            ],
            strict_future=not args.warn_future_stages,
        )
    return [str(p.error) for p in demoted]


def _summarise(args: argparse.Namespace, schedule: StepSchedule, demoted: list[str]) -> int:
    """A schedule of more than TABLE_LIMIT stages (a long ramp): described, not listed."""
    if args.plot:
        raise UsageError(
            f"--plot draws a table of stages; this schedule has {schedule.num_stages:,}, more "
            f"than the {TABLE_LIMIT:,} listed."
        )
    note = (
        f"{schedule.num_stages:,} stages: too many to list or to write as {FLAG}; run the ramp "
        "with "
        f"--ga-convert-rampup. Every stage is checked (in closed form) against the layout."
    )
    if args.json:
        print(
            json.dumps(
                {
                    "schedule": None,
                    "summary": schedule.summary(),
                    "stages_count": schedule.num_stages,
                    "stages": None,
                    "note": note,
                    "warnings": demoted,
                },
                indent=2,
            )
        )
    else:
        print(f"{_source(args)} is this step schedule: {schedule.summary()}")
        print(f"  {note}")
        for text in demoted:
            print(f"warning: {text}", file=sys.stderr)
    return 0


def _source(args: argparse.Namespace) -> str:
    start, increment, ramp = args.from_rampup
    return (
        f"--rampup-batch-size {start} {increment} {ramp} --global-batch-size "
        f"{args.global_batch_size}"
    )


def _header(args: argparse.Namespace, schedule: StepSchedule, seq: int | None) -> list[str]:
    lines = []
    if args.from_rampup is not None:
        lines.append(f"{_source(args)} is this step schedule ({schedule.num_stages} stages):")
        if seq is not None:
            lines.append(f"  pretrain_gpt (thresholds in tokens, --seq-length {seq}):")
            lines.append(f'    {FLAG} "{schedule.to_string(seq_length=seq)}"')
            lines.append("  megatron-core callers passing seq_length=None (thresholds in samples):")
        else:
            lines.append(
                "  thresholds in samples, for megatron-core callers passing seq_length=None; "
                "pretrain_gpt reads thresholds as tokens: add --seq-length for its "
                "string:"
            )
        lines.append(f'    {FLAG} "{schedule.samples_string()}"')
    else:
        unit = f"tokens, --seq-length {schedule.seq_length}" if schedule.seq_length else "samples"
        lines.append(f'{FLAG} "{schedule}" (thresholds in {unit})')
    return lines
