"""The configurations of the oracle tier: real models (SC21's GPT-3 175B launch, Llama-3 8B/70B with
GQA, Mixtral-style and DeepSeek-V3-style MoE with MLA and MTP, a latent MoE) under layouts that
cover TP, SP, CP, PP, VPP, EP/ETP, the distributed optimizer and recompute; and the upstream args
Namespace of each."""

from argparse import Namespace
from dataclasses import dataclass, field
from typing import Any

from megatron_ga_ext.core.memory import Parallel, Precision, Recompute
from megatron_ga_ext.core.model_shape import ModelShape, padded_vocab


@dataclass(frozen=True)
class Case:
    id: str
    model: ModelShape
    par: Parallel
    precision: Precision = field(default_factory=Precision)
    recompute: Recompute = field(default_factory=Recompute)
    micro_batch_size: int = 1
    global_batch_size: int = 0

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.par.data_parallel_size)

    @property
    def upstream_models_activations(self) -> bool:
        """Upstream's activation formula covers the case (it leaves full recompute out)."""
        return self.recompute.granularity != "full"


def _model(vocab: int, tp: int, **kw: Any) -> ModelShape:
    return ModelShape(padded_vocab_size=padded_vocab(vocab, 128, tp), **kw)


GPT3 = dict(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048)
LLAMA8 = dict(
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_query_groups=8,
    ffn_hidden_size=14336,
    seq_length=8192,
    swiglu=True,
    normalization="RMSNorm",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)
LLAMA70 = {
    **LLAMA8,
    "num_layers": 80,
    "hidden_size": 8192,
    "num_attention_heads": 64,
    "ffn_hidden_size": 28672,
}
MIXTRAL = {**LLAMA8, "seq_length": 4096, "num_experts": 8, "moe_router_topk": 2}
DSV3 = dict(
    num_layers=61,
    hidden_size=7168,
    num_attention_heads=128,
    seq_length=4096,
    ffn_hidden_size=18432,
    swiglu=True,
    normalization="RMSNorm",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    multi_latent_attention=True,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_head_dim=128,
    qk_pos_emb_head_dim=64,
    v_head_dim=128,
    num_experts=256,
    moe_ffn_hidden_size=2048,
    moe_router_topk=8,
    moe_shared_expert_intermediate_size=2048,
    moe_layer_freq=(0, 0, 0, *([1] * 58)),
    mtp_num_layers=1,
)
LATENT = dict(
    num_layers=24,
    hidden_size=2048,
    num_attention_heads=16,
    seq_length=4096,
    swiglu=True,
    num_experts=64,
    moe_ffn_hidden_size=1024,
    moe_router_topk=6,
    moe_latent_size=512,
    moe_layer_freq=2,
    moe_shared_expert_intermediate_size=2048,
    moe_shared_expert_gate=True,
    mtp_num_layers=2,
)
GPT345 = dict(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=1024)

SEL = Recompute(granularity="selective")
DIST = Precision(use_distributed_optimizer=True)


def _case(name: str, shape: dict, vocab: int, world: int, mbs: int, gbs: int, **kw: Any) -> Case:
    par_kw = {k: v for k, v in kw.items() if k not in ("precision", "recompute", "model")}
    par = Parallel(world_size=world, **par_kw)
    model = _model(vocab, par.tensor_model_parallel_size, **{**shape, **kw.get("model", {})})
    extra = {k: kw[k] for k in ("precision", "recompute") if k in kw}
    return Case(name, model, par, micro_batch_size=mbs, global_batch_size=gbs, **extra)


T, P, V, C = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
)
E, ET, SP = "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel"

