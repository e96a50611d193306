"""Synthetic gradients of known covariance, for checking the noise-scale estimators against the
truth.

Each trial draws N per-token gradients x_i = G + L z_i, with z_i independent, zero mean and unit
variance per coordinate, so Cov(x_i) = Sigma = L L^T and the truth is tr(Sigma) = sum(L**2) and
|G|^2 = G.G. The z are centred exponentials (skewed, not Gaussian): the estimators assume
independence, not a distribution. Replica r takes the next b_r tokens; its gradient is their mean,
and the reduced gradient the mean over all N, as in Megatron's token-level reduction. Used by
tests/test_noise_scale.py and tools/noise_scale.py (the docs table).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_ga_ext.science.core.noise_scale import (
    NoiseEstimate,
    equal_count_estimate,
    replica_estimate,
)

__all__ = [
    "COUNTS",
    "Problem",
    "Summary",
    "simulate",
    "summarise",
    "unbiasedness_rows",
    "unbiasedness_table",
]

#: Token counts per replica (K = 4, N = 128): equal, and unequal as packed sequences with padding
#: give them.
COUNTS = {"equal": (32, 32, 32, 32), "unequal": (8, 24, 40, 56)}

ESTIMATORS: dict[str, Callable[[Sequence[float], float, Sequence[int]], NoiseEstimate]] = {
    "unequal-count (ours)": replica_estimate,
    "equal-count (b = N/K)": equal_count_estimate,
}


@dataclass(frozen=True)
class Problem:
    """The true gradient G and noise factor L (Sigma = L L^T) of a synthetic problem."""

    mean: torch.Tensor
    factor: torch.Tensor

    @classmethod
    def make(cls, dim: int = 16, seed: int = 0) -> Problem:
        """A dense, non-diagonal Sigma and a G with B_simple = tr(Sigma) / |G|^2 of a few tens of
        tokens."""
        generator = torch.Generator().manual_seed(seed)
        factor = torch.randn(dim, dim, generator=generator, dtype=torch.float64) / math.sqrt(dim)
        mean = torch.randn(dim, generator=generator, dtype=torch.float64) * 0.2
        return cls(mean=mean, factor=factor)

    @property
    def trace_sigma(self) -> float:
        return float((self.factor**2).sum())

    @property
    def grad_sq(self) -> float:
        return float(self.mean @ self.mean)


def simulate(
    problem: Problem, counts: Sequence[int], trials: int, seed: int = 1
) -> tuple[list[list[float]], list[float]]:
    """(per-trial |g_r|^2 for each replica, per-trial |g|^2) for ``trials`` independent steps."""
    generator = torch.Generator().manual_seed(seed)
    total, dim = sum(counts), problem.mean.numel()
    noise = (
        torch.empty(trials, total, dim, dtype=torch.float64).exponential_(generator=generator) - 1
    )
    tokens = problem.mean + noise @ problem.factor.T  # x_i = G + L z_i
    local = torch.stack(
        [part.mean(dim=1) for part in torch.split(tokens, list(counts), dim=1)], dim=1
    )
    reduced = tokens.mean(dim=1)
    return (local**2).sum(dim=2).tolist(), (reduced**2).sum(dim=1).tolist()


@dataclass(frozen=True)
class Summary:
    """Mean of one estimate over the trials, its standard error, and the truth."""

    truth: float
    mean: float
    standard_error: float

    @property
    def bias_in_errors(self) -> float:
        """(mean - truth) / standard error: within +-4 for an unbiased estimator (a 4-sigma
        band)."""
        return (self.mean - self.truth) / self.standard_error


def summarise(values: Sequence[float], truth: float) -> Summary:
    """Sample mean and its standard error, sd / sqrt(n)."""
    n = len(values)
    mean = math.fsum(values) / n
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return Summary(truth=truth, mean=mean, standard_error=math.sqrt(variance / n))


def unbiasedness_rows(trials: int = 4000, seed: int = 1) -> list[tuple[str, str, str, Summary]]:
    """(counts, estimator, quantity, summary) for both count regimes, both estimators, tr(Sigma) and
    |G|^2."""
    problem = Problem.make()
    rows = []
    for regime, counts in COUNTS.items():
        local, reduced = simulate(problem, counts, trials, seed)
        for name, estimator in ESTIMATORS.items():
            estimates = [estimator(norms, g, counts) for norms, g in zip(local, reduced)]
            rows.append(
                (
                    regime,
                    name,
                    "tr(Sigma)",
                    summarise([e.trace_sigma for e in estimates], problem.trace_sigma),
                )
            )
            rows.append(
                (regime, name, "|G|^2", summarise([e.grad_sq for e in estimates], problem.grad_sq))
            )
    return rows


def unbiasedness_table(trials: int = 4000, seed: int = 1) -> str:
    """The rows as a Markdown table (deterministic for a seed and a torch build)."""
    header = (
        "| token counts b_r | estimator | quantity | truth | mean estimate | standard error | "
        "(mean - truth) / SE |"
    )
    lines = [header, "|---|---|---|---|---|---|---|"]
    for regime, name, quantity, s in unbiasedness_rows(trials, seed):
        counts = " ".join(map(str, COUNTS[regime]))
        quantity = quantity.replace("|", "\\|")  # a bare pipe would split the Markdown cell
        lines.append(
            f"| {regime}: {counts} | {name} | {quantity} | {s.truth:.4f} | {s.mean:.4f} | "
            f"{s.standard_error:.4f} | {s.bias_in_errors:+.1f} |"
        )
    return "\n".join(lines)
