# Upstream-style test for patches/upstream/*/0001-fsdp2-scale-gradients.patch.
import torch
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.distributed.torch_fully_sharded_data_parallel import (
    TorchFullyShardedDataParallel,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from tests.upstream_style.unit_tests.test_utilities import Utils


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2 * Utils.world_size, 4))

    def forward(self, x):
        return x @ self.weight.t()


class TestTorchFSDP2PerTokenLoss:
    def setup_method(self, method):
        Utils.initialize_model_parallel()

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_gradient_is_the_per_token_mean(self):
        """Rank r holds 1 + 2r tokens, each x = (r + 1) * ones: loss = sum over tokens and outputs
        of W x, whose per-token mean has the gradient sum_t x_t / N in every row of W."""
        config = TransformerConfig(
            num_layers=1,
            hidden_size=4,
            num_attention_heads=1,
            calculate_per_token_loss=True,
        )
        config.transformer_impl = "local"
        model = TorchFullyShardedDataParallel(
            config, DistributedDataParallelConfig(), _Linear(), sub_modules_to_wrap=set()
        )
        num_tokens = 1 + 2 * Utils.rank
        x = torch.full((num_tokens, 4), float(Utils.rank + 1))

        model(x).sum().backward()
        finalize_model_grads([model], num_tokens=torch.tensor(num_tokens))

        tokens = [1 + 2 * rank for rank in range(Utils.world_size)]
        expected = sum(n * (rank + 1) for rank, n in enumerate(tokens)) / sum(tokens)
        grad = model.module.weight.grad.full_tensor()
        torch.testing.assert_close(grad, torch.full_like(grad, expected))
