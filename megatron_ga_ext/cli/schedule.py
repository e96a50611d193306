"""``megatron-ga schedule``: the table of a step batch-size schedule, or of a converted rampup.

    megatron-ga schedule "0:768 250B:1536 500B:3072" --micro-batch-size 4 --data-parallel-size 64 \\
        --seq-length 4096 --train-tokens 1T [--json] [--plot schedule.png] [--lr 3e-4 --lr-base-batch-size 768]
    megatron-ga schedule --from-rampup 16 8 300000 --global-batch-size 1024 --micro-batch-size 4 \\
        --data-parallel-size 2
    megatron-ga schedule --suggest trace.json --micro-batch-size 2 --data-parallel-size 64 \\
        --max-global-batch-size 8192 [--global-batch-size 128] [--trust 1.5] [--lr-warmup-samples 2M] \\
        [--lr-decay-samples 100M --lr-wsd-decay-samples 20M] [--plot suggest.png]

``--suggest`` reads a measured noise-scale trace (the ``--ga-noise-scale-trace`` file, a run's log or its TensorBoard
directory) and prints the schedule the doubling rule gives
(``core/schedule/suggest.py``; docs/noise-scale.md). Pure Python: no torch, no megatron; matplotlib is imported
only for ``--plot``. The schedule is the options
layer's (``resolve_schedule``), as for ``check``, the calculator and a running job. Bad input raises a typed
error, which the CLI's one error path prints in one line (exit 2). A ramp of more than 10,000 stages is
summarised, not listed.
"""

from __future__ import annotations

import argparse
import codecs
import json
import math
import os
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
from megatron_ga_ext.core.schedule.suggest import (
    DoublingRule,
    Frozen,
    Suggestion,
    TraceRow,
    parse_trace,
    read_log,
    read_trace,
    suggest_schedule,
)
from megatron_ga_ext.core.schedule.tables import TABLE_LIMIT
from megatron_ga_ext.errors import ScheduleWarning, SizeError, UsageError

__all__ = ["configure_parser", "run", "plot_schedule", "plot_suggestion"]

#: The flags that only ``--suggest`` reads: (dest, flag).
SUGGEST_ONLY = (("max_global_batch_size", "--max-global-batch-size"), ("trust", "--trust"),
                ("lr_warmup_samples", "--lr-warmup-samples"), ("lr_decay_samples", "--lr-decay-samples"),
                ("lr_wsd_decay_samples", "--lr-wsd-decay-samples"))

#: The largest trace file read (a row per step of a million-step run is about 100 MB).
MAX_TRACE_BYTES = 256 * 2**20

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
    parser.add_argument("--global-batch-size", metavar="N",
                        help="the GBS a --from-rampup ramp ends at; with --suggest, the first stage (default MBS x DP)")
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
    parser.add_argument("--plot", metavar="FILE.png", help="draw GBS and num_microbatches against tokens (with "
                                                           "--suggest: the measured trace against the schedule)")
    suggest = parser.add_argument_group("--suggest: a schedule from a measured critical batch (docs/noise-scale.md)")
    suggest.add_argument("--suggest", metavar="TRACE",
                         help="a noise-scale trace (JSON or JSON Lines rows of consumed_samples and b_simple_samples), "
                              "a --ga-noise-scale run's log or its --tensorboard-dir: print the schedule that doubles "
                              "GBS where trust x B_simple passes 2 x GBS")
    suggest.add_argument("--max-global-batch-size", metavar="N", help="the cap: GBS doubles only while 2 x GBS <= N")
    suggest.add_argument("--trust", metavar="F", help="multiply the measured B_simple by F before comparing "
                                                      "(default 1; Merrill et al. 2025 found B_simple below the "
                                                      "critical batch)")
    suggest.add_argument("--lr-warmup-samples", metavar="N", help="no change before N consumed samples")
    suggest.add_argument("--lr-decay-samples", metavar="N", help="where the LR decay ends (with "
                                                                 "--lr-wsd-decay-samples)")
    suggest.add_argument("--lr-wsd-decay-samples", metavar="N",
                         help="the final decay's length: no change from --lr-decay-samples - N on")


def run(args: argparse.Namespace) -> int:
    """Print the table (or JSON) and draw the plot; 0 on success. Bad input raises a GAError."""
    return _run(args)



# -- the work ----------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    if args.suggest is not None:
        return _run_suggest(args)
    for dest, flag in SUGGEST_ONLY:
        if getattr(args, dest) is not None:
            raise UsageError(f"{flag} goes with --suggest TRACE.json; without it there is no trace to follow.")
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


