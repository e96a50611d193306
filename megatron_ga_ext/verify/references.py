"""Unpartitioned single-process references: one forward of the whole global batch, no DDP, no schedule.

Both definitions are a weighted sum of the per-token losses l[b, s] over the global batch:

    token:          w[b, s] = mask[b, s] / N,                      N = sum of the mask
    mean of means:  w[b, s] = mask[b, s] / (U * max(n_u, 1)),      u = unit of (b, s), U units,
                    n_u = non-padding tokens of unit u (one micro-batch of one DP rank, one CP shard)

and the reference gradient is grad of sum_{b,s} w[b, s] * l[b, s].
"""

from __future__ import annotations

from typing import Iterable

import torch

from megatron_ga_ext.verify.layouts import GlobalBatch, Layout
from megatron_ga_ext.verify.models import ModelConfig, build_gpt, build_positionwise, init_model_parallel
from megatron_ga_ext.verify.models import transformer_config

__all__ = ["mean_of_means_weights", "reference_grads", "token_weights"]


def token_weights(loss_mask: torch.Tensor) -> torch.Tensor:
    """w = mask / sum(mask): every non-padding token of the global batch weighs the same."""
    return loss_mask / loss_mask.sum()


def mean_of_means_weights(loss_mask: torch.Tensor, unit_ids: torch.Tensor) -> torch.Tensor:
    """w = mask / (U * max(n_u, 1)): each unit's token mean, then the mean over the U units."""
    num_units = int(unit_ids.max()) + 1
    counts = torch.zeros(num_units).index_add_(0, unit_ids.reshape(-1), loss_mask.reshape(-1))
    return loss_mask / (num_units * counts.clamp(min=1)[unit_ids])


def reference_grads(model: ModelConfig, layouts: Iterable[Layout], batch: GlobalBatch,
                    device: str = "cpu") -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    """{(model kind, "token") or (layout name, "mean_of_means"): {global name: gradient}}.

    Needs megatron's parallel state for building the model; it initialises TP = PP = CP = 1 and tears
    it down again, so call it between layouts. The model is used unwrapped, on this rank alone.
    """
    from megatron.core import parallel_state

    layouts = list(layouts)
    init_model_parallel()
    try:
        refs = {}
        for kind in sorted({layout.model for layout in layouts}):
            module, names = _build(model, kind, device)
            refs[(kind, "token")] = _grads(module, names, batch, token_weights(batch.loss_mask))
            for layout in (lay for lay in layouts if lay.model == kind):
                weights = mean_of_means_weights(batch.loss_mask, layout.unit_ids(model.seq_length))
                refs[(layout.name, "mean_of_means")] = _grads(module, names, batch, weights)
        return refs
    finally:
        parallel_state.destroy_model_parallel()


def _build(model: ModelConfig, kind: str, device: str):
    config = transformer_config(model, pipeline_model_parallel_size=1, context_parallel_size=1,
                                calculate_per_token_loss=True)
    if kind == "gpt":
        module, names = build_gpt(model, config, pre_process=True, post_process=True, offset=0)
    else:
        module, names = build_positionwise(model, config)
    return module.to(device), names


def _grads(module: torch.nn.Module, names: dict[str, str], batch: GlobalBatch,
           weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """grad of sum(w * l); a fresh forward each time (megatron's cross entropy frees its saved state)."""
    device = next(module.parameters()).device
    losses = module(batch.tokens.to(device), batch.position_ids.to(device), None,
                    labels=batch.labels.to(device))
    params = [p for _, p in module.named_parameters()]
    grads = torch.autograd.grad((losses * weights.to(device)).sum(), params)
    return {names[n]: g.detach().cpu() for (n, _), g in zip(module.named_parameters(), grads)}
