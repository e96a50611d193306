"""Auxiliary losses in token mode: the MoE load-balancing and z-losses, and multi-token prediction
(MTP).

The target (docs/reduction.md): over the units u of a step (micro-batch x DP rank x CP shard), with
n_u the loss tokens of u and N = sum_u n_u,

    L = (1/N) sum_t l_t  +  sum_u (n_u / N) * alpha * aux_u

where aux_u is the auxiliary term computed over u's loss tokens and alpha the coefficient upstream
documents (--moe-aux-loss-coeff, --moe-z-loss-coeff, --mtp-loss-scaling-factor / MTP depth). Every
loss token weighs the same, and with equal n_u this is upstream's 1/(M x DP) per micro-batch.
global_aux_loss is one loss aux(m) per micro-batch m over all its rows (statistics over TP x DP x
CP; each rank attaches its piece, the pieces summing to aux(m)), and its term is

    sum_m c_m * alpha * aux(m),   c_m = T(m) / (DP x N),   T(m) = loss tokens of m over every DP rank,

the same factor on every piece, so every token of m weighs the same: a piece weighted by its rank's
n(m, r) / N would weigh a token by n(m, r) / T(m), the rank-local weighting rejected for TP and CP
too. With equal counts (n(m, r) = T(m) / DP) c_m is upstream's n(m, r) / N.

How megatron-core reaches it: its router pre-multiplies aux and z by the micro-batch's token count
and finalize divides by N, so aux_u gets n_u / N *if* the router counts loss tokens, i.e. is given a
padding mask. Megatron-LM's pretrain_gpt gives GPTModel the loss mask but no padding mask, so the
router counts every routed position and the statistics include padding: the aux and z gradients come
out (positions / loss tokens) times too large (about 2x at 50% padding). install() wraps
``GPTModel.forward``: in token mode, a model with MoE layers that is given a loss mask and no
padding mask routes with ``padding_mask = (loss_mask == 0)``. Routing itself ignores the padding
mask, only the aux statistics, the z-loss and the expert-bias counts exclude those positions.
Quantile balancing (0.19+) is routed without it: it has no load-balancing loss, and upstream's
router refuses a padding mask there (a z-loss then counts padding positions, as upstream's does).

The padding mask turns on two upstream defects that install() corrects (Megatron-LM #7452, finding
10):

* ``get_tokens_per_expert_and_token_count`` all-reduces ``local_tokens_per_expert`` in place and
  reads it back as the local count, so the count the router pre-multiplies by is the group's (TP x
  CP, or TP x DP x CP for global_aux_loss), not this rank's: the aux gradient is TP x CP (TP x DP x
  CP) times its target. And even the local count is exact only where every TP / CP shard holds the
  same number of loss tokens. The exact factor for a shard's piece of aux_u is n_u itself, the loss
  tokens its TP x CP group holds for this micro-batch of this DP rank, and for a piece of
  global_aux_loss's aux(m) T(m) / DP; :func:`exact_token_counts` returns that factor divided by |TP
  x CP| on releases whose router multiplies it by |TP x CP| (0.19 and later), the factor before.
* Before 0.19 the router's per-token z-loss lacks that |TP x CP| factor (upstream #5047): its
  coefficient is divided by |TP x CP| and nothing multiplies it back, so the z-loss gradient is 1 /
  (TP x CP) of its target.
  :func:`tp_cp_scaled_z_loss` multiplies the gradient (not the logged value) by |TP x CP| there.
* Before main@d98e8a64 the expert-bias update (``--moe-router-enable-expert-bias``) masks its
  [tokens, experts] routing map with the flat padding mask: a shape error at the first step, or,
  where the tokens number the experts, experts masked instead of padding.
  :func:`~.padding_mask.per_token_padding_expert_bias` gives it the mask per token.

MTP (0.17+): ``process_mtp_loss`` weighs depth k's MTP loss of unit u by n_u / m_u (m_u: u's rolled
MTP tokens), local counts that give each MTP token the weight alpha n_u / (m_u N): unequal across
units whenever the ratio differs (#7452, finding 3), and 0 on a CP shard without LM loss tokens that
the roll gives an MTP token (#7498). The target is every MTP token at alpha / N (alpha: the scaling
factor / MTP depth), the one global count every other term of the step is divided by: L_mtp = alpha
sum_t mtp_t / N. :func:`global_count_mtp_loss` attaches each depth's loss as that sum, from the
per-token loss and the rolled mask (megatron-core 0.16 already attaches the sum).

What cannot be made exact is said once at the first step, with the size of the error
(aux_report.py).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from megatron_ga_ext.integration import bridge_loop, upstream_factors
from megatron_ga_ext.integration.compat import (
    GPT_MODEL,
    MOE_LAYER,
    MOE_UTILS,
    MTP,
    ROUTER,
    SCHEDULE_PLAN,
)
from megatron_ga_ext.integration.features import Feature, Finalizing, Handle, Step
from megatron_ga_ext.integration.features.aux_report import (
    aux_summary,
    routes_unmasked,
    unmasked_moe_note,
    unmasked_moe_stages,
)
from megatron_ga_ext.integration.features.padding_mask import (
    broadcasts_padding_per_token,
    masked_plan_run,
    matches_labels,
    padding_mask_schedule_plan,
    per_token_padding_expert_bias,
    plan_masked_route,
    stage_padding_mask,
    wants_padding_mask,
)
from megatron_ga_ext.integration.guards import current_pipeline_size
from megatron_ga_ext.integration.hook_rows import Hook
from megatron_ga_ext.integration.mtp_interception import MTPInterception
from megatron_ga_ext.integration.mtp_ratio_check import MTPRatioCheck
from megatron_ga_ext.logs import get_logger

if TYPE_CHECKING:
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_ga_ext.integration.installation import Installation

__all__ = [
    "AuxLosses",
    "exact_token_counts",
    "global_count_mtp_loss",
    "padding_mask_forward",
    "router_scales_by_tp_cp",
    "tp_cp_scaled_z_loss",
]

logger = get_logger(__name__)


def padding_mask_forward(original: Callable, state: Installation) -> Callable:
    """``GPTModel.forward`` that, in token mode, routes with padding_mask = (loss_mask == 0) (see
    above). A call without a loss mask gets the one Megatron-Bridge's ``get_batch`` just returned
    for it, where it has the labels' shape: Bridge's GPT step passes none to the model (Bridge
    #6103), so MoE and MTP get it here."""

    @functools.wraps(original)
    def forward(model: GPTModel, *args: Any, **kwargs: Any) -> Any:
        aux = state.feature(AuxLosses) if state.active and state.contract is not None else None
        if aux is not None:  # token mode
            kept, aux.host_loss_mask = aux.host_loss_mask, None
            if (
                kwargs.get("loss_mask") is None
                and kept is not None
                and matches_labels(kept, args, kwargs)
            ):
                kwargs["loss_mask"] = kept
            if wants_padding_mask(model, kwargs):
                kwargs["padding_mask"] = stage_padding_mask(model, kwargs["loss_mask"] == 0)
            elif routes_unmasked(model.config, kwargs):  # said at the first step (aux_report.py)
                aux.routed_without_padding_mask(model)
        return original(model, *args, **kwargs)

    return forward


def _token_mode(state: Installation) -> bool:
    return state.active and state.contract is not None


def router_scales_by_tp_cp() -> bool:
    """megatron-core 0.19 and later: the router multiplies valid_token_count and the z-loss by |TP x
    CP| (#5047)."""
    from megatron_ga_ext.integration.compat import megatron_core_version

    major, minor = (int(part) for part in megatron_core_version().split(".")[:2])
    return (major, minor) >= (0, 19)


def _tp_cp_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_and_context_parallel_group()


def exact_token_counts(original: Callable, state: Installation) -> Callable:
    """``moe_utils.get_tokens_per_expert_and_token_count`` whose local count makes the router's
    pre-multiplication the target's (module docstring): n_u, the loss tokens of this micro-batch of
    this DP rank over its TP x CP group, for aux_loss and seq_aux_loss; T(m) / DP for
    global_aux_loss, T(m) the loss tokens of micro-batch m over the TP x DP x CP group, the same on
    every piece of m:

        valid_token_count = k / |TP x CP|   (0.19+, whose router multiplies it by |TP x CP|),   k before,
        k = total / (|reduce group| / |TP x CP|) = n_u (reduced over TP x CP) or T(m) / DP (over TP
        x DP x CP)

    where total is upstream's own reduced count: no extra all-reduce. Without a padding mask
    (microbatch mode, quantile balancing) upstream's counts stand: it reads the routing map's shape,
    not the reduced counts. A total of 0 becomes 1: upstream divides the load-balancing loss by its
    square, and a micro-batch without loss tokens would give NaN. Any other total stands, also a
    fractional one: seq_aux_loss counts per sequence, n_u / MBS, which is below 1 where a
    micro-batch's samples hold fewer loss tokens than it has samples (a truncated sample with
    none)."""
    scales = router_scales_by_tp_cp()
    upstream = upstream_factors.RouterCountCheck()  # where upstream is fixed it steps aside

    @functools.wraps(original)
    def counts(
        routing_map: Any,
        reduce_group: Any,
        topk: int | None = None,
        with_padding_mask: bool = False,
    ) -> Any:
        if (
            with_padding_mask
            and _token_mode(state)
            and upstream.steps_aside(counts, original, routing_map, reduce_group, topk)
        ):
            return upstream_factors.nonzero_total(
                original(routing_map, reduce_group, topk, with_padding_mask)
            )
        if not (with_padding_mask and _token_mode(state)):
            return original(routing_map, reduce_group, topk, with_padding_mask)
        tokens_per_expert, _, total = original(routing_map, reduce_group, topk, with_padding_mask)
        group = _tp_cp_group()
        # total: n_u over TP x CP; for global_aux_loss T(m) over TP x DP x CP, whose pieces each
        # take T(m) / DP.
        unit = total / (reduce_group.size() // group.size())
        # A unit without loss tokens routes none: its load-balancing loss is 0, not upstream's 0 / 0
        # (NaN).
        return (
            tokens_per_expert,
            unit / group.size() if scales else unit,
            total.masked_fill(total == 0, 1),
        )

    return counts


def tp_cp_scaled_z_loss(original: Callable, state: Installation) -> Callable:
    """``moe_utils.z_loss_func`` as the router calls it before 0.19: in token mode with |TP x CP| >
    1, the same value with |TP x CP| times its gradient, ``z + (k - 1) (z - z.detach())``, the
    factor 0.19's router applies."""

    upstream = (
        upstream_factors.ZLossFactorCheck()
    )  # where the router scales it itself it steps aside

    @functools.wraps(original)
    def z_loss_func(*args: Any, **kwargs: Any) -> Any:
        z_loss = original(*args, **kwargs)
        factor = _tp_cp_group().size() if _token_mode(state) else 1
        if factor == 1:
            return z_loss
        return upstream.z_loss(
            z_loss, z_loss + (factor - 1) * (z_loss - z_loss.detach()), factor, args, kwargs
        )

    return z_loss_func


def global_count_mtp_loss(original: Callable, state: Installation) -> Callable:
    """``process_mtp_loss`` (0.17+) that, in token mode, attaches depth k's MTP loss as alpha /
    depth x sum_t mtp_t over its rolled loss tokens, so that finalize's division by N gives every
    MTP token the weight alpha / (depth N) (module docstring).

    Upstream attaches ``alpha / depth * mtp_loss * (n_u / max(m_u, 1))``, local counts that give a
    unit (a CP shard) without LM loss tokens the factor 0 even where the roll brings it an MTP token
    from the next shard (#7498). So the attachment is built here, not rescaled: during the call each
    depth's per-token loss (upstream's ``compute_language_model_loss``) and its rolled loss mask
    (the last ``roll_tensor`` before the attachment) are kept and attached as ``alpha / depth *
    rolled_mask * loss``. Where labels are not given (upstream derives them from input_ids by a roll
    of its own, the RL path) upstream's weighting stands."""
    module = sys.modules[original.__module__]
    signature = inspect.signature(original)
    upstream = MTPRatioCheck()

    @functools.wraps(original)
    def process_mtp_loss(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        given = bound.arguments
        config = given["config"]
        if (
            given.get("labels") is None
            or not _token_mode(state)
            or not config.calculate_per_token_loss
        ):
            return original(*args, **kwargs)
        if upstream.steps_aside(original, given):  # upstream no longer weighs by local counts
            return original(*args, **kwargs)
        summed = _SummedMTPLoss(module, config.mtp_loss_scaling_factor / config.mtp_num_layers)
        given["compute_language_model_loss"] = summed.recording(
            given["compute_language_model_loss"]
        )
        with summed.in_module():
            return original(*bound.args, **bound.kwargs)

    return process_mtp_loss


class _SummedMTPLoss(MTPInterception):
    """One process_mtp_loss call: each depth's per-token loss and rolled loss mask, and their
    attachment."""

    def __init__(self, module: Any, scale: float) -> None:
        super().__init__(module)
        self.scale = scale
        self.per_token_loss: Any = None

    def recording(self, compute_language_model_loss: Callable) -> Callable:
        def compute(*args: Any, **kwargs: Any) -> Any:
            self.per_token_loss = compute_language_model_loss(*args, **kwargs)
            return self.per_token_loss

        return compute

    def apply(self, hidden_states: Any, upstream_mtp_loss: Any) -> Any:
        """Attach this depth's alpha / depth x rolled_mask x loss in place of upstream's product."""
        return self.autoscaler.apply(hidden_states, self.scale * self.rolled * self.per_token_loss)


def keeping_loss_mask(original: Callable, state: Installation) -> Callable:
    """``gpt_step.get_batch(...)`` -> (tokens, labels, loss_mask, ...): in token mode the loss mask
    is kept for the model call that follows, which Bridge's GPT step makes without it (Bridge #6103:
    MoE routing and MTP would count the positions the mask drops); aux_losses.padding_mask_forward
    gives it to the model."""

    @functools.wraps(original)
    def get_batch(*args: Any, **kwargs: Any) -> Any:
        batch = original(*args, **kwargs)
        if state.active and state.contract is not None:
            aux = state.feature(AuxLosses)
            if aux is not None:
                aux.host_loss_mask = batch[2]
        return batch

    return get_batch


class AuxLosses(Feature):
    """The auxiliary losses' corrections (its hook rows, above) and its part of the step: the loss
    mask Megatron-Bridge's GPT step keeps from the model, the model calls with MoE that routed
    without a padding mask, and the report after the first training step (aux_report.py)."""

    # fmt: off
    hooks = (
        Hook("micro_batch", bridge_loop.GPT_STEP, "get_batch", keeping_loss_mask, load="loaded",
             host="megatron-bridge", when=_token_mode,
             does="token mode: the loss mask kept for the model call Bridge's GPT step makes "
                 "without it (#6103)"),
        Hook("micro_batch", GPT_MODEL, "GPTModel.forward", padding_mask_forward, fingerprinted=True,
             when=_token_mode, does="token mode, MoE: routes with padding_mask = (loss_mask == "
                 "0); a call without a "
             "loss mask gets Bridge's kept one"),
        # combined 1F1B (--overlap-moe-expert-parallel-comm) builds a schedule plan instead
        Hook("micro_batch", GPT_MODEL, "GPTModel.build_schedule_plan", padding_mask_schedule_plan,
             fingerprinted=True, when=_token_mode,
             does="token mode, MoE, combined 1F1B: the plan gets padding_mask = (loss_mask == 0)"),
        Hook("micro_batch", SCHEDULE_PLAN, "TransformerModelChunkSchedulePlan.run", masked_plan_run,
             fingerprinted=True, when=_token_mode,
             does="token mode, combined 1F1B: the forward plan current while it runs"),
        Hook("micro_batch", MOE_LAYER, "MoELayer.route", plan_masked_route, fingerprinted=True,
             when=_token_mode,
             does="token mode, combined 1F1B: routes with the running plan's chunk-state mask"),
        # the router first: it binds moe_utils' functions by name, and is patched there too once it
        # is loaded
        Hook("micro_batch", ROUTER, "TopKRouter._apply_expert_bias", per_token_padding_expert_bias,
             fingerprinted=True, present=lambda module: not broadcasts_padding_per_token(module.TopKRouter),
             does="before main@d98e8a64: the expert-bias counts given the padding mask per token"),
        Hook("micro_batch", MOE_UTILS, "get_tokens_per_expert_and_token_count", exact_token_counts,
             fingerprinted=True, when=_token_mode,
             does="token mode: the router's count n_u over this micro-batch's TP x CP group "
                 "(#7452 finding 10)"),
        Hook("micro_batch", MOE_UTILS, "z_loss_func", tp_cp_scaled_z_loss, fingerprinted=True, when=_token_mode,
             present=lambda module: not router_scales_by_tp_cp(),
             does="before 0.19, token mode: the z-loss gradient times the TP x CP size (value "
                 "unchanged)"),
        Hook("micro_batch", MTP, "process_mtp_loss", global_count_mtp_loss, fingerprinted=True, when=_token_mode,
             does="0.17+, token mode: every MTP token weighs alpha / N (#7452 finding 3)"),
    )
    # fmt: on

    def __init__(self, handle: Handle) -> None:
        super().__init__(handle)
        self.host_loss_mask: Any = None
        """The loss mask Megatron-Bridge's ``gpt_step.get_batch`` returned for the model call that
        follows, which Bridge's GPT step does not pass to the model (Bridge #6103;
        bridge_loop.keeping_loss_mask); token mode only."""
        self.unmasked_moe_models: list[torch.nn.Module] = []
        """Token mode, until the first step's report: the model chunks with MoE whose call routed
        without a padding mask (aux_losses.padding_mask_forward records them)."""
        self.reported = False
        self.num_tokens: torch.Tensor | None = None
        """The first training step's N on the device (token mode), until the report reads it
        (once)."""

    def routed_without_padding_mask(self, model: torch.nn.Module) -> None:
        """A model call with MoE routed without a padding mask (token mode): kept for the first
        step's report."""
        if not self.reported and all(known is not model for known in self.unmasked_moe_models):
            self.unmasked_moe_models.append(model)

    def finalize(self, step: Finalizing) -> None:
        """The first training step's N kept on the device for the report (read there once, where it
        is needed)."""
        if not self.reported:
            self.num_tokens = step.num_tokens

    def end_step(self, step: Step) -> None:
        """Once, after the first training step: the aux losses' report, and where MoE routed without
        a mask.

        The auxiliary losses and their scaling, and where the run did not meet the token-mode target
        (MoE layers that routed without a padding mask), by how much."""
        if self.reported or not step.training or step.left_open:
            return
        self.reported = True
        config = self.handle.model_config(step.call.get("model"))
        mode = self.handle.config.loss_reduction
        summary = aux_summary(config, mode)
        if summary is None:
            return
        logger.info(summary)
        from megatron.core import parallel_state

        call = step.call
        positions = (
            call["num_microbatches"]
            * call.get("micro_batch_size", 1)
            * call.get("seq_length", 0)
            * parallel_state.get_data_parallel_world_size()
        )
        if mode != "token" or not routes_unmasked(
            config, {}
        ):  # no MoE statistics a padding mask corrects
            return
        stages = unmasked_moe_stages(
            self.unmasked_moe_models
        )  # every rank: one all-gather over its PP group
        self.unmasked_moe_models.clear()
        tokens = (
            0 if self.num_tokens is None else int(self.num_tokens)
        )  # the first step's N: one read, once
        self.num_tokens = None
        note = unmasked_moe_note(config, mode, stages, current_pipeline_size(), positions, tokens)
        if note is not None:
            logger.warning(note)
