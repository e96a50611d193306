"""The tiny models verify trains: a real megatron-core GPTModel (dense, MoE, with an MTP layer, or
both), and a position-wise model for CP.

All are initialised from their parameters' *global* names (megatron's own layer numbering across PP
and virtual stages, and global expert indices across EP ranks), so every layout and the
unpartitioned reference start from bit-identical weights:

    w[name] = 1 + 0.1 * N(0, 1)   for norm weights,   0.02 * N(0, 1) otherwise,
    with the generator seeded by crc32(global name).
"""

from __future__ import annotations

import contextlib
import re
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = [
    "KINDS",
    "POSITIONWISE_GPT",
    "UNTIED_GPT",
    "ModelConfig",
    "build_gpt",
    "build_positionwise",
    "global_names",
    "init_by_name",
    "init_model_parallel",
    "transformer_config",
]


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """Sizes of the tiny models (fp32 throughout)."""

    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    vocab_size: int = 64
    seq_length: int = 16


#: What each model kind adds to the dense GPT's TransformerConfig: top-2 of 4 experts with the
#: load-balancing aux loss and the z-loss (the local implementation wants no linear biases), and one
#: multi-token-prediction layer (which wants rotary position embeddings).
MOE: dict[str, Any] = {
    "num_moe_experts": 4,
    "moe_router_topk": 2,
    "moe_aux_loss_coeff": 1e-2,
    "moe_z_loss_coeff": 1e-3,
    "moe_router_load_balancing_type": "aux_loss",
    "add_bias_linear": False,
}
#: global_aux_loss alone (its gradient measured apart, verify/aux.py), and with the z-loss: the
#: reference (references.py) takes the load-balancing loss per micro-batch over every DP rank's
#: rows, the z-loss per unit.
MOE_GLOBAL = {**MOE, "moe_router_load_balancing_type": "global_aux_loss", "moe_z_loss_coeff": None}
MOE_GLOBAL_Z = {**MOE, "moe_router_load_balancing_type": "global_aux_loss"}
MTP = {"mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.1}
KINDS: dict[str, dict[str, Any]] = {
    "gpt": {},
    "moe": MOE,
    "mtp": MTP,
    "mtp2": {**MTP, "mtp_num_layers": 2},
    "moe_mtp": {**MOE, **MTP},
    "moe_global": MOE_GLOBAL,
    "moe_global_z": MOE_GLOBAL_Z,
    "moe_seq": {**MOE, "moe_router_load_balancing_type": "seq_aux_loss"},
    "moe_positionwise": MOE,
    "moe_bias": {
        **MOE,
        "moe_router_enable_expert_bias": True,
        "moe_router_score_function": "sigmoid",
    },
    "gpt_untied": {},
}
#: GPT kinds whose layers have no attention (an MoE MLP and its norm only), so a CP shard's gradient
#: is exact without ring attention (which needs Transformer Engine).
POSITIONWISE_GPT = ("moe_positionwise",)
#: GPT kinds with an output layer of their own (torch FSDP2 cannot shard a weight two of its units
#: share).
UNTIED_GPT = ("gpt_untied",)


def init_model_parallel(**sizes: int | None) -> None:
    """megatron's parallel state and its RNG tracker, as training sets them up (``sizes``:
    initialize_model_parallel's keywords; None where megatron takes its default, as for the virtual
    pipeline and the expert TP size)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(**sizes)
    model_parallel_cuda_manual_seed(1234)


def transformer_config(
    model: ModelConfig,
    *,
    calculate_per_token_loss: bool,
    kind: str = "gpt",
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    tensor_model_parallel_size: int = 1,
    sequence_parallel: bool = False,
    overlap_moe_expert_parallel_comm: bool = False,
    delay_wgrad_compute: bool = False,
) -> TransformerConfig:
    """A megatron TransformerConfig for the tiny models: fp32, no dropout, CPU initialisation;
    ``kind`` adds MoE and/or MTP (:data:`KINDS`); MoE uses the alltoall dispatcher across EP ranks,
    else allgather. Combined 1F1B (``overlap_moe_expert_parallel_comm``) is validated with
    ``bf16``, as upstream's config requires, then runs in fp32 (``bf16`` cleared before the model
    is built): the precision is not what decides where the loss is divided, and fp32 keeps the
    comparison with the unpartitioned reference at 1e-6."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = dict(KINDS.get(kind, {}))
    if "num_moe_experts" in extra:
        extra.update(
            expert_model_parallel_size=expert_model_parallel_size,
            expert_tensor_parallel_size=expert_tensor_parallel_size,
            moe_token_dispatcher_type="alltoall" if expert_model_parallel_size > 1 else "allgather",
        )
    if overlap_moe_expert_parallel_comm:
        extra.update(
            overlap_moe_expert_parallel_comm=True,
            delay_wgrad_compute=delay_wgrad_compute,
            bf16=True,
        )
    if virtual_pipeline_model_parallel_size > 1:
        extra["virtual_pipeline_model_parallel_size"] = virtual_pipeline_model_parallel_size
    config = TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=2 * model.hidden_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        tensor_model_parallel_size=tensor_model_parallel_size,
        sequence_parallel=sequence_parallel,
        context_parallel_size=context_parallel_size,
        calculate_per_token_loss=calculate_per_token_loss,
        batch_p2p_comm=False,
        # the schedules call the autograd engine themselves, as in training
        deallocate_pipeline_outputs=True,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        **extra,
    )
    config.bf16 = False
    return config


