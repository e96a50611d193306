"""The auxiliary losses in words, once, after the first training step (the AuxLosses feature,
aux_losses.py, which has the hooks): which terms are active and how they are scaled, and what cannot
be made exact, with the size of the error:

* MoE layers that routed without a padding mask in token mode: their aux and z gradients keep the
  (positions / loss tokens) factor. Said where it happened, not where a layout suggests it might:
  the hook records each model call with MoE that routes without one (:func:`routes_unmasked`),
  typically a call without the loss mask the padding mask is derived from (from 0.18 on,
  Megatron-LM's pretrain_gpt drops it on the first pipeline stage; verify gives it to every stage),
  and the stages that did are gathered over the pipeline group once, at the report.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from megatron_ga_ext.logs import get_logger

if TYPE_CHECKING:
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = [
    "QUANTILE_BALANCING",
    "aux_summary",
    "balancing_types",
    "routes_unmasked",
    "unmasked_moe_note",
    "unmasked_moe_stages",
]

logger = get_logger(__name__)

QUANTILE_BALANCING = "quantile_balancing"


def balancing_types(config: TransformerConfig) -> list[str]:
    """--moe-router-load-balancing-type as a list (one type, or one per layer group)."""
    kinds = getattr(config, "moe_router_load_balancing_type", "aux_loss")
    return list(kinds) if isinstance(kinds, (list, tuple)) else [kinds]


def aux_summary(config: TransformerConfig, mode: str) -> str | None:
    """The one line rank 0 logs at the first step: which auxiliary losses are active, and how
    scaled."""
    terms = []
    if getattr(config, "num_moe_experts", None):
        kinds = getattr(config, "moe_router_load_balancing_type", "aux_loss")
        kinds = kinds if isinstance(kinds, (list, tuple)) else [kinds]
        coeffs = getattr(config, "moe_aux_loss_coeff", 0.0)
        coeffs = coeffs if isinstance(coeffs, (list, tuple)) else [coeffs] * len(kinds)
        terms += [
            f"MoE {kind} (coefficient {coeff:g})" for kind, coeff in zip(kinds, coeffs) if coeff
        ]
        if getattr(config, "moe_z_loss_coeff", None):
            terms.append(f"MoE z-loss (coefficient {config.moe_z_loss_coeff:g})")
    if getattr(config, "mtp_num_layers", None):
        terms.append(
            f"MTP ({config.mtp_num_layers} layer(s), scaling factor "
            f"{config.mtp_loss_scaling_factor:g})"
        )
    if not terms:
        return None
    if (
        mode == "token"
        and QUANTILE_BALANCING in balancing_types(config)
        and getattr(config, "num_moe_experts", None)
    ):
        how = (
            "MoE routes without a padding mask under quantile balancing (upstream's router "
            "refuses one), so its terms count every routed position, as upstream's "
            "--calculate-per-token-loss does"
        )
    elif mode == "token":
        how = (
            "MoE: each micro-batch's terms over its loss tokens (routed with padding_mask = "
            "loss_mask == 0, the router's counts over its TP x CP group) and weighted by "
            "its share n_u / N of the global batch's loss tokens (global_aux_loss: "
            "micro-batch m's loss over every DP rank, T(m) / (DP x N) on each rank's "
            "piece); MTP: every MTP token weighs its scaling factor / (MTP depth x N)"
        )
    else:
        how = (
            "each micro-batch's term over all its positions, weighted 1 / (num_microbatches x "
            "DP), as upstream"
        )
    return f"megatron-ga-ext {mode} mode, auxiliary losses: {', '.join(terms)}: {how}."


def routes_unmasked(config: TransformerConfig, kwargs: Mapping[str, Any]) -> bool:
    """A GPTModel call about to route MoE layers without a padding mask, in a load-balancing mode
    whose aux and z statistics the mask would correct (under quantile balancing the summary says so
    already)."""
    if not getattr(config, "num_moe_experts", None) or kwargs.get("padding_mask") is not None:
        return False
    return QUANTILE_BALANCING not in balancing_types(config)


def unmasked_moe_stages(models: Iterable[torch.nn.Module]) -> list[int]:
    """The pipeline stages (PP ranks of this rank's pipeline group) on which a model chunk with MoE
    layers routed without a padding mask: this rank's ``models`` (those that did, recorded by the
    hook), all-gathered over the pipeline group where it has more than one stage (once, at the first
    step's report)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_layer import MoELayer

    unmasked = any(isinstance(module, MoELayer) for model in models for module in model.modules())
    if not parallel_state.model_parallel_is_initialized():
        return [0] if unmasked else []
    stage = parallel_state.get_pipeline_model_parallel_rank()
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return [stage] if unmasked else []
    group = parallel_state.get_pipeline_model_parallel_group()
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (stage, unmasked), group=group)
    return sorted(other for other, routed_unmasked in gathered if routed_unmasked)


def unmasked_moe_note(
    config: TransformerConfig,
    mode: str,
    stages: list[int],
    pipeline_model_parallel_size: int,
    positions: int,
    num_tokens: int,
) -> str | None:
    """Token mode, MoE layers that routed without a padding mask on ``stages``: their aux and z-loss
    gradients keep the (positions / loss tokens) factor."""
    if mode != "token" or not stages or not getattr(config, "num_moe_experts", None):
        return None
    ratio = positions / max(num_tokens, 1)
    where = f"pipeline stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"
    if pipeline_model_parallel_size > 1:
        where += f" of PP {pipeline_model_parallel_size}"
    return (
        f"MoE in token mode: the MoE layers on {where} routed without a padding mask (their "
        "model call got no loss mask to derive it from: from 0.18 on, Megatron-LM's pretrain_gpt "
        "drops it on the first pipeline stage), so their aux and z-loss gradients are "
        "(routed positions / loss tokens) times their "
        f"target weight: {positions} / {num_tokens} = {ratio:.3f} on the first step."
    )
