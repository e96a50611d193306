"""Unpartitioned single-process references: the whole global batch, no DDP, no schedule, no
extension.

The LM part of both definitions is a weighted sum of the per-token losses l[b, s] over the global
batch:

    token:          w[b, s] = mask[b, s] / N,                      N = sum of the mask
    mean of means:  w[b, s] = mask[b, s] / (U * max(n_u, 1)),      u = unit of (b, s), U units,
                    n_u = non-padding tokens of unit u (one micro-batch of one DP rank, one CP
                    shard)

and models with auxiliary losses add, per unit u = (micro-batch m, DP rank r) (its TP and CP shards
together, as the router reduces its counts over TP x CP),

    MoE load balancing and z-loss:
      token:          (n_u / N) * alpha * aux_u,   aux_u over u's loss tokens (the router given padding_mask =
                      (loss_mask == 0)): the target docs/reduction.md defines;
      mean of means:  (1 / U) * alpha * aux_u,     aux_u over all of u's positions: upstream's default path;
      global_aux_loss: aux(m), micro-batch m's loss over every DP rank's rows (its statistics,
                      tokens per expert averaged over the step's micro-batches so far and the token
                      count T(m), are m's), at T(m) / (DP * N) (token: every token of m weighs the
                      same) or 1 / U (mean of means, upstream's); its z-loss per unit, as above;
    MTP (depth D, alpha = scaling factor / D):
      token:          alpha * sum over depths and MTP tokens t of mtp_t / N over the whole batch: every MTP token
                      weighs alpha / N, computed from the definition (depth k's target at position s
                      is label s + k, counted where loss_mask[s + k] is 1), on the model's own
                      per-token losses;
      mean of means:  (1 / U) * alpha * sum over depths of the mean of u's MTP tokens: upstream's default path.

The auxiliary terms are megatron's own (router, MTP block), attached with megatron's autoscalers at
exactly these weights (``set_loss_scale``), computed on a model built without the per-token flag, so
that no per-token pre-multiplication nor finalize division takes part; global_aux_loss runs one
forward per micro-batch m over every DP rank's rows (the z-loss off), then one per unit for the
z-loss (load balancing off). The reference gradient is the gradient of the sum of both parts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from megatron_ga_ext.verify.layouts import GlobalBatch, Layout
from megatron_ga_ext.verify.models import (
    KINDS,
    POSITIONWISE_GPT,
    UNTIED_GPT,
    ModelConfig,
    build_gpt,
    build_positionwise,
    init_model_parallel,
    transformer_config,
)

__all__ = ["aux_reference_grads", "mean_of_means_weights", "reference_grads", "token_weights"]

Grads = dict[str, torch.Tensor]


def token_weights(loss_mask: torch.Tensor) -> torch.Tensor:
    """w = mask / sum(mask): every non-padding token of the global batch weighs the same."""
    return loss_mask / loss_mask.sum()


def mean_of_means_weights(loss_mask: torch.Tensor, unit_ids: torch.Tensor) -> torch.Tensor:
    """w = mask / (U * max(n_u, 1)): each unit's token mean, then the mean over the U units."""
    num_units = int(unit_ids.max()) + 1
    counts = torch.zeros(num_units).index_add_(0, unit_ids.reshape(-1), loss_mask.reshape(-1))
    return loss_mask / (num_units * counts.clamp(min=1)[unit_ids])


