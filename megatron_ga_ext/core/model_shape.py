"""The shape of a Megatron GPT model, from its flags, and its parameter counts. Pure Python (stdlib
only).

Defaults are Megatron's (megatron/training/arguments.py at core_v0.19.0): --ffn-hidden-size 4 h, or
``int(4 h 2/3 / 64) x 64`` with --swiglu (:1280-1289); --kv-channels h / heads (:1291-1293); the
vocabulary padded to a multiple of --make-vocab-size-divisible-by x TP
(megatron/core/tokenizers/utils/build_tokenizer.py:124-130); --moe-ffn-hidden-size = FFN
(:1595-1596). The counts are upstream's (megatron/training/theoretical_memory_usage.py:12-245), by
how each parameter is held: TP-sharded (attention, dense MLP, shared experts), replicated (norms,
router, latent projections), expert-sharded (routed experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

__all__ = ["Counts", "ModelShape", "moe_pattern", "padded_vocab"]


def padded_vocab(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> int:
    """``ceil(vocab / (divisible_by x TP)) x divisible_by x TP`` (build_tokenizer.py:128-130)."""
    multiple = divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def moe_pattern(freq: int | tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """1 for each MoE layer: every ``freq``-th layer from the first, or the pattern as given
    (theoretical_memory_usage.py:30-40)."""
    if isinstance(freq, int):
        return tuple(1 if i % freq == 0 else 0 for i in range(num_layers))
    return tuple(freq)


@dataclass(frozen=True)
class Counts:
    """Parameters of the whole model by how they are held (not yet divided among ranks)."""

    tp_block: float
    replicated_block: float
    expert_block: float
    tp_mtp: float
    replicated_mtp: float
    expert_mtp: float
    embedding_layers: float

    @property
    def total(self) -> float:
        return (
            self.tp_block
            + self.replicated_block
            + self.expert_block
            + self.tp_mtp
            + self.replicated_mtp
            + self.expert_mtp
            + self.embedding_layers
        )


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A GPT model's flags, by Megatron's argparse destinations; None: Megatron's default (see the
    module)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    padded_vocab_size: int
    """The vocabulary as Megatron pads it (:func:`padded_vocab`)."""
    ffn_hidden_size: int | None = None
    kv_channels: int | None = None
    num_query_groups: int | None = None
    """None (no --group-query-attention): one group per head."""
    untie_embeddings_and_output_weights: bool = False
    swiglu: bool = False
    normalization: str = "LayerNorm"
    add_bias_linear: bool = True
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 2
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_latent_size: int | None = None
    mtp_num_layers: int | None = None
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    attention_output_gate: bool = False

    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            return int((4 * self.hidden_size * 2 / 3) / 64) * 64
        return 4 * self.hidden_size

    @property
    def kv(self) -> int:
        return (
            self.kv_channels
            if self.kv_channels is not None
            else self.hidden_size // self.num_attention_heads
        )

    @property
    def groups(self) -> int:
        return (
            self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads
        )

    @property
    def moe_ffn(self) -> int:
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn

    @property
    def norm_size(self) -> int:
        """RMSNorm has no bias, LayerNorm has (:59-60)."""
        return 1 if self.normalization == "RMSNorm" else 2

    @property
    def embedding_size(self) -> int:
        return self.hidden_size * self.padded_vocab_size

    @property
    def pattern(self) -> tuple[int, ...]:
        if self.num_experts is None:
            return (0,) * self.num_layers
        return moe_pattern(self.moe_layer_freq, self.num_layers)

    @property
    def mtp_layers(self) -> tuple[int, int]:
        """(dense, MoE) MTP layers: each is as the last decoder layer is (:51-57)."""
        depth = self.mtp_num_layers or 0
        last_moe = self.pattern[-1] if self.pattern else 0
        return (1 - last_moe) * depth, last_moe * depth

    def attention_params(self) -> float:
        """2 h^2 (1 + groups / heads) x (kv x heads / h) (:82-93); MLA's low-rank projections
        (:62-80)."""
        h, heads = self.hidden_size, self.num_attention_heads
        if not self.multi_latent_attention:
            return 2 * h * h * ((1 + self.groups / heads) * (self.kv * heads / h))
        rope, qk, v = self.qk_pos_emb_head_dim, self.qk_head_dim, self.v_head_dim
        if self.q_lora_rank is None:
            q_term = h * heads * (qk + rope)
        else:
            q_term = self.q_lora_rank * (h + heads * (qk + rope) + self.norm_size)
        kv_term = self.kv_lora_rank * (h + heads * (qk + v) + self.norm_size)
        return q_term + kv_term + h * rope + heads * v * h

    @cached_property
    def counts(self) -> Counts:
        """The parameters by how they are held (:102-245); computed once per shape."""
        h = self.hidden_size
        gated = 3 / 2 if self.swiglu else 1
        experts = self.num_experts or 1
        moe_ffn = self.moe_ffn if self.num_experts is not None else 0
        shared = self.moe_shared_expert_intermediate_size or 0
        attention = self.attention_params()
        dense_mlp = 2 * h * self.ffn * gated
        shared_mlp = 2 * h * shared * gated
        routed_h = self.moe_latent_size if self.moe_latent_size is not None else h
        routed = 2 * routed_h * moe_ffn * experts * gated
        moe = self.num_experts is not None
        latent = 2 * h * self.moe_latent_size if moe and self.moe_latent_size is not None else 0
        norms = 2 * h * self.norm_size
        router = h * experts + (experts if self.add_bias_linear else 0) if moe else 0
        gate = h if shared > 0 and self.moe_shared_expert_gate else 0
        n_moe = sum(self.pattern)
        n_dense = self.num_layers - n_moe
        mtp_dense, mtp_moe = self.mtp_layers
        moe_replicated = norms + latent + router + gate
        embedding = self.embedding_size * (2 if self.untie_embeddings_and_output_weights else 1)
        return Counts(
            tp_block=(attention + dense_mlp) * n_dense + (attention + shared_mlp) * n_moe,
            replicated_block=norms * n_dense + moe_replicated * n_moe + self.norm_size * h,
            expert_block=routed * n_moe,
            tp_mtp=(attention + dense_mlp) * mtp_dense + (attention + shared_mlp) * mtp_moe,
            replicated_mtp=norms * mtp_dense + moe_replicated * mtp_moe,
            expert_mtp=routed * mtp_moe,
            embedding_layers=embedding,
        )
