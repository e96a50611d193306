"""The tiny models verify trains: a real megatron-core GPTModel, and a position-wise model for CP.

Both are initialised from their parameters' *global* names (layer index plus the PP stage offset), so
every layout and the unpartitioned reference start from bit-identical weights:

    w[name] = 1 + 0.1 * N(0, 1)   for norm weights,   0.02 * N(0, 1) otherwise,
    with the generator seeded by crc32(global name).
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

import torch

__all__ = ["ModelConfig", "build_gpt", "build_positionwise", "global_name", "init_by_name",
           "init_model_parallel", "transformer_config"]


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """Sizes of the tiny models (fp32 throughout)."""

    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 4
    vocab_size: int = 64
    seq_length: int = 16


def init_model_parallel(**sizes: int) -> None:
    """megatron's parallel state (TP = 1) and its RNG tracker, as training sets them up."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(**sizes)
    model_parallel_cuda_manual_seed(1234)


def transformer_config(model: ModelConfig, *, pipeline_model_parallel_size: int,
                       context_parallel_size: int, calculate_per_token_loss: bool):
    """A megatron TransformerConfig for the tiny models: fp32, no dropout, CPU initialisation."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
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
        context_parallel_size=context_parallel_size,
        calculate_per_token_loss=calculate_per_token_loss,
        batch_p2p_comm=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )


def layer_offset(model: ModelConfig, pipeline_rank: int, pipeline_size: int) -> int:
    """Global index of this stage's first layer: stage x num_layers / PP."""
    return pipeline_rank * (model.num_layers // pipeline_size)


def global_name(name: str, offset: int) -> str:
    """A parameter's name in the unpartitioned model (``decoder.layers.i`` -> ``i + offset``).

    The output layer of a last PP stage is tied to the word embedding, so it takes that name.
    """
    if name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + offset}.", name)


def init_by_name(module: torch.nn.Module, names: dict[str, str]) -> None:
    """Set every parameter from its global name (see the module docstring)."""
    with torch.no_grad():
        for local, param in module.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(names[local].encode()))
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            is_norm = "norm" in local and local.endswith("weight")
            param.copy_(1.0 + 0.1 * values if is_norm else 0.02 * values)


def build_gpt(model: ModelConfig, config, *, pre_process: bool, post_process: bool, offset: int):
    """A GPTModel with the local (no Transformer Engine) layer spec and tied embeddings."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=model.vocab_size,
        max_sequence_length=model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )
    names = {n: global_name(n, offset) for n, _ in gpt.named_parameters()}
    init_by_name(gpt, names)
    return gpt, names


def build_positionwise(model: ModelConfig, config):
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

        def set_input_tensor(self, input_tensor) -> None:
            pass

        def forward(self, input_ids, position_ids, attention_mask=None, labels=None):
            h = self.word(input_ids) + self.position(position_ids)
            h = h + self.fc2(torch.tanh(self.fc1(h)))
            logits = self.output(h).float()
            return torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), labels, reduction="none")

    lm = PositionwiseLM()
    names = {n: n for n, _ in lm.named_parameters()}
    init_by_name(lm, names)
    return lm, names