def reference_grads(
    model: ModelConfig, layouts: Iterable[Layout], batch: GlobalBatch, device: str = "cpu"
) -> dict[tuple[str, str], Grads]:
    """{(layout name, "token" or "mean_of_means"): {global name: gradient}} for every layout.

    Needs megatron's parallel state for building the model; it initialises TP = PP = CP = 1 and
    tears it down again, so call it between layouts. The model is used unwrapped, on this rank
    alone.
    """
    from megatron.core import parallel_state

    layouts = list(layouts)
    init_model_parallel()
    try:
        refs = {}
        for kind in sorted({layout.model for layout in layouts}):
            module, names = _build(model, kind, device)
            token = _lm_grads(module, names, batch, token_weights(batch.loss_mask))
            for layout in (lay for lay in layouts if lay.model == kind):
                mean_of_means = _lm_grads(
                    module,
                    names,
                    batch,
                    mean_of_means_weights(batch.loss_mask, layout.unit_ids(model.seq_length)),
                )
                refs[(layout.name, "token")] = token
                refs[(layout.name, "mean_of_means")] = mean_of_means
                if layout.auxiliary:
                    refs[(layout.name, "token")] = _plus(
                        token, _aux_grads(module, names, batch, layout, "token")
                    )
                    refs[(layout.name, "mean_of_means")] = _plus(
                        mean_of_means, _aux_grads(module, names, batch, layout, "microbatch")
                    )
        return refs
    finally:
        _set_aux_scale(None)
        parallel_state.destroy_model_parallel()


def aux_reference_grads(
    model: ModelConfig, layout: Layout, batch: GlobalBatch, mode: str, device: str = "cpu"
) -> Grads:
    """The auxiliary-loss part alone of ``layout``'s reference in ``mode`` (the LM loss at weight
    0)."""
    from megatron.core import parallel_state

    init_model_parallel()
    try:
        module, names = _build(model, layout.model, device)
        return _aux_grads(module, names, batch, layout, mode)
    finally:
        _set_aux_scale(None)
        parallel_state.destroy_model_parallel()


def _build(model: ModelConfig, kind: str, device: str) -> tuple[torch.nn.Module, dict[str, str]]:
    """The unpartitioned model of ``kind`` on ``device``, and its parameters' global names."""
    config = transformer_config(
        model, kind=kind if kind != "positionwise" else "gpt", calculate_per_token_loss=False
    )
    if kind == "positionwise":
        module, names = build_positionwise(model, config)
    else:
        module, names = build_gpt(
            model,
            config,
            pre_process=True,
            post_process=True,
            positionwise=kind in POSITIONWISE_GPT,
            untied=kind in UNTIED_GPT,
        )
    for router in (
        module.modules()
    ):  # the expert bias starts at 0 and moves in finalize: one step never reads it
        if getattr(router, "enable_expert_bias", False):
            router.enable_expert_bias = False
    return module.to(device), names


def _set_aux_scale(scale: float | None, mtp: float | None = None) -> None:
    """The weight megatron's autoscalers give the auxiliary losses attached in the next forward
    (``mtp``: MTP's, if it differs from MoE's); None leaves them unset, as a new process has them
    (the schedule sets its own, of shape [1])."""
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    scalers = [(MoEAuxLossAutoScaler, scale)]
    try:
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        scalers.append((MTPLossAutoScaler, scale if mtp is None else mtp))
    except ImportError:  # a release without MTP
        pass
    for scaler, value in scalers:
        if value is None:
            scaler.main_loss_backward_scale = None
        else:
            scaler.set_loss_scale(torch.tensor([value]))


def _forward(
    module: torch.nn.Module, batch: GlobalBatch, rows: list[int] | slice, device: str, padding: bool
) -> torch.Tensor:
    """Per-token losses of ``rows``; GPT kinds also get the loss mask (MTP), and padding_mask if
    asked."""
    mask = batch.loss_mask[rows].to(device)
    kwargs = {} if not hasattr(module, "decoder") else {"loss_mask": mask}
    if padding:
        kwargs["padding_mask"] = mask == 0
    return module(
        batch.tokens[rows].to(device),
        batch.position_ids[rows].to(device),
        None,
        labels=batch.labels[rows].to(device),
        **kwargs,
    )


def _lm_grads(
    module: torch.nn.Module, names: dict[str, str], batch: GlobalBatch, weights: torch.Tensor
) -> Grads:
    """grad of sum(w * l) with every auxiliary loss at weight 0; a fresh forward each time
    (megatron's cross entropy frees its saved state)."""
    device = next(module.parameters()).device
    _set_aux_scale(0.0)
    losses = _forward(module, batch, slice(None), device, padding=False)
    return _grad(module, names, (losses * weights.to(device)).sum())


