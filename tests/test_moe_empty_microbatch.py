"""A micro-batch without loss tokens, MoE in token mode: install()'s padding mask makes the router's
token count 0, and upstream divides the load-balancing loss by its square (0 / 0). Found writing
verify --fuzz; install() clamps the count, so that micro-batch routes none and adds no term, and the
step matches the reference."""

from __future__ import annotations

import math
import warnings

import pytest

pytestmark = pytest.mark.slow

LENGTHS = (16, 0, 13, 4, 16, 9, 2, 11)  # sample 1, micro-batch 0 of DP rank 1, has no loss tokens


def _rows(clamped: bool):
    from dataclasses import replace

    from megatron_ga_ext.integration.features import aux_losses
    from megatron_ga_ext.verify.harness import run_rank
    from megatron_ga_ext.verify.layouts import Layout
    from megatron_ga_ext.verify.run_config import VerifyConfig

    if (
        not clamped
    ):  # the correction with upstream's total: the per-expert counts' sum / topk, 0 here

        def unclamped(original, state):
            counts = aux_losses.exact_token_counts(original, state)

            def call(routing_map, reduce_group, topk=None, with_padding_mask=False):
                tokens, local, total = counts(routing_map, reduce_group, topk, with_padding_mask)
                return tokens, local, tokens.sum() / topk if with_padding_mask else total

            return call

        rows = aux_losses.AuxLosses.hooks  # the feature's own rows
        aux_losses.AuxLosses.hooks = tuple(
            replace(h, wrap=unclamped) if h.name == "get_tokens_per_expert_and_token_count" else h
            for h in rows
        )
    cfg = VerifyConfig(
        layouts=(Layout(data_parallel_size=2, num_microbatches=4, model="moe"),),
        lengths=LENGTHS,
        modes=("token",),
        progress=False,
    )
    return run_rank(cfg)


@pytest.fixture(scope="module")
def results():
    from megatron_ga_ext.testing.distributed import run_on_ranks

    warnings.filterwarnings("ignore", category=UserWarning)
    return {clamped: run_on_ranks(_rows, 2, (clamped,)) for clamped in (True, False)}


def test_the_step_matches_the_token_reference(results):
    from megatron_ga_ext.cli.verify import rows_from_results

    (row,) = rows_from_results({2: results[True]}, 1e-5, sum(LENGTHS))
    assert row["ok"] and row["rel_err_token"] < 1e-5 and row["num_tokens"] == 71, row


def test_without_the_clamp_the_router_gradient_is_nan(results):
    (result,) = results[False][0]
    assert math.isnan(result.rel_err_token), result
