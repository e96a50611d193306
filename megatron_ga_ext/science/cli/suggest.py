"""``megatron-ga schedule --suggest TRACE``: the schedule the doubling rule gives for a measured
noise-scale trace.

    megatron-ga schedule --suggest trace.json --micro-batch-size 2 --data-parallel-size 64 \\
        --max-global-batch-size 8192 [--global-batch-size 128] [--trust 1.5] [--lr-warmup-samples
        2M] \\ [--lr-decay-samples 100M --lr-wsd-decay-samples 20M] [--plot suggest.png]

TRACE is the ``--ga-noise-scale-trace`` file (science/core/noise_trace.py reads it), a
``--ga-noise-scale`` run's log, or its ``--tensorboard-dir``. The rule is science/core/suggest.py's
(docs/noise-scale.md): GBS doubles at a row where trust x B_simple >= 2 x GBS, outside the LR
windows (science/core/lr_windows.py), up to the cap. Every number goes through the table's checks
(cli/schedule_args.py) before the trace is read; the table and JSON are the table's
(cli/stage_table.py), with the doublings added.
"""

from __future__ import annotations

import argparse
import codecs
import json
import os

from megatron_ga_ext.cli.render import print_table
from megatron_ga_ext.cli.schedule_args import count, lr_hints, run_length
from megatron_ga_ext.cli.stage_table import print_stages, stages_json
from megatron_ga_ext.core.schedule.step_schedule import FLAG, StepSchedule
from megatron_ga_ext.errors import UsageError
from megatron_ga_ext.science.cli import plots
from megatron_ga_ext.science.core.lr_windows import Frozen, lr_windows
from megatron_ga_ext.science.core.noise_trace import (
    TraceRow,
    parse_trace,
    read_log,
    read_trace,
    scalar_tag,
)
from megatron_ga_ext.science.core.suggest import DoublingRule, Suggestion, suggest_schedule

__all__ = ["MAX_TRACE_BYTES", "run_suggest"]

#: The largest trace file read (a row per step of a million-step run is about 100 MB).
MAX_TRACE_BYTES = 256 * 2**20