def _aux_grads(
    module: torch.nn.Module, names: dict[str, str], batch: GlobalBatch, layout: Layout, mode: str
) -> Grads:
    """grad of the auxiliary part of the reference (module docstring), the LM loss at weight 0:
    MoE's terms (MTP's at weight 0), then MTP's (MoE's at weight 0)."""
    extra = KINDS[layout.model]
    out: Grads = {}
    if extra.get("num_moe_experts"):
        moe = (
            _global_aux_grads
            if extra["moe_router_load_balancing_type"] == "global_aux_loss"
            else _moe_grads
        )
        out = moe(module, names, batch, layout, mode)
    if extra.get("mtp_num_layers"):
        out = _plus(out, _mtp_grads(module, names, batch, layout, mode))
    return out


def _unit_weight(batch: GlobalBatch, rows: list[int], num_units: int, mode: str) -> float:
    """n_u / N (token) or 1 / U (mean of means)."""
    return (
        float(batch.loss_mask[rows].sum() / batch.loss_mask.sum())
        if mode == "token"
        else 1.0 / num_units
    )


def _moe_grads(
    module: torch.nn.Module, names: dict[str, str], batch: GlobalBatch, layout: Layout, mode: str
) -> Grads:
    """One forward per unit, its MoE terms at the unit's weight."""
    device = next(module.parameters()).device
    units = layout.unit_samples()
    out: Grads = {}
    for rows in units:
        weight = _unit_weight(batch, rows, len(units), mode)
        if (
            weight == 0
        ):  # a unit without loss tokens has no term (upstream's router would divide 0 by 0)
            continue
        _set_aux_scale(weight, mtp=0.0)
        losses = _forward(module, batch, rows, device, padding=(mode == "token"))
        out = _plus(out, _grad(module, names, (losses * 0.0).sum()))
    return out


def _global_aux_grads(
    module: torch.nn.Module, names: dict[str, str], batch: GlobalBatch, layout: Layout, mode: str
) -> Grads:
    """global_aux_loss from its definition: aux(m), micro-batch m's loss over all its rows (every DP
    rank's), one unpartitioned forward each, in order from a fresh tracker (the router averages
    tokens per expert over the micro-batches so far), at the weight

        token:          c_m = T(m) / (DP x N),   T(m) = loss tokens of m: every token of m weighs the same;
        mean of means:  1 / U = 1 / (M x DP):    upstream's default path (each DP rank's piece at 1 / U, the
                                                 pieces summing to aux(m), over every position);

    then the z-loss per unit at the unit's weight (:func:`_moe_grads`, load balancing off)."""
    device = next(module.parameters()).device
    routers = [m for m in module.modules() if hasattr(m, "reset_global_aux_loss_tracker")]
    for router in routers:
        router.reset_global_aux_loss_tracker()
    units = layout.unit_samples()
    per_microbatch = len(units) // layout.num_microbatches
    out: Grads = {}
    with _local_counts(routers), _config_set(routers, moe_z_loss_coeff=None):
        for m in range(layout.num_microbatches):
            rows = [
                row for unit in units[m * per_microbatch : (m + 1) * per_microbatch] for row in unit
            ]
            weight = _microbatch_weight(batch, rows, layout, mode)
            if (
                weight == 0
                # no loss tokens: install() routes none (its count clamped to 1), the tracker
                # advances
            ):
                for router in routers:
                    router.ga_steps += 1
                continue
            _set_aux_scale(weight, mtp=0.0)
            losses = _forward(module, batch, rows, device, padding=(mode == "token"))
            out = _plus(out, _grad(module, names, (losses * 0.0).sum()))
    if KINDS[layout.model].get("moe_z_loss_coeff"):
        with _config_set(routers, moe_aux_loss_coeff=0.0):
            out = _plus(out, _moe_grads(module, names, batch, layout, mode))
    return out


def _microbatch_weight(batch: GlobalBatch, rows: list[int], layout: Layout, mode: str) -> float:
    """T(m) / (DP x N) (token) or 1 / (M x DP) (mean of means): global_aux_loss's weight of
    micro-batch m."""
    units = layout.num_microbatches * layout.data_parallel_size
    if mode != "token":
        return 1.0 / units
    return float(batch.loss_mask[rows].sum() / (layout.data_parallel_size * batch.loss_mask.sum()))


