"""The model's flags the memory ledger reads, by argparse destination and kind. No imports: ledger's
parser declares them without loading the ledger's formulas."""

from __future__ import annotations

__all__ = ["MODEL_FLAGS", "NEEDS"]

#: What a costs section needs of the line, said where it is missing.
NEEDS = "give --num-layers, --hidden-size, --num-attention-heads and --seq-length"

_INT, _STR, _ON, _OFF, _FREQ = "int", "str", "on", "off", "freq"
#: Each flag the memory ledger reads: (argparse destination, kind).
MODEL_FLAGS: dict[str, tuple[str, str]] = {
    "--num-layers": ("num_layers", _INT),
    "--hidden-size": ("hidden_size", _INT),
    "--ffn-hidden-size": ("ffn_hidden_size", _INT),
    "--num-attention-heads": ("num_attention_heads", _INT),
    "--num-query-groups": ("num_query_groups", _INT),
    "--group-query-attention": ("group_query_attention", _ON),
    "--kv-channels": ("kv_channels", _INT),
    "--seq-length": ("seq_length", _INT),
    "--vocab-size": ("vocab_size", _INT),
    "--make-vocab-size-divisible-by": ("make_vocab_size_divisible_by", _INT),
    "--untie-embeddings-and-output-weights": ("untie_embeddings_and_output_weights", _ON),
    "--swiglu": ("swiglu", _ON),
    "--normalization": ("normalization", _STR),
    "--disable-bias-linear": ("add_bias_linear", _OFF),
    "--num-experts": ("num_experts", _INT),
    "--moe-ffn-hidden-size": ("moe_ffn_hidden_size", _INT),
    "--moe-router-topk": ("moe_router_topk", _INT),
    "--moe-layer-freq": ("moe_layer_freq", _FREQ),
    "--moe-shared-expert-intermediate-size": ("moe_shared_expert_intermediate_size", _INT),
    "--moe-shared-expert-gate": ("moe_shared_expert_gate", _ON),
    "--moe-latent-size": ("moe_latent_size", _INT),
    "--mtp-num-layers": ("mtp_num_layers", _INT),
    "--multi-latent-attention": ("multi_latent_attention", _ON),
    "--q-lora-rank": ("q_lora_rank", _INT),
    "--kv-lora-rank": ("kv_lora_rank", _INT),
    "--qk-head-dim": ("qk_head_dim", _INT),
    "--qk-pos-emb-head-dim": ("qk_pos_emb_head_dim", _INT),
    "--v-head-dim": ("v_head_dim", _INT),
    "--bf16": ("bf16", _ON),
    "--fp16": ("fp16", _ON),
    "--fp8-param-gather": ("fp8_param_gather", _ON),
    "--grad-reduce-in-bf16": ("grad_reduce_in_bf16", _ON),
    "--use-distributed-optimizer": ("use_distributed_optimizer", _ON),
    "--use-megatron-fsdp": ("use_megatron_fsdp", _ON),
    "--data-parallel-sharding-strategy": ("data_parallel_sharding_strategy", _STR),
    "--sequence-parallel": ("sequence_parallel", _ON),
    "--recompute-granularity": ("recompute_granularity", _STR),
    "--recompute-method": ("recompute_method", _STR),
    "--recompute-num-layers": ("recompute_num_layers", _INT),
    "--recompute-activations": ("recompute_activations", _ON),
    "--hybrid-layer-pattern": ("hybrid_layer_pattern", _STR),
    "--hybrid-override-pattern": ("hybrid_layer_pattern", _STR),
}
