"""The auxiliary losses in words, once, after the first training step: which terms are active and how they are scaled
(aux_losses.py has the hooks), and what cannot be made exact, with the size of the error:

* MoE layers on a pipeline stage that is not given the loss mask (pretrain_gpt's get_batch gives it to the
  last stage only): their aux and z gradients keep the (positions / loss tokens) factor; with sequence
  parallelism the mask is only given where the stage scatters it (the first stage).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["QUANTILE_BALANCING", "aux_summary", "balancing_types", "pipeline_inexact_note"]

QUANTILE_BALANCING = "quantile_balancing"


def balancing_types(config: TransformerConfig) -> list[str]:
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
    if mode == "token" and QUANTILE_BALANCING in balancing_types(config) and getattr(config, "num_moe_experts", None):
        how = ("MoE routes without a padding mask under quantile balancing (upstream's router refuses one), so its "
               "terms count every routed position, as upstream's --calculate-per-token-loss does")
    elif mode == "token":
        how = ("MoE: each micro-batch's terms over its loss tokens (routed with padding_mask = loss_mask == 0, the "
               "router's counts over its TP x CP group) and weighted by its share n_u / N of the global batch's loss "
               "tokens; MTP: every MTP token weighs its scaling factor / N")
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
