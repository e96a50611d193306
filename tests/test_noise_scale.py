"""The noise-scale estimator against the truth: synthetic gradients of known covariance, thousands
of trials.

An unbiased estimator's mean over T trials lies within 4 standard errors of the truth (a false alarm
about once in 16,000 runs, and the seeds are fixed); the equal-count formula on unequal counts
misses by many.
"""

import json
import math
from fractions import Fraction

import pytest

from megatron_ga_ext.errors import NoiseScaleError
from megatron_ga_ext.science.core.noise_scale import (
    NoiseEstimate,
    NoiseScaleEMA,
    b_simple,
    equal_count_estimate,
    replica_estimate,
    two_batch_estimate,
)
from tests.support.noise_scale import COUNTS, Problem, simulate, summarise, unbiasedness_rows

TRIALS = 4000


@pytest.fixture(scope="module")
def rows():
    return {
        (regime, name.split()[0], quantity): summary
        for regime, name, quantity, summary in unbiasedness_rows(TRIALS)
    }


@pytest.mark.parametrize("regime", COUNTS)
@pytest.mark.parametrize("quantity", ["tr(Sigma)", "|G|^2"])
def test_the_estimator_is_unbiased_on_equal_and_unequal_counts(rows, regime, quantity):
    summary = rows[(regime, "unequal-count", quantity)]
    assert abs(summary.bias_in_errors) <= 4, summary
    assert summary.standard_error < 0.02 * summary.truth  # the test can see a bias of a few percent


@pytest.mark.parametrize("quantity", ["tr(Sigma)", "|G|^2"])
def test_the_equal_count_formula_is_unbiased_only_on_equal_counts(rows, quantity):
    assert abs(rows[("equal", "equal-count", quantity)].bias_in_errors) <= 4
    assert abs(rows[("unequal", "equal-count", quantity)].bias_in_errors) > 20


def test_the_equal_count_bias_is_the_derived_factor(rows):
    """E[tr^] = tr(Sigma) (h - 1/N) / ((K - 1)/N) for the formula that takes B_small = N/K."""
    counts = COUNTS["unequal"]
    total, k = sum(counts), len(counts)
    h = sum(Fraction(1, b) for b in counts) / k
    factor = float((h - Fraction(1, total)) / Fraction(k - 1, total))
    summary = rows[("unequal", "equal-count", "tr(Sigma)")]
    assert abs(summary.mean - factor * summary.truth) <= 4 * summary.standard_error
    assert factor > 1.8


def test_exact_expectations_give_the_truth():
    """Fed E|g_r|^2 = |G|^2 + tr/b_r and E|g|^2 = |G|^2 + tr/N, the estimator returns (tr, |G|^2)
    exactly."""
    trace, grad_sq, counts = 3.0, 0.25, [5, 17, 100, 2]
    total = sum(counts)
    estimate = replica_estimate(
        [grad_sq + trace / b for b in counts], grad_sq + trace / total, counts
    )
    assert estimate.trace_sigma == pytest.approx(trace, rel=1e-12)
    assert estimate.grad_sq == pytest.approx(grad_sq, rel=1e-12)
    assert estimate.tokens == total and estimate.b_simple_tokens == pytest.approx(12.0)


def test_it_is_mccandlish_with_the_harmonic_mean_as_the_small_batch():
    local, reduced, counts = [1.3, 0.9, 2.2], 0.7, [10, 30, 6]
    harmonic = len(counts) / sum(1 / b for b in counts)
    ours = replica_estimate(local, reduced, counts)
    pair = two_batch_estimate(sum(local) / 3, harmonic, reduced, sum(counts))
    assert (ours.trace_sigma, ours.grad_sq) == pytest.approx(pair, rel=1e-12)
    equal = [24, 24, 24]
    ours, his = replica_estimate(local, reduced, equal), equal_count_estimate(local, reduced, equal)
    assert (ours.trace_sigma, ours.grad_sq) == pytest.approx(
        (his.trace_sigma, his.grad_sq), rel=1e-12
    )


def test_huge_token_counts_keep_their_precision():
    """h - 1/N in exact arithmetic: at N ~ 4e12 tokens the float difference would lose digits."""
    counts = [10**12 + 1, 10**12 + 3, 10**12 + 7, 10**12]
    trace, grad_sq = 5.0, 1e-6
    estimate = replica_estimate(
        [grad_sq + trace / b for b in counts], grad_sq + trace / sum(counts), counts
    )
    assert estimate.trace_sigma == pytest.approx(trace, rel=1e-6)


def test_integer_scalars_from_torch_count_as_token_counts():
    torch = pytest.importorskip("torch")
    counts = [torch.tensor(4), torch.tensor(12)]
    assert replica_estimate([1.0, 0.5], 0.4, counts).tokens == 16


@pytest.mark.parametrize(
    "local, reduced, counts, match",
    [
        ([1.0], 0.5, [8], r"1 replica\(s\): the noise estimate needs at least 2"),
        ([1.0, 2.0], 0.5, [8], r"1 token counts for 2 local squared norms"),
        ([1.0, 2.0], 0.5, [8, 0], r"tokens\[1\] 0 is not a token count >= 1"),
        ([1.0, 2.0], 0.5, [8, True], r"tokens\[1\] True is not a token count"),
        ([1.0, 2.0], 0.5, [8, 2.5], r"tokens\[1\] 2.5 is not a token count"),
        ([1.0, -2.0], 0.5, [8, 8], r"local_sq_norms\[1\] -2.0 is not a squared norm"),
        (
            [1.0, 2.0],
            math.inf,
            [8, 8],
            r"global_sq_norm inf is not a squared norm .* skip the step",
        ),
        ([math.nan, 2.0], 0.5, [8, 8], r"local_sq_norms\[0\] nan"),
    ],
)
def test_bad_measurements_are_refused(local, reduced, counts, match):
    with pytest.raises(NoiseScaleError, match=match):
        replica_estimate(local, reduced, counts)


