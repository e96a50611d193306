"""core/critical_batch.py and core/loss_curve.py: the hyperbola fit on points drawn from known hyperbolas, its
bootstrap interval, the targets it refuses, and the rule by which a run reaches a target."""

import math
import random

import pytest

from megatron_ga_ext.core.critical_batch import (
    RunPoint,
    bootstrap_b_crit,
    default_targets,
    fit_hyperbola,
    fit_target,
    steps_rise,
)
from megatron_ga_ext.core.loss_curve import LossPoint, first_reach, read_megatron_log, smooth
from megatron_ga_ext.errors import CriticalBatchError, GAError

#: 8 runs over a 128x span of batch sizes, B_crit = 64 in its middle.
SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)


def sweep(b_crit: float, s_min: float, sizes=SIZES, sigma: float = 0.0, seed: int = 0) -> list[RunPoint]:
    """Points on S = S_min (1 + B_crit / B), E = S x B, each run's S times exp(N(0, sigma)) (seeded)."""
    rng = random.Random(seed)
    points = []
    for b in sizes:
        steps = s_min * (1 + b_crit / b) * math.exp(rng.gauss(0, sigma))
        points.append(RunPoint(label=f"gbs{b}", batch_size=b, steps=steps, samples=steps * b))
    return points


@pytest.mark.parametrize("b_crit", [12.0, 64.0, 700.0])
def test_exact_points_give_back_their_hyperbola(b_crit):
    fit = fit_hyperbola(sweep(b_crit, 1500.0))
    assert fit.b_crit == pytest.approx(b_crit, rel=1e-6)
    assert fit.s_min == pytest.approx(1500.0, rel=1e-6)
    assert fit.e_min == pytest.approx(1500.0 * b_crit, rel=1e-6)
    assert fit.rms_log_residual < 1e-6
    # the fitted curve is McCandlish's hyperbola: (S/S_min - 1)(E/E_min - 1) = 1 at every B
    for b in (3.0, 64.0, 5000.0):
        assert (fit.steps(b) / fit.s_min - 1) * (fit.samples(b) / fit.e_min - 1) == pytest.approx(1.0)


def test_noisy_sweeps_recover_b_crit_within_their_interval():
    """20 seeded sweeps with 5 % log-normal noise on S: the 95 % percentile interval holds the true B_crit = 64 in
    at least 16 of them (a percentile bootstrap over 8 runs covers less than its nominal level: 19 of 20 here), and
    no interval is wider than a factor 1.6 (high / low)."""
    covered, widths, estimates = 0, [], []
    for seed in range(20):
        result = fit_target(3.0, sweep(64.0, 1000.0, sigma=0.05, seed=seed), resamples=300, seed=seed)
        assert result.fit is not None and result.interval is not None, result.reason
        estimates.append(result.fit.b_crit)
        widths.append(result.interval.high / result.interval.low)
        covered += result.interval.low <= 64.0 <= result.interval.high
    assert covered >= 16, (covered, estimates)
    assert max(widths) < 1.6, widths
    assert 0.85 < math.exp(sum(math.log(e) for e in estimates) / len(estimates)) / 64.0 < 1.15


def test_one_seeded_sweep_numbers():
    """The example docs/critical-batch.md quotes: seed 0, 5 % noise, true B_crit 64."""
    result = fit_target(3.0, sweep(64.0, 1000.0, sigma=0.05, seed=0), resamples=1000, seed=0)
    assert result.fit is not None and result.interval is not None
    assert (result.fit.b_crit, result.interval.low, result.interval.high) == pytest.approx((64.8, 58.1, 70.7), abs=0.05)
    assert 0.04 > result.fit.rms_log_residual > 0.01


def test_the_bootstrap_is_seeded():
    points = sweep(64.0, 1000.0, sigma=0.05, seed=3)
    assert bootstrap_b_crit(points, resamples=200, seed=7) == bootstrap_b_crit(points, resamples=200, seed=7)
    assert bootstrap_b_crit(points, resamples=200, seed=7) != bootstrap_b_crit(points, resamples=200, seed=8)