@contextlib.contextmanager
def _local_counts(routers: list[torch.nn.Module]) -> Iterator[None]:
    """The routers count over this process alone: their TP x DP x CP group is their TP x CP one, of
    size 1 here (the reference runs on every rank of a launch, whose DP group spans them)."""
    groups = [router.tp_dp_cp_group for router in routers]
    for router in routers:
        router.tp_dp_cp_group = router.tp_cp_group
    try:
        yield
    finally:
        for router, group in zip(routers, groups):
            router.tp_dp_cp_group = group


@contextlib.contextmanager
def _config_set(routers: list[torch.nn.Module], **fields: Any) -> Iterator[None]:
    """The routers' TransformerConfig with ``fields`` set (an auxiliary term off), restored
    after."""
    configs = list({id(router.config): router.config for router in routers}.values())
    saved = [{name: getattr(config, name) for name in fields} for config in configs]
    for config in configs:
        for name, value in fields.items():
            setattr(config, name, value)
    try:
        yield
    finally:
        for config, values in zip(configs, saved):
            for name, value in values.items():
                setattr(config, name, value)


def _mtp_grads(
    module: torch.nn.Module, names: dict[str, str], batch: GlobalBatch, layout: Layout, mode: str
) -> Grads:
    """Token: the definition over the whole batch (:func:`_mtp_token_objective`); mean of means: one
    forward per unit, upstream's attachment (each depth's mean over the unit's rolled tokens) at 1 /
    U."""
    device = next(module.parameters()).device
    if mode == "token":
        return _grad(module, names, _mtp_token_objective(module, batch, device))
    units = layout.unit_samples()
    out: Grads = {}
    for rows in units:
        _set_aux_scale(0.0, mtp=1.0 / len(units))
        losses = _forward(module, batch, rows, device, padding=False)
        out = _plus(out, _grad(module, names, (losses * 0.0).sum()))
    return out


def _mtp_token_objective(module: torch.nn.Module, batch: GlobalBatch, device: str) -> torch.Tensor:
    """alpha / D x sum over depths k = 1..D and positions s of mask[s + k] x l_k[s], over N: depth k
    predicts label s + k at position s (0 past the sequence's end). l_k is the model's own per-token
    loss of depth k, recorded from its ``compute_language_model_loss`` calls (the call whose labels
    are the labels shifted by k); the autoscalers attach nothing (weight 0)."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    compute = module.compute_language_model_loss

    def record(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        calls.append((labels, loss := compute(labels, logits)))
        return loss

    module.compute_language_model_loss = record
    try:
        _set_aux_scale(0.0)
        _forward(module, batch, slice(None), device, padding=False)
    finally:
        del module.compute_language_model_loss
    config = module.config
    labels, mask = batch.labels.to(device), batch.loss_mask.to(device)
    objective = torch.zeros((), device=device)
    for k in range(1, config.mtp_num_layers + 1):
        (loss,) = [loss for given, loss in calls if torch.equal(given, _shifted(labels, k))]
        objective = objective + (_shifted(mask, k) * loss).sum()
    return objective * config.mtp_loss_scaling_factor / config.mtp_num_layers / mask.sum()


def _shifted(tensor: torch.Tensor, k: int) -> torch.Tensor:
    """tensor[:, s + k] at position s, 0 past the end."""
    return torch.cat([tensor[:, k:], torch.zeros_like(tensor[:, :k])], dim=1)


def _grad(module: torch.nn.Module, names: dict[str, str], objective: torch.Tensor) -> Grads:
    params = [p for _, p in module.named_parameters()]
    grads = torch.autograd.grad(objective, params, allow_unused=True)
    return {
        names[n]: (torch.zeros_like(p) if g is None else g).detach().cpu()
        for (n, p), g in zip(module.named_parameters(), grads)
    }


def _plus(a: Grads, b: Grads) -> Grads:
    return {name: a.get(name, 0) + grad for name, grad in b.items()} if a else dict(b)