def run_suggest(args: argparse.Namespace) -> int:
    """``--suggest TRACE``: the doubling rule's schedule, its doublings, its table, and the plot."""
    if args.schedule is not None or args.from_rampup is not None:
        raise UsageError(
            "--suggest writes the schedule itself: give --suggest TRACE.json without a schedule "
            "or --from-rampup."
        )
    unread = [
        flag
        for flag, given in (
            ("--sample-thresholds", args.sample_thresholds),
            ("--consumed-samples", args.consumed_samples != "0"),
            ("--planned-data-parallel-sizes", bool(args.planned_data_parallel_sizes)),
            ("--warn-future-stages", args.warn_future_stages),
        )
        if given
    ]
    if unread:
        raise UsageError(
            f"{', '.join(unread)} do(es) not apply to --suggest: the suggested schedule starts "
            "at 0 and is held to today's layout. Leave it out, or run the printed schedule "
            "through megatron-ga schedule with it."
        )
    mbs = count("--micro-batch-size", args.micro_batch_size)
    dp = count("--data-parallel-size", args.data_parallel_size)
    seq = count("--seq-length", args.seq_length) if args.seq_length is not None else None
    # the flags first, through the table's own checks: a bad one fails before a long trace is read
    rule = _rule(args, mbs, dp)
    train_samples = run_length(args, seq)
    lr, base = lr_hints(args)
    trace = _read_source(args.suggest, seq)
    suggestion = suggest_schedule(trace, rule)
    schedule = suggestion.schedule
    _validate_suggested(args, schedule, mbs, dp)
    rows = schedule.table(
        mbs, dp, seq_length=seq, train_samples=train_samples, lr=lr, lr_base_batch_size=base
    )
    if args.json:
        data = stages_json(args, schedule, rows, mbs, dp, seq, train_samples, 0, [])
        data.update(_suggestion_json(args, trace, rule, suggestion))
        print(json.dumps(data, indent=2))
    else:
        header = _suggest_header(args, trace, rule, schedule, seq)
        print_stages(
            rows,
            title=f"stages for MBS {args.micro_batch_size} x DP {args.data_parallel_size}",
            seq=seq,
            train_samples=train_samples,
            header=header,
            lr=args.lr is not None,
        )
        _print_decisions(suggestion)
    if args.plot:
        plots.plot_suggestion(
            trace, suggestion, rule, args.plot, seq_length=seq, train_samples=train_samples
        )
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _validate_suggested(
    args: argparse.Namespace, schedule: StepSchedule, mbs: int, dp: int
) -> None:
    """Doubling keeps MBS x DP dividing every stage, not the interleaved rule: hold it to the whole
    layout."""
    vpp, group = (
        args.virtual_pipeline_model_parallel_size,
        args.microbatch_group_size_per_virtual_pipeline_stage,
    )
    schedule.validate(
        mbs,
        dp,
        count("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
        count("--virtual-pipeline-model-parallel-size", vpp) if vpp else None,
        microbatch_group_size_per_vp_stage=count(
            "--microbatch-group-size-per-virtual-pipeline-stage", group
        )
        if group
        else None,
    )


def _read_source(path: str, seq: int | None) -> list[TraceRow]:
    """``--suggest``'s source: a TensorBoard directory (the run's ``--tensorboard-dir``), a JSON or
    JSON Lines trace (``--ga-noise-scale-trace``), else a Megatron-LM run's log, read line by
    line."""
    if os.path.isdir(path):
        return _tensorboard_trace(path)
    text = _trace_text(path, limit=4096)
    if text.lstrip()[:1] in ("[", "{"):
        return read_trace(_trace_text(path), tokens_per_sample=seq)
    with open(path, encoding="utf-8", errors="replace") as handle:
        return read_log(handle)


def _tensorboard_trace(directory: str) -> list[TraceRow]:
    """Rows from the noise-scale/b-simple-samples and noise-scale/consumed-samples scalars of a
    run's TensorBoard event files (the later value of a step logged twice, as by a resumed run).
    TensorBoard keeps float32: consumed samples past 2**24 come back rounded to 7 digits (the trace
    file keeps them exact)."""
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError:
        raise UsageError(
            f"--suggest {directory}: reading TensorBoard event files needs the tensorboard "
            "package (pip install tensorboard); or give the run's --ga-noise-scale-trace file."
        ) from None
    accumulator = event_accumulator.EventAccumulator(
        directory, size_guidance={event_accumulator.SCALARS: 0}
    )
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    wanted = (
        scalar_tag("consumed_samples"),
        scalar_tag("b_simple_samples"),
    )  # as the run logs them
    if not set(wanted) <= tags:
        raise UsageError(
            f"--suggest {directory}: no {' and '.join(t for t in wanted if t not in tags)} "
            "scalars in its event files; give the --tensorboard-dir of a run with "
            "--ga-noise-scale K."
        )
    consumed = {event.step: round(event.value) for event in accumulator.Scalars(wanted[0])}
    estimates = {event.step: event.value for event in accumulator.Scalars(wanted[1])}
    return parse_trace(
        [
            {
                "iteration": step,
                "consumed_samples": consumed[step],
                "b_simple_samples": estimates.get(step),
            }
            for step in sorted(consumed)
        ]
    )


def _trace_text(path: str, limit: int | None = None) -> str:
    """The file's text; with ``limit``, its first ``limit`` bytes (a character they cut is left
    out)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read((limit or MAX_TRACE_BYTES) + 1)
    except OSError as error:
        raise UsageError(
            f"--suggest {path}: cannot read the trace ({error.strerror or error})."
        ) from None
    if limit is None and len(data) > MAX_TRACE_BYTES:
        raise UsageError(
            f"--suggest {path}: the trace is over {MAX_TRACE_BYTES // 2**20} MiB; measure less "
            "often or keep every k-th row."
        )
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(
            data[:limit] if limit else data, final=limit is None
        )
    except UnicodeDecodeError as error:
        raise UsageError(
            f"--suggest {path}: not UTF-8 text at byte {error.start}; give the JSON trace."
        ) from None


def _rule(args: argparse.Namespace, mbs: int, dp: int) -> DoublingRule:
    if args.max_global_batch_size is None:
        raise UsageError(
            "--suggest needs --max-global-batch-size: the largest batch the run may reach "
            "(memory, the data, or where the loss stops improving per sample)."
        )
    return DoublingRule(
        micro_batch_size=mbs,
        data_parallel_size=dp,
        max_global_batch_size=count("--max-global-batch-size", args.max_global_batch_size),
        initial_global_batch_size=count("--global-batch-size", args.global_batch_size)
        if args.global_batch_size is not None
        else None,
        trust=_trust(args.trust),
        frozen=_frozen(args),
    )


def _trust(text: str | None) -> float:
    if text is None:
        return 1.0
    try:
        return float(text)
    except ValueError:
        raise UsageError(
            f"--trust {text!r} is not a number; give a positive factor, e.g. 1 or 1.5."
        ) from None


def _frozen(args: argparse.Namespace) -> tuple[Frozen, ...]:
    """The LR warmup [0, W) and WSD's final decay [D - F, end) (science/core/lr_windows.py): no
    stage may start in them."""
    warmup = 0
    if args.lr_warmup_samples is not None:
        warmup = count("--lr-warmup-samples", args.lr_warmup_samples, minimum=0)
    decay, final = args.lr_decay_samples, args.lr_wsd_decay_samples
    if (decay is None) != (final is None):
        raise UsageError(
            "--lr-decay-samples and --lr-wsd-decay-samples go together: the final decay runs "
            "from --lr-decay-samples - --lr-wsd-decay-samples to --lr-decay-samples "
            "(WSD). A cosine or linear decay spans the whole run after warmup: leave "
            "both out."
        )
    end = length = None
    if decay is not None:
        end, length = count("--lr-decay-samples", decay), count("--lr-wsd-decay-samples", final)
        if length > end:
            raise UsageError(
                f"--lr-wsd-decay-samples {length:,} is longer than --lr-decay-samples {end:,}: the "
                "final decay must fit inside the decay."
            )
    return lr_windows(
        warmup=warmup,
        decay_end=end,
        final_decay=length,
        warmup_label="the LR warmup (--lr-warmup-samples {samples:,})",
        final_decay_label="the final decay (from {samples:,} samples)",
    )


def _suggest_header(
    args: argparse.Namespace,
    trace: list[TraceRow],
    rule: DoublingRule,
    schedule: StepSchedule,
    seq: int | None,
) -> list[str]:
    lines = [
        f"suggested from {args.suggest} ({len(trace):,} rows; trust {rule.trust:g}; first GBS "
        f"{rule.first_global_batch_size:,}; cap {rule.max_global_batch_size:,}):"
    ]
    if seq is not None:
        lines.append(f"  pretrain_gpt (thresholds in tokens, --seq-length {seq}):")
        lines.append(f'    {FLAG} "{schedule.to_string(seq_length=seq)}"')
        lines.append("  megatron-core callers passing seq_length=None (thresholds in samples):")
    else:
        lines.append(
            "  thresholds in samples; pretrain_gpt reads tokens: add --seq-length for its string:"
        )
    lines.append(f'    {FLAG} "{schedule.samples_string()}"')
    return lines


def _print_decisions(suggestion: Suggestion) -> None:
    rows = [
        [
            d.row.position,
            d.row.iteration,
            d.row.consumed_samples,
            d.row.b_simple_samples,
            d.trusted,
            f"{d.before:,} -> {d.after:,}",
        ]
        for d in suggestion.decisions
    ]
    print()
    print_table(
        f"{len(rows)} doubling(s)",
        ["trace row", "iteration", "consumed samples", "B_simple (samples)", "x trust", "GBS"],
        rows,
    )
    reasons: dict[str, list[TraceRow]] = {}
    for held in suggestion.held:
        reasons.setdefault(held.reason, []).append(held.row)
    for reason, held_rows in reasons.items():
        print(
            f"note: held by {reason} at {len(held_rows):,} row(s) that called for doubling, from "
            "consumed "
            f"samples {held_rows[0].consumed_samples:,} to {held_rows[-1].consumed_samples:,}."
        )


def _suggestion_json(
    args: argparse.Namespace, trace: list[TraceRow], rule: DoublingRule, suggestion: Suggestion
) -> dict:
    return {
        "trace": args.suggest,
        "trace_rows": len(trace),
        "trust": rule.trust,
        "first_global_batch_size": rule.first_global_batch_size,
        "max_global_batch_size": rule.max_global_batch_size,
        "frozen": [{"label": f.label, "start": f.start, "end": f.end} for f in rule.frozen],
        "decisions": [
            {
                "row": d.row.position,
                "iteration": d.row.iteration,
                "consumed_samples": d.row.consumed_samples,
                "b_simple_samples": d.row.b_simple_samples,
                "trusted": d.trusted,
                "before": d.before,
                "after": d.after,
            }
            for d in suggestion.decisions
        ],
        "held": [
            {
                "row": h.row.position,
                "consumed_samples": h.row.consumed_samples,
                "trusted": h.trusted,
                "global_batch_size": h.global_batch_size,
                "reason": h.reason,
            }
            for h in suggestion.held
        ],
    }
