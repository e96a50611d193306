"""The gradient noise scale from data-parallel replicas with unequal token counts. Pure Python.

McCandlish et al. 2018 (appendix A) estimate the simple noise scale B_simple = tr(Sigma) / |G|^2
from the squared norms of one gradient at two batch sizes. Data parallelism gives both for free:
each replica's local gradient before the reduction (the small batch) and the reduced gradient after
it (the big one). Replicas see unequal numbers of loss tokens, so the small batch is not one size;
this module's estimator allows that.

Derivation. Let the per-token gradients x_i be independent draws with mean G and covariance Sigma
(tr(Sigma) is the noise of one token). Replica r of K holds b_r loss tokens; N = sum_r b_r.

    g_r = (1/b_r) sum_{i in r} x_i          the replica's token mean (its local gradient)
    g   = (1/N) sum_i x_i = sum_r (b_r/N) g_r   the token mean over all N (the reduced gradient, token mode)

Since E|v|^2 = |E v|^2 + tr Cov(v) and the draws are independent,

    E|g_r|^2 = |G|^2 + tr(Sigma) / b_r          E|g|^2 = |G|^2 + tr(Sigma) / N

With A = mean_r |g_r|^2 and h = mean_r 1/b_r, E[A] = |G|^2 + tr(Sigma) h, so E[A - |g|^2] =
tr(Sigma) (h - 1/N) and

    tr(Sigma)^ = (A - |g|^2) / (h - 1/N)        |G|^2^ = |g|^2 - tr(Sigma)^ / N

are unbiased (the second is linear in the first). The denominator is positive for K >= 2: by the
inequality of the arithmetic and harmonic means h >= 1/mean(b) = K/N, so h - 1/N >= (K - 1)/N. This
is McCandlish's two-batch pair with B_small = 1/h (the harmonic mean of the b_r) and B_big = N; when
the b_r are equal, 1/h = N/K and it is exactly his. The equal-count formula applied to unequal
counts takes B_small = N/K, the arithmetic mean, which is never below the harmonic one: its
tr(Sigma) is biased up by (h - 1/N) / ((K - 1)/N) and its |G|^2 down.

Each estimate is unbiased but noisy, and |G|^2^ is often negative on one step: a ratio of one step's
estimates is meaningless. :class:`NoiseScaleEMA` keeps an EMA of each part and divides the EMAs
(never averages a ratio).

Limits (docs/noise-scale.md): the tokens are treated as independent draws (tokens of one sequence
are not); g must be the token mean (Megatron's token-level reduction), not the mean of replica
means; the norms are of the raw gradient, before clipping and Adam's preconditioning, and after
unscaling a loss scale.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from megatron_ga_ext.errors import NoiseScaleError

__all__ = [
    "NoiseEstimate",
    "NoiseScaleEMA",
    "b_simple",
    "equal_count_estimate",
    "replica_estimate",
    "replica_estimate_from_sums",
    "two_batch_estimate",
]

#: The version of :meth:`NoiseScaleEMA.state_dict`'s layout, checked on load.
STATE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class NoiseEstimate:
    """One measured step's unbiased estimates (each may be negative on a noisy step)."""

    trace_sigma: float
    """tr(Sigma): the gradient noise of one token, sum of the per-coordinate variances."""
    grad_sq: float
    """|G|^2: the squared norm of the true (expected) gradient."""
    tokens: int
    """N, the loss tokens behind the reduced gradient."""

    @property
    def b_simple_tokens(self) -> float | None:
        """B_simple = tr(Sigma) / |G|^2 in tokens; None where either estimate is not positive."""
        return b_simple(self.trace_sigma, self.grad_sq)


