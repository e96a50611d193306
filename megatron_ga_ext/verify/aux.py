"""Measure the effective MoE auxiliary-loss coefficient per micro-batch through megatron's own code.

A probe parameter ``p`` (one entry per sample of the global batch) stands in for the router: micro-batch
``u`` attaches ``aux(u) = alpha * p[b(u)]`` to its activations with megatron's ``MoEAuxLossAutoScaler``,
pre-multiplied in ``token`` mode exactly as the router does (router.py:604-637):

    aux(u) * k(u) * TP * CP,   k(u) = valid tokens (router given a padding mask) or all tokens

Megatron's schedule sets the autoscaler's scale (``config.num_moe_experts`` is set), DDP reduces, and
finalize (through the extension's wrapper in ``token`` mode) divides. Because ``aux`` is linear in ``p``,

    p.main_grad[b] = alpha_eff(u)          exactly: the coefficient micro-batch u's aux loss received.

The target megatron's router comments state is ``alpha / (M * D)`` per micro-batch, what ``microbatch`` mode
gives; the result is reported relative to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from megatron_ga_ext.finalize import make_finalize_model_grads
from megatron_ga_ext.reduction import LossContract, ReductionConfig, masked_loss
from megatron_ga_ext.verify.layouts import GlobalBatch, Layout
from megatron_ga_ext.verify.models import ModelConfig, build_positionwise, transformer_config

__all__ = ["AuxProbeResult", "measure_aux_coefficients"]

ALPHA = 0.01


@dataclass(frozen=True)
class AuxProbeResult:
    """Effective coefficient of each sample's micro-batch, in units of alpha / (M * D)."""

    mode: str
    router_counts: str
    relative_coefficients: list[float]


def measure_aux_coefficients(layout: Layout, model: ModelConfig, batch: GlobalBatch, *, mode: str,
                             router_counts: str) -> AuxProbeResult:
    """One step of ``layout`` (TP = PP = CP = 1; parallel state initialised) with the aux probe."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = transformer_config(model, pipeline_model_parallel_size=1, context_parallel_size=1,
                                calculate_per_token_loss=(mode == "token"))
    config.num_moe_experts = 2  # makes the schedule set the MoE aux-loss scale; no MoE layer is built
    module = _probe_model(model, config, layout.global_batch_size, mode, router_counts)
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=module)
    contract = LossContract()
    config.finalize_model_grads_func = make_finalize_model_grads(
        finalize_model_grads, contract, config=ReductionConfig(mode=mode))
    config.no_sync_func = ddp.no_sync
    wrap = contract.wrap if mode == "token" else (lambda f: f)
    ddp.zero_grad_buffer()
    get_forward_backward_func()(
        forward_step_func=partial(_forward_step, mode=mode, wrap=wrap),
        data_iterator=iter(_microbatches(layout, batch)),
        model=[ddp], num_microbatches=layout.num_microbatches, seq_length=model.seq_length,
        micro_batch_size=layout.micro_batch_size, forward_only=False)
    target = ALPHA / (layout.num_microbatches * layout.data_parallel_size)
    coefficients = (module.probe.main_grad / target).tolist()
    return AuxProbeResult(mode, router_counts, coefficients)


def _zero_lm_loss(loss_mask, output, *, mode):
    loss, n, report = masked_loss(output, loss_mask, mode=mode)
    return loss * 0.0, n, report  # only the auxiliary loss reaches the probe


def _probe_model(model: ModelConfig, config: Any, num_samples: int, mode: str, router_counts: str):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    lm, _ = build_positionwise(model, config)
    lm.probe = torch.nn.Parameter(torch.zeros(num_samples))
    inner_forward = lm.forward

    def forward(input_ids, position_ids, attention_mask=None, labels=None, *, sample_ids, loss_mask):
        losses = inner_forward(input_ids, position_ids, attention_mask, labels=labels)
        aux = ALPHA * lm.probe[sample_ids].sum()
        if mode == "token":  # the router's pre-multiplication (TP = CP = 1 here)
            k = loss_mask.sum() if router_counts == "valid" else torch.tensor(float(loss_mask.numel()))
            aux = aux * k
        return MoEAuxLossAutoScaler.apply(losses, aux)

    lm.forward = forward
    return lm


def _microbatches(layout: Layout, batch: GlobalBatch) -> list[dict[str, torch.Tensor]]:
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    out = []
    for m in range(layout.num_microbatches):
        rows = [layout.sample(m, dp_rank, j) for j in range(layout.micro_batch_size)]
        out.append({"tokens": batch.tokens[rows], "labels": batch.labels[rows],
                    "loss_mask": batch.loss_mask[rows], "position_ids": batch.position_ids[rows],
                    "sample_ids": torch.tensor(rows)})
    return out


def _forward_step(data_iterator: Any, model: torch.nn.Module, *, mode: str, wrap: Any):
    micro = next(data_iterator)
    losses = model(micro["tokens"], micro["position_ids"], None, labels=micro["labels"],
                   sample_ids=micro["sample_ids"], loss_mask=micro["loss_mask"])
    return losses, wrap(partial(_zero_lm_loss, micro["loss_mask"], mode=mode))
