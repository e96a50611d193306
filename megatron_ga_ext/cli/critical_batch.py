"""``megatron-ga critical-batch RUN...``: the critical batch size B_crit = E_min / S_min from runs of one model at
several global batch sizes (McCandlish et al. 2018; docs/critical-batch.md).

    megatron-ga critical-batch run-gbs16.log run-gbs32.log tb/run-gbs64 ... [--targets 3.2,3.0,2.8]
        [--train-loss-smoothing 0.9] [--interpolate] [--bootstrap 1000] [--seed 0] [--json] [--plot fit.png]

Each RUN is a Megatron-LM run's stdout log (core/loss_curve.py reads it) or its ``--tensorboard-dir`` (the
``batch-size`` and loss scalars Megatron's training_log and evaluate_and_print_results write). The steps and samples
at which each run first reaches each target go to core/critical_batch.py's fit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence

from megatron_ga_ext.cli import plots
from megatron_ga_ext.cli.render import print_table
from megatron_ga_ext.core.critical_batch import RunPoint, TargetFit, default_targets, fit_target, steps_rise
from megatron_ga_ext.core.loss_curve import LossCurve, LossPoint, curve, first_reach, read_megatron_log, smooth
from megatron_ga_ext.errors import CriticalBatchError

__all__ = ["configure_parser", "run"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="a run's Megatron-LM stdout log, or its --tensorboard-dir; one run per global batch size",
    )
    parser.add_argument(
        "--targets",
        metavar="L1,L2,...",
        help="target losses, e.g. 3.2,3.0,2.8 (default: "
        "--num-targets losses evenly spaced between what every run reaches)",
    )
    parser.add_argument("--num-targets", metavar="N", default="3", help="default targets (3)")
    parser.add_argument(
        "--train-loss-smoothing",
        metavar="EMA_DECAY",
        help="use the training loss, smoothed by an EMA of this decay per logged point (default: the validation loss)",
    )
    parser.add_argument(
        "--interpolate",
        action="store_true",
        help="interpolate S and E linearly between the two "
        "logged points around the target (default: the first logged point at or below it)",
    )
    parser.add_argument("--loss-name", default="lm loss", help="the loss as Megatron logs it ('lm loss')")
    parser.add_argument("--bootstrap", metavar="N", default="1000", help="bootstrap resamples over runs (1000)")
    parser.add_argument("--confidence", metavar="LEVEL", default="0.95", help="the interval's level (0.95)")
    parser.add_argument("--seed", metavar="N", default="0", help="the bootstrap's seed (0)")
    parser.add_argument("--json", action="store_true", help="print the runs and the fits as JSON")
    parser.add_argument("--plot", metavar="FILE", help="draw the S-E points and fitted hyperbola per target")


def run(args: argparse.Namespace) -> int:
    resamples, seed = _whole("--bootstrap", args.bootstrap, 1), _whole("--seed", args.seed, 0)
    level = _number("--confidence", args.confidence)
    if not 0 < level < 1:
        raise CriticalBatchError(f"--confidence {args.confidence} must lie strictly between 0 and 1, e.g. 0.95.")
    decay = None if args.train_loss_smoothing is None else _number("--train-loss-smoothing", args.train_loss_smoothing)
    curves = [_read_run(path, args.loss_name) for path in args.runs]
    _check_runs(curves)
    series = {c.source: _series(c, decay, args.loss_name) for c in curves}
    targets = _targets(args, series)
    fits, early = [], {}
    for target in targets:
        points, early[target] = _points(curves, series, target, args.interpolate)
        fits.append(fit_target(target, points, resamples=resamples, seed=seed, level=level))
    rule = _rule(args, decay)
    if args.json:
        print(json.dumps(_as_json(rule, curves, series, fits, early), indent=2))
    else:
        _print(rule, curves, series, fits, early, level)
    if args.plot:
        plot_fits(fits, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


# -- reading the runs ------------------------------------------------------------------------------


def _read_run(path: str, loss_name: str) -> LossCurve:
    """A TensorBoard directory (or one event file), else a log read line by line."""
    if os.path.isdir(path) or "tfevents" in os.path.basename(path):
        return _tensorboard_curve(path, loss_name)
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return read_megatron_log(handle, path, loss_name)
    except OSError as error:
        raise CriticalBatchError(
            f"RUN {path}: cannot read it ({error.strerror or error}); give a Megatron-LM "
            "log file or a --tensorboard-dir."
        ) from None


def _tensorboard_curve(path: str, loss_name: str) -> LossCurve:
    """The scalars Megatron-LM writes (training.py): ``batch-size`` and ``LOSS`` per iteration, ``LOSS validation``
    per evaluation, and each one's ``... vs samples`` twin, whose step is the consumed samples (written in the same
    order: the k-th events pair up)."""
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError:
        raise CriticalBatchError(
            f"RUN {path}: reading TensorBoard event files needs the tensorboard package (pip "
            "install tensorboard); or give the run's stdout log."
        ) from None
    if os.path.isdir(path) and not any("tfevents" in name for name in os.listdir(path)):
        raise CriticalBatchError(
            f"RUN {path} is a directory without TensorBoard event files (events.out.tfevents.*) "
            "and not a log; give the run's --tensorboard-dir or its stdout log."
        )
    accumulator = event_accumulator.EventAccumulator(path, size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    if "batch-size" not in tags:
        raise CriticalBatchError(
            f"RUN {path}: its event files have no 'batch-size' scalar (Megatron-LM writes it "
            "every --tensorboard-log-interval); give the --tensorboard-dir of a Megatron-LM run."
        )

    def by_step(tag: str) -> dict[int, float]:
        return {e.step: e.value for e in accumulator.Scalars(tag)} if tag in tags else {}

    consumed: dict[int, int] = {}
    for tag in ("batch-size", loss_name, f"{loss_name} validation"):
        if tag in tags and f"{tag} vs samples" in tags:
            pairs = zip(accumulator.Scalars(tag), accumulator.Scalars(f"{tag} vs samples"))
            consumed.update({event.step: twin.step for event, twin in pairs})
    sizes = {step: round(value) for step, value in by_step("batch-size").items()}
    if len(set(sizes.values())) > 1:
        raise CriticalBatchError(
            f"RUN {path}: its global batch size changes ({sorted(set(sizes.values()))[:4]}); "
            "the fit needs each run at one global batch size: give runs at a fixed batch size."
        )
    batch = next(iter(sizes.values()))
    return curve(path, batch, consumed, by_step(loss_name), by_step(f"{loss_name} validation"))


def _check_runs(curves: Sequence[LossCurve]) -> None:
    seen: dict[int, str] = {}
    for c in curves:
        if c.source in seen.values():
            raise CriticalBatchError(f"RUN {c.source} is given twice; give each run once.")
        if c.global_batch_size in seen:
            raise CriticalBatchError(
                f"RUN {c.source} and RUN {seen[c.global_batch_size]} both ran at global batch size "
                f"{c.global_batch_size:,}; the fit takes one run per batch size: keep one (the best learning rate's)."
            )
        seen[c.global_batch_size] = c.source
    if len(curves) < 3:
        raise CriticalBatchError(
            f"{len(curves)} RUN(s) given; the fit of S_min and E_min needs runs at 3 or more "
            "global batch sizes (a 16x span or more gives a knee to fit)."
        )


def _series(c: LossCurve, decay: float | None, loss_name: str) -> tuple[LossPoint, ...]:
    if decay is not None:
        if not c.train:
            raise CriticalBatchError(f"RUN {c.source}: no training '{loss_name}' was logged; check --loss-name.")
        return smooth(c.train, decay)
    if not c.validation:
        raise CriticalBatchError(
            f"RUN {c.source}: no validation '{loss_name}' was logged (\"validation loss at iteration N | "
            f'{loss_name} value: ..."); run with --eval-interval, or use the training loss: '
            "--train-loss-smoothing EMA_DECAY."
        )
    return c.validation


# -- targets and points ------------------------------------------------------------------------------


def _targets(args: argparse.Namespace, series: dict[str, tuple[LossPoint, ...]]) -> list[float]:
    if args.targets is None:
        count = _whole("--num-targets", args.num_targets, 1)
        reaches = max(min(p.loss for p in points) for points in series.values())
        starts = min(points[0].loss for points in series.values())
        return default_targets(reaches, starts, count)
    words = [w for w in args.targets.replace(",", " ").split()]
    if not words:
        raise CriticalBatchError("--targets is empty; give target losses, e.g. --targets 3.2,3.0,2.8.")
    targets = [_number("--targets", word) for word in words]
    if len(set(targets)) < len(targets):
        raise CriticalBatchError(f"--targets {args.targets!r} gives a loss twice; give each target once.")
    lowest = min(p.loss for points in series.values() for p in points)
    for target in targets:
        if target < lowest:
            raise CriticalBatchError(
                f"--targets {target:g}: no run reached it (the lowest loss any run logged is {lowest:.6g}); every "
                f"target must be reached by at least one run, and 3 to be fitted: give targets at or above "
                f"{max(min(p.loss for p in points) for points in series.values()):.6g} (what every run reaches)."
            )
    return targets


def _points(
    curves: Sequence[LossCurve], series: dict[str, tuple[LossPoint, ...]], target: float, interpolate: bool
) -> tuple[list[RunPoint], list[str]]:
    """Each run's (S, E) at the target, by batch size; and the runs whose first logged loss is already at or below
    it: they reached it at or before that point, at an S the log does not give, and are left out."""
    points, early = [], []
    for c in sorted(curves, key=lambda c: c.global_batch_size):
        if series[c.source][0].loss <= target:
            early.append(c.source)
            continue
        reached = first_reach(series[c.source], target, interpolate)
        if reached is not None:
            points.append(
                RunPoint(label=c.source, batch_size=c.global_batch_size, steps=reached[0], samples=reached[1])
            )
    return points, early


# -- numbers -----------------------------------------------------------------------------------------


def _whole(flag: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise CriticalBatchError(f"{flag} {text!r} is not a whole number; give one >= {minimum}.") from None
    if value < minimum or value > 10**7:
        raise CriticalBatchError(f"{flag} {value} must lie from {minimum} to 10,000,000.")
    return value


def _number(flag: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise CriticalBatchError(f"{flag} {text!r} is not a finite number.")
    return value


# -- output ------------------------------------------------------------------------------------------


def _rule(args: argparse.Namespace, decay: float | None) -> dict:
    loss = (
        f"validation '{args.loss_name}'"
        if decay is None
        else f"training '{args.loss_name}', EMA decay {decay:g} per logged point"
    )
    reach = (
        "linear interpolation between the last logged point above the target and the first at or below it"
        if args.interpolate
        else "the first logged point at or below the target"
    )
    return {
        "loss": loss,
        "reach": reach,
        "fit": "least squares in log S, log E (1-D search over B_crit)",
        "interpolate": args.interpolate,
        "train_loss_smoothing": decay,
    }


def _print(
    rule: dict,
    curves: Sequence[LossCurve],
    series: dict[str, tuple[LossPoint, ...]],
    fits: Sequence[TargetFit],
    early: dict[float, list[str]],
    level: float,
) -> None:
    print(f"loss: {rule['loss']}")
    print(f"reached: S and E at {rule['reach']}")
    print(f"fit: (S/S_min - 1)(E/E_min - 1) = 1 by {rule['fit']}; B_crit = E_min / S_min\n")
    runs = sorted(curves, key=lambda c: c.global_batch_size)
    header = ["run", "GBS", "points", "lowest loss", *(f"S to {f.target:.4g}" for f in fits)]
    reached = [{p.label: p.steps for p in f.points} for f in fits]
    rows = [
        [
            c.source,
            c.global_batch_size,
            len(series[c.source]),
            min(p.loss for p in series[c.source]),
            *(r.get(c.source) for r in reached),
        ]
        for c in runs
    ]
    print_table("runs", header, rows)
    print()
    interval_name = f"B_crit {level * 100:g}% interval"
    table = []
    for f in fits:
        if f.fit is None or f.interval is None:
            table.append([f.target, len(f.points), None, None, "NOT FITTABLE", None, None])
        else:
            table.append(
                [
                    f.target,
                    len(f.points),
                    f.fit.s_min,
                    f.fit.e_min,
                    f.fit.b_crit,
                    span(f.interval.low, f.interval.high),
                    f.fit.rms_log_residual,
                ]
            )
    print_table(
        "critical batch per target",
        ["target", "runs", "S_min", "E_min", "B_crit", interval_name, "rms log residual"],
        table,
    )
    for f in fits:
        if early[f.target]:
            print(
                f"target {f.target:.4g}: left out {', '.join(early[f.target])}: its first logged loss is already at "
                "or below the target (reached at an earlier step than the log gives)."
            )
        if f.reason:
            print(f"target {f.target:.4g}: NOT FITTABLE: {f.reason}.")
            continue
        for small, large in steps_rise(f.points):
            print(
                f"target {f.target:.4g}: S rises from {small.steps:.4g} steps at GBS {small.batch_size:,} to "
                f"{large.steps:.4g} at GBS {large.batch_size:,}: the hyperbola has S fall as B grows, so the larger "
                "run is limited by something it leaves out (its LR, its warmup, the run's length)."
            )
        i = f.interval
        if i is None:
            continue
        if i.used < i.resamples:
            print(
                f"target {f.target:.4g}: {i.resamples - i.used} of {i.resamples} bootstrap resamples had fewer "
                "than 3 distinct batch sizes and were left out."
            )
        for count, limit, end in ((i.below, "B_crit -> 0", i.low), (i.above, "B_crit -> inf", i.high)):
            if count:
                print(
                    f"target {f.target:.4g}: {count} of {i.used} fitted resamples ran to {limit} (every drawn run "
                    "far on one side of the knee): undetermined"
                    f"{'' if end is not None else ', so that end of the interval is not bounded'}."
                )


def _as_json(
    rule: dict,
    curves: Sequence[LossCurve],
    series: dict[str, tuple[LossPoint, ...]],
    fits: Sequence[TargetFit],
    early: dict[float, list[str]],
) -> dict:
    return {
        "rule": rule,
        "runs": [
            {
                "run": c.source,
                "global_batch_size": c.global_batch_size,
                "points": len(series[c.source]),
                "lowest_loss": min(p.loss for p in series[c.source]),
                "skipped_not_finite": c.skipped,
            }
            for c in sorted(curves, key=lambda c: c.global_batch_size)
        ],
        "targets": [{**_fit_json(f), "reached_before_first_log": early[f.target]} for f in fits],
    }


def _fit_json(f: TargetFit) -> dict:
    data: dict = {
        "target": f.target,
        "runs_reaching": len(f.points),
        "fittable": f.fit is not None,
        "reason": f.reason,
        "steps_rise": [[small.batch_size, large.batch_size] for small, large in steps_rise(f.points)],
        "points": [
            {"run": p.label, "global_batch_size": p.batch_size, "steps": p.steps, "samples": p.samples}
            for p in f.points
        ],
    }
    if f.fit is not None and f.interval is not None:
        i = f.interval
        data.update(
            {
                "s_min": f.fit.s_min,
                "e_min": f.fit.e_min,
                "b_crit": f.fit.b_crit,
                "b_crit_interval": {
                    "low": i.low,
                    "high": i.high,
                    "level": i.level,
                    "resamples": i.resamples,
                    "used": i.used,
                    "below": i.below,
                    "above": i.above,
                    "seed": i.seed,
                },
                "rms_log_residual": f.fit.rms_log_residual,
                "log_residuals": [{"steps": s, "samples": e} for s, e in f.fit.residuals],
            }
        )
    return data


def span(low: float | None, high: float | None) -> str:
    """An interval as text; an end the data do not bound (None) is said so."""
    if low is None and high is None:
        return "not bounded"
    if low is None:
        return f"below {high:.4g}"
    return f"above {low:.4g}" if high is None else f"{low:.4g} - {high:.4g}"


def plot_fits(fits: Sequence[TargetFit], path: str) -> None:
    """E against S on log-log axes: each target's points, and where fitted its hyperbola and B_crit's point."""
    plt = plots.pyplot()
    figure, axis = plt.subplots(figsize=(7, 5), dpi=100)
    for k, f in enumerate(fits):
        color = f"C{k % 10}"
        label = f"loss {f.target:.4g}" + ("" if f.fit else " (not fittable)")
        axis.plot([p.steps for p in f.points], [p.samples for p in f.points], "o", color=color, label=label)
        if f.fit is None:
            continue
        sizes = [p.batch_size for p in f.points]
        low, high = math.log(min(sizes) / 4), math.log(max(sizes) * 4)
        grid = [math.exp(low + (high - low) * i / 199) for i in range(200)]
        axis.plot([f.fit.steps(b) for b in grid], [f.fit.samples(b) for b in grid], "-", color=color, lw=1)
        axis.plot([2 * f.fit.s_min], [2 * f.fit.e_min], "x", color=color, ms=9)  # at B = B_crit
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("optimizer steps S to the target")
    axis.set_ylabel("samples E to the target")
    axis.set_title("(S/S_min - 1)(E/E_min - 1) = 1 per target; x: B = B_crit (2 S_min, 2 E_min)")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    plots.save_figure(plt, figure, path)
