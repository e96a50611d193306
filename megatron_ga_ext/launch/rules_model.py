"""The rules of TransformerConfig and parallel_state on the parallel sizes, declared for
``megatron-ga check``: MoE bias under expert TP, the distributed optimizer's instances, TP
communication overlap, and the layers an uneven first or last pipeline stage leaves to the middle
ones. Pure Python.
"""

from __future__ import annotations

from megatron_ga_ext.core.megatron_flags import BY_DEST
from megatron_ga_ext.launch.rule import ARGS, CONFIG, Rule, cite
from megatron_ga_ext.launch.rules_batch import drop, give
from megatron_ga_ext.launch.view import COUNTS, View

__all__ = ["MODEL_RULES"]

STATE = "megatron/core/parallel_state.py"

MOE_BIAS = Rule(
    id="moe-bias-expert-tensor-parallel",
    about="expert_tensor_parallel_size",
    reads=("num_experts", "add_bias_linear", "expert_tensor_parallel_size"),
    broken=lambda v: (
        v["num_experts"] is not None
        and bool(v["add_bias_linear"])
        and (v["expert_tensor_parallel_size"] or 1) != 1
    ),
    given=lambda v: (
        f"--num-experts {v['num_experts']} with linear biases (no --disable-bias-linear) at "
        "expert TP "
        f"{v['expert_tensor_parallel_size']}"
        + (
            ""
            if "expert_tensor_parallel_size" in v.given
            else " (--tensor-model-parallel-size, its default)"
        )
    ),
    says="Bias in Moe is only supported when ETP==1",
    fix="Add --disable-bias-linear, or use --expert-tensor-parallel-size 1.",
    edit=lambda v: give("add_bias_linear"),
    source=cite(CONFIG, 1589, 1831, 2056, 2280, 2613),
    topic="parallel",
)


def _shard_base(view: View) -> int | None:
    dp = view["data_parallel_size"]
    return None if dp is None else dp * (view["context_parallel_size"] or 1)


DIST_OPT_INSTANCES = Rule(
    id="distributed-optimizer-instances",
    about="num_distributed_optimizer_instances",
    reads=("num_distributed_optimizer_instances", "data_parallel_size", "context_parallel_size"),
    broken=lambda v: (
        isinstance(v["num_distributed_optimizer_instances"], int)
        and _shard_base(v) is not None
        and (_shard_base(v) or 1) % v["num_distributed_optimizer_instances"] != 0
    ),
    given=lambda v: (
        f"{v.named('num_distributed_optimizer_instances')} at DP x CP = {_shard_base(v)}"
    ),
    says="Data parallel size should be divisible by partial DistOpt shard factor",
    fix=lambda v: (
        "Give --num-distributed-optimizer-instances dividing DP x CP: "
        + ", ".join(
            str(n) for n in range(1, (_shard_base(v) or 1) + 1) if (_shard_base(v) or 1) % n == 0
        )[:80]
        + "."
    ),
    edit=lambda v: give("num_distributed_optimizer_instances", 1),
    source=cite(STATE, 833, 837, 827, 922, 922),
    topic="parallel",
)

TP_COMM_OVERLAP = Rule(
    id="tp-comm-overlap",
    about="tp_comm_overlap",
    reads=("tp_comm_overlap", "sequence_parallel"),
    broken=lambda v: bool(v["tp_comm_overlap"]) and not v["sequence_parallel"],
    given=lambda v: "--tp-comm-overlap without --sequence-parallel",
    says="Tensor parallel communication/GEMM overlap can happen only when sequence parallelism "
    "is enabled",
    fix="Add --sequence-parallel.",
    edit=lambda v: give("sequence_parallel"),
    source=cite(ARGS, 916, 1207, 1387, 1402, 1442),
    topic="parallel",
)


def _middle(view: View) -> tuple[int, int] | None:
    """(layers, stages) left to the middle pipeline stages by
    --decoder-first/last-pipeline-num-layers at PP 1."""
    first, last = (
        view["decoder_first_pipeline_num_layers"],
        view["decoder_last_pipeline_num_layers"],
    )
    layers, pp = view["num_layers"], view["pipeline_model_parallel_size"]
    if (first is None and last is None) or not isinstance(layers, int) or pp != 1:
        # above PP 1 the layer split reports it with the rest of the split (launch/layer_split.py)
        return None
    if view["pipeline_model_parallel_layout"] is not None:
        return None  # the layout's own rule refuses the pair
    stages = pp - (first is not None) - (last is not None)
    return layers - (first or 0) - (last or 0), stages


MIDDLE_STAGES = Rule(
    id="layer-split",
    about="decoder_first_pipeline_num_layers",
    reads=("num_layers", "pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
           "decoder_last_pipeline_num_layers"),
    broken=lambda v: (m := _middle(v)) is not None and m[1] >= 0 and bool(m[0]) != bool(m[1]),
    given=lambda v: f"{v.named('num_layers')} with an uneven first or last stage at "
    f"{v.named('pipeline_model_parallel_size')}",
    says=lambda v: f"Mismatch: {(_middle(v) or (0, 0))[0]} middle layers remaining but "
    f"{(_middle(v) or (0, 0))[1]} middle PP stages available.",
    fix="Give the first and last stages all the layers where no middle stage is left, or raise PP.",
    source=cite(CONFIG, 1407, 1587, 1812, 2036, 2342),
    verb="raises ValueError",
    topic="parallel",
)  # fmt: skip

DELAYED_WGRAD = Rule(
    id="delay-wgrad-compute",
    about="transformer_impl",
    reads=("delay_wgrad_compute", "transformer_impl"),
    broken=lambda v: (
        bool(v["delay_wgrad_compute"]) and v["transformer_impl"] != "transformer_engine"
    ),
    given=lambda v: f"--delay-wgrad-compute with {v.named('transformer_impl')}",
    says="Delaying wgrad compute is only supported with transformer_engine implementation",
    fix="Use --transformer-impl transformer_engine, or drop --delay-wgrad-compute.",
    edit=lambda v: drop("delay_wgrad_compute"),
    source=cite(ARGS, 1210, 1516, 1691, 1823, 1904),
    topic="parallel",
)


def _count_at_least_one(dest: str) -> Rule:
    return Rule(
        id="count-below-one",
        about=dest,
        reads=(dest, *(("group_query_attention",) if dest == "num_query_groups" else ())),
        # query groups count only with --group-query-attention (Megatron sets them to the heads
        # otherwise)
        broken=lambda v: (
            dest in v["below_one"]
            and (dest != "num_query_groups" or bool(v["group_query_attention"]))
        ),
        given=lambda v: f"{v.flag(dest)} {v['below_one'][dest]}",
        says="must be at least 1",
        fix=f"Give {BY_DEST[dest].flag} 1 or more.",
        ours="Megatron divides by it (a ZeroDivisionError at 0, a negative count past its checks)",
        topic="model",
    )


COUNTS_AT_LEAST_ONE = tuple(_count_at_least_one(dest) for dest in COUNTS)

MODEL_RULES: tuple[Rule, ...] = (
    *COUNTS_AT_LEAST_ONE,
    MOE_BIAS,
    DIST_OPT_INSTANCES,
    TP_COMM_OVERLAP,
    MIDDLE_STAGES,
    DELAYED_WGRAD,
)
