"""The critical batch size from a sweep of runs at several global batch sizes (McCandlish et al.
2018). Pure Python.

Each run, at batch size B, first reaches a target loss after S optimizer steps and E = S x B
samples. McCandlish's trade-off between the two is the hyperbola

    (S / S_min - 1) (E / E_min - 1) = 1,

which this module fits in the parametrisation

    S(B) = S_min (1 + B_crit / B),     E(B) = E_min (1 + B / B_crit),     B_crit = E_min / S_min,

so that log S(B) = a + log(1 + B_crit / B) and log E(B) = a + log(B_crit + B), with a = log S_min.

**The fit** is least squares in log space (the residuals are multiplicative errors, and a run at a
small B weighs as much as one at a large B):

    minimise over (a, B_crit):  sum_i (log S_i - a - log(1 + B_crit / B_i))^2.

It is a fit of log S alone: E_i = B_i x S_i and E(B) = B x S(B), so a run's log E residual equals
its log S residual exactly, and a sum over both coordinates is twice this one (the same minimum).
For a fixed B_crit the best a is closed-form (the mean residual without it), so the fit is a 1-D
search over u = log B_crit: a grid of :data:`GRID` points over [log min B - log 1000, log max B +
log 1000], then a golden section search between the best grid point's neighbours. S_min = exp(a),
E_min = S_min x B_crit. Several runs at one batch size (seeds) are points of their own.

**Dominated runs** are left out first (:func:`pareto_split`): the trade-off curve has S fall and E
rise as B grows, so a batch size whose runs need at least as many steps *and* samples as another
batch size's (geometric means over its runs, one of the two strictly more) is not on it (its LR, its
warmup or the run's length limits it); the caller reports which.

**Fittable** only when at least 3 runs with 3 distinct batch sizes reached the target, and the
fitted B_crit lies within the span of their batch sizes [min B, max B] (a run on each side of the
knee). Where every run is far above the knee (B >> B_crit) S is flat at S_min and E_min is not
determined; where every run is far below it (B << B_crit) E is flat at E_min and S_min is not: such
a target is reported with its reason, never fitted.

**The uncertainty** (default, :func:`profile_b_crit`) is the profile-likelihood interval on the 1-D
search, with n runs: every B_crit whose profile RSS is within 1 + t^2 / (n - 2) of the least
(science/core/profile_interval.py; t the Student quantile at n - 2 degrees of freedom); an end the
search's range does not close is not bounded (None). Its coverage on synthetic sweeps is measured by
tests/test_critical_batch_fit.py and stated in docs/critical-batch.md. The percentile bootstrap over
runs (:func:`bootstrap_b_crit`) is kept as an option: with 5 to 6 runs it has few distinct resamples
and covers less than its level. It draws n runs with replacement (seeded), refits, and takes the (1
- level) / 2 and (1 + level) / 2 quantiles of the refitted B_crit; a resample with fewer than 3
distinct batch sizes is counted and left out; one whose fit runs to the search's edge counts as -inf
or +inf, and where a quantile falls on such a resample, that end of the interval is not bounded
(None), never the search's edge.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_ga_ext.errors import CriticalBatchError
from megatron_ga_ext.science.core.profile_interval import profile_bounds, t_quantile

__all__ = [
    "Fit",
    "Interval",
    "RunPoint",
    "bootstrap_b_crit",
    "fit_hyperbola",
    "pareto_split",
    "profile_b_crit",
    "steps_rise",
]

#: Grid points of the 1-D search over log B_crit before the golden section refines it.
GRID = 32
#: The search reaches this factor beyond the smallest and largest batch size.
REACH = 1000.0
#: Golden-section iterations: the bracket shrinks by 0.618 each, from two grid steps (about 1.3 in
#: log B_crit for a 100x sweep) to under 1e-6, a relative precision far below any sweep's noise.
GOLDEN_ITERATIONS = 30
#: The fewest runs (with distinct batch sizes) a target needs to be fitted: two parameters and one
#: degree of freedom.
MIN_RUNS = 3


@dataclass(frozen=True, kw_only=True)
class RunPoint:
    """Where one run first reached a target."""

    label: str
    """The run, for messages and tables (its log file or TensorBoard directory)."""
    batch_size: int
    """Its global batch size B, in samples."""
    steps: float
    """Optimizer steps S to the target."""
    samples: float
    """Samples E to the target (S x B for a run at one batch size from step 0)."""


@dataclass(frozen=True, kw_only=True)
class Fit:
    """The least-squares hyperbola through a target's points (module docstring)."""

    s_min: float
    e_min: float
    b_crit: float
    residuals: tuple[tuple[float, float], ...]
    """Per point, in the order given: (log S - log S(B), log E - log E(B)), natural log (0.05 is
    about 5 %)."""

    @property
    def rms_log_residual(self) -> float:
        """The root mean square of the 2n log residuals: the fit's typical multiplicative error."""
        values = [r for pair in self.residuals for r in pair]
        return math.sqrt(sum(r * r for r in values) / len(values))

    def steps(self, batch_size: float) -> float:
        return self.s_min * (1 + self.b_crit / batch_size)

    def samples(self, batch_size: float) -> float:
        return self.e_min * (1 + batch_size / self.b_crit)


