"""MTP under context parallelism, token mode, through install(): a CP shard without LM loss tokens
that megatron's roll gives one MTP target from the next shard (upstream #7498; SFT whose response
starts at a CP chunk boundary).

Two gloo ranks form the CP group. Each calls megatron-core's own ``process_mtp_loss`` (as install()
patched it) on its zigzag shard of one sequence, cut by megatron's ``get_batch_on_this_cp_rank``
(verify's ``cp_shard``), with megatron's real ``roll_tensor``; the reference is the definition on
the whole sequence in one process: depth 1's target at position s is label s + 1, counted where
loss_mask[s + 1] is 1, each at alpha = scaling factor / depth (finalize's 1 / N comes after).
Sequence 16 in 4 chunks: shard 0 holds positions 0-3 and 12-15, shard 1 positions 4-11; the response
is 4-11, so shard 0 has no LM loss token, and its position 3 predicts label 4.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

SEQ, HIDDEN, VOCAB, ALPHA = 16, 8, 11, 0.3
RESPONSE = range(4, 12)


def _definition(hidden, weight, labels, loss_mask):
    """alpha x sum_s loss_mask[s + 1] x CE(hidden_s W, label_{s+1}) over the whole sequence: its
    gradient in W."""
    import torch

    weight = weight.detach().requires_grad_()
    logits = hidden[:-1, 0] @ weight
    losses = torch.nn.functional.cross_entropy(logits, labels[0, 1:], reduction="none")
    (ALPHA * (loss_mask[0, 1:] * losses).sum()).backward()
    return weight.grad


def _rank(extension: bool):
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_token_prediction as mtp

    import megatron_ga_ext
    from megatron_ga_ext.config.ga_config import GAConfig
    from megatron_ga_ext.testing.shims import cpu_shims
    from megatron_ga_ext.verify.models import ModelConfig, init_model_parallel, transformer_config
    from megatron_ga_ext.verify.step import cp_shard

    with cpu_shims():
        init_model_parallel(context_parallel_size=2)
        if extension:
            megatron_ga_ext.install(GAConfig(loss_reduction="token"))
        try:
            gen = torch.Generator().manual_seed(7)
            hidden = torch.randn(SEQ, 1, HIDDEN, generator=gen)  # the MTP layer's output, [s, b, h]
            labels = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
            loss_mask = torch.zeros(1, SEQ)
            loss_mask[0, list(RESPONSE)] = 1.0
            weight = torch.randn(HIDDEN, VOCAB, generator=gen)
            reference = _definition(hidden, weight, labels, loss_mask)

            cp_group = parallel_state.get_context_parallel_group()
            shard = cp_shard(
                {
                    "hidden": hidden.transpose(0, 1).contiguous(),
                    "labels": labels,
                    "loss_mask": loss_mask,
                }
            )
            local_hidden = shard["hidden"].transpose(0, 1).contiguous()
            local_weight = weight.clone().requires_grad_()
            config = transformer_config(
                ModelConfig(), calculate_per_token_loss=True, context_parallel_size=2
            )
            config.mtp_num_layers, config.mtp_loss_scaling_factor = 1, ALPHA

            def output_layer(states, weight=None, runtime_gather_output=None):
                return states @ local_weight, None

            def compute_language_model_loss(
                labels, logits
            ):  # [b, s] per-token losses from [s, b, v] logits
                return torch.nn.functional.cross_entropy(
                    logits.transpose(0, 1).transpose(1, 2), labels, reduction="none"
                )

            mtp.MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
            main = torch.zeros_like(local_hidden, requires_grad=True)
            out = mtp.process_mtp_loss(
                hidden_states=torch.cat([main, local_hidden]),
                labels=shard["labels"],
                loss_mask=shard["loss_mask"],
                output_layer=output_layer,
                output_weight=None,
                runtime_gather_output=None,
                is_training=False,
                compute_language_model_loss=compute_language_model_loss,
                config=config,
                cp_group=cp_group,
            )
            (out * 0).sum().backward()
            local = local_weight.grad.clone()
            total = local.clone()
            torch.distributed.all_reduce(total, group=cp_group)
            lm_tokens = float(shard["loss_mask"].sum())
            return (
                lm_tokens,
                float(local.abs().max()),
                float((total - reference).abs().max() / reference.abs().max()),
            )
        finally:
            megatron_ga_ext.uninstall()
            parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def results():
    from megatron.core.transformer import multi_token_prediction

    from megatron_ga_ext.testing.distributed import run_on_ranks

    if not hasattr(multi_token_prediction, "process_mtp_loss"):
        pytest.skip(
            "megatron-core 0.16 computes MTP in GPTModel and attaches its sum: install() does "
            "not rework it"
        )

    return {extension: run_on_ranks(_rank, 2, (extension,)) for extension in (True, False)}


def test_a_shard_without_lm_tokens_keeps_its_rolled_mtp_token(results):
    (lm_0, grad_0, err_0), (lm_1, _, err_1) = results[True]
    assert (lm_0, lm_1) == (0.0, 8.0)  # shard 0 has no LM loss token
    assert grad_0 > 0  # yet its position 3 predicts label 4: a gradient
    assert err_0 < 1e-6 and err_1 < 1e-6  # the shards' sum is the definition's


def test_upstream_drops_that_token(results):
    (lm_0, grad_0, err_0), _ = results[False]
    assert lm_0 == 0.0 and grad_0 == 0.0  # upstream attaches 0 x its MTP loss there (n_u = 0)
    assert err_0 > 1e-2
