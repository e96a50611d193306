"""The MoE router's auxiliary-loss gradient against the token-mode target, before and after install().

On the MoE layout DP 2 x GA 4 (top-2 of 4 experts, load-balancing aux loss and z-loss) and the verify batch
(72 loss tokens in 128 positions), with the LM loss at weight 0 so that only the router's auxiliary losses
reach its weights, the step's router-weight gradient g is compared with the target g* of docs/reduction.md
(each micro-batch's terms over its loss tokens, weighted n_u / N: references.aux_reference_grads):

    coefficient = <g, g*> / <g*, g*>      (1 when g = g*; the factor by which the aux losses are over-weighted)
    error       = max over router weights of max |g - g*| / max |g*|

"before" is upstream's own ``--calculate-per-token-loss`` step (no extension: the router counts every position);
"after" is the same step through install(), which routes with padding_mask = (loss_mask == 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ga_ext.integration.loss_contract import masked_loss
from megatron_ga_ext.verify.harness import VerifyConfig, relative_error, run_layout
from megatron_ga_ext.verify.layouts import GlobalBatch, Layout, make_global_batch
from megatron_ga_ext.verify.references import aux_reference_grads

__all__ = ["ROUTER_LAYOUT", "RouterCoefficient", "measure_router_coefficients"]

ROUTER_LAYOUT = Layout(data_parallel_size=2, num_microbatches=4, model="moe")


@dataclass(frozen=True)
class RouterCoefficient:
    """The router's auxiliary-loss gradient coefficient and error against the target, for one variant."""

    variant: str
    coefficient: float
    error: float


def measure_router_coefficients(cfg: VerifyConfig) -> list[RouterCoefficient]:
    """Before (upstream alone) and after (install()), on this rank; every rank of a DP 2 launch agrees."""
    batch = make_global_batch(cfg.lengths, cfg.model.seq_length, cfg.model.vocab_size)
    target = _router(aux_reference_grads(cfg.model, ROUTER_LAYOUT, batch, "token", device=cfg.device))
    out = []
    for variant, extension in (("upstream --calculate-per-token-loss", False), ("with megatron-ga-ext", True)):
        grads, _ = run_layout(ROUTER_LAYOUT, "token", cfg, batch, loss_func=_no_lm_loss, extension=extension)
        mine = _router(grads)
        dot = sum(float((mine[n] * target[n]).sum()) for n in target)
        norm = sum(float((target[n] * target[n]).sum()) for n in target)
        out.append(RouterCoefficient(variant, dot / norm, relative_error(mine, target)))
    return out


def _no_lm_loss(output: torch.Tensor, loss_mask: torch.Tensor, *, mode: str):
    loss, num_tokens, report = masked_loss(output, loss_mask, mode=mode)
    return loss * 0.0, num_tokens, report  # N is still the batch's loss tokens


def _router(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: grad for name, grad in grads.items() if "router" in name}


def padded_share(batch: GlobalBatch) -> float:
    """Loss tokens / positions of the batch (72 / 128 for verify's)."""
    return float(batch.loss_mask.sum()) / batch.loss_mask.numel()