CASES = [
    # SC21 (Narayanan et al. 2021), GPT-3 175B: 1024 A100s, TP 8, PP 16, B 1536, MBS 1, interleaved.
    _case("gpt3-175b-sc21", GPT3, 50257, 1024, 1, 1536, **{T: 8, P: 16}),
    _case("gpt3-175b-sc21-vpp", GPT3, 50257, 1024, 1, 1536, **{T: 8, P: 16, V: 3}),
    _case("gpt3-175b-sp-sel", GPT3, 50257, 1024, 1, 1536, **{T: 8, P: 16, SP: True}, recompute=SEL),
    _case(
        "gpt3-175b-sp-sel-vpp-dist",
        GPT3,
        50257,
        1024,
        1,
        1536,
        **{T: 8, P: 16, V: 2, SP: True},
        recompute=SEL,
        precision=DIST,
    ),
    _case(
        "gpt3-175b-full-recompute",
        GPT3,
        50257,
        1024,
        1,
        1536,
        **{T: 8, P: 16},
        recompute=Recompute(granularity="full", method="uniform", num_layers=1),
    ),
    _case("gpt3-175b-ga-below-pp", GPT3, 50257, 1024, 1, 64, **{T: 8, P: 16}),
    _case("gpt3-175b-mbs4", GPT3, 50257, 1024, 4, 1536, **{T: 8, P: 16, SP: True}, recompute=SEL),
    _case("gpt345m-dp8", GPT345, 50257, 8, 8, 256),
    _case("gpt345m-tp2-dist", GPT345, 50257, 8, 4, 256, **{T: 2}, precision=DIST),
    _case("gpt345m-cp2", GPT345, 50257, 8, 4, 256, **{C: 2}),
    _case("gpt345m-tied-pp2", GPT345, 50257, 8, 2, 64, **{P: 2}),
    _case("llama3-8b-dp8", LLAMA8, 128256, 8, 1, 128),
    _case("llama3-8b-dp8-dist", LLAMA8, 128256, 8, 1, 128, precision=DIST),
    _case("llama3-8b-tp2-sp-sel", LLAMA8, 128256, 16, 2, 256, **{T: 2, SP: True}, recompute=SEL),
    _case(
        "llama3-8b-tp4-cp2",
        LLAMA8,
        128256,
        32,
        1,
        256,
        **{T: 4, C: 2, SP: True},
        recompute=SEL,
        precision=DIST,
    ),
    _case("llama3-8b-pp4-vpp2", LLAMA8, 128256, 16, 1, 128, **{P: 4, V: 2}),
    _case("llama3-8b-pp2-ga1", LLAMA8, 128256, 4, 4, 8, **{P: 2}),
    _case(
        "llama3-8b-block-recompute",
        LLAMA8,
        128256,
        8,
        2,
        128,
        recompute=Recompute(granularity="full", method="block", num_layers=8),
    ),
    _case(
        "llama3-70b-tp8-pp4-vpp5",
        LLAMA70,
        128256,
        256,
        1,
        512,
        **{T: 8, P: 4, V: 5, SP: True},
        recompute=SEL,
        precision=DIST,
    ),
    _case(
        "llama3-70b-tp8-pp4-cp2",
        LLAMA70,
        128256,
        512,
        1,
        512,
        **{T: 8, P: 4, C: 2, SP: True},
        recompute=SEL,
        precision=DIST,
    ),
    _case("llama3-70b-tp8-pp8", LLAMA70, 128256, 512, 1, 1024, **{T: 8, P: 8}),
    _case("llama3-70b-fsdp-like-dp", LLAMA70, 128256, 64, 1, 64, **{T: 8}, precision=DIST),
    _case("mixtral-ep8", MIXTRAL, 32000, 8, 1, 64, **{E: 8}),
    _case(
        "mixtral-tp2-ep4-dist",
        MIXTRAL,
        32000,
        16,
        1,
        128,
        **{T: 2, E: 4, SP: True},
        recompute=SEL,
        precision=DIST,
    ),
    _case(
        "mixtral-tp2-etp1-ep8-pp2",
        MIXTRAL,
        32000,
        32,
        1,
        128,
        **{T: 2, P: 2, E: 8, ET: 1},
        precision=DIST,
    ),
    _case("mixtral-freq2", MIXTRAL, 32000, 8, 2, 64, **{E: 4}, model={"moe_layer_freq": 2}),
    _case(
        "deepseek-v3-mtp",
        DSV3,
        129280,
        2048,
        1,
        4096,
        **{T: 2, P: 16, E: 64, ET: 1, SP: True},
        recompute=SEL,
        precision=DIST,
    ),
    _case(
        "deepseek-v3-mtp-vpp",
        DSV3,
        129280,
        2048,
        1,
        4096,
        **{T: 1, P: 16, V: 2, E: 64},
        precision=DIST,
    ),
    _case(
        "deepseek-v3-mtp-cp2",
        DSV3,
        129280,
        4096,
        1,
        4096,
        **{T: 2, P: 16, C: 2, E: 64, ET: 1, SP: True},
        recompute=SEL,
        precision=DIST,
    ),
    _case(
        "deepseek-v3-no-qlora",
        DSV3,
        129280,
        1024,
        1,
        2048,
        **{T: 4, P: 8, E: 32, ET: 1},
        model={"q_lora_rank": None, "mtp_num_layers": None},
        precision=DIST,
    ),
    _case("latent-moe-mtp2", LATENT, 50257, 16, 2, 256, **{T: 2, E: 8, SP: True}, recompute=SEL),
    _case("latent-moe-pp2-dist", LATENT, 50257, 32, 1, 256, **{T: 2, P: 2, E: 8}, precision=DIST),
    _case(
        "gpt345m-fp8-params",
        GPT345,
        50257,
        8,
        8,
        256,
        precision=Precision(fp8_param_gather=True, use_distributed_optimizer=True),
    ),
    _case(
        "gpt345m-fsdp-full",
        GPT345,
        50257,
        8,
        8,
        256,
        precision=Precision(fsdp_sharding="optim_grads_params"),
    ),
    _case(
        "gpt3-175b-tp8-pp8-cp2",
        GPT3,
        50257,
        1024,
        1,
        1536,
        **{T: 8, P: 8, C: 2, SP: True},
        recompute=SEL,
        precision=DIST,
    ),
    _case(
        "llama3-8b-swiglu-default-ffn",
        {**LLAMA8, "ffn_hidden_size": None},
        128256,
        8,
        1,
        64,
        **{T: 2},
    ),
]


