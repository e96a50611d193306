"""Auxiliary losses in token mode: the MoE load-balancing and z-losses, and multi-token prediction (MTP).

The target (docs/reduction.md): over the units u of a step (micro-batch x DP rank x CP shard), with n_u the
loss tokens of u and N = sum_u n_u,

    L = (1/N) sum_t l_t  +  sum_u (n_u / N) * alpha * aux_u

where aux_u is the auxiliary term computed over u's loss tokens and alpha the coefficient upstream documents
(--moe-aux-loss-coeff, --moe-z-loss-coeff, --mtp-loss-scaling-factor / MTP depth). Every loss token weighs the
same, and with equal n_u this is upstream's 1/(M x DP) per micro-batch.

How megatron-core reaches it: its router pre-multiplies aux and z by the micro-batch's token count and
finalize divides by N, so aux_u gets n_u / N *if* the router counts loss tokens, i.e. is given a padding
mask. Megatron-LM's pretrain_gpt gives GPTModel the loss mask but no padding mask, so the router counts
every routed position and the statistics include padding: the aux and z gradients come out
(positions / loss tokens) times too large (about 2x at 50% padding). install() wraps ``GPTModel.forward``:
in token mode, a model with MoE layers that is given a loss mask and no padding mask routes with
``padding_mask = (loss_mask == 0)``. It changes nothing else: routing itself ignores the padding mask, only
the aux statistics, the z-loss and the expert-bias counts exclude those positions. Quantile balancing (0.19+) is
routed without it: it has no load-balancing loss, and upstream's router refuses a padding mask there (a z-loss
then counts padding positions, as upstream's does). MTP (0.17+) already
weighs its mean by n_u / N (process_mtp_loss's original/rolled token counts).

What cannot be made exact, said once at the first step with the size of the error:
* MoE layers on a pipeline stage that is not given the loss mask (pretrain_gpt's get_batch gives it to the
  last stage only): their aux and z gradients keep the (positions / loss tokens) factor; with sequence
  parallelism the mask is only given where the stage scatters it (the first stage);
* MTP on megatron-core 0.16: each MTP token weighs 1/N instead of n_u / (n_mtp_u N): the MTP gradient is
  n_mtp_u / n_u of the target, where the rolled mask drops one token per sequence and MTP layer.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

from megatron_ga_ext.integration.installation import Installation
from megatron_ga_ext.logs import get_logger

if TYPE_CHECKING:
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["aux_summary", "padding_mask_forward", "pipeline_inexact_note", "mtp_inexact_note"]

logger = get_logger(__name__)


def padding_mask_forward(original: Callable, state: Installation) -> Callable:
    """``GPTModel.forward`` that, in token mode, routes with padding_mask = (loss_mask == 0) (see above)."""

    @functools.wraps(original)
    def forward(model: GPTModel, *args: Any, **kwargs: Any) -> Any:
        if state.active and state.contract is not None and _wants_padding_mask(model, kwargs):
            kwargs["padding_mask"] = kwargs["loss_mask"] == 0
        return original(model, *args, **kwargs)

    return forward


def _wants_padding_mask(model: GPTModel, kwargs: dict[str, Any]) -> bool:
    """MoE layers, a loss mask and no padding mask; with sequence parallelism only where the stage
    scatters the mask itself (the first stage). Not under quantile balancing (0.19+): it has no load-balancing
    loss to correct, and upstream's router asserts it is given no padding mask."""
    config = model.config
    if not getattr(config, "num_moe_experts", None) or kwargs.get("padding_mask") is not None:
        return False
    if QUANTILE_BALANCING in _balancing_types(config):
        return False
    if kwargs.get("loss_mask") is None:
        return False
    return not getattr(config, "sequence_parallel", False) or bool(getattr(model, "pre_process", False))


QUANTILE_BALANCING = "quantile_balancing"


def _balancing_types(config: TransformerConfig) -> list[str]:
    """--moe-router-load-balancing-type as a list (one type, or one per layer group)."""
    kinds = getattr(config, "moe_router_load_balancing_type", "aux_loss")
    return list(kinds) if isinstance(kinds, (list, tuple)) else [kinds]


def aux_summary(config: TransformerConfig, mode: str) -> str | None:
    """The one line rank 0 logs at the first step: which auxiliary losses are active, and how scaled."""
    terms = []
    if getattr(config, "num_moe_experts", None):
        kinds = getattr(config, "moe_router_load_balancing_type", "aux_loss")
        kinds = kinds if isinstance(kinds, (list, tuple)) else [kinds]
        coeffs = getattr(config, "moe_aux_loss_coeff", 0.0)
        coeffs = coeffs if isinstance(coeffs, (list, tuple)) else [coeffs] * len(kinds)
        terms += [f"MoE {kind} (coefficient {coeff:g})" for kind, coeff in zip(kinds, coeffs) if coeff]
        if getattr(config, "moe_z_loss_coeff", None):
            terms.append(f"MoE z-loss (coefficient {config.moe_z_loss_coeff:g})")
    if getattr(config, "mtp_num_layers", None):
        terms.append(f"MTP ({config.mtp_num_layers} layer(s), scaling factor {config.mtp_loss_scaling_factor:g})")
    if not terms:
        return None
    if mode == "token" and QUANTILE_BALANCING in _balancing_types(config) and getattr(config, "num_moe_experts", None):
        how = ("MoE routes without a padding mask under quantile balancing (upstream's router refuses one), so its "
               "terms count every routed position, as upstream's --calculate-per-token-loss does")
    elif mode == "token":
        how = ("each micro-batch's term computed over its loss tokens (MoE routes with padding_mask = loss_mask "
               "== 0) and weighted by its share n_u / N of the global batch's loss tokens")
    else:
        how = "each micro-batch's term over all its positions, weighted 1 / (num_microbatches x DP), as upstream"
    return f"megatron-ga-ext {mode} mode, auxiliary losses: {', '.join(terms)}: {how}."


def pipeline_inexact_note(config: TransformerConfig, mode: str, pipeline_model_parallel_size: int, positions: int,
                          num_tokens: int) -> str | None:
    """MoE with PP in token mode: stages without the loss mask keep the (positions / loss tokens) factor."""
    if mode != "token" or pipeline_model_parallel_size <= 1 or not getattr(config, "num_moe_experts", None):
        return None
    ratio = positions / max(num_tokens, 1)
    return (f"MoE with pipeline parallelism (PP {pipeline_model_parallel_size}) in token mode: Megatron-LM's "
            f"get_batch gives the loss mask to the last stage only, so MoE layers on the other stages route "
            f"without a padding mask and their aux and z-loss gradients are (routed positions / loss tokens) "
            f"times their target weight: {positions} / {num_tokens} = {ratio:.3f} on the first step.")


def mtp_inexact_note(config: TransformerConfig, mode: str) -> str | None:
    """MTP in token mode on megatron-core 0.16 (no process_mtp_loss): each MTP token weighs 1/N."""
    if mode != "token" or not getattr(config, "mtp_num_layers", None):
        return None
    from megatron.core.transformer import multi_token_prediction

    if hasattr(multi_token_prediction, "process_mtp_loss"):
        return None
    return ("MTP in token mode on this megatron-core (0.16): each MTP token weighs 1/N instead of "
            "n_u / (n_mtp_u x N), so micro-batch u's MTP gradient is n_mtp_u / n_u of its target (the rolled "
            "mask drops one token per sequence and MTP layer: at most MBS x MTP layers / n_u below 1). "
            "megatron-core 0.17 and later meet the target.")
