"""The output of ``megatron-ga critical-batch`` (science/cli/critical_batch.py): the rule it states,
the tables, the notes on dominated runs, rising steps and open interval ends, the JSON and the
plot."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from megatron_ga_ext.cli import plots
from megatron_ga_ext.cli.render import print_table
from megatron_ga_ext.science.core.critical_batch import steps_rise
from megatron_ga_ext.science.core.critical_batch_targets import TargetFit
from megatron_ga_ext.science.core.loss_curve import LossCurve, LossPoint

__all__ = ["as_json", "plot_fits", "print_fits", "rule_of", "span"]


def rule_of(args: argparse.Namespace, decay: float | None) -> dict:
    loss = (
        f"validation '{args.loss_name}'"
        if decay is None
        else f"training '{args.loss_name}', EMA decay {decay:g} per logged point"
    )
    reach = (
        "linear interpolation between the last logged point above the target and the first at or "
        "below it"
        if args.interpolate
        else "the first logged point at or below the target"
    )
    dominated = (
        "kept (--keep-dominated)"
        if args.keep_dominated
        else "left out: a batch size needing at least as many steps and samples as another "
        "(geometric means over its "
        "runs) is not on the trade-off curve; --keep-dominated keeps them"
    )
    interval = (
        "profile likelihood, F-calibrated (its coverage: docs/critical-batch.md)"
        if args.interval == "profile"
        else "percentile bootstrap over runs (covers less than its level with few runs)"
    )
    return {
        "loss": loss,
        "reach": reach,
        "fit": "least squares in log S (log E's residual equals it: E = B x S), a 1-D search "
        "over B_crit",
        "dominated_runs": dominated,
        "interval": interval,
        "interpolate": args.interpolate,
        "train_loss_smoothing": decay,
    }


def print_fits(
    rule: dict,
    curves: Sequence[LossCurve],
    series: dict[str, tuple[LossPoint, ...]],
    fits: Sequence[TargetFit],
    early: dict[float, list[str]],
    level: float,
) -> None:
    print(f"loss: {rule['loss']}")
    print(f"reached: S and E at {rule['reach']}")
    print(f"fit: (S/S_min - 1)(E/E_min - 1) = 1 by {rule['fit']}; B_crit = E_min / S_min")
    print(f"dominated runs: {rule['dominated_runs']}")
    print(f"interval: {rule['interval']}\n")
    runs = sorted(curves, key=lambda c: c.global_batch_size)
    header = ["run", "GBS", "points", "lowest loss", *(f"S to {f.target:.4g}" for f in fits)]
    reached = [{p.label: p.steps for p in (*f.points, *f.dominated)} for f in fits]
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
                f"target {f.target:.4g}: left out {', '.join(early[f.target])}: its first logged "
                "loss is already at or below the target (reached at an earlier step than the log "
                "gives)."
            )
        if f.dominated:
            print(
                f"target {f.target:.4g}: left out as dominated (more steps and samples than "
                "another batch size): "
                + ", ".join(
                    f"{p.label} (GBS {p.batch_size:,}: S {p.steps:.4g}, E {p.samples:.4g})"
                    for p in f.dominated
                )
                + "."
            )
        if f.reason:
            print(f"target {f.target:.4g}: NOT FITTABLE: {f.reason}.")
            continue
        for small, large in steps_rise(f.points):
            print(
                f"target {f.target:.4g}: S rises from {small.steps:.4g} steps at GBS "
                f"{small.batch_size:,} to {large.steps:.4g} at GBS {large.batch_size:,}: "
                "the hyperbola has S fall as B grows, so the larger run is limited by something "
                "it leaves out (its LR, its warmup, the run's length)."
            )
        i = f.interval
        if i is None or i.method != "bootstrap":
            continue
        if i.used < i.resamples:
            print(
                f"target {f.target:.4g}: {i.resamples - i.used} of {i.resamples} bootstrap "
                "resamples had fewer than 3 distinct batch sizes and were left out."
            )
        for count, limit, end in (
            (i.below, "B_crit -> 0", i.low),
            (i.above, "B_crit -> inf", i.high),
        ):
            if count:
                print(
                    f"target {f.target:.4g}: {count} of {i.used} fitted resamples ran to {limit} "
                    "(every drawn run far on one side of the knee): undetermined"
                    f"{'' if end is not None else ', so that end of the interval is not bounded'}."
                )


def as_json(
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
        "steps_rise": [
            [small.batch_size, large.batch_size] for small, large in steps_rise(f.points)
        ],
        "points": [
            {
                "run": p.label,
                "global_batch_size": p.batch_size,
                "steps": p.steps,
                "samples": p.samples,
            }
            for p in f.points
        ],
        "dominated": [
            {
                "run": p.label,
                "global_batch_size": p.batch_size,
                "steps": p.steps,
                "samples": p.samples,
            }
            for p in f.dominated
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
                    "method": i.method,
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
    """E against S on log-log axes: each target's points, and where fitted its hyperbola and
    B_crit's point."""
    plt = plots.pyplot()
    figure, axis = plt.subplots(figsize=(7, 5), dpi=100)
    for k, f in enumerate(fits):
        color = f"C{k % 10}"
        label = f"loss {f.target:.4g}" + ("" if f.fit else " (not fittable)")
        axis.plot(
            [p.steps for p in f.points],
            [p.samples for p in f.points],
            "o",
            color=color,
            label=label,
        )
        if f.fit is None:
            continue
        sizes = [p.batch_size for p in f.points]
        low, high = math.log(min(sizes) / 4), math.log(max(sizes) * 4)
        grid = [math.exp(low + (high - low) * i / 199) for i in range(200)]
        axis.plot(
            [f.fit.steps(b) for b in grid], [f.fit.samples(b) for b in grid], "-", color=color, lw=1
        )
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