def upstream_args(case: Case) -> Namespace:
    """Megatron's args for ``case`` as validate_args leaves them; CP as upstream's formula would
    need it: each rank of a CP group holds seq_length / CP tokens (upstream leaves CP out,
    docs/memory.md)."""
    m, p = case.model, case.par
    return Namespace(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        kv_channels=m.kv,
        ffn_hidden_size=m.ffn,
        group_query_attention=m.num_query_groups is not None,
        num_query_groups=m.num_query_groups,
        padded_vocab_size=m.padded_vocab_size,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        swiglu=m.swiglu,
        normalization=m.normalization,
        add_bias_linear=m.add_bias_linear,
        num_experts=m.num_experts,
        moe_ffn_hidden_size=m.moe_ffn if m.num_experts is not None else None,
        moe_router_topk=m.moe_router_topk,
        moe_layer_freq=m.moe_layer_freq
        if isinstance(m.moe_layer_freq, int)
        else list(m.moe_layer_freq),
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=m.moe_shared_expert_gate,
        moe_latent_size=m.moe_latent_size,
        mtp_num_layers=m.mtp_num_layers,
        multi_latent_attention=m.multi_latent_attention,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_head_dim,
        qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
        v_head_dim=m.v_head_dim,
        attention_output_gate=m.attention_output_gate,
        experimental_attention_variant=None,
        hybrid_layer_pattern=None,
        seq_length=m.seq_length // p.context_parallel_size,
        micro_batch_size=case.micro_batch_size,
        world_size=p.world_size,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.etp,
        data_parallel_size=p.data_parallel_size,
        sequence_parallel=p.sequence_parallel,
        recompute_granularity=case.recompute.granularity,
        use_distributed_optimizer=case.precision.use_distributed_optimizer,
    )


def flops_args(case: Case) -> Namespace:
    """The args num_floating_point_operations reads: the whole sequence (FLOPs are per step, CP does
    not change them)."""
    args = upstream_args(case)
    args.seq_length = case.model.seq_length
    return args