def b_simple(
    trace_sigma: float, grad_sq: float, tokens_per_sample: float | None = None
) -> float | None:
    """B_simple = tr(Sigma) / |G|^2, in tokens, or in samples given ``tokens_per_sample`` (tokens /
    it).

    None where tr(Sigma) <= 0 or |G|^2 <= 0: noise swamped the estimate, and no batch size follows
    from it.
    """
    if tokens_per_sample is not None and not (_finite(tokens_per_sample) and tokens_per_sample > 0):
        raise NoiseScaleError(
            f"tokens_per_sample {tokens_per_sample!r} must be a positive finite number "
            "(loss tokens per sample, at most --seq-length)."
        )
    if not (trace_sigma > 0 and grad_sq > 0):
        return None
    tokens = trace_sigma / grad_sq
    return tokens if tokens_per_sample is None else tokens / tokens_per_sample


def two_batch_estimate(
    small_sq_norm: float, small_batch: float, big_sq_norm: float, big_batch: float
) -> tuple[float, float]:
    """McCandlish's pair: (tr(Sigma), |G|^2) from E|g_B|^2 = |G|^2 + tr(Sigma)/B at two batch sizes.

    tr(Sigma) = (|g_small|^2 - |g_big|^2) / (1/B_small - 1/B_big)
    |G|^2     = |g_big|^2 - tr(Sigma) / B_big   (= (B_big |g_big|^2 - B_small |g_small|^2) / (B_big - B_small))
    """
    for name, value in (("small_sq_norm", small_sq_norm), ("big_sq_norm", big_sq_norm)):
        _require_norm(name, value)
    if not (_finite(small_batch) and _finite(big_batch) and 0 < small_batch < big_batch):
        raise NoiseScaleError(
            f"the batch sizes ({small_batch!r}, {big_batch!r}) must be finite with "
            "0 < small < big: two equal batches say nothing about the noise."
        )
    trace = (small_sq_norm - big_sq_norm) / (1 / small_batch - 1 / big_batch)
    return trace, big_sq_norm - trace / big_batch


def replica_estimate(
    local_sq_norms: Sequence[float], global_sq_norm: float, tokens: Sequence[int]
) -> NoiseEstimate:
    """The estimate for K >= 2 replicas with loss-token counts ``tokens`` (b_r; see the module's
    derivation).

        N = sum b_r,  A = mean |g_r|^2,  h = mean 1/b_r
        tr(Sigma) = (A - |g|^2) / (h - 1/N),   |G|^2 = |g|^2 - tr(Sigma) / N

    ``local_sq_norms`` are |g_r|^2 (replica r's token-mean gradient, before the reduction),
    ``global_sq_norm`` is
    |g|^2 (the token mean over all N, after it), over the same parameters.
    """
    counts = _require_counts(tokens, len(local_sq_norms))
    for r, value in enumerate(local_sq_norms):
        _require_norm(f"local_sq_norms[{r}]", value)
    _require_norm("global_sq_norm", global_sq_norm)
    total = sum(counts)
    # h - 1/N in exact arithmetic: with N in the billions both terms are tiny and close.
    excess = sum(Fraction(1, b) for b in counts) / len(counts) - Fraction(1, total)
    mean_local = math.fsum(local_sq_norms) / len(local_sq_norms)
    return _estimate(mean_local, global_sq_norm, float(excess), total)


def replica_estimate_from_sums(
    *,
    mean_local_sq_norm: float,
    global_sq_norm: float,
    mean_inverse_tokens: float,
    tokens: int,
    replicas: int,
) -> NoiseEstimate:
    """:func:`replica_estimate` from what one all-reduce gives: A = mean |g_r|^2, |g|^2, h = mean 1/b_r, N and K
    (the in-run measurement, science/integration/noise_scale.py). h - 1/N >= (K - 1)/N keeps the
    float subtraction exact to a few ulps of h."""
    if replicas < 2:
        raise NoiseScaleError(
            f"{replicas} replica(s): the noise estimate needs at least 2 (data-parallel size "
            ">= 2), since it compares a replica's gradient with the reduced one."
        )
    if not (isinstance(tokens, int) and tokens >= replicas):
        raise NoiseScaleError(
            f"{tokens!r} loss tokens over {replicas} replicas: every replica needs at least one."
        )
    _require_norm("mean_local_sq_norm", mean_local_sq_norm)
    _require_norm("global_sq_norm", global_sq_norm)
    excess = mean_inverse_tokens - 1 / tokens
    if not (_finite(excess) and excess > 0):
        raise NoiseScaleError(
            f"mean 1/b_r {mean_inverse_tokens!r} with N = {tokens}: h - 1/N must be > 0 (h >= "
            "K/N for K >= 2 replicas)."
        )
    return _estimate(mean_local_sq_norm, global_sq_norm, excess, tokens)