def global_names(module: torch.nn.Module) -> dict[str, str]:
    """Each parameter's name in the unpartitioned model, from megatron's own numbering.

    ``decoder.layers.i`` becomes the layer's global index (``layer_number - 1``, which megatron sets
    from the PP stage and virtual stage), ``local_experts.j`` the expert's global index (EP rank x
    local experts + j), and the output layer of a last PP stage, tied to the word embedding, takes
    its name.
    """
    from megatron.core import parallel_state

    layers = getattr(getattr(module, "decoder", None), "layers", [])
    numbers = {str(i): str(layer.layer_number - 1) for i, layer in enumerate(layers)}
    experts = getattr(getattr(module, "config", None), "num_moe_experts", None) or 0
    local = (
        experts // max(parallel_state.get_expert_model_parallel_world_size(), 1) if experts else 0
    )
    first_expert = parallel_state.get_expert_model_parallel_rank() * local if experts else 0

    tied = getattr(module, "share_embeddings_and_output_weights", True)

    def rename(name: str) -> str:
        if name == "output_layer.weight" and tied:
            return "embedding.word_embeddings.weight"
        name = re.sub(
            r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{numbers[m.group(1)]}.", name
        )
        return re.sub(
            r"local_experts\.(\d+)\.",
            lambda m: f"local_experts.{int(m.group(1)) + first_expert}.",
            name,
        )

    return {n: rename(n) for n, _ in module.named_parameters()}


def init_by_name(module: torch.nn.Module, names: dict[str, str]) -> None:
    """Set every parameter from its global name (see the module docstring). A tensor-parallel shard
    is its rank's contiguous chunk of the whole parameter along ``partition_dim``, as megatron
    splits it (stride 1; an expert's over the expert TP group), so a TP layout holds the same
    weights as TP 1."""
    from megatron.core import parallel_state

    with torch.no_grad():
        for local, param in module.named_parameters():
            expert = not getattr(param, "allreduce", True)  # split over the expert TP group, not TP
            tp_size = (
                parallel_state.get_expert_tensor_parallel_world_size()
                if expert
                else parallel_state.get_tensor_model_parallel_world_size()
            )
            tp_rank = (
                parallel_state.get_expert_tensor_parallel_rank()
                if expert
                else parallel_state.get_tensor_model_parallel_rank()
            )
            gen = torch.Generator().manual_seed(zlib.crc32(names[local].encode()))
            split = tp_size > 1 and getattr(param, "tensor_model_parallel", False)
            shape = list(param.shape)
            if split:
                shape[param.partition_dim] *= tp_size
            values = torch.randn(shape, generator=gen, dtype=torch.float32)
            if split:
                values = values.chunk(tp_size, dim=param.partition_dim)[tp_rank]
            is_norm = "norm" in local and local.endswith("weight")
            param.copy_(1.0 + 0.1 * values if is_norm else 0.02 * values)


def reset_moe_logging() -> None:
    """megatron keeps one process-wide MoE loss tracker sized by the first model's layers (0.18+:
    moe_logging's metrics tracker; 0.16/0.17: moe_utils' layer-wise dict), and one MTP tracker sized
    by the first model's MTP depth; verify builds models of several depths in one process, so each
    starts with fresh ones."""
    with contextlib.suppress(ImportError):
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        MTPLossLoggingHelper.tracker.clear()
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe import moe_utils

        moe_utils.get_moe_layer_wise_logging_tracker().clear()
        return
    destroy_moe_metrics_tracker()


