"""science/core/critical_batch.py and science/core/loss_curve.py: the hyperbola fit on points drawn
from known hyperbolas, its intervals (with the profile's coverage over many synthetic sweeps), the
dominated runs it leaves out, the targets it refuses, and the rule by which a run reaches a
target."""

import math
import random

import pytest

from megatron_ga_ext.errors import CriticalBatchError, GAError
from megatron_ga_ext.science.core.critical_batch import (
    RunPoint,
    bootstrap_b_crit,
    fit_hyperbola,
    pareto_split,
    steps_rise,
)
from megatron_ga_ext.science.core.critical_batch_targets import default_targets, fit_target
from megatron_ga_ext.science.core.loss_curve import (
    LossPoint,
    first_reach,
    read_megatron_log,
    smooth,
)
from megatron_ga_ext.science.core.profile_interval import profile_bounds, t_quantile

#: 8 runs over a 128x span of batch sizes, B_crit = 64 in its middle.
SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)


def sweep(
    b_crit: float, s_min: float, sizes=SIZES, sigma: float = 0.0, seed: int = 0
) -> list[RunPoint]:
    """Points on S = S_min (1 + B_crit / B), E = S x B, each run's S times exp(N(0, sigma))
    (seeded)."""
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
        assert (fit.steps(b) / fit.s_min - 1) * (fit.samples(b) / fit.e_min - 1) == pytest.approx(
            1.0
        )


#: The coverage designs: (batch sizes, runs per batch size, true B_crit, a dominated run past the
#: largest size).
DESIGNS = [
    ((8, 16, 32, 64, 128), 1, 20.0, False),
    ((4, 8, 16, 32, 64, 128), 1, 20.0, False),
    ((4, 8, 16, 32, 64, 128), 3, 20.0, False),
    ((4, 8, 16, 32, 64, 128), 3, 60.0, False),
    ((4, 8, 16, 32, 64, 128), 1, 20.0, True),
    (SIZES, 1, 64.0, False),
]


def synthetic(design, rng: random.Random, sigma: float = 0.1) -> list[RunPoint]:
    """One synthetic sweep of ``design``: S times exp(N(0, sigma)) per run; the dominated run (where
    asked) at twice the largest size needs 1.5x the largest size's noiseless steps."""
    sizes, seeds, b_crit, dominated = design
    points = [
        RunPoint(label=f"gbs{b}-seed{k}", batch_size=b, steps=s, samples=s * b)
        for b in sizes
        for k in range(seeds)
        for s in [100.0 * (1 + b_crit / b) * math.exp(rng.gauss(0, sigma))]
    ]
    if dominated:
        steps = 100.0 * (1 + b_crit / sizes[-1]) * 1.5
        points.append(
            RunPoint(
                label="dominated",
                batch_size=2 * sizes[-1],
                steps=steps,
                samples=steps * 2 * sizes[-1],
            )
        )
    return points


def coverage(design, sweeps: int, interval: str = "profile") -> tuple[float, int]:
    """(share of the fitted sweeps whose 95 % interval holds the true B_crit, sweeps fitted) over
    ``sweeps`` seeded synthetic sweeps of ``design``, dominated runs left out (the default)."""
    rng, covered, fitted = random.Random(0), 0, 0
    for _ in range(sweeps):
        result = fit_target(3.0, synthetic(design, rng), interval=interval, resamples=200)
        if result.interval is None:
            continue
        fitted += 1
        low, high = result.interval.low or 0.0, result.interval.high or math.inf
        covered += low <= design[2] <= high
    return covered / fitted, fitted


@pytest.mark.parametrize(
    "design", DESIGNS, ids=lambda d: f"{len(d[0])}sizes-x{d[1]}-bcrit{d[2]:g}-dom{d[3]:d}"
)
def test_the_profile_interval_covers_at_its_level_on_many_synthetic_sweeps(design):
    """1,000 synthetic sweeps per design, 10 % log-normal noise on S (about the benchmark's seed
    noise): the 95 % profile interval holds the true B_crit in 92 % to 98 % of the fitted ones
    (binomial sd 0.7 %); printed for docs/critical-batch.md (pytest -s)."""
    share, fitted = coverage(design, 1000)
    print(f"\nprofile 95% coverage, {design}: {share:.3f} of {fitted} fitted sweeps")
    assert fitted >= 950
    assert 0.92 <= share <= 0.98, share


