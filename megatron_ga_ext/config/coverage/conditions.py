"""What the coverage rows look at: predicates of a
:class:`~megatron_ga_ext.config.coverage.row.Setting`, each true where a row applies (a feature on,
a loss mode, a layout). Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_ga_ext.config.coverage.row import SCOPE_DEPRECATED, Setting
from megatron_ga_ext.config.flags import BY_DEST

__all__ = [
    "above_one",
    "any_given",
    "balancing",
    "batch_schedule",
    "full_iteration_graph",
    "gtp_remat",
    "has_moe",
    "in_microbatch_mode",
    "in_token_mode",
    "is_hybrid",
    "is_on",
    "layer_graphs",
    "megatron_fsdp_with",
    "nan_check_by_megatron",
    "pipeline_tied",
    "quantile_balancing",
    "quantile_unmasked_losses",
]


def has_moe(s: Setting) -> bool:
    """MoE layers: --num-experts, or an E (MoE) layer in a hybrid model's pattern."""
    patterns = s.names("hybrid_override_pattern") + s.names("hybrid_layer_pattern")
    return s.number("num_experts") > 0 or any("E" in p for p in patterns)


def is_hybrid(s: Setting) -> bool:
    return s.on("is_hybrid_model") or bool(
        s.names("hybrid_override_pattern") + s.names("hybrid_layer_pattern")
    )


def full_iteration_graph(s: Setting) -> bool:
    """A full-iteration CUDA graph: --cuda-graph-impl full_iteration (0.18+, where a full_iteration
    scope or module migrates to it), or a full_iteration scope with the local implementation (0.16,
    0.17)."""
    impl = s.value("cuda_graph_impl")
    scopes = s.names("cuda_graph_scope") + s.names(SCOPE_DEPRECATED) + s.names("cuda_graph_modules")
    return impl == "full_iteration" or ("full_iteration" in scopes and impl != "transformer_engine")


def layer_graphs(s: Setting) -> bool:
    graphs = (
        s.value("cuda_graph_impl") in ("local", "transformer_engine")
        or s.on("enable_cuda_graph")
        or s.on("external_cuda_graph")
    )
    return graphs and not full_iteration_graph(s)


def batch_schedule(s: Setting) -> bool:
    """The global batch size changes during the run: a step schedule, or a rampup (0.16 and 0.17 run
    their own; --ga-convert-rampup runs it on every release)."""
    return bool(s.value("step_batch_size_schedule") or s.value("rampup_batch_size"))


#: --data-parallel-sharding-strategy's default from 0.18 on (0.16's and 0.17's is no_shard), for a
#: launch line without it.
MEGATRON_FSDP_DEFAULT_STRATEGY = "optim_grads_params"


def megatron_fsdp_with(strategy: str) -> Callable[[Setting], bool]:
    """Megatron-FSDP with ``strategy`` (--data-parallel-sharding-strategy; its default where not
    given)."""

    def applies(s: Setting) -> bool:
        given = s.value("data_parallel_sharding_strategy") or MEGATRON_FSDP_DEFAULT_STRATEGY
        return s.on("use_megatron_fsdp") and given == strategy

    return applies


def balancing(*kinds: str) -> Callable[[Setting], bool]:
    return lambda s: (
        has_moe(s) and any(kind in s.names("moe_router_load_balancing_type") for kind in kinds)
    )


def quantile_balancing(s: Setting) -> bool:
    return balancing("quantile_balancing")(s)


def quantile_unmasked_losses(s: Setting) -> bool:
    """Under quantile balancing the model routes without a padding mask: a z-loss or an aux-loss
    type in the same list then counts padding positions."""
    aux = {"aux_loss", "seq_aux_loss", "global_aux_loss"} & set(
        s.names("moe_router_load_balancing_type")
    )
    return bool(s.value("moe_z_loss_coeff")) or bool(aux)


def nan_check_by_megatron(s: Setting) -> bool:
    return s.on("check_for_nan_in_loss_and_grad") and s.value("rerun_mode") == "validate_results"


def in_token_mode(check: Callable[[Setting], bool]) -> Callable[[Setting], bool]:
    return lambda s: s.token and check(s)


def in_microbatch_mode(check: Callable[[Setting], bool]) -> Callable[[Setting], bool]:
    return lambda s: not s.token and check(s)


def is_on(dest: str) -> Callable[[Setting], bool]:
    return lambda s: s.on(dest)


def above_one(dest: str) -> Callable[[Setting], bool]:
    return lambda s: s.number(dest) > 1


def any_given(*dests: str) -> Callable[[Setting], bool]:
    """Any of ``dests`` set otherwise than Megatron's default."""
    return lambda s: any(s.value(dest) != BY_DEST[dest].default for dest in dests)


def gtp_remat(s: Setting) -> bool:
    """GTP weight rematerialization: more weight shards than tensor-parallel ranks (Megatron's
    gtp_weight_remat_size
    = shards / TP > 1), for the dense layers or the experts."""
    tp = max(s.number("tensor_model_parallel_size"), 1)
    expert_tp = s.number("expert_tensor_parallel_size") or tp
    return (
        s.number("tensor_parallel_num_weight_shards") > tp
        or s.number("expert_tensor_parallel_num_weight_shards") > expert_tp
    )


def pipeline_tied(untied: bool) -> Callable[[Setting], bool]:
    return lambda s: (
        s.number("pipeline_model_parallel_size") > 1
        and s.on("untie_embeddings_and_output_weights") == untied
    )
