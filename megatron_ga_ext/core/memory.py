"""Memory per GPU of a Megatron GPT launch, before the allocation. Pure Python (stdlib only).

The split follows what the micro-batch size moves and what it does not:

    weights and optimizer (MBS never moves them)      per parameter held on the rank:
        parameters      2 B (bf16/fp16), 1 B (--fp8-param-gather), 4 B (fp32)
        gradients       4 B (fp32 main grads), 2 B (--grad-reduce-in-bf16, or fp16)
        optimizer       4 B fp32 main params (none for fp32 params) + 8 B Adam moments,
                        / DP with --use-distributed-optimizer (expert params: / expert DP)
                        Megatron-FSDP also shards gradients (optim_grads) and parameters
                        (optim_grads_params) by DP
    activations (linear in MBS)                       first pipeline stage, where the peak is:
        one micro-batch of the stage; the pipeline's peak = one micro-batch x those in flight

With the default precision (bf16 params, fp32 grads and main params, Adam) the
weights-and-optimizer bytes are upstream's ``18`` or ``6 + 12 / DP`` per parameter
(megatron/training/theoretical_memory_usage.py:293-303 at core_v0.19.0), and the activations are
its Table 2 formulas of Korthikanti et al. (2205.05198), chosen as upstream chooses them
(:349-350 and :466-477): with sequence parallelism and selective recompute ``s b h (18 + 4 ffn /
h) / TP`` per layer, otherwise ``s b h (10 + 24 / TP)`` per layer and 5 % more. Where this module
goes beyond upstream (context parallelism, full recompute, other precisions, FSDP) docs/memory.md
says what and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_ga_ext.core.model_shape import ModelShape

__all__ = ["GiB", "Memory", "Parallel", "Precision", "Recompute", "ShardParams", "memory"]

GiB = 1024**3
#: Upstream's "MB" (theoretical_memory_usage.py:9).
MiB = 1024 * 1024
#: What Megatron-FSDP's --data-parallel-sharding-strategy shards by DP.
_FSDP_SHARDS = {
    "no_shard": (),
    "optim": ("optimizer",),
    "optim_grads": ("optimizer", "grads"),
    "optim_grads_params": ("optimizer", "grads", "params"),
}


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """The parallel sizes the memory depends on."""

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    """None: TP, as in Megatron."""
    sequence_parallel: bool = False

    @property
    def data_parallel_size(self) -> int:
        """DP = world / (TP x PP x CP)."""
        tp, pp, cp = (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.context_parallel_size,
        )
        return self.world_size // (tp * pp * cp)

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """Expert DP = world / (ETP x EP x PP) (theoretical_memory_usage.py:205-212)."""
        return self.world_size // (
            self.etp * self.expert_model_parallel_size * self.pipeline_model_parallel_size
        )


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Bytes each parameter costs, and how the optimizer state is sharded."""

    params_dtype: str = "bf16"
    """bf16, fp16 or fp32 (--bf16, --fp16, neither)."""
    fp8_param_gather: bool = False
    """--fp8-param-gather: the model's copy of the weights in fp8 (1 B)."""
    grad_reduce_in_bf16: bool = False
    """--grad-reduce-in-bf16: the gradient buffer in bf16 (arguments.py:1189-1190)."""
    use_distributed_optimizer: bool = False
    fsdp_sharding: str | None = None
    """Megatron-FSDP's --data-parallel-sharding-strategy (None: no Megatron-FSDP)."""

    @property
    def param_bytes(self) -> int:
        if self.fp8_param_gather:
            return 1
        return 4 if self.params_dtype == "fp32" else 2

    @property
    def grad_bytes(self) -> int:
        """fp32 main grads for bf16 (Megatron turns --accumulate-allreduce-grads-in-fp32 on,
        arguments.py:1191-1194) and fp32; fp16 keeps fp16 grads; --grad-reduce-in-bf16 keeps bf16
        ones."""
        if self.grad_reduce_in_bf16 or self.params_dtype == "fp16":
            return 2
        return 4

    @property
    def optimizer_bytes(self) -> int:
        """Adam's two fp32 moments (8 B), and an fp32 main copy of the weights (4 B) unless they are
        fp32."""
        return 8 + (0 if self.params_dtype == "fp32" else 4)

    def sharded(self, part: str) -> bool:
        """Whether ``part`` (params, grads, optimizer) is split across the data-parallel ranks."""
        dist_optimizer = part == "optimizer" and self.use_distributed_optimizer
        if self.fsdp_sharding is not None:
            return dist_optimizer or part in _FSDP_SHARDS.get(self.fsdp_sharding, ())
        return dist_optimizer