def build_gpt(
    model: ModelConfig,
    config: TransformerConfig,
    *,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
    positionwise: bool = False,
    untied: bool = False,
) -> tuple[GPTModel, dict[str, str]]:
    """A GPTModel with the local (no Transformer Engine) layer spec and tied embeddings (``untied``:
    an output layer of its own, as torch FSDP2 asks); MoE layers and an MTP block where ``config``
    asks for them (rotary position embeddings with MTP). ``positionwise``: the layers keep their MLP
    (MoE) and its norm and drop attention (megatron's identity ops, as its attention-free
    layers)."""
    import dataclasses

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

    reset_moe_logging()
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    if positionwise:
        spec = dataclasses.replace(
            spec,
            submodules=dataclasses.replace(
                spec.submodules,
                input_layernorm=IdentityOp,
                self_attention=IdentityOp,
                self_attn_bda=IdentityFuncOp,
            ),
        )
    if config.sequence_parallel:  # the local spec's torch norm refuses sequence parallelism
        from megatron.core.transformer.transformer_block import (
            TransformerBlockSubmodules,
            get_num_layers_to_build,
        )

        norms = {
            "input_layernorm": SequenceParallelLayerNorm,
            "pre_mlp_layernorm": SequenceParallelLayerNorm,
        }
        layer = dataclasses.replace(
            spec,
            submodules=dataclasses.replace(
                spec.submodules,
                **{k: v for k, v in norms.items() if getattr(spec.submodules, k) is not IdentityOp},
            ),
        )
        spec = TransformerBlockSubmodules(
            layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
            layer_norm=SequenceParallelLayerNorm,
        )  # a block spec holds its stage's
    mtp = bool(getattr(config, "mtp_num_layers", None))
    extra: dict[str, Any] = {"vp_stage": vp_stage} if vp_stage is not None else {}
    if mtp:
        mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
        extra["mtp_block_spec"] = (
            _sequence_parallel_mtp_norms(mtp_spec) if config.sequence_parallel else mtp_spec
        )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=model.vocab_size,
        max_sequence_length=model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not untied,
        position_embedding_type="rope" if mtp else "learned_absolute",
        **extra,
    )
    names = global_names(gpt)
    init_by_name(gpt, names)
    return gpt, names


def _sequence_parallel_mtp_norms(
    block_spec: TransformerBlockSubmodules | None,
) -> TransformerBlockSubmodules | None:
    """The MTP block spec with verify's sequence-parallel norm for each MTP layer's norms (the local
    spec's torch norm refuses sequence parallelism); a release whose layer spec has other norm
    fields keeps them."""
    import dataclasses

    if block_spec is None:  # a pipeline stage without MTP layers
        return None
    norms = ("enorm", "hnorm", "layer_norm")
    layers = [
        dataclasses.replace(
            layer,
            submodules=dataclasses.replace(
                layer.submodules,
                **{k: SequenceParallelLayerNorm for k in norms if hasattr(layer.submodules, k)},
            ),
        )
        for layer in block_spec.layer_specs
    ]
    return dataclasses.replace(block_spec, layer_specs=layers)


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm whose weights megatron's finalize sums over TP under sequence parallelism
    (each TP rank normalises its shard of the sequence), as its fused norms mark theirs."""

    def __init__(
        self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object
    ) -> None:
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


def build_positionwise(
    model: ModelConfig, config: TransformerConfig
) -> tuple[MegatronModule, dict[str, str]]:
    """A model without attention, so a CP shard's gradient needs no other shard (exact under CP)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.module import MegatronModule

    class PositionwiseLM(MegatronModule):
        """embed(token) + embed(position) -> MLP (tanh) -> logits -> per-token cross entropy."""

        def __init__(self) -> None:
            super().__init__(config=config)
            self.model_type = ModelType.encoder_or_decoder
            self.word = torch.nn.Embedding(model.vocab_size, model.hidden_size)
            self.position = torch.nn.Embedding(model.seq_length, model.hidden_size)
            self.fc1 = torch.nn.Linear(model.hidden_size, 2 * model.hidden_size)
            self.fc2 = torch.nn.Linear(2 * model.hidden_size, model.hidden_size)
            self.output = torch.nn.Linear(model.hidden_size, model.vocab_size, bias=False)

        def set_input_tensor(self, input_tensor: object) -> None:
            """Nothing to take: the model runs on one pipeline stage."""

        def forward(
            self,
            input_ids: torch.Tensor,
            position_ids: torch.Tensor,
            attention_mask: torch.Tensor | None = None,
            labels: torch.Tensor | None = None,
        ) -> torch.Tensor:
            """Per-token cross entropy of ``labels`` (the attention mask is unused: nothing
            attends)."""
            h = self.word(input_ids) + self.position(position_ids)
            h = h + self.fc2(torch.tanh(self.fc1(h)))
            logits = self.output(h).float()
            return torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), labels, reduction="none"
            )

    lm = PositionwiseLM()
    names = {n: n for n, _ in lm.named_parameters()}
    init_by_name(lm, names)
    return lm, names