@dataclass(frozen=True, kw_only=True)
class Interval:
    """An interval of B_crit, profile likelihood or percentile bootstrap; an end is None where the
    data do not bound it (module docstring). The resample counts are the bootstrap's (0 for the
    profile)."""

    low: float | None
    high: float | None
    level: float
    method: str = "bootstrap"
    """``profile`` or ``bootstrap``."""
    resamples: int = 0
    """Resamples drawn."""
    used: int = 0
    """Resamples fitted (the others had fewer than 3 distinct batch sizes)."""
    below: int = 0
    """Fitted resamples whose fit ran to the search's lower edge (B_crit -> 0: every drawn run above
    the knee)."""
    above: int = 0
    """Fitted resamples whose fit ran to the search's upper edge (B_crit -> inf: every drawn run
    below the knee)."""
    seed: int = 0


def fit_hyperbola(points: Sequence[RunPoint]) -> Fit:
    """The least-squares fit of the module docstring, whatever side of the knee the points lie on
    (the caller judges that: :func:`fit_target`). Needs at least 2 points with distinct batch
    sizes."""
    if len({p.batch_size for p in points}) < 2:
        raise CriticalBatchError(
            f"the hyperbola needs points at 2 or more batch sizes ({len(points)} given)."
        )
    for p in points:
        if not (
            p.batch_size > 0
            and p.steps > 0
            and p.samples > 0
            and math.isfinite(p.steps * p.samples)
        ):
            raise CriticalBatchError(
                f"run {p.label}: batch size {p.batch_size}, steps {p.steps!r} and samples "
                f"{p.samples!r} must all be positive finite numbers."
            )
    logs = [(float(p.batch_size), math.log(p.steps), math.log(p.samples)) for p in points]
    b_crit, a = _fit_logs(logs, [1] * len(logs))
    residuals = tuple(
        (s - a - math.log1p(b_crit / b), e - a - math.log(b_crit + b)) for b, s, e in logs
    )
    s_min = math.exp(a)
    return Fit(s_min=s_min, e_min=s_min * b_crit, b_crit=b_crit, residuals=residuals)


def _fit_logs(
    logs: Sequence[tuple[float, float, float]], weights: Sequence[int], edges: bool = False
) -> tuple[float, float]:
    """(B_crit, a = log S_min) minimising the weighted sum of squares over (B, log S, log E) points:
    a point of weight w counts as w copies (a bootstrap resample draws a run more than once). With
    ``edges``, a minimum at the search's edge (within a hundredth of a grid step) gives B_crit =
    -inf or +inf: not determined."""
    sizes = [b for b, _, _ in logs]
    low, high = math.log(min(sizes) / REACH), math.log(max(sizes) * REACH)
    u = _minimise(lambda x: _rss(logs, weights, x)[0], low, high)
    margin = (high - low) / (GRID - 1) / 100
    if edges and not low + margin < u < high - margin:
        return (-math.inf if u - low < high - u else math.inf), math.nan
    return math.exp(u), _rss(logs, weights, u)[1]