@dataclass(frozen=True, kw_only=True)
class Recompute:
    """--recompute-granularity, --recompute-method, --recompute-num-layers."""

    granularity: str | None = None
    """None, "selective" or "full"."""
    method: str | None = None
    """"uniform" or "block" (full recompute only)."""
    num_layers: int = 1


@dataclass(frozen=True)
class ShardParams:
    """Parameters on the most loaded rank (the first pipeline stage), by how they are held:
    TP-sharded, replicated, expert-sharded (theoretical_memory_usage.py:214-267)."""

    tp_sharded: float
    replicated: float
    expert: float

    @property
    def total(self) -> float:
        return self.tp_sharded + self.replicated + self.expert


@dataclass(frozen=True, kw_only=True)
class Memory:
    """Bytes per GPU; ``activations_*`` are linear in MBS, the rest do not depend on it."""

    parameters: float
    gradients: float
    optimizer: float
    activations_one_microbatch: float
    """One micro-batch through the first pipeline stage (all its model chunks)."""
    activations_peak: float
    """At the pipeline's peak: in-flight micro-batches on the first stage, VPP's penalty in."""
    in_flight: float
    """Micro-batches whose activations the first stage holds at once."""
    params_on_rank: float
    total_parameters: float

    @property
    def weights_and_optimizer(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.weights_and_optimizer + self.activations_peak


def shard_params(model: ModelShape, par: Parallel) -> ShardParams:
    """Parameters held by the most loaded rank: 1/PP of the layers, the MTP block, the embedding
    (and, with PP = 1, the untied output layer); TP-sharded ones / TP, expert ones / (ETP x EP)."""
    counts = model.counts
    pp, tp = par.pipeline_model_parallel_size, par.tensor_model_parallel_size
    tp_sharded = (counts.tp_block / pp + counts.tp_mtp + model.embedding_size) / tp
    replicated = counts.replicated_block / pp + counts.replicated_mtp
    expert = (counts.expert_block / pp + counts.expert_mtp) / (
        par.etp * par.expert_model_parallel_size
    )
    if model.untie_embeddings_and_output_weights and pp == 1:
        tp_sharded += model.embedding_size / tp
    return ShardParams(tp_sharded, replicated, expert)


def _part(params: ShardParams, per_param: int, sharded: bool, par: Parallel) -> float:
    """Bytes of one part: ``per_param`` bytes each, / DP (expert ones / expert DP) where sharded."""
    dense, expert = params.tp_sharded + params.replicated, params.expert
    if not sharded:
        return (dense + expert) * per_param
    return (
        dense * per_param / par.data_parallel_size
        + expert * per_param / par.expert_data_parallel_size
    )


def in_flight_microbatches(par: Parallel, num_microbatches: int | None) -> float:
    """Micro-batches the first stage holds: min(GA, PP) without interleaving; PP x (1 + (PP - 1) /
    (PP x VPP)) with it (theoretical_memory_usage.py:341-366)."""
    pp, vpp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    if vpp is not None:
        return pp * (1 + (pp - 1) / (pp * vpp))
    if pp > 1 and num_microbatches is not None:
        return min(num_microbatches, pp)
    return pp


def _per_layer(model: ModelShape, par: Parallel, tokens: float, recompute: Recompute) -> float:
    """Bytes one transformer layer keeps for ``tokens`` tokens of one micro-batch (Korthikanti Table
    2; upstream's choice of formula, theoretical_memory_usage.py:317-319 and :386); the SP
    formula is divided by TP later, with the rest of the stage (:379)."""
    h, tp = model.hidden_size, par.tensor_model_parallel_size
    if _sp_formula(par, recompute):
        return tokens * h * (18 + 4 * model.ffn / h)
    return tokens * h * (10 + 24 / tp)


def _sp_formula(par: Parallel, recompute: Recompute) -> bool:
    """Upstream's choice (theoretical_memory_usage.py:466): the SP formula only with SP and
    selective recompute."""
    return par.sequence_parallel and recompute.granularity == "selective"


def _stage_layers(model: ModelShape, par: Parallel, tokens: float, recompute: Recompute) -> float:
    """Bytes the first stage's layers keep for one micro-batch. Full recompute keeps each recomputed
    layer's input (2 s b h, / TP with SP) instead of its activations: uniform keeps one input per
    group of N layers, block keeps the inputs of N layers and the rest whole; the group being
    recomputed is counted once (in the peak)."""
    layers = model.num_layers / par.pipeline_model_parallel_size
    whole = _per_layer(model, par, tokens, recompute)
    if recompute.granularity != "full":
        return whole * layers
    sp = par.tensor_model_parallel_size if par.sequence_parallel else 1
    layer_input = 2 * tokens * model.hidden_size / sp
    n = max(recompute.num_layers, 1)
    if recompute.method == "block":
        kept = min(n, layers)
        return layer_input * kept + whole * (layers - kept)
    return layer_input * math.ceil(layers / n)


def _recompute_working(
    model: ModelShape, par: Parallel, tokens: float, recompute: Recompute
) -> float:
    """The activations of the layers recomputed at once in the backward of full uniform recompute
    (one group)."""
    if recompute.granularity != "full" or recompute.method == "block":
        return 0.0
    layers = model.num_layers / par.pipeline_model_parallel_size
    return _per_layer(model, par, tokens, recompute) * min(max(recompute.num_layers, 1), layers)


def _embedding(model: ModelShape, tokens: float) -> float:
    """Input to the embedding (8 B per token) and its dropout (s b h), per micro-batch (:329-339); /
    TP with the SP formula, as upstream divides the whole (:379)."""
    return 8 * tokens + tokens * model.hidden_size


def _output(model: ModelShape, par: Parallel, tokens: float, recompute: Recompute) -> float:
    """Inputs to the output layer and the loss, on the first stage only when PP = 1 (:368-376,
    :437-447)."""
    if par.pipeline_model_parallel_size != 1:
        return 0.0
    h, v, tp = model.hidden_size, model.padded_vocab_size, par.tensor_model_parallel_size
    if _sp_formula(par, recompute):
        return tokens * h * 4 * (1 + v / h)
    return (tokens * v / tp + tokens * h) * 2


def activations(
    model: ModelShape,
    par: Parallel,
    micro_batch_size: int,
    num_microbatches: int | None,
    recompute: Recompute,
) -> tuple[float, float, float]:
    """(one micro-batch, the peak, in-flight micro-batches) in bytes on the first stage. Each rank
    of a context parallel group holds seq_length / CP tokens of a sample (upstream leaves CP
    out)."""
    tokens = model.seq_length / par.context_parallel_size * micro_batch_size
    stage = _stage_layers(model, par, tokens, recompute) + _embedding(model, tokens)
    output = _output(model, par, tokens, recompute)
    flight = in_flight_microbatches(par, num_microbatches)
    working = _recompute_working(model, par, tokens, recompute)
    if _sp_formula(par, recompute):
        scale = 1 / par.tensor_model_parallel_size
        return (stage + output) * scale, (stage * flight + output) * scale + working, flight
    return (stage + output) * 1.05, (stage * flight + output) * 1.05 + working * 1.05, flight


def memory(
    model: ModelShape,
    par: Parallel,
    precision: Precision,
    micro_batch_size: int,
    num_microbatches: int | None,
    recompute: Recompute | None = None,
) -> Memory:
    """Bytes per GPU of ``model`` under ``par``, ``precision`` and ``recompute`` at
    ``micro_batch_size``."""
    params = shard_params(model, par)
    one, peak, flight = activations(
        model, par, micro_batch_size, num_microbatches, recompute or Recompute()
    )
    return Memory(
        parameters=_part(params, precision.param_bytes, precision.sharded("params"), par),
        gradients=_part(params, precision.grad_bytes, precision.sharded("grads"), par),
        optimizer=_part(params, precision.optimizer_bytes, precision.sharded("optimizer"), par),
        activations_one_microbatch=one,
        activations_peak=peak,
        in_flight=flight,
        params_on_rank=params.total,
        total_parameters=model.counts.total,
    )
