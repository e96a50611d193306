# Upstream-style test for patches/upstream/*/0003-mtp-normalize-by-lm-tokens.patch
# (Megatron-LM #7452 finding 3; PRs #7498, #7570).
import pytest
import torch
from megatron.core import parallel_state
from megatron.core.transformer.multi_token_prediction import process_mtp_loss
from megatron.core.transformer.transformer_config import TransformerConfig

from tests.upstream_style.unit_tests.test_utilities import Utils


def _output_layer(hidden_states, weight=None, runtime_gather_output=None):
    return hidden_states, None


def _per_token_loss(labels, logits):
    # [s, b, v] -> [b, s]: linear in the logits, so the gradient of a token's loss is 1
    return logits.sum(dim=-1).transpose(0, 1).contiguous()


class TestMTPPerTokenLoss:
    def setup_method(self, method):
        Utils.initialize_model_parallel()

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize("mtp_num_layers", [1, 2])
    def test_every_mtp_token_weighs_the_scaling_factor(self, mtp_num_layers):
        """With mtp_loss_normalize_by_lm_tokens, depth k's MTP loss is attached as a sum: each MTP
        token (loss_mask rolled by k) gets the gradient mtp_loss_scaling_factor / mtp_num_layers,
        which finalize_model_grads then divides by the global LM token count."""
        config = TransformerConfig(
            num_layers=1,
            hidden_size=4,
            num_attention_heads=1,
            mtp_num_layers=mtp_num_layers,
            mtp_loss_scaling_factor=0.3,
            calculate_per_token_loss=True,
            mtp_loss_normalize_by_lm_tokens=True,
        )
        seq_length, vocab = 8, 3
        loss_mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]]).float()
        labels = torch.zeros(2, seq_length, dtype=torch.long)
        hidden_states = torch.zeros((1 + mtp_num_layers) * seq_length, 2, vocab, requires_grad=True)

        out = process_mtp_loss(
            hidden_states=hidden_states,
            labels=labels,
            loss_mask=loss_mask,
            output_layer=_output_layer,
            output_weight=None,
            runtime_gather_output=None,
            is_training=False,
            compute_language_model_loss=_per_token_loss,
            config=config,
            cp_group=parallel_state.get_context_parallel_group(),
            tp_group=parallel_state.get_tensor_model_parallel_group(),
        )
        out.sum().backward()

        alpha = config.mtp_loss_scaling_factor / mtp_num_layers
        grads = hidden_states.grad.chunk(1 + mtp_num_layers, dim=0)
        for depth in range(1, mtp_num_layers + 1):
            rolled = torch.roll(loss_mask, shifts=-depth, dims=-1)
            rolled[:, -depth:] = 0
            expected = alpha * rolled.t().unsqueeze(-1).expand(-1, -1, vocab)
            torch.testing.assert_close(grads[depth], expected)


class TestMTPPerTokenLossContextParallel:
    def setup_method(self, method):
        Utils.initialize_model_parallel(context_parallel_size=Utils.world_size)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_a_shard_without_lm_tokens_keeps_its_mtp_token(self):
        """One sequence whose only LM loss token sits on CP rank 1 (position 2 of 8, chunks of 2,
        rank 0 holding positions 0, 1, 6, 7): the roll hands rank 0 its MTP target (position 1). The
        local ratio gives it weight 0; with mtp_loss_normalize_by_lm_tokens it weighs
        mtp_loss_scaling_factor."""
        config = TransformerConfig(
            num_layers=1,
            hidden_size=4,
            num_attention_heads=1,
            mtp_num_layers=1,
            mtp_loss_scaling_factor=0.3,
            context_parallel_size=Utils.world_size,
            calculate_per_token_loss=True,
            mtp_loss_normalize_by_lm_tokens=True,
        )
        cp, rank, vocab = Utils.world_size, Utils.rank, 3
        seq_length = 4 * cp
        chunk = seq_length // (2 * cp)
        positions = list(range(rank * chunk, (rank + 1) * chunk))
        positions += list(range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk))
        loss_mask = torch.zeros(1, seq_length)
        loss_mask[0, 2] = 1
        rolled = torch.roll(loss_mask, shifts=-1, dims=-1)
        rolled[:, -1] = 0
        hidden_states = torch.zeros(2 * len(positions), 1, vocab, requires_grad=True)

        out = process_mtp_loss(
            hidden_states=hidden_states,
            labels=torch.zeros(1, len(positions), dtype=torch.long),
            loss_mask=loss_mask[:, positions],
            output_layer=_output_layer,
            output_weight=None,
            runtime_gather_output=None,
            is_training=False,
            compute_language_model_loss=_per_token_loss,
            config=config,
            cp_group=parallel_state.get_context_parallel_group(),
            tp_group=parallel_state.get_tensor_model_parallel_group(),
        )
        out.sum().backward()

        mtp_grad = hidden_states.grad.chunk(2, dim=0)[1]
        expected = config.mtp_loss_scaling_factor * rolled[:, positions].t().unsqueeze(-1).expand(
            -1, -1, vocab
        )
        torch.testing.assert_close(mtp_grad, expected)
