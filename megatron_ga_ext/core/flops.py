"""Floating-point operations of one training step of a Megatron GPT model. Pure Python (stdlib
only).

Upstream's ``num_floating_point_operations`` (megatron/training/training.py:390-902 at
core_v0.19.0), for fixed-length samples (BSHD, no packing), a standard Transformer (MHA, GQA or
MLA; dense or MoE; MTP):

    FLOPs = 3 (forward, wgrad, dgrad) x 2 (multiply-add) x [
        tokens x ( h x (ffn x f x dense + moe_ffn x topk x f x moe + shared x f x moe)
                   + attention projections x layers + MTP (3 h + 2 h^2) x depth
                   + h x V x (depth + 1) )
        + tokens x seq x attention core (q_proj / 2 causal x 2 matmuls) x layers ]

with f = 3 for SwiGLU (2 otherwise), tokens = GBS x seq. Recomputation is not counted (as
upstream): these are the model's FLOPs, not the hardware's.
"""

from __future__ import annotations

from megatron_ga_ext.core.model_shape import ModelShape

__all__ = ["step_flops"]

_FWD_BWD = 3
_FMA = 2


def _attention_terms(model: ModelShape) -> tuple[float, float]:
    """(projections per token, core attention per token per token of the sequence) of one layer,
    before the 3 x 2 factor (training.py:609-700)."""
    h, heads = model.hidden_size, model.num_attention_heads
    if model.multi_latent_attention:
        rope, qk, v = model.qk_pos_emb_head_dim, model.qk_head_dim, model.v_head_dim
        if model.q_lora_rank is None:
            q_term = h * heads * (qk + rope)
        else:
            q_term = model.q_lora_rank * (h + heads * (qk + rope) + 1)
        linear = q_term + model.kv_lora_rank * (h + heads * (qk + v) + 1) + h * rope + heads * v * h
        return linear, heads * (qk + rope) / 2 + heads * v / 2
    query = model.kv * heads
    kv = model.kv * model.groups
    gate = query if model.attention_output_gate else 0
    return h * (query + 2 * kv + gate) + query * h, query / 2 * 2


def step_flops(model: ModelShape, global_batch_size: int) -> float:
    """FLOPs of one step of ``global_batch_size`` samples of ``model.seq_length`` tokens
    (training.py:390)."""
    h, seq = model.hidden_size, model.seq_length
    tokens = global_batch_size * seq
    pattern = model.pattern
    n_moe = sum(pattern)
    n_dense = model.num_layers - n_moe
    topk = model.moe_router_topk if model.num_experts is not None else 0
    depth = model.mtp_num_layers or 0
    last_moe = pattern[-1] if model.num_experts is not None else 0
    n_moe += last_moe * depth
    n_dense += (1 - last_moe) * depth
    layers = model.num_layers + depth
    f = 3 if model.swiglu else 2
    shared = model.moe_shared_expert_intermediate_size or 0
    latent = model.moe_latent_size
    routed: float = model.moe_ffn * topk * f
    if latent is not None:  # routed experts run on the latent size, plus its up/down projections
        routed = routed * latent / h + 2 * latent
    mlp = h * (model.ffn * f * n_dense + routed * n_moe + shared * f * n_moe)
    linear, core = _attention_terms(model)
    mtp = depth * (3 * h + 2 * h * h)
    logits = h * model.padded_vocab_size * (depth + 1)
    scale = _FWD_BWD * _FMA
    per_token = scale * (mlp + linear * layers + mtp + logits)
    return tokens * per_token + global_batch_size * seq * seq * scale * core * layers
