"""The padding mask MoE routes with, where install() gives it (aux_losses.py: the loss mask's zeros,
so that routing, its counts and the expert-bias update skip exactly the positions the loss drops):
which model call wants one, its pipeline stage's part under sequence parallelism, and the expert-bias
update given it per token on sources that mask the [tokens, experts] map with the flat mask, and
the mask on combined 1F1B's path (``build_schedule_plan``), where upstream's plan routes without it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megatron_ga_ext.integration.features.aux_report import QUANTILE_BALANCING, balancing_types

if TYPE_CHECKING:
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_ga_ext.integration.installation import Installation

__all__ = [
    "broadcasts_padding_per_token",
    "masked_plan_run",
    "matches_labels",
    "padding_mask_schedule_plan",
    "per_token_padding_expert_bias",
    "plan_masked_route",
    "stage_padding_mask",
    "wants_padding_mask",
]


def matches_labels(loss_mask: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
    """The mask is this call's: the shape of its labels (``labels``, the fifth argument)."""
    labels = kwargs["labels"] if "labels" in kwargs else args[4] if len(args) > 4 else None
    return labels is not None and labels.shape == loss_mask.shape


def wants_padding_mask(model: GPTModel, kwargs: dict[str, Any]) -> bool:
    """MoE layers, a loss mask and no padding mask. Not under quantile balancing (0.19+): it has no
    load-balancing loss to correct, and upstream's router asserts it is given no padding mask."""
    config = model.config
    if not getattr(config, "num_moe_experts", None) or kwargs.get("padding_mask") is not None:
        return False
    if QUANTILE_BALANCING in balancing_types(config):
        return False
    return kwargs.get("loss_mask") is not None


def stage_padding_mask(model: GPTModel, padding_mask: Any) -> Any:
    """The mask as this stage's MoE layers route: with sequence parallelism a first stage scatters
    it along the sequence itself (GPTModel.forward, as its embedding output), a later stage is given
    the hidden states already scattered and the whole mask, so its TP rank's part is cut here, as
    upstream's own scatter cuts it."""
    if not getattr(model.config, "sequence_parallel", False) or getattr(
        model, "pre_process", False
    ):
        return padding_mask
    return _sequence_parallel_part(padding_mask)


def _sequence_parallel_part(padding_mask: Any) -> Any:
    """[b, s] -> [b, s / TP]: this TP rank's part of the sequence, as upstream's scatter cuts it."""
    from megatron.core import tensor_parallel

    sequence_major = padding_mask.transpose(0, 1).contiguous()
    return (
        tensor_parallel.scatter_to_sequence_parallel_region(sequence_major)
        .transpose(0, 1)
        .contiguous()
    )


class _PlanForward:
    """The schedule plan whose forward runs now (combined 1F1B runs one forward at a time, in one
    thread; None outside a plan's run), and the last mask made ready for its router."""

    plan: Any = None
    given: Any = None
    routed: Any = None


def padding_mask_schedule_plan(original: Callable, state: Installation) -> Callable:
    """``GPTModel.build_schedule_plan`` (combined 1F1B, ``--overlap-moe-expert-parallel-comm``):
    in token mode a MoE model given a loss mask and no padding mask gets padding_mask = (loss_mask
    == 0), as ``GPTModel.forward`` does (aux_losses.padding_mask_forward). The plan keeps it in its
    chunk state (its MTP layer rolls it there, as MTP's forward does) and routes without it
    (``fine_grained_callables.py`` calls ``layer.mlp.route(hidden_states)``, core_v0.19.0 :130,
    main d98e8a64 :126), so :func:`masked_plan_run` and :func:`plan_masked_route` hand it to the
    router."""

    @functools.wraps(original)
    def build_schedule_plan(model: GPTModel, *args: Any, **kwargs: Any) -> Any:
        if state.active and state.contract is not None and wants_padding_mask(model, kwargs):
            kwargs["padding_mask"] = kwargs["loss_mask"] == 0
        return original(model, *args, **kwargs)

    return build_schedule_plan


def masked_plan_run(original: Any, state: Installation) -> Any:
    """``TransformerModelChunkSchedulePlan.run`` (a staticmethod): the forward plan is the current
    one while it runs."""
    run = original.__func__

    @functools.wraps(run)
    def run_with_mask(f_schedule_plan: Any, b_schedule_plan: Any, *args: Any, **kwargs: Any) -> Any:
        saved = _PlanForward.plan
        _PlanForward.plan = f_schedule_plan
        try:
            return run(f_schedule_plan, b_schedule_plan, *args, **kwargs)
        finally:
            _PlanForward.plan = saved

    return staticmethod(run_with_mask)


def plan_masked_route(original: Callable, state: Installation) -> Callable:
    """``MoELayer.route``: called without a padding mask inside a plan's run, it routes with the
    plan's chunk-state mask (rolled there for an MTP layer) as ``MoELayer.forward`` hands one on:
    [s, b], this TP rank's part of s where the hidden states hold that part (sequence
    parallelism)."""

    @functools.wraps(original)
    def route(layer: Any, hidden_states: Any, padding_mask: Any = None) -> Any:
        plan = _PlanForward.plan
        if padding_mask is None and plan is not None:
            padding_mask = _routed(plan._model_chunk_state.padding_mask, hidden_states)
        return original(layer, hidden_states, padding_mask)

    return route


def _routed(mask: Any, hidden_states: Any) -> Any:
    """[b, s] -> [s (or s / TP), b] bool, made once per mask object."""
    if mask is None:
        return None
    if mask is not _PlanForward.given:
        part = mask if mask.shape[1] == hidden_states.shape[0] else _sequence_parallel_part(mask)
        _PlanForward.given, _PlanForward.routed = mask, part.transpose(0, 1).bool()
    return _PlanForward.routed


def broadcasts_padding_per_token(router_class: type[Any]) -> bool:
    """Upstream's expert-bias update masks its [tokens, experts] routing map with the padding mask
    unsqueezed to [tokens, 1] (main from d98e8a64); before, with the flat [tokens] mask, which
    broadcasts against the experts."""
    return ".unsqueeze(-1)" in inspect.getsource(router_class._apply_expert_bias)


def per_token_padding_expert_bias(original: Callable, state: Installation) -> Callable:
    """``TopKRouter._apply_expert_bias`` on sources whose update masks the [tokens, experts] routing
    map with the flat [tokens] padding mask (a shape error, or experts masked where the tokens
    number the experts): given the mask as [tokens, 1], so that the expert-bias counts exclude
    exactly the padding positions install()'s mask names."""

    @functools.wraps(original)
    def apply_expert_bias(router: Any, routing_map: Any, padding_mask: Any = None) -> Any:
        if padding_mask is not None and padding_mask.dim() == 1 and state.active:
            padding_mask = padding_mask.unsqueeze(-1)
        return original(router, routing_map, padding_mask)

    return apply_expert_bias
