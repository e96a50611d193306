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

from megatron_ga_ext.reduction import masked_loss
from megatron_ga_ext.verify.harness import VerifyConfig, build_ddp, gradients, reduction_hooks, train_step
from megatron_ga_ext.verify.layouts import GlobalBatch, Layout
from megatron_ga_ext.verify.models import ModelConfig, build_positionwise

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
    cfg = VerifyConfig(layouts=(layout,), model=model, progress=False)
    ddp, names, config = build_ddp(
        layout, cfg, calculate_per_token_loss=(mode == "token"),
        build_module=partial(_probe_model, model, num_samples=layout.global_batch_size, mode=mode,
                             router_counts=router_counts))
    finalize, loss_func = reduction_hooks(mode, partial(_zero_lm_loss, mode=mode))
    train_step(ddp, config, layout, cfg, batch, finalize=finalize, loss_func=loss_func,
               forward_step_func=_forward_step, sample_ids=True)
    target = ALPHA / (layout.num_microbatches * layout.data_parallel_size)
    coefficients = (gradients(ddp, names)["probe"] / target).tolist()
    return AuxProbeResult(mode, router_counts, coefficients)


def _zero_lm_loss(output, loss_mask, *, mode):
    loss, n, report = masked_loss(output, loss_mask, mode=mode)
    return loss * 0.0, n, report  # only the auxiliary loss reaches the probe


def _probe_model(model: ModelConfig, config: Any, *, num_samples: int, mode: str, router_counts: str):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    config.num_moe_experts = 2  # makes the schedule set the MoE aux-loss scale; no MoE layer is built
    lm, names = build_positionwise(model, config)
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
    return lm, {**names, "probe": "probe"}


def _forward_step(data_iterator: Any, model: torch.nn.Module, *, loss_func: Any):
    micro = next(data_iterator)
    losses = model(micro["tokens"], micro["position_ids"], None, labels=micro["labels"],
                   sample_ids=micro["sample_ids"], loss_mask=micro["loss_mask"])
    return losses, partial(loss_func, loss_mask=micro["loss_mask"])