@pytest.mark.parametrize(
    ("sizes", "side"), [((512, 1024, 2048, 4096), "above the knee"), ((1, 2, 4, 8), "below the knee")]
)
def test_points_on_one_side_of_the_knee_are_not_fitted(sizes, side):
    result = fit_target(3.0, sweep(64.0, 1000.0, sizes=sizes, sigma=0.05, seed=1))
    assert result.fit is None and result.interval is None
    assert side in result.reason and "not determined" in result.reason


def test_resamples_that_run_to_the_search_edge_leave_that_end_unbounded():
    """Five runs whose largest batch needs more steps than the one before it (an LR- or warmup-limited large batch,
    as in docs/noise-scale.md's sweep): a resample of only the three largest has its minimum at B_crit -> 0. Such
    resamples count as -inf, so the lower end is None (not the search's edge, 32 / 1000); the same sweep without
    the rise bounds both ends."""
    clean = sweep(20.0, 100.0, sizes=(8, 16, 32, 64, 128))
    rising = [
        *clean[:4],
        RunPoint(label="gbs128", batch_size=128, steps=clean[4].steps * 2, samples=clean[4].samples * 2),
    ]
    result = fit_target(3.0, rising)
    assert result.fit is not None and result.interval is not None, result.reason
    interval = result.interval
    assert interval.low is None and interval.above == 0
    assert interval.below > (1 - interval.level) / 2 * interval.used
    assert interval.high is not None and result.fit.b_crit < interval.high < 128
    assert [(a.batch_size, b.batch_size) for a, b in steps_rise(rising)] == [(64, 128)] and not steps_rise(clean)
    bounded = fit_target(3.0, clean).interval
    assert bounded is not None and bounded.below == bounded.above == 0
    assert bounded.low == pytest.approx(20.0) and bounded.high == pytest.approx(20.0)


@pytest.mark.parametrize("sizes", [(16, 64), (16, 16, 64)])
def test_too_few_runs_or_batch_sizes_are_not_fitted(sizes):
    result = fit_target(3.0, sweep(32.0, 1000.0, sizes=sizes))
    assert result.fit is None
    assert "the fit needs at least 3 runs at distinct batch sizes" in result.reason


def test_default_targets_lie_between_what_every_run_reaches():
    assert default_targets(2.0, 3.5, 3) == pytest.approx([3.0, 2.5, 2.0])
    with pytest.raises(CriticalBatchError, match=r"do not overlap.*give --targets"):
        default_targets(3.0, 2.9, 3)


def test_bad_fit_inputs_are_typed_errors():
    with pytest.raises(GAError, match="2 or more batch sizes"):
        fit_hyperbola(sweep(64.0, 10.0, sizes=(16,)))
    with pytest.raises(CriticalBatchError, match=r"level 1\.5"):
        bootstrap_b_crit(sweep(64.0, 10.0), level=1.5)


# -- reaching a target -------------------------------------------------------------------------------

CURVE = tuple(LossPoint(iteration=i, consumed_samples=16 * i, loss=v) for i, v in ((10, 4.0), (20, 3.0), (30, 2.0)))


def test_first_reach_is_the_first_point_at_or_below_or_interpolated():
    assert first_reach(CURVE, 3.0) == (20.0, 320.0)
    assert first_reach(CURVE, 2.5) == (30.0, 480.0)
    assert first_reach(CURVE, 2.5, interpolate=True) == pytest.approx((25.0, 400.0))
    assert first_reach(CURVE, 1.0) is None


def test_smoothing_is_an_ema_over_logged_points():
    assert [p.loss for p in smooth(CURVE, 0.5)] == pytest.approx([4.0, 3.5, 2.75])
    with pytest.raises(CriticalBatchError, match=r"--train-loss-smoothing 1.0 must be an EMA decay in \[0, 1\)"):
        smooth(CURVE, 1.0)


def test_a_run_whose_batch_size_changes_is_refused():
    lines = [
        f" [t] iteration {i:8d}/     100 | consumed samples: {16 * i:12d} | global batch size: {b:5d} | "
        "lm loss: 3.0E+00 |"
        for i, b in ((10, 16), (20, 32))
    ]
    with pytest.raises(CriticalBatchError, match=r"global batch size changes \(16 from iteration 10, 32 from"):
        read_megatron_log(lines, "run.log")
