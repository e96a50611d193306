"""A feature that needs the reduced gradient is one file and one line in FEATURES
(integration/features/): the finalize phase hands it the model after the DP x CP reduction, before
the division by N, with N on the device. 2 gloo ranks, DP 2 x GA 2, install() and megatron-core's
own schedule and finalize."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core.pipeline_parallel.schedules")

from megatron_ga_ext.testing.distributed import LaunchConfig, run_on_ranks

pytestmark = pytest.mark.slow


def rank_main() -> dict:
    from megatron_ga_ext.testing.shims import cpu_shims

    with cpu_shims():
        return _rank_main()


def _rank_main() -> dict:
    from megatron.core import parallel_state

    import megatron_ga_ext
    from megatron_ga_ext import GAConfig
    from megatron_ga_ext.integration import installation
    from megatron_ga_ext.integration.features import Entry
    from megatron_ga_ext.integration.loss_contract import masked_loss
    from megatron_ga_ext.verify.harness import build_ddp
    from megatron_ga_ext.verify.layouts import Layout, make_global_batch
    from megatron_ga_ext.verify.models import init_model_parallel
    from megatron_ga_ext.verify.run_config import VerifyConfig
    from megatron_ga_ext.verify.step import train_step
    from tests.support.reduced_gradient import ReducedGradient

    installation.FEATURES = (
        *installation.FEATURES,
        Entry("tests.support.reduced_gradient:ReducedGradient"),
    )
    cfg, layout = VerifyConfig(), Layout(data_parallel_size=2, num_microbatches=2)
    batch = make_global_batch((5, 9, 12, 16), cfg.model.seq_length, cfg.model.vocab_size, seed=3)
    state = megatron_ga_ext.install(GAConfig(loss_reduction="token"))
    init_model_parallel()
    try:
        from megatron.core.distributed import (
            finalize_model_grads,
        )  # the extension's, after install()

        ddp, _, config = build_ddp(layout, cfg, calculate_per_token_loss=True)
        train_step(
            ddp, config, layout, cfg, batch, finalize=finalize_model_grads, loss_func=masked_loss
        )
        feature = state.feature(ReducedGradient)
        divided = sum(param.main_grad.double().square().sum() for param in ddp.parameters())
        return {
            "N": int(feature.num_tokens),
            "loss tokens": int(batch.loss_mask.sum()),
            "undivided / divided": float(feature.squared_norm / divided),
        }
    finally:
        megatron_ga_ext.uninstall()
        parallel_state.destroy_model_parallel()


def test_a_feature_added_in_one_line_reads_the_reduced_gradient_before_the_division():
    results = run_on_ranks(rank_main, world_size=2, config=LaunchConfig(timeout_s=240))
    for result in results:
        assert (
            result["N"] == result["loss tokens"]
        )  # N after the DP x CP all-reduce: every rank's tokens
        assert result["undivided / divided"] == pytest.approx(
            result["N"] ** 2, rel=1e-6
        )  # fp32 grads times 1/N
