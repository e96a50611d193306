"""``--moe-router-enable-expert-bias`` in token mode: the expert-bias counts exclude exactly the
padding positions.

Before main@d98e8a64 upstream's ``TopKRouter._apply_expert_bias`` masks its [tokens, experts]
routing map with the flat [tokens] padding mask: with install()'s padding mask that is a shape error
at the first step, or, where the tokens number the experts, experts masked instead of padding.
install() gives it the mask per token there.
"""

from __future__ import annotations

import warnings

import pytest

pytestmark = pytest.mark.slow

LENGTHS = (16, 1, 13, 4, 16, 9, 2, 11)


def _counts_and_step():
    import torch
    from megatron.core import parallel_state

    import megatron_ga_ext
    from megatron_ga_ext.config.ga_config import GAConfig
    from megatron_ga_ext.testing.shims import cpu_shims
    from megatron_ga_ext.verify.harness import run_rank
    from megatron_ga_ext.verify.layouts import Layout
    from megatron_ga_ext.verify.models import (
        ModelConfig,
        build_gpt,
        init_model_parallel,
        transformer_config,
    )
    from megatron_ga_ext.verify.run_config import VerifyConfig

    out = {}
    with cpu_shims():
        init_model_parallel()
        megatron_ga_ext.install(GAConfig(loss_reduction="token"))
        try:
            model, _ = build_gpt(
                ModelConfig(),
                transformer_config(ModelConfig(), kind="moe_bias", calculate_per_token_loss=True),
                pre_process=True,
                post_process=True,
            )
            router = model.decoder.layers[0].mlp.router
            for tokens in (
                16,
                4,
            ):  # 4 tokens: as many as the experts, where the flat mask broadcasts silently
                routing_map = (
                    torch.rand(tokens, 4, generator=torch.Generator().manual_seed(tokens)) > 0.4
                )
                padding_mask = torch.arange(tokens) >= tokens // 2
                router.local_tokens_per_expert.zero_()
                router._apply_expert_bias(routing_map, padding_mask)
                out[tokens] = (
                    router.local_tokens_per_expert.tolist(),
                    routing_map[~padding_mask].sum(dim=0).tolist(),
                )
        finally:
            megatron_ga_ext.uninstall()
            parallel_state.destroy_model_parallel()
        cfg = VerifyConfig(
            layouts=(Layout(data_parallel_size=2, num_microbatches=4, model="moe_bias"),),
            lengths=LENGTHS,
            progress=False,
        )
        out["step"] = [
            (r.mode, r.rel_err_token, r.rel_err_mean_of_means, r.num_tokens) for r in run_rank(cfg)
        ]
    return out


@pytest.fixture(scope="module")
def measured():
    from megatron_ga_ext.testing.distributed import run_on_ranks

    warnings.filterwarnings("ignore", category=UserWarning)
    return run_on_ranks(_counts_and_step, 2)[0]


@pytest.mark.parametrize("tokens", [16, 4])
def test_the_expert_bias_counts_exclude_the_padding_tokens(measured, tokens):
    counted, expected = measured[tokens]
    assert counted == expected


def test_a_step_with_the_expert_bias_meets_both_references(measured):
    assert [row[0] for row in measured["step"]] == ["token", "microbatch"]
    assert measured["step"][0][1] < 1e-5 and measured["step"][0][3] == sum(LENGTHS)
    assert measured["step"][1][2] < 1e-5