def _rss(
    logs: Sequence[tuple[float, float, float]], weights: Sequence[int], u: float
) -> tuple[float, float]:
    """(residual sum of squares in log S, a) at B_crit = exp(u), a at its closed-form best (the
    weighted mean residual). log E is not summed: its residual equals log S's (module docstring)."""
    c = math.exp(u)
    r = [(s - math.log1p(c / b), w) for (b, s, _), w in zip(logs, weights)]
    a = sum(w * x for x, w in r) / sum(weights)
    return sum(w * (x - a) ** 2 for x, w in r), a


def _minimise(f: Callable[[float], float], low: float, high: float) -> float:
    """The argmin of ``f`` on [low, high]: the best of :data:`GRID` points, then a golden section
    between its neighbours (the profile is smooth; the grid keeps the section off a far local
    minimum)."""
    step = (high - low) / (GRID - 1)
    grid = [low + i * step for i in range(GRID)]
    best = min(range(GRID), key=lambda i: f(grid[i]))
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, GRID - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    x1, x2 = b - ratio * (b - a), a + ratio * (b - a)
    f1, f2 = f(x1), f(x2)
    for _ in range(GOLDEN_ITERATIONS):
        if f1 <= f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - ratio * (b - a)
            f1 = f(x1)
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + ratio * (b - a)
            f2 = f(x2)
    return (a + b) / 2


def not_fittable_reason(points: Sequence[RunPoint], fit: Fit | None) -> str | None:
    """Why a target's points cannot determine both S_min and E_min (module docstring), or None."""
    sizes = sorted({p.batch_size for p in points})
    if len(points) < MIN_RUNS or len(sizes) < MIN_RUNS:
        return (
            f"{len(points)} run(s) at {len(sizes)} batch size(s) reached it; the fit needs at "
            f"least {MIN_RUNS} "
            "runs at distinct batch sizes"
        )
    if fit is None:
        return None
    if fit.b_crit < sizes[0]:
        return (
            f"every run is above the knee: the fit puts B_crit at {fit.b_crit:.4g}, below the "
            "smallest batch "
            f"size {sizes[0]:,}, where S is flat at S_min and E_min (so B_crit) is not "
            "determined; add runs at smaller batch sizes"
        )
    if fit.b_crit > sizes[-1]:
        return (
            f"every run is below the knee: the fit puts B_crit at {fit.b_crit:.4g}, above the "
            "largest batch "
            f"size {sizes[-1]:,}, where E is flat at E_min and S_min (so B_crit) is not "
            "determined; add runs at larger batch sizes"
        )
    return None


def steps_rise(points: Sequence[RunPoint]) -> list[tuple[RunPoint, RunPoint]]:
    """Pairs of runs at neighbouring batch sizes (the fewest steps at each) where the larger batch
    needed more steps: the hyperbola has S fall as B grows, so such a run is limited by something
    the model leaves out (its LR, its warmup, the run's length)."""
    fewest: dict[int, RunPoint] = {}
    for p in points:
        if p.batch_size not in fewest or p.steps < fewest[p.batch_size].steps:
            fewest[p.batch_size] = p
    ordered = [fewest[b] for b in sorted(fewest)]
    return [
        (small, large) for small, large in itertools.pairwise(ordered) if large.steps > small.steps
    ]


