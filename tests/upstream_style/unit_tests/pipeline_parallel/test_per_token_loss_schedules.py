# Upstream-style tests for patches/upstream/*/0005-schedules-int64-token-count.patch and
# 0006-schedules-per-token-loss-needs-num-tokens.patch.
import pytest
import torch
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig

from tests.upstream_style.unit_tests.test_utilities import Utils


class _Scale(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.weight = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.weight * x

    def set_input_tensor(self, input_tensor):
        pass


def _run(loss_func, num_microbatches=2):
    config = TransformerConfig(
        num_layers=1, hidden_size=4, num_attention_heads=1, calculate_per_token_loss=True
    )
    seen = []
    config.finalize_model_grads_func = lambda model, num_tokens, *args, **kwargs: seen.append(
        num_tokens
    )
    model = _Scale(config)

    def forward_step(data_iterator, model):
        return model(next(data_iterator)), loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([torch.ones(5)] * num_microbatches),
        model=[model],
        num_microbatches=num_microbatches,
        seq_length=5,
        micro_batch_size=1,
        forward_only=False,
    )
    return seen


class TestPerTokenLossSchedules:
    def setup_method(self, method):
        Utils.initialize_model_parallel()

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_token_count_does_not_wrap(self):
        """Two micro-batches of 2**30 + 1 loss tokens: 2**31 + 2 tokens, above int32's range."""
        num_tokens = 2**30 + 1

        def loss_func(output_tensor):
            loss = output_tensor.sum()
            return loss, torch.tensor(num_tokens, dtype=torch.int64), {"lm loss": loss.detach()}

        (total,) = _run(loss_func)
        assert int(total) == 2 * num_tokens

    def test_two_tuple_loss_is_refused(self):
        """Without its token count a loss would be divided by 0 clamped to 1: a summed gradient."""

        def loss_func(output_tensor):
            loss = output_tensor.sum()
            return loss, {"lm loss": loss.detach()}

        with pytest.raises(ValueError, match="calculate_per_token_loss requires loss_func"):
            _run(loss_func)
