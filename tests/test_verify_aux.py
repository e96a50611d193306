"""The MoE router's auxiliary-loss gradient in token mode, before and after install(), on real MoE layers.

Upstream's own ``--calculate-per-token-loss`` pre-multiplies the router's aux and z-losses by every routed
position and computes their statistics over the padding too; install() routes with padding_mask = (loss_mask
== 0), which meets the target of docs/reduction.md (each micro-batch's terms over its loss tokens, weighted
n_u / N). One 2-rank launch measures both against the unpartitioned target (verify/aux.py).
"""

from __future__ import annotations

import warnings

import pytest

pytestmark = pytest.mark.slow


def _measure():
    from megatron_ga_ext.testing.shims import cpu_shims
    from megatron_ga_ext.verify.aux import measure_router_coefficients
    from megatron_ga_ext.verify.harness import VerifyConfig

    with cpu_shims():
        return [(r.variant, r.coefficient, r.error) for r in measure_router_coefficients(VerifyConfig(progress=False))]


@pytest.fixture(scope="module")
def per_rank():
    from megatron_ga_ext.testing.distributed import run_on_ranks

    warnings.filterwarnings("ignore", category=UserWarning)
    return run_on_ranks(_measure, 2)


def test_both_ranks_measure_the_same(per_rank):
    assert per_rank[0] == per_rank[1]  # the router's gradient is DP all-reduced: every rank holds it all


def test_upstream_per_token_loss_misweighs_the_router_on_a_padded_batch(per_rank):
    variant, coefficient, error = per_rank[0][0]
    assert variant == "upstream --calculate-per-token-loss"
    assert coefficient > 1.1 and error > 0.5  # counts and statistics over 128 positions, 72 of them loss tokens


def test_install_meets_the_token_mode_target(per_rank):
    variant, coefficient, error = per_rank[0][1]
    assert variant == "with megatron-ga-ext"
    assert coefficient == pytest.approx(1.0, abs=1e-6) and error < 1e-5
