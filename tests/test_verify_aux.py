"""MoE auxiliary-loss coefficients under each mode, measured through megatron's schedule and finalize."""

from __future__ import annotations

import warnings

import pytest

from megatron_ga_ext.verify.layouts import DEFAULT_LENGTHS

pytestmark = pytest.mark.slow

CASES = [("microbatch", "all"), ("token", "all"), ("token", "valid")]


def _measure():
    from megatron.core import parallel_state

    from megatron_ga_ext.verify.aux import measure_aux_coefficients
    from megatron_ga_ext.verify.harness import init_model_parallel
    from megatron_ga_ext.verify.layouts import Layout, make_global_batch
    from megatron_ga_ext.verify.models import ModelConfig
    from megatron_ga_ext.verify.shims import cpu_shims

    model = ModelConfig()
    batch = make_global_batch(DEFAULT_LENGTHS, model.seq_length, model.vocab_size)
    out = {}
    with cpu_shims():
        for mode, counts in CASES:
            init_model_parallel()
            try:
                out[(mode, counts)] = measure_aux_coefficients(
                    Layout(data_parallel_size=2, num_microbatches=4), model, batch, mode=mode,
                    router_counts=counts).relative_coefficients
            finally:
                parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def per_rank():
    from megatron_ga_ext.verify.launch import run_on_ranks

    warnings.filterwarnings("ignore", category=UserWarning)
    return run_on_ranks(_measure, 2)


@pytest.fixture(scope="module")
def coefficients(per_rank):
    return per_rank[0]


def test_both_ranks_hold_the_same_coefficients(per_rank):
    assert per_rank[0] == per_rank[1]  # the probe's gradient is DP all-reduced: every rank holds it all


def test_microbatch_mode_gives_every_microbatch_the_target(coefficients):
    assert coefficients[("microbatch", "all")] == pytest.approx([1.0] * 8)


def test_token_mode_without_padding_mask_inflates_by_the_padding_ratio(coefficients):
    ratio = 8 * 16 / sum(DEFAULT_LENGTHS)  # all positions / non-padding tokens = 128 / 72
    assert coefficients[("token", "all")] == pytest.approx([ratio] * 8)


def test_token_mode_with_padding_mask_weighs_by_token_share_and_keeps_the_total(coefficients):
    measured = coefficients[("token", "valid")]
    mean_count = sum(DEFAULT_LENGTHS) / len(DEFAULT_LENGTHS)
    assert measured == pytest.approx([n / mean_count for n in DEFAULT_LENGTHS])  # sums to 8, as microbatch