# -- suggest -----------------------------------------------------------------------------------


def _run_suggest(args: argparse.Namespace) -> int:
    """``--suggest TRACE``: the doubling rule's schedule, its doublings, its table, and the plot."""
    if args.schedule is not None or args.from_rampup is not None:
        raise UsageError("--suggest writes the schedule itself: give --suggest TRACE.json without a schedule or "
                         "--from-rampup.")
    unread = [flag for flag, given in (("--sample-thresholds", args.sample_thresholds),
                                       ("--consumed-samples", args.consumed_samples != "0"),
                                       ("--planned-data-parallel-sizes", bool(args.planned_data_parallel_sizes)),
                                       ("--warn-future-stages", args.warn_future_stages)) if given]
    if unread:
        raise UsageError(f"{', '.join(unread)} do(es) not apply to --suggest: the suggested schedule starts at 0 "
                         "and is held to today's layout. Leave it out, or run the printed schedule through "
                         "megatron-ga schedule with it.")
    mbs = _count("--micro-batch-size", args.micro_batch_size)
    dp = _count("--data-parallel-size", args.data_parallel_size)
    seq = _count("--seq-length", args.seq_length) if args.seq_length is not None else None
    rule = _rule(args, mbs, dp)  # the flags first: a bad one fails before a long trace is read
    trace = _read_source(args.suggest, seq)
    suggestion = suggest_schedule(trace, rule)
    schedule = suggestion.schedule
    _validate_suggested(args, schedule, mbs, dp)
    train_samples = _train_samples(args, seq)
    base = _count("--lr-base-batch-size", args.lr_base_batch_size) if args.lr_base_batch_size else None
    if (args.lr is None) != (base is None):
        raise UsageError("--lr and --lr-base-batch-size go together: the hints scale --lr from the base batch size.")
    rows = schedule.table(mbs, dp, seq_length=seq, train_samples=train_samples, lr=args.lr, lr_base_batch_size=base)
    if args.json:
        data = _as_json(args, schedule, rows, mbs, dp, seq, train_samples, 0, [])
        data.update(_suggestion_json(args, trace, rule, suggestion))
        print(json.dumps(data, indent=2))
    else:
        _print(args, schedule, rows, seq, train_samples, 0, [], header=_suggest_header(args, trace, rule, schedule,
                                                                                        seq))
        _print_decisions(suggestion)
    if args.plot:
        plot_suggestion(trace, suggestion, rule, args.plot, seq_length=seq, train_samples=train_samples)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _validate_suggested(args: argparse.Namespace, schedule: StepSchedule, mbs: int, dp: int) -> None:
    """Doubling keeps MBS x DP dividing every stage, not the interleaved rule: hold it to the whole layout."""
    vpp, group = args.virtual_pipeline_model_parallel_size, args.microbatch_group_size_per_virtual_pipeline_stage
    schedule.validate(
        mbs, dp, _count("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
        _count("--virtual-pipeline-model-parallel-size", vpp) if vpp else None,
        microbatch_group_size_per_vp_stage=_count("--microbatch-group-size-per-virtual-pipeline-stage", group)
        if group else None,
    )


def _read_source(path: str, seq: int | None) -> list[TraceRow]:
    """``--suggest``'s source: a TensorBoard directory (the run's ``--tensorboard-dir``), a JSON or JSON Lines trace
    (``--ga-noise-scale-trace``), else a Megatron-LM run's log, read line by line."""
    if os.path.isdir(path):
        return _tensorboard_trace(path)
    text = _trace_text(path, limit=4096)
    if text.lstrip()[:1] in ("[", "{"):
        return read_trace(_trace_text(path), tokens_per_sample=seq)
    with open(path, encoding="utf-8", errors="replace") as handle:
        return read_log(handle)


def _tensorboard_trace(directory: str) -> list[TraceRow]:
    """Rows from the noise-scale/b-simple-samples and noise-scale/consumed-samples scalars of a run's TensorBoard
    event files (the later value of a step logged twice, as by a resumed run). TensorBoard keeps float32: consumed
    samples past 2**24 come back rounded to 7 digits (the trace file keeps them exact)."""
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError:
        raise UsageError(f"--suggest {directory}: reading TensorBoard event files needs the tensorboard package (pip "
                         "install tensorboard); or give the run's --ga-noise-scale-trace file.") from None
    accumulator = event_accumulator.EventAccumulator(directory, size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    wanted = ("noise-scale/consumed-samples", "noise-scale/b-simple-samples")
    if not set(wanted) <= tags:
        raise UsageError(f"--suggest {directory}: no {' and '.join(t for t in wanted if t not in tags)} scalars in "
                         "its event files; give the --tensorboard-dir of a run with --ga-noise-scale K.")
    consumed = {event.step: round(event.value) for event in accumulator.Scalars(wanted[0])}
    estimates = {event.step: event.value for event in accumulator.Scalars(wanted[1])}
    return parse_trace([{"iteration": step, "consumed_samples": consumed[step],
                         "b_simple_samples": estimates.get(step)} for step in sorted(consumed)])


def _trace_text(path: str, limit: int | None = None) -> str:
    """The file's text; with ``limit``, its first ``limit`` bytes (a character they cut is left out)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read((limit or MAX_TRACE_BYTES) + 1)
    except OSError as error:
        raise UsageError(f"--suggest {path}: cannot read the trace ({error.strerror or error}).") from None
    if limit is None and len(data) > MAX_TRACE_BYTES:
        raise UsageError(f"--suggest {path}: the trace is over {MAX_TRACE_BYTES // 2**20} MiB; measure less often "
                         "or keep every k-th row.")
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(data[:limit] if limit else data, final=limit is None)
    except UnicodeDecodeError as error:
        raise UsageError(f"--suggest {path}: not UTF-8 text at byte {error.start}; give the JSON trace.") from None


def _rule(args: argparse.Namespace, mbs: int, dp: int) -> DoublingRule:
    if args.max_global_batch_size is None:
        raise UsageError("--suggest needs --max-global-batch-size: the largest batch the run may reach (memory, "
                         "the data, or where the loss stops improving per sample).")
    return DoublingRule(
        micro_batch_size=mbs, data_parallel_size=dp,
        max_global_batch_size=_count("--max-global-batch-size", args.max_global_batch_size),
        initial_global_batch_size=_count("--global-batch-size", args.global_batch_size)
        if args.global_batch_size is not None else None,
        trust=_trust(args.trust), frozen=_frozen(args),
    )


def _trust(text: str | None) -> float:
    if text is None:
        return 1.0
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"--trust {text!r} is not a number; give a positive factor, e.g. 1 or 1.5.") from None


def _frozen(args: argparse.Namespace) -> tuple[Frozen, ...]:
    """The LR warmup [0, W) and WSD's final decay [D - F, end): no stage may start in them."""
    frozen = []
    if args.lr_warmup_samples is not None:
        warmup = _count("--lr-warmup-samples", args.lr_warmup_samples, minimum=0)
        if warmup:
            frozen.append(Frozen(label=f"the LR warmup (--lr-warmup-samples {warmup:,})", start=0, end=warmup))
    decay, final = args.lr_decay_samples, args.lr_wsd_decay_samples
    if (decay is None) != (final is None):
        raise UsageError("--lr-decay-samples and --lr-wsd-decay-samples go together: the final decay runs from "
                         "--lr-decay-samples - --lr-wsd-decay-samples to --lr-decay-samples (WSD). A cosine or "
                         "linear decay spans the whole run after warmup: leave both out.")
    if decay is not None:
        end, length = _count("--lr-decay-samples", decay), _count("--lr-wsd-decay-samples", final)
        if length > end:
            raise UsageError(f"--lr-wsd-decay-samples {length:,} is longer than --lr-decay-samples {end:,}: the "
                             "final decay must fit inside the decay.")
        frozen.append(Frozen(label=f"the final decay (from {end - length:,} samples)", start=end - length, end=None))
    return tuple(frozen)


def _suggest_header(args: argparse.Namespace, trace: list[TraceRow], rule: DoublingRule, schedule: StepSchedule,
                    seq: int | None) -> list[str]:
    lines = [f"suggested from {args.suggest} ({len(trace):,} rows; trust {rule.trust:g}; first GBS "
             f"{rule.first_global_batch_size:,}; cap {rule.max_global_batch_size:,}):"]
    if seq is not None:
        lines.append(f"  pretrain_gpt (thresholds in tokens, --seq-length {seq}):")
        lines.append(f'    {FLAG} "{schedule.to_string(seq_length=seq)}"')
        lines.append("  megatron-core callers passing seq_length=None (thresholds in samples):")
    else:
        lines.append("  thresholds in samples; pretrain_gpt reads tokens: add --seq-length for its string:")
    lines.append(f'    {FLAG} "{schedule.samples_string()}"')
    return lines


def _print_decisions(suggestion: Suggestion) -> None:
    rows = [[d.row.position, d.row.iteration, d.row.consumed_samples, d.row.b_simple_samples, d.trusted,
             f"{d.before:,} -> {d.after:,}"] for d in suggestion.decisions]
    print()
    print_table(f"{len(rows)} doubling(s)", ["trace row", "iteration", "consumed samples", "B_simple (samples)",
                                             "x trust", "GBS"], rows)
    reasons: dict[str, list[TraceRow]] = {}
    for held in suggestion.held:
        reasons.setdefault(held.reason, []).append(held.row)
    for reason, held_rows in reasons.items():
        print(f"note: held by {reason} at {len(held_rows):,} row(s) that called for doubling, from consumed "
              f"samples {held_rows[0].consumed_samples:,} to {held_rows[-1].consumed_samples:,}.")


def _suggestion_json(args: argparse.Namespace, trace: list[TraceRow], rule: DoublingRule,
                     suggestion: Suggestion) -> dict:
    return {
        "trace": args.suggest, "trace_rows": len(trace), "trust": rule.trust,
        "first_global_batch_size": rule.first_global_batch_size, "max_global_batch_size": rule.max_global_batch_size,
        "frozen": [{"label": f.label, "start": f.start, "end": f.end} for f in rule.frozen],
        "decisions": [{"row": d.row.position, "iteration": d.row.iteration, "consumed_samples": d.row.consumed_samples,
                       "b_simple_samples": d.row.b_simple_samples, "trusted": d.trusted, "before": d.before,
                       "after": d.after} for d in suggestion.decisions],
        "held": [{"row": h.row.position, "consumed_samples": h.row.consumed_samples, "trusted": h.trusted,
                  "global_batch_size": h.global_batch_size, "reason": h.reason} for h in suggestion.held],
    }


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
    header: list[str] | None = None,
) -> None:
    for line in header if header is not None else _header(args, schedule, seq):
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
    plt = _pyplot()
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
    _save(plt, figure, path)



def plot_suggestion(
    trace: list[TraceRow], suggestion: Suggestion, rule: DoublingRule, path: str, seq_length: int | None = None,
    train_samples: int | None = None,
) -> None:
    """Draw the measured B_simple (and x trust), the suggested GBS, the 2 x GBS trigger and the frozen ranges,
    against samples (or tokens with a seq_length), on a log scale, to ``path``; to ``train_samples`` if given."""
    plt = _pyplot()
    scale = seq_length or 1
    measured = [(r.consumed_samples * scale, r.b_simple_samples) for r in trace if r.b_simple_samples is not None]
    last = max([r.consumed_samples for r in trace] + [t for t, _ in suggestion.schedule.stages])
    end = max(train_samples or 0, last + last // 20, 1) * scale  # the last stage gets some width
    xs = [t * scale for t, _ in suggestion.schedule.stages] + [end]
    batches = [b for _, b in suggestion.schedule.stages]
    figure, axis = plt.subplots(figsize=(8, 4.5), dpi=100)
    if measured:
        axis.plot([x for x, _ in measured], [b for _, b in measured], "o-", color="C0", ms=3, lw=0.6,
                  label="B_simple measured")
        if rule.trust != 1:
            axis.plot([x for x, _ in measured], [rule.trust * b for _, b in measured], "-", color="C0", lw=0.8,
                      alpha=0.6, label=f"B_simple x trust {rule.trust:g}")
    axis.step(xs, batches + batches[-1:], where="post", color="C1", lw=2, label="suggested GBS")
    axis.step(xs, [2 * b for b in batches + batches[-1:]], where="post", color="C1", ls="--", lw=0.8,
              label="2 x GBS (doubles when crossed)")
    axis.axhline(rule.max_global_batch_size, color="grey", ls=":", lw=1, label="cap")
    for frozen in rule.frozen:
        axis.axvspan(frozen.start * scale, (frozen.end if frozen.end is not None else end / scale) * scale,
                     color="grey", alpha=0.15, lw=0)
    axis.set_yscale("log")
    axis.set_xlabel("tokens consumed" if seq_length else "samples consumed")
    axis.set_ylabel("samples")
    axis.set_title("measured critical batch (B_simple) and the suggested schedule; grey: no change")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    _save(plt, figure, path)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'megatron-ga-ext[plot]'.") from None
    return plt


def _save(plt, figure, path: str) -> None:
    try:
        figure.savefig(path)
    except OSError as error:
        raise UsageError(f"--plot {path}: cannot write the figure ({error.strerror or error}).") from None
    finally:
        plt.close(figure)