def test_the_bootstrap_covers_less_than_its_level_with_few_runs():
    """The percentile bootstrap over the 5 runs of one seed's sweep: printed beside the profile's
    (pytest -s); it covers less (few distinct resamples), the reason the profile is the default."""
    design = DESIGNS[0]
    boot, _ = coverage(design, 200, interval="bootstrap")
    profile, _ = coverage(design, 200)
    print(f"\n5 runs, 95% intervals over 200 sweeps: bootstrap {boot:.3f}, profile {profile:.3f}")
    assert boot < profile


def test_a_dominated_run_is_left_out_and_reported():
    """Five runs on a hyperbola with B_crit 20 and a sixth at GBS 256 that needs more steps and
    samples than GBS 128: it is left out and reported, and the fit gives back B_crit; kept, it pulls
    B_crit down."""
    clean = sweep(20.0, 100.0, sizes=(8, 16, 32, 64, 128))
    extra = RunPoint(
        label="gbs256",
        batch_size=256,
        steps=clean[-1].steps * 1.5,
        samples=clean[-1].steps * 1.5 * 256,
    )
    result = fit_target(3.0, [*clean, extra])
    assert [p.label for p in result.dominated] == ["gbs256"]
    assert [p.label for p in result.points] == [p.label for p in clean]
    assert result.fit is not None and result.fit.b_crit == pytest.approx(20.0)
    kept = fit_target(3.0, [*clean, extra], keep_dominated=True)
    assert kept.dominated == () and kept.fit is not None and kept.fit.b_crit < 15.0


def test_seeds_are_judged_by_their_geometric_mean_per_batch_size():
    """Three runs at each size: one seed of GBS 64 needing more steps than a seed of GBS 32 leaves
    none out, since GBS 64's mean is below GBS 32's; pareto_split keeps the order given."""
    points = [
        RunPoint(label=f"gbs{b}-{k}", batch_size=b, steps=s, samples=s * b)
        for b, steps in ((16, (300, 310, 290)), (32, (200, 190, 260)), (64, (150, 250, 140)))
        for k, s in enumerate(steps)
    ]
    kept, dominated = pareto_split(points)
    assert kept == tuple(points) and dominated == ()
    worse = [*points, RunPoint(label="gbs128", batch_size=128, steps=240.0, samples=240.0 * 128)]
    assert [p.label for p in pareto_split(worse)[1]] == ["gbs128"]


def test_one_seeded_sweep_numbers():
    """The example docs/critical-batch.md quotes: seed 0, 5 % noise, true B_crit 64; noise makes GBS
    8 need more samples than GBS 16 here (E is nearly flat below the knee), so it is left out as
    dominated."""
    result = fit_target(3.0, sweep(64.0, 1000.0, sigma=0.05, seed=0))
    assert result.fit is not None and result.interval is not None
    assert [p.batch_size for p in result.dominated] == [8]
    assert (result.fit.b_crit, result.interval.low, result.interval.high) == pytest.approx(
        (61.0, 53.8, 69.0), abs=0.05
    )
    assert result.interval.method == "profile"
    assert 0.04 > result.fit.rms_log_residual > 0.01


def test_the_t_quantile_and_the_profile_ends():
    assert [round(t_quantile(0.95, df), 3) for df in (1, 2, 3, 4, 10, 30)] == [
        12.706,
        4.303,
        3.182,
        2.776,
        2.228,
        2.042,
    ]
    # a parabola: {u : u^2 <= 4} is [-2, 2]; cut at the range's edge, that end is not bounded
    assert profile_bounds(lambda u: u * u, 0.0, -10.0, 10.0, 4.0) == pytest.approx((-2.0, 2.0))
    assert profile_bounds(lambda u: u * u, 0.0, -1.0, 10.0, 4.0)[0] is None
    with pytest.raises(CriticalBatchError, match="at least 1 degree"):
        t_quantile(0.95, 0)


