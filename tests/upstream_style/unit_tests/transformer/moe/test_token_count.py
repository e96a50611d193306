# Upstream-style test for patches/upstream/*/0002-moe-router-token-count.patch (Megatron-LM #7452
# finding 10).
import pytest
import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import get_tokens_per_expert_and_token_count

from tests.upstream_style.unit_tests.test_utilities import Utils


class TestTokenCountWithPaddingMask:
    def setup_method(self, method):
        Utils.initialize_model_parallel(tensor_model_parallel_size=Utils.world_size)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize("topk", [1, 2])
    def test_local_count_times_group_size_is_the_group_count(self, topk):
        """The router pre-multiplies the aux loss by local_num_tokens * |TP x CP|: with uneven
        valid tokens per rank (3, 5, ...) that product must be the group's count."""
        num_experts = 4
        valid = 3 + 2 * Utils.rank
        routing_map = torch.zeros(8, num_experts, dtype=torch.bool)
        for token in range(valid):
            routing_map[token, [(token + i) % num_experts for i in range(topk)]] = True
        group = parallel_state.get_tensor_model_parallel_group()

        _, local_num_tokens, total_num_tokens = get_tokens_per_expert_and_token_count(
            routing_map=routing_map, reduce_group=group, topk=topk, with_padding_mask=True
        )

        expected_total = sum(3 + 2 * rank for rank in range(Utils.world_size))
        assert float(total_num_tokens) == expected_total
        assert float(local_num_tokens) * group.size() == expected_total