def pareto_split(points: Sequence[RunPoint]) -> tuple[tuple[RunPoint, ...], tuple[RunPoint, ...]]:
    """(kept, dominated): the runs at a batch size whose geometric-mean steps and samples are both
    at least another batch size's, one strictly more, are dominated (module docstring); the others
    are kept, in the order given."""
    by_size: dict[int, list[RunPoint]] = {}
    for p in points:
        by_size.setdefault(p.batch_size, []).append(p)
    means = {
        b: (
            sum(math.log(p.steps) for p in ps) / len(ps),
            sum(math.log(p.samples) for p in ps) / len(ps),
        )
        for b, ps in by_size.items()
    }
    dominated = {
        b
        for b, (s, e) in means.items()
        if any(
            s2 <= s and e2 <= e and (s2, e2) != (s, e) for b2, (s2, e2) in means.items() if b2 != b
        )
    }
    return (
        tuple(p for p in points if p.batch_size not in dominated),
        tuple(p for p in points if p.batch_size in dominated),
    )


def profile_b_crit(points: Sequence[RunPoint], *, level: float = 0.95) -> Interval:
    """The profile-likelihood interval of B_crit (module docstring;
    science/core/profile_interval.py)."""
    if len(points) < MIN_RUNS:
        raise CriticalBatchError(
            f"the profile interval needs at least {MIN_RUNS} runs ({len(points)} given)."
        )
    logs = [(float(p.batch_size), math.log(p.steps), math.log(p.samples)) for p in points]
    weights = [1] * len(logs)
    b_crit, _ = _fit_logs(logs, weights)
    best = math.log(b_crit)
    least = _rss(logs, weights, best)[0]
    threshold = least * (1 + t_quantile(level, len(points) - 2) ** 2 / (len(points) - 2))
    sizes = [b for b, _, _ in logs]
    low, high = profile_bounds(
        lambda u: _rss(logs, weights, u)[0],
        best,
        math.log(min(sizes) / REACH),
        math.log(max(sizes) * REACH),
        threshold,
    )
    return Interval(
        low=None if low is None else math.exp(low),
        high=None if high is None else math.exp(high),
        level=level,
        method="profile",
    )


def bootstrap_b_crit(
    points: Sequence[RunPoint], *, resamples: int = 1000, seed: int = 0, level: float = 0.95
) -> Interval:
    """The percentile bootstrap interval of B_crit over runs (module docstring)."""
    if resamples < 1:
        raise CriticalBatchError(f"the bootstrap needs at least 1 resample ({resamples} given).")
    if not 0 < level < 1:
        raise CriticalBatchError(
            f"the interval's level {level!r} must lie strictly between 0 and 1, e.g. 0.95."
        )
    rng = random.Random(seed)
    logs = [(float(p.batch_size), math.log(p.steps), math.log(p.samples)) for p in points]
    values = []
    fitted: dict[
        tuple[int, ...], float
    ] = {}  # a resample is its counts: few runs draw the same counts often
    for _ in range(resamples):
        counts = [0] * len(points)
        for _ in points:
            counts[rng.randrange(len(points))] += 1
        drawn = [k for k, count in enumerate(counts) if count]
        if len({points[k].batch_size for k in drawn}) >= MIN_RUNS:
            key = tuple(counts)
            if key not in fitted:
                fitted[key] = _fit_logs(
                    [logs[k] for k in drawn], [counts[k] for k in drawn], edges=True
                )[0]
            values.append(fitted[key])
    if not values:
        raise CriticalBatchError(
            f"no bootstrap resample of {len(points)} runs had {MIN_RUNS} distinct batch sizes."
        )
    values.sort()
    return Interval(
        low=_quantile(values, (1 - level) / 2),
        high=_quantile(values, (1 + level) / 2),
        level=level,
        resamples=resamples,
        used=len(values),
        below=values.count(-math.inf),
        above=values.count(math.inf),
        seed=seed,
    )


def _quantile(ordered: Sequence[float], q: float) -> float | None:
    """The q quantile of sorted values, linear between order statistics (numpy's default); None
    where it touches an infinite (undetermined) value."""
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    share = position - below
    low, high = ordered[below], ordered[min(below + 1, len(ordered) - 1)]
    if not math.isfinite(low) or (share and not math.isfinite(high)):
        return None
    return low + (high - low) * share if share else low
