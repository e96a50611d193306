"""One loss target of a critical-batch sweep: its fit and interval, or why it is not fittable.

For each target the caller gives the runs that reached it (science/core/loss_curve.py's
``first_reach``); :func:`fit_target` leaves the Pareto-dominated batch sizes out, checks the rest
are fittable, fits the hyperbola and bounds B_crit (science/core/critical_batch.py, whose module
docstring states the fit, the fittable rule and both intervals). :func:`default_targets` spaces the
targets evenly between what every run reaches and where every run starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_ga_ext.errors import CriticalBatchError
from megatron_ga_ext.science.core.critical_batch import (
    Fit,
    Interval,
    RunPoint,
    bootstrap_b_crit,
    fit_hyperbola,
    not_fittable_reason,
    pareto_split,
    profile_b_crit,
)

__all__ = ["TargetFit", "default_targets", "fit_target"]


@dataclass(frozen=True, kw_only=True)
class TargetFit:
    """One target: its points, and either a fit with its interval or the reason it is not
    fittable."""

    target: float
    points: tuple[RunPoint, ...]
    fit: Fit | None
    interval: Interval | None
    reason: str | None
    """Why the target is not fittable; None when it is fitted."""
    dominated: tuple[RunPoint, ...] = ()
    """Runs left out of the fit as Pareto-dominated (:func:`pareto_split`); not in ``points``."""


def fit_target(
    target: float,
    points: Sequence[RunPoint],
    *,
    resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    interval: str = "profile",
    keep_dominated: bool = False,
) -> TargetFit:
    """One target: its dominated runs left out (unless ``keep_dominated``), then fitted with its
    interval (``profile`` or ``bootstrap``), or not fittable with the reason (critical_batch.py's
    module docstring)."""
    if interval not in ("profile", "bootstrap"):
        raise CriticalBatchError(f"the interval {interval!r} is not one of 'profile', 'bootstrap'.")
    points, dominated = (tuple(points), ()) if keep_dominated else pareto_split(points)
    reason = not_fittable_reason(points, None)
    fit = None if reason else fit_hyperbola(points)
    reason = reason or not_fittable_reason(points, fit)
    if reason is not None:
        return TargetFit(
            target=target,
            points=points,
            fit=None,
            interval=None,
            reason=reason,
            dominated=dominated,
        )
    found = (
        profile_b_crit(points, level=level)
        if interval == "profile"
        else bootstrap_b_crit(points, resamples=resamples, seed=seed, level=level)
    )
    return TargetFit(
        target=target, points=points, fit=fit, interval=found, reason=None, dominated=dominated
    )


def default_targets(
    every_run_reaches: float, every_run_starts_above: float, count: int
) -> list[float]:
    """``count`` evenly spaced losses, highest first, from ``every_run_reaches`` (the highest of the
    runs' lowest losses: each run reaches it) up to, not including, ``every_run_starts_above`` (the
    lowest of the runs' first losses): lo + (hi - lo) x k / count for k = count - 1, ..., 0."""
    lo, hi = every_run_reaches, every_run_starts_above
    if count < 1:
        raise CriticalBatchError(f"--num-targets {count} must be at least 1.")
    if not lo < hi:
        raise CriticalBatchError(
            f"the runs' losses do not overlap: some run's first logged loss ({hi:.6g}) is "
            "already at or below the "
            f"lowest loss every run reaches ({lo:.6g}), so no target lies between; give --targets."
        )
    return [lo + (hi - lo) * k / count for k in reversed(range(count))]