def _estimate(mean_local: float, global_sq_norm: float, excess: float, total: int) -> NoiseEstimate:
    """tr(Sigma) = (A - |g|^2) / (h - 1/N), |G|^2 = |g|^2 - tr(Sigma) / N."""
    trace = (mean_local - global_sq_norm) / excess
    return NoiseEstimate(trace_sigma=trace, grad_sq=global_sq_norm - trace / total, tokens=total)


def equal_count_estimate(
    local_sq_norms: Sequence[float], global_sq_norm: float, tokens: Sequence[int]
) -> NoiseEstimate:
    """McCandlish's equal-count formula, B_small = N/K, whatever the counts: for comparison only.

    Exact when every b_r is N/K; otherwise tr(Sigma) is biased up by (h - 1/N) / ((K - 1)/N) >= 1.
    """
    counts = _require_counts(tokens, len(local_sq_norms))
    total = sum(counts)
    mean_local = math.fsum(local_sq_norms) / len(local_sq_norms)
    trace, grad_sq = two_batch_estimate(mean_local, total / len(counts), global_sq_norm, total)
    return NoiseEstimate(trace_sigma=trace, grad_sq=grad_sq, tokens=total)


@dataclass(kw_only=True)
class NoiseScaleEMA:
    """EMAs of tr(Sigma) and |G|^2 kept apart, bias-corrected, and divided: B_simple = EMA(tr) /
    EMA(|G|^2).

        m_n = decay m_{n-1} + (1 - decay) x_n,  m_0 = 0          corrected: m_n / (1 - decay^n)

    One update per measured step. The correction cancels in the ratio but not in each part, which is
    logged. Averaging per-step ratios instead would be biased, and undefined on steps where |G|^2^
    <= 0.
    """

    decay: float = 0.95
    """Weight of the past per measured step (0 <= decay < 1); the EMA spans about 1 / (1 - decay)
    measurements."""
    trace_sigma_ema: float = 0.0
    grad_sq_ema: float = 0.0
    updates: int = 0

    def __post_init__(self) -> None:
        if not (_finite(self.decay) and 0 <= self.decay < 1):
            raise NoiseScaleError(
                f"the noise-scale EMA decay {self.decay!r} must be in [0, 1): 0 keeps the last "
                "measurement only, 0.95 averages about 20."
            )
        for name in ("trace_sigma_ema", "grad_sq_ema"):
            if not _finite(getattr(self, name)):
                raise NoiseScaleError(
                    f"the noise-scale EMA {name} {getattr(self, name)!r} is not a finite number."
                )
        if isinstance(self.updates, bool) or not isinstance(self.updates, int) or self.updates < 0:
            raise NoiseScaleError(
                f"the noise-scale EMA updates {self.updates!r} must be a whole number >= 0."
            )

    def update(self, estimate: NoiseEstimate) -> None:
        """Fold one measured step in; a non-finite estimate is refused (it would poison every later
        value)."""
        if not (_finite(estimate.trace_sigma) and _finite(estimate.grad_sq)):
            raise NoiseScaleError(
                f"a noise estimate (tr(Sigma) {estimate.trace_sigma!r}, |G|^2 "
                f"{estimate.grad_sq!r}) is not finite; skip the step instead of updating."
            )
        keep = self.decay
        self.trace_sigma_ema = keep * self.trace_sigma_ema + (1 - keep) * estimate.trace_sigma
        self.grad_sq_ema = keep * self.grad_sq_ema + (1 - keep) * estimate.grad_sq
        self.updates += 1

    @property
    def trace_sigma(self) -> float | None:
        """Bias-corrected EMA of tr(Sigma); None before the first update."""
        return self._corrected(self.trace_sigma_ema)

    @property
    def grad_sq(self) -> float | None:
        """Bias-corrected EMA of |G|^2; None before the first update."""
        return self._corrected(self.grad_sq_ema)

    def b_simple(self, tokens_per_sample: float | None = None) -> float | None:
        """EMA(tr(Sigma)) / EMA(|G|^2), in tokens or (given ``tokens_per_sample``) samples; None if
        undefined."""
        if self.updates == 0:
            return None
        return b_simple(self.trace_sigma_ema, self.grad_sq_ema, tokens_per_sample)

    def state_dict(self) -> dict[str, float | int]:
        """Plain numbers for a checkpoint, so a resumed run continues the EMAs."""
        return {
            "version": STATE_VERSION,
            "decay": self.decay,
            "trace_sigma_ema": self.trace_sigma_ema,
            "grad_sq_ema": self.grad_sq_ema,
            "updates": self.updates,
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, object]) -> NoiseScaleEMA:
        """The EMA :meth:`state_dict` saved; a missing key or another version is refused, not
        guessed."""
        expected = {"version", "decay", "trace_sigma_ema", "grad_sq_ema", "updates"}
        if not isinstance(state, Mapping) or set(state) != expected:
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise NoiseScaleError(
                f"a noise-scale EMA state has keys {keys}, not {sorted(expected)}; it was not "
                "written by NoiseScaleEMA.state_dict."
            )
        if state["version"] != STATE_VERSION:
            raise NoiseScaleError(
                f"a noise-scale EMA state has version {state['version']!r}; this release reads "
                f"version {STATE_VERSION}."
            )
        # Any, not object: __post_init__ checks each value's type and range, and refuses a wrong
        # one.
        fields: dict[str, Any] = {name: state[name] for name in expected - {"version"}}
        return cls(**fields)

    def _corrected(self, ema: float) -> float | None:
        if self.updates == 0:
            return None
        return ema / (1 - self.decay**self.updates)


