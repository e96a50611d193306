"""``megatron-ga critical-batch RUN...``: the critical batch size B_crit = E_min / S_min from runs
of one model at several global batch sizes (McCandlish et al. 2018; docs/critical-batch.md).

    megatron-ga critical-batch run-gbs16.log run-gbs32.log tb/run-gbs64 ... [--targets 3.2,3.0,2.8]
        [--train-loss-smoothing 0.9] [--interpolate] [--interval profile|bootstrap]
        [--keep-dominated] [--json] [--plot fit.png]

Each RUN is a Megatron-LM run's stdout log (science/core/loss_curve.py reads it) or its
``--tensorboard-dir`` (the ``batch-size`` and loss scalars Megatron's training_log and
evaluate_and_print_results write). The steps and samples at which each run first reaches each target
go to science/core/critical_batch.py's fit: by default the runs of a batch size that needs at least
as many steps and samples as another's are left out as dominated (and named), and B_crit's interval
is the profile likelihood's. Several runs at one batch size (seeds) are points of their own. The
output lives in science/cli/critical_batch_output.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence

from megatron_ga_ext.errors import CriticalBatchError
from megatron_ga_ext.science.cli.critical_batch_output import (
    as_json,
    plot_fits,
    print_fits,
    rule_of,
)
from megatron_ga_ext.science.core.critical_batch import RunPoint
from megatron_ga_ext.science.core.critical_batch_targets import default_targets, fit_target
from megatron_ga_ext.science.core.loss_curve import (
    LossCurve,
    LossPoint,
    curve,
    first_reach,
    read_megatron_log,
    smooth,
)

__all__ = ["configure_parser", "run"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="a run's Megatron-LM stdout log, or its --tensorboard-dir; one run per global batch "
        "size",
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
        help="use the training loss, smoothed by an EMA of this decay per logged point (default: "
        "the validation loss)",
    )
    parser.add_argument(
        "--interpolate",
        action="store_true",
        help="interpolate S and E linearly between the two "
        "logged points around the target (default: the first logged point at or below it)",
    )
    parser.add_argument(
        "--loss-name", default="lm loss", help="the loss as Megatron logs it ('lm loss')"
    )
    parser.add_argument(
        "--interval",
        choices=("profile", "bootstrap"),
        default="profile",
        help="B_crit's interval: the profile likelihood (default; its coverage is measured in "
        "docs/critical-batch.md) "
        "or the percentile bootstrap over runs (covers less than its level with few runs)",
    )
    parser.add_argument(
        "--keep-dominated",
        action="store_true",
        help="fit every run (default: a batch size that needs at least as many steps and samples "
        "as another is left "
        "out as dominated, and named)",
    )
    parser.add_argument(
        "--bootstrap", metavar="N", default="1000", help="bootstrap resamples over runs (1000)"
    )
    parser.add_argument(
        "--confidence", metavar="LEVEL", default="0.95", help="the interval's level (0.95)"
    )
    parser.add_argument("--seed", metavar="N", default="0", help="the bootstrap's seed (0)")
    parser.add_argument("--json", action="store_true", help="print the runs and the fits as JSON")
    parser.add_argument(
        "--plot", metavar="FILE", help="draw the S-E points and fitted hyperbola per target"
    )


def run(args: argparse.Namespace) -> int:
    resamples, seed = _whole("--bootstrap", args.bootstrap, 1), _whole("--seed", args.seed, 0)
    level = _number("--confidence", args.confidence)
    if not 0 < level < 1:
        raise CriticalBatchError(
            f"--confidence {args.confidence} must lie strictly between 0 and 1, e.g. 0.95."
        )
    decay = (
        None
        if args.train_loss_smoothing is None
        else _number("--train-loss-smoothing", args.train_loss_smoothing)
    )
    curves = [_read_run(path, args.loss_name) for path in args.runs]
    _check_runs(curves)
    series = {c.source: _series(c, decay, args.loss_name) for c in curves}
    targets = _targets(args, series)
    fits, early = [], {}
    for target in targets:
        points, early[target] = _points(curves, series, target, args.interpolate)
        fits.append(
            fit_target(
                target,
                points,
                resamples=resamples,
                seed=seed,
                level=level,
                interval=args.interval,
                keep_dominated=args.keep_dominated,
            )
        )
    rule = rule_of(args, decay)
    if args.json:
        print(json.dumps(as_json(rule, curves, series, fits, early), indent=2))
    else:
        print_fits(rule, curves, series, fits, early, level)
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
    """The scalars Megatron-LM writes (training.py): ``batch-size`` and ``LOSS`` per iteration,
    ``LOSS validation`` per evaluation, and each one's ``... vs samples`` twin, whose step is the
    consumed samples (written in the same order: the k-th events pair up)."""
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
    accumulator = event_accumulator.EventAccumulator(
        path, size_guidance={event_accumulator.SCALARS: 0}
    )
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
    """Each run once; runs at 3 or more batch sizes (several at one size are seeds, each a point of
    the fit)."""
    seen: set[str] = set()
    for c in curves:
        if c.source in seen:
            raise CriticalBatchError(f"RUN {c.source} is given twice; give each run once.")
        seen.add(c.source)
    sizes = {c.global_batch_size for c in curves}
    if len(sizes) < 3:
        raise CriticalBatchError(
            f"{len(curves)} RUN(s) at {len(sizes)} global batch size(s) given; the fit of S_min "
            "and E_min needs runs at 3 or more global batch sizes (a 16x span or more gives a "
            "knee to fit)."
        )


def _series(c: LossCurve, decay: float | None, loss_name: str) -> tuple[LossPoint, ...]:
    if decay is not None:
        if not c.train:
            raise CriticalBatchError(
                f"RUN {c.source}: no training '{loss_name}' was logged; check --loss-name."
            )
        return smooth(c.train, decay)
    if not c.validation:
        raise CriticalBatchError(
            f"RUN {c.source}: no validation '{loss_name}' was logged (\"validation loss at "
            "iteration N | "
            f'{loss_name} value: ..."); run with --eval-interval, or use the training loss: '
            "--train-loss-smoothing EMA_DECAY."
        )
    return c.validation


# -- targets and points
# ------------------------------------------------------------------------------


def _targets(args: argparse.Namespace, series: dict[str, tuple[LossPoint, ...]]) -> list[float]:
    if args.targets is None:
        count = _whole("--num-targets", args.num_targets, 1)
        reaches = max(min(p.loss for p in points) for points in series.values())
        starts = min(points[0].loss for points in series.values())
        return default_targets(reaches, starts, count)
    words = [w for w in args.targets.replace(",", " ").split()]
    if not words:
        raise CriticalBatchError(
            "--targets is empty; give target losses, e.g. --targets 3.2,3.0,2.8."
        )
    targets = [_number("--targets", word) for word in words]
    if len(set(targets)) < len(targets):
        raise CriticalBatchError(
            f"--targets {args.targets!r} gives a loss twice; give each target once."
        )
    lowest = min(p.loss for points in series.values() for p in points)
    for target in targets:
        if target < lowest:
            raise CriticalBatchError(
                f"--targets {target:g}: no run reached it (the lowest loss any run logged is "
                f"{lowest:.6g}); every "
                "target must be reached by at least one run, and 3 to be fitted: give targets at "
                "or above "
                f"{max(min(p.loss for p in points) for points in series.values()):.6g} (what "
                "every run reaches)."
            )
    return targets


def _points(
    curves: Sequence[LossCurve],
    series: dict[str, tuple[LossPoint, ...]],
    target: float,
    interpolate: bool,
) -> tuple[list[RunPoint], list[str]]:
    """Each run's (S, E) at the target, by batch size; and the runs whose first logged loss is
    already at or below it: they reached it at or before that point, at an S the log does not give,
    and are left out."""
    points, early = [], []
    for c in sorted(curves, key=lambda c: c.global_batch_size):
        if series[c.source][0].loss <= target:
            early.append(c.source)
            continue
        reached = first_reach(series[c.source], target, interpolate)
        if reached is not None:
            points.append(
                RunPoint(
                    label=c.source,
                    batch_size=c.global_batch_size,
                    steps=reached[0],
                    samples=reached[1],
                )
            )
    return points, early


# -- numbers
# -----------------------------------------------------------------------------------------


def _whole(flag: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise CriticalBatchError(
            f"{flag} {text!r} is not a whole number; give one >= {minimum}."
        ) from None
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