def test_the_bootstrap_is_seeded():
    points = sweep(64.0, 1000.0, sigma=0.05, seed=3)
    assert bootstrap_b_crit(points, resamples=200, seed=7) == bootstrap_b_crit(
        points, resamples=200, seed=7
    )
    assert bootstrap_b_crit(points, resamples=200, seed=7) != bootstrap_b_crit(
        points, resamples=200, seed=8
    )


@pytest.mark.parametrize(
    ("sizes", "side"),
    [((512, 1024, 2048, 4096), "above the knee"), ((1, 2, 4, 8), "below the knee")],
)
def test_points_on_one_side_of_the_knee_are_not_fitted(sizes, side):
    result = fit_target(
        3.0, sweep(64.0, 1000.0, sizes=sizes, sigma=0.05, seed=1), keep_dominated=True
    )
    assert result.fit is None and result.interval is None
    assert side in result.reason and "not determined" in result.reason


def test_resamples_that_run_to_the_search_edge_leave_that_end_unbounded():
    """Five runs whose largest batch needs more steps than the one before it (an LR- or
    warmup-limited large batch, as in docs/noise-scale.md's sweep): a resample of only the three
    largest has its minimum at B_crit -> 0. Such resamples count as -inf, so the lower end is None
    (not the search's edge, 32 / 1000); the same sweep without the rise bounds both ends."""
    clean = sweep(20.0, 100.0, sizes=(8, 16, 32, 64, 128))
    rising = [
        *clean[:4],
        RunPoint(
            label="gbs128", batch_size=128, steps=clean[4].steps * 2, samples=clean[4].samples * 2
        ),
    ]
    result = fit_target(3.0, rising, interval="bootstrap", keep_dominated=True)
    assert result.fit is not None and result.interval is not None, result.reason
    interval = result.interval
    assert interval.low is None and interval.above == 0
    assert interval.below > (1 - interval.level) / 2 * interval.used
    assert interval.high is not None and result.fit.b_crit < interval.high < 128
    assert [(a.batch_size, b.batch_size) for a, b in steps_rise(rising)] == [
        (64, 128)
    ] and not steps_rise(clean)
    bounded = fit_target(3.0, clean, interval="bootstrap").interval
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


# -- reaching a target
# -------------------------------------------------------------------------------

CURVE = tuple(
    LossPoint(iteration=i, consumed_samples=16 * i, loss=v)
    for i, v in ((10, 4.0), (20, 3.0), (30, 2.0))
)


def test_first_reach_is_the_first_point_at_or_below_or_interpolated():
    assert first_reach(CURVE, 3.0) == (20.0, 320.0)
    assert first_reach(CURVE, 2.5) == (30.0, 480.0)
    assert first_reach(CURVE, 2.5, interpolate=True) == pytest.approx((25.0, 400.0))
    assert first_reach(CURVE, 1.0) is None


def test_smoothing_is_an_ema_over_logged_points():
    assert [p.loss for p in smooth(CURVE, 0.5)] == pytest.approx([4.0, 3.5, 2.75])
    with pytest.raises(
        CriticalBatchError, match=r"--train-loss-smoothing 1.0 must be an EMA decay in \[0, 1\)"
    ):
        smooth(CURVE, 1.0)


def test_a_run_whose_batch_size_changes_is_refused():
    lines = [
        f" [t] iteration {i:8d}/     100 | consumed samples: {16 * i:12d} | global batch size: "
        f"{b:5d} | "
        "lm loss: 3.0E+00 |"
        for i, b in ((10, 16), (20, 32))
    ]
    with pytest.raises(
        CriticalBatchError, match=r"global batch size changes \(16 from iteration 10, 32 from"
    ):
        read_megatron_log(lines, "run.log")
