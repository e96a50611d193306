# Upstream-style test for
# patches/upstream/megatron-core-0.19.2/0004-moe-expert-bias-padding-mask.patch (fixed on main by
# Megatron-LM #6114).
import pytest
import torch
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

from tests.upstream_style.unit_tests.test_utilities import Utils


class TestExpertBiasPaddingMask:
    def setup_method(self, method):
        Utils.initialize_model_parallel()
        self.config = TransformerConfig(
            num_layers=1,
            hidden_size=8,
            num_attention_heads=1,
            num_moe_experts=4,
            moe_router_topk=1,
            moe_router_enable_expert_bias=True,
            moe_router_score_function="sigmoid",
            add_bias_linear=False,
        )
        self.router = TopKRouter(config=self.config, pg_collection=get_default_pg_collection())

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_padding_tokens_are_not_counted(self):
        # token t routes to expert t, except token 3 (padding), which routes to expert 0
        routing_map = torch.eye(4, dtype=torch.bool)
        routing_map[3] = torch.tensor([True, False, False, False])
        padding_mask = torch.tensor([False, False, False, True])

        self.router._apply_expert_bias(routing_map, padding_mask=padding_mask)

        assert self.router.local_tokens_per_expert.tolist() == [1, 1, 1, 0]

    @pytest.mark.parametrize("num_tokens", [2, 6])
    def test_mask_of_any_token_count(self, num_tokens):
        routing_map = torch.zeros(num_tokens, 4, dtype=torch.bool)
        routing_map[:, 0] = True
        padding_mask = torch.zeros(num_tokens, dtype=torch.bool)
        padding_mask[-1] = True

        self.router._apply_expert_bias(routing_map, padding_mask=padding_mask)

        assert self.router.local_tokens_per_expert.tolist() == [num_tokens - 1, 0, 0, 0]