def test_two_batch_refuses_batches_that_say_nothing():
    with pytest.raises(NoiseScaleError, match=r"0 < small < big"):
        two_batch_estimate(1.0, 8, 0.5, 8)


def test_b_simple_in_tokens_and_samples_and_where_undefined():
    assert b_simple(8.0, 0.5) == 16.0
    assert b_simple(8.0, 0.5, tokens_per_sample=4) == 4.0
    assert (
        b_simple(8.0, -0.1) is None and b_simple(-1.0, 0.5) is None and b_simple(1.0, 0.0) is None
    )
    with pytest.raises(
        NoiseScaleError, match=r"tokens_per_sample 0 must be a positive finite number"
    ):
        b_simple(8.0, 0.5, tokens_per_sample=0)


# -- the EMA ---------------------------------------------------------------------------------


def _estimates():
    return [
        NoiseEstimate(trace_sigma=t, grad_sq=g, tokens=64)
        for t, g in [(10, 1), (12, -0.5), (8, 2), (11, 0.7)]
    ]


def test_ema_divides_the_averages_never_averages_the_ratio():
    ema = NoiseScaleEMA(decay=0.5)
    for estimate in _estimates():
        ema.update(estimate)
    weights = [0.5 ** (3 - i) * 0.5 for i in range(4)]
    trace = sum(w * e.trace_sigma for w, e in zip(weights, _estimates()))
    grad_sq = sum(w * e.grad_sq for w, e in zip(weights, _estimates()))
    assert ema.b_simple() == pytest.approx(trace / grad_sq)
    assert ema.trace_sigma == pytest.approx(trace / (1 - 0.5**4))  # bias-corrected parts
    assert ema.grad_sq == pytest.approx(grad_sq / (1 - 0.5**4))
    assert ema.b_simple(tokens_per_sample=4) == pytest.approx(trace / grad_sq / 4)


def test_ema_after_one_update_is_that_estimate():
    ema = NoiseScaleEMA(decay=0.99)
    assert ema.trace_sigma is None and ema.b_simple() is None
    ema.update(_estimates()[0])
    assert ema.trace_sigma == pytest.approx(10) and ema.grad_sq == pytest.approx(1)


def test_ema_converges_to_the_truth_on_synthetic_gradients():
    problem = Problem.make(seed=3)
    counts = COUNTS["unequal"]
    local, reduced = simulate(problem, counts, 2000, seed=4)
    ema = NoiseScaleEMA(decay=0.999)
    for norms, g in zip(local, reduced):
        ema.update(replica_estimate(norms, g, counts))
    assert ema.b_simple() == pytest.approx(problem.trace_sigma / problem.grad_sq, rel=0.1)


def test_ema_state_round_trips_and_resumes_exactly():
    whole, first = NoiseScaleEMA(decay=0.9), NoiseScaleEMA(decay=0.9)
    estimates = _estimates()
    for estimate in estimates:
        whole.update(estimate)
    for estimate in estimates[:2]:
        first.update(estimate)
    resumed = NoiseScaleEMA.from_state_dict(
        json.loads(json.dumps(first.state_dict()))
    )  # as a checkpoint keeps it
    for estimate in estimates[2:]:
        resumed.update(estimate)
    assert resumed == whole


@pytest.mark.parametrize(
    "state, match",
    [
        ({"decay": 0.9}, r"has keys \['decay'\], not"),
        (
            {"version": 2, "decay": 0.9, "trace_sigma_ema": 0.0, "grad_sq_ema": 0.0, "updates": 0},
            r"version 2",
        ),
        (
            {"version": 1, "decay": 1.0, "trace_sigma_ema": 0.0, "grad_sq_ema": 0.0, "updates": 0},
            r"decay 1.0 must be",
        ),
        (
            {
                "version": 1,
                "decay": 0.9,
                "trace_sigma_ema": math.nan,
                "grad_sq_ema": 0.0,
                "updates": 0,
            },
            r"not a finite",
        ),
        (
            {"version": 1, "decay": 0.9, "trace_sigma_ema": 0.0, "grad_sq_ema": 0.0, "updates": -1},
            r"updates -1",
        ),
        ([1, 2], r"has keys list"),
    ],
)
def test_bad_ema_state_is_refused(state, match):
    with pytest.raises(NoiseScaleError, match=match):
        NoiseScaleEMA.from_state_dict(state)


def test_ema_refuses_a_non_finite_estimate():
    with pytest.raises(NoiseScaleError, match=r"is not finite; skip the step"):
        NoiseScaleEMA().update(NoiseEstimate(trace_sigma=math.inf, grad_sq=1.0, tokens=8))


def test_summary_of_a_known_sample():
    s = summarise([1.0, 2.0, 3.0, 4.0], truth=2.5)
    assert (
        s.mean == 2.5
        and s.standard_error == pytest.approx(math.sqrt(5 / 3 / 4))
        and s.bias_in_errors == 0
    )
