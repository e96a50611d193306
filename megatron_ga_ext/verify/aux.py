"""The auxiliary losses' gradients, and torch FSDP2's whole gradient, against the token-mode target,
before and after install().

For each layout of :data:`AUX_LAYOUTS` (the MoE router at DP 2, with global_aux_loss, under TP 2 and
CP 2; MTP at DP 2) and the verify batch (72 loss tokens in 128 positions, uneven across units and DP
ranks), with the LM loss at weight 0 so that only the auxiliary losses reach the weights, the step's
gradient g of the measured parameters (the router weights for MoE, every parameter for MTP) is
compared with the target g* of docs/reduction.md (references.aux_reference_grads):

    coefficient = <g, g*> / <g*, g*>      (1 when g = g*; the factor by which the auxiliary terms are over-weighted)
    error       = max over the measured parameters of max |g - g*| / max |g*|

"before" is upstream's own ``--calculate-per-token-loss`` step (no extension: the router counts
every position, and with it MTP's local counts); "after" is the same step through install().

:data:`DATA_PARALLEL_LAYOUTS` (torch FSDP2 at DP 2, DP 4 and CP 2 x DP 2) are measured the same way on the whole
loss and every parameter, against the token reference: upstream's coefficient there is N / (DP x CP)
(its ``scale_gradients`` on FSDP2 does nothing and FSDP2 averages): 36 at DP 2, 18 at DP 4 and at CP
2 x DP 2 on the verify batch (N = 72).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ga_ext.integration.loss_contract import masked_loss
from megatron_ga_ext.verify.harness import relative_error, run_layout
from megatron_ga_ext.verify.layouts import GlobalBatch, Layout, make_global_batch
from megatron_ga_ext.verify.references import aux_reference_grads, reference_grads
from megatron_ga_ext.verify.run_config import VerifyConfig

__all__ = [
    "AUX_LAYOUTS",
    "DATA_PARALLEL_LAYOUTS",
    "UPSTREAM",
    "AuxCoefficient",
    "measure_aux_coefficients",
]

#: The layouts measured, each on the verify launch of its world size.
AUX_LAYOUTS = (
    Layout(data_parallel_size=2, num_microbatches=4, model="moe"),
    Layout(data_parallel_size=2, num_microbatches=4, model="moe_global"),
    Layout(data_parallel_size=2, num_microbatches=4, model="mtp"),
    Layout(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        data_parallel_size=2,
        num_microbatches=4,
        model="moe",
    ),
    Layout(
        context_parallel_size=2, data_parallel_size=2, num_microbatches=4, model="moe_positionwise"
    ),
)

#: Data-parallel paths whose whole gradient upstream scales wrongly in token mode (verify's launches
#: of their sizes).
DATA_PARALLEL_LAYOUTS = (
    Layout(
        data_parallel_size=2, num_microbatches=4, model="gpt_untied", data_parallel="torch_fsdp2"
    ),
    Layout(
        data_parallel_size=4, num_microbatches=2, model="gpt_untied", data_parallel="torch_fsdp2"
    ),
    Layout(
        context_parallel_size=2,
        data_parallel_size=2,
        num_microbatches=4,
        model="positionwise",
        data_parallel="torch_fsdp2",
    ),
)

BEFORE, AFTER = "upstream --calculate-per-token-loss", "with megatron-ga-ext"
UPSTREAM = "megatron-core alone (verify --upstream)"


@dataclass(frozen=True)
class AuxCoefficient:
    """An auxiliary loss's gradient coefficient and error against the target, for one layout and
    variant."""

    layout: str
    variant: str
    coefficient: float
    error: float


def measure_aux_coefficients(
    cfg: VerifyConfig, layouts: tuple[Layout, ...]
) -> list[AuxCoefficient]:
    """Before (upstream alone) and after (install()) for each of ``layouts`` (all of this launch's
    world size), on this rank; every rank agrees (the measured gradients are whole on each after the
    step). ``cfg.upstream``: megatron-core alone only, as verify --upstream runs it
    (verify/upstream.py)."""
    batch = make_global_batch(cfg.lengths, cfg.model.seq_length, cfg.model.vocab_size)
    out = []
    for layout in layouts:
        target = _measured(layout, _target(cfg, layout, batch))
        loss_func = _no_lm_loss if layout.auxiliary else masked_loss
        for variant, extension in (
            ((UPSTREAM, False),) if cfg.upstream else ((BEFORE, False), (AFTER, True))
        ):
            grads, _ = run_layout(
                layout, "token", cfg, batch, loss_func=loss_func, extension=extension
            )
            mine = _measured(layout, grads)
            dot = sum(float((mine[n] * target[n]).sum()) for n in target)
            norm = sum(float((target[n] * target[n]).sum()) for n in target)
            out.append(
                AuxCoefficient(layout.name, variant, dot / norm, relative_error(mine, target))
            )
    return out


def _target(cfg: VerifyConfig, layout: Layout, batch: GlobalBatch) -> dict[str, torch.Tensor]:
    """The auxiliary losses' part of the token reference (the LM loss at weight 0); the whole of it
    for a layout without auxiliary losses."""
    if layout.auxiliary:
        return aux_reference_grads(cfg.model, layout, batch, "token", device=cfg.device)
    return reference_grads(cfg.model, [layout], batch, device=cfg.device)[(layout.name, "token")]


def _no_lm_loss(
    output: torch.Tensor, loss_mask: torch.Tensor, *, mode: str
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The loss function with the LM loss zeroed: only the auxiliary losses reach the gradient."""
    loss, num_tokens, report = masked_loss(output, loss_mask, mode=mode)
    return loss * 0.0, num_tokens, report  # N is still the batch's loss tokens


def _measured(layout: Layout, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The router weights of an MoE layout; every parameter of any other (MTP, a data-parallel
    path's)."""
    if not layout.model.startswith("moe"):
        return grads
    return {name: grad for name, grad in grads.items() if "router" in name}