def _finite(value: object) -> bool:
    """An int or float that is finite as a float (an int past the float range is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _require_norm(name: str, value: object) -> None:
    if not (_finite(value) and value >= 0):  # type: ignore[operator]
        raise NoiseScaleError(
            f"{name} {value!r} is not a squared norm (a finite number >= 0); a non-finite "
            "gradient (an overflowed fp16 step) has no noise estimate: skip the step."
        )


def _require_counts(tokens: Sequence[int], replicas: int) -> list[int]:
    """The b_r: whole numbers >= 1, one per replica, at least two replicas."""
    counts = list(tokens)
    if len(counts) != replicas:
        raise NoiseScaleError(
            f"{len(counts)} token counts for {replicas} local squared norms: give one b_r per "
            "data-parallel replica."
        )
    if replicas < 2:
        raise NoiseScaleError(
            f"{replicas} replica(s): the noise estimate needs at least 2 (data-parallel size "
            ">= 2), since it compares a replica's gradient with the reduced one."
        )
    for r, b in enumerate(counts):
        try:
            counts[r] = operator.index(b)  # an int, or a numpy/torch integer scalar
        except TypeError:
            counts[r] = 0
        if isinstance(b, bool) or counts[r] < 1:
            raise NoiseScaleError(
                f"tokens[{r}] {b!r} is not a token count >= 1: a replica without loss tokens "
                "has no gradient of its own; leave the step out."
            )
    return counts
