"""The rules of validate_args and TransformerConfig on the parallel sizes, declared for
``megatron-ga check``. Pure Python.

Context parallelism (hierarchical sizes, sequence length, hybrid CP), the interleaved schedule's p2p
overlap, the overlapped param gather, expert parallelism, attention heads and query groups against
TP; the layer counts of --pipeline-model-parallel-layout are launch/rules_layout.py's, placed
last here. Each cites its upstream line at every tested source.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from megatron_ga_ext.core.rules import divisors, nearest_multiples
from megatron_ga_ext.launch.report import Edit
from megatron_ga_ext.launch.rule import ARGS, CONFIG, Rule, cite, switched
from megatron_ga_ext.launch.rules_batch import drop, give
from megatron_ga_ext.launch.rules_layout import LAYOUT_RULES
from megatron_ga_ext.launch.view import View

__all__ = ["PARALLEL_RULES", "valid_tensor_parallel_sizes"]

# -- context parallelism
# -------------------------------------------------------------------------------


def _cp_sizes(view: View) -> list[int] | None:
    sizes = view["hierarchical_context_parallel_sizes"]
    return sizes if sizes and all(isinstance(s, int) for s in sizes) else None


def _seq_nearest(view: View) -> list[int]:
    return nearest_multiples(view["seq_length"], 2 * view["context_parallel_size"])


def _closest(values: list[int], given: int) -> int:
    return min(values, key=lambda v: (abs(v - given), v))


HIERARCHICAL_CP = (
    Rule(
        id="hierarchical-context-parallel",
        about="hierarchical_context_parallel_sizes",
        reads=("hierarchical_context_parallel_sizes", "context_parallel_size"),
        broken=lambda v: (
            _cp_sizes(v) is not None and math.prod(_cp_sizes(v) or ()) != v["context_parallel_size"]
        ),
        given=lambda v: (
            f"{v.named('hierarchical_context_parallel_sizes')} (product "
            f"{math.prod(_cp_sizes(v) or ())}) with {v.named('context_parallel_size')}"
        ),
        says="args.context_parallel_size == prod(args.hierarchical_context_parallel_sizes)",
        fix="Give sizes whose product is --context-parallel-size.",
        source=cite(ARGS, 405, 473, 580, 564, 582),
        topic="parallel",
    ),
    Rule(
        id="hierarchical-context-parallel",
        about="cp_comm_type",
        reads=("cp_comm_type", "hierarchical_context_parallel_sizes"),
        broken=lambda v: (
            "a2a+p2p" in (v["cp_comm_type"] or ()) and not v["hierarchical_context_parallel_sizes"]
        ),
        given=lambda v: f"{v.named('cp_comm_type')} without --hierarchical-context-parallel-sizes",
        says="--hierarchical-context-parallel-sizes must be set when a2a+p2p is used in cp comm",
        fix="Give --hierarchical-context-parallel-sizes (a2a size, p2p size), or another "
        "--cp-comm-type.",
        source=cite(ARGS, 407, 475, 582, 566, 584),
        topic="parallel",
    ),
)

SEQ_CP = Rule(
    id="seq-length-context-parallel",
    about="seq_length",
    reads=("seq_length", "context_parallel_size"),
    broken=lambda v: (
        (v["context_parallel_size"] or 1) > 1
        and isinstance(v["seq_length"], int)
        and v["seq_length"] % (2 * v["context_parallel_size"]) != 0
    ),
    given=lambda v: f"{v.named('seq_length')} with {v.named('context_parallel_size')}",
    says="seq-length should be a multiple of 2 * context-parallel-size if context-parallel-size "
    "> 1.",
    fix=lambda v: f"Nearest valid --seq-length: {', '.join(map(str, _seq_nearest(v)))}.",
    edit=lambda v: give("seq_length", _closest(_seq_nearest(v), v["seq_length"])),
    source=cite(ARGS, 818, 1109, 1287, 1296, 1336),
    topic="parallel",
)


def _positions(dest: str, lines: tuple[int, ...]) -> Rule:
    says = (
        "max_position_embeddings ({p}) must be greater than or equal to seq_length ({s})."
        if dest == "seq_length"
        else "args.max_position_embeddings >= args.decoder_seq_length"
    )
    return Rule(
        id="max-position-embeddings",
        about="max_position_embeddings",
        reads=("max_position_embeddings", dest),
        broken=lambda v: (
            "max_position_embeddings" in v.given
            and isinstance(v[dest], int)
            and isinstance(v["max_position_embeddings"], int)
            and v["max_position_embeddings"] < v[dest]
        ),
        given=lambda v: f"{v.named(dest)} with {v.named('max_position_embeddings')}",
        says=lambda v: says.format(p=v["max_position_embeddings"], s=v[dest]),
        fix=lambda v: f"Give --max-position-embeddings {v[dest]} or more, or a shorter sequence.",
        edit=lambda v: give("max_position_embeddings", v[dest]),
        source=cite(ARGS, *lines),
        topic="parallel",
    )


POSITIONS = (
    _positions("seq_length", (830, 1121, 1299, 1314, 1354)),
    _positions("decoder_seq_length", (834, 1125, 1303, 1318, 1358)),
)


_hybrid = switched(
    "hybrid_context_parallel",
    "--hybrid-context-parallel",
    id="hybrid-context-parallel",
    topic="parallel",
)


HYBRID_CP = (
    _hybrid("pipeline_model_parallel_size", lambda v: (v["pipeline_model_parallel_size"] or 1) > 1,
            lambda v: v.named("pipeline_model_parallel_size"),
            "Hybrid context parallelism not supported with pipeline parallelism",
            "Drop --hybrid-context-parallel, or use --pipeline-model-parallel-size 1.",
            drop("hybrid_context_parallel"), (919, 1210, 1390, 1405, 1445)),
    _hybrid("enable_cuda_graph", lambda v: bool(v["enable_cuda_graph"]), lambda v: "--enable-cuda-graph",
            "Hybrid context parallelism not supported with CUDA Graph",
            "Drop --hybrid-context-parallel or --enable-cuda-graph.",
            drop("enable_cuda_graph"), (920, 1211, 1391, 1406, 1446)),
    _hybrid("use_megatron_fsdp", lambda v: bool(v["use_megatron_fsdp"]), lambda v: "--use-megatron-fsdp",
            "Hybrid context parallelism not supported with Megatron FSDP",
            "Drop --hybrid-context-parallel or --use-megatron-fsdp.",
            drop("hybrid_context_parallel"), (921, 1212, 1392, 1407, 1447)),
    _hybrid("dataloader_type", lambda v: v["dataloader_type"] not in (None, "single"),
            lambda v: v.named("dataloader_type"),
            "Hybrid context parallelism only supported with single dataloader type",
            "Use --dataloader-type single.", give("dataloader_type", "single"), (922, 1213, 1393, 1408, 1448)),
    _hybrid("calculate_per_token_loss", lambda v: not v["calculate_per_token_loss"],
            lambda v: "no --calculate-per-token-loss",
            "Hybrid context parallelism must be used with --calculate-per-token-loss",
            "Add --calculate-per-token-loss.", give("calculate_per_token_loss"), (923, 1214, 1394, 1409, 1449)),
)  # fmt: skip

# -- the interleaved schedule and the overlapped param gather
# ---------------------------------------------

VPP_P2P = Rule(
    id="interleave-p2p-overlap",
    about="pipeline_model_parallel_size",
    reads=(
        "virtual_pipeline_model_parallel_size",
        "overlap_p2p_comm",
        "pipeline_model_parallel_size",
    ),
    broken=lambda v: (
        (v["virtual_pipeline_model_parallel_size"] or 1) > 1
        and not v["overlap_p2p_comm"]
        and v["pipeline_model_parallel_size"] == 2
    ),
    given=lambda v: (
        f"an interleaved schedule (VPP {v['virtual_pipeline_model_parallel_size']}) with "
        f"--no-overlap-p2p-communication and {v.named('pipeline_model_parallel_size')}"
    ),
    says="When interleaved schedule is used and p2p communication overlap is disabled, "
    "pipeline-model-parallel "
    "size should be greater than 2 to avoid having multiple p2p sends and recvs between same 2 "
    "ranks per "
    "communication batch",
    fix="Drop --no-overlap-p2p-communication, or use --pipeline-model-parallel-size > 2.",
    edit=lambda v: drop("overlap_p2p_comm"),
    source=cite(ARGS, 579, 838, 985, 972, 1006),
    topic="parallel",
)

OVERLAP_PARAM_GATHER = (
    Rule(
        id="overlap-param-gather",
        about="overlap_param_gather",
        reads=(
            "overlap_param_gather",
            "use_distributed_optimizer",
            "use_megatron_fsdp",
            "optimizer",
        ),
        broken=lambda v: (
            bool(v["overlap_param_gather"])
            and not (
                v["use_distributed_optimizer"]
                or v["use_megatron_fsdp"]
                or v["optimizer"] == "dist_muon"
            )
        ),
        given=lambda v: (
            "--overlap-param-gather without --use-distributed-optimizer (or --use-megatron-fsdp)"
        ),
        says="--overlap-param-gather only supported with distributed optimizer, megatron fsdp, "
        "or dist_muon",
        fix="Add --use-distributed-optimizer, or drop --overlap-param-gather.",
        # FSDP2 refuses the distributed optimizer: there the overlap goes
        edit=lambda v: (
            drop("overlap_param_gather")
            if v["use_torch_fsdp2"]
            else give("use_distributed_optimizer")
        ),
        source=cite(ARGS, 598, 857, 1004, 991, 1025),
        topic="parallel",
    ),
    Rule(
        id="overlap-param-gather",
        about="overlap_param_gather",
        reads=("overlap_param_gather", "overlap_grad_reduce"),
        broken=lambda v: bool(v["overlap_param_gather"]) and not v["overlap_grad_reduce"],
        given=lambda v: "--overlap-param-gather without --overlap-grad-reduce",
        says="Must use --overlap-param-gather with --overlap-grad-reduce",
        fix="Add --overlap-grad-reduce.",
        edit=lambda v: give("overlap_grad_reduce"),
        source=cite(ARGS, 600, 860, 1007, 994, 1028),
        topic="parallel",
    ),
)


_gather_with_step = switched(
    "overlap_param_gather_with_optimizer_step",
    "--overlap-param-gather-with-optimizer-step",
    id="overlap-param-gather",
    topic="parallel",
)


def _with_step(
    reads: str,
    broken: Callable[[View], bool],
    says: str,
    fix: str,
    edit: Edit,
    lines: tuple[int, ...],
) -> Rule:
    """--overlap-param-gather-with-optimizer-step's needs: the flag it needs, or its absence."""
    given = lambda v: v.named(reads) if v[reads] else f"no {v.flag(reads)}"  # noqa: E731
    return _gather_with_step(reads, broken, given, says, fix, edit, lines)


WITH_OPTIMIZER_STEP = (
    _with_step("use_distributed_optimizer", lambda v: not v["use_distributed_optimizer"],
               "--overlap-param-gather-with-optimizer-step only supported with distributed "
                   "optimizer",
               "Add --use-distributed-optimizer.", give("use_distributed_optimizer"), (636, 901, 1046, 1033, 1067)),
    _with_step("overlap_param_gather", lambda v: not v["overlap_param_gather"],
               "Must use --overlap-param-gather-with-optimizer-step with --overlap-param-gather",
               "Add --overlap-param-gather.", give("overlap_param_gather"), (638, 903, 1048, 1035, 1069)),
    _with_step("virtual_pipeline_model_parallel_size", lambda v: v["virtual_pipeline_model_parallel_size"] is None,
               "--overlap-param-gather-with-optimizer-step only supported with interleaved "
                   "pipeline parallelism",
               "Drop --overlap-param-gather-with-optimizer-step, or interleave the pipeline.",
               drop("overlap_param_gather_with_optimizer_step"), (640, 905, 1050, 1037, 1071)),
)  # fmt: skip

# -- experts, heads, query groups
# -------------------------------------------------------------------------

EP_EXPERTS = Rule(
    id="expert-parallel-experts",
    about="expert_model_parallel_size",
    reads=("expert_model_parallel_size", "num_experts"),
    broken=lambda v: (v["expert_model_parallel_size"] or 1) > 1 and v["num_experts"] is None,
    given=lambda v: f"{v.named('expert_model_parallel_size')} without --num-experts",
    says="num_experts must be non None to use expert model parallelism",
    fix="Give --num-experts (a multiple of the EP size), or drop --expert-model-parallel-size.",
    edit=lambda v: drop("expert_model_parallel_size"),
    source=cite(ARGS, 1026, 1317, 1487, 1601, 1656),
    topic="parallel",
)


def _groups_fit(groups: int, tp: int) -> bool:
    return groups % tp == 0 or tp % groups == 0


def valid_tensor_parallel_sizes(view: View) -> list[int]:
    """TP sizes the heads (and query groups) allow and the world divides: world / (TP x PP x CP)
    whole."""
    heads, world = view["num_attention_heads"], view["world_size"]
    pp, cp = view["pipeline_model_parallel_size"] or 1, view["context_parallel_size"] or 1
    groups = view["num_query_groups"] if view["group_query_attention"] else None
    sizes = divisors(heads)[0] if isinstance(heads, int) else []
    return [
        t
        for t in sizes
        if (not isinstance(world, int) or world % (t * pp * cp) == 0)
        and (not isinstance(groups, int) or _groups_fit(groups, t))
    ]


def _tp_fix(view: View) -> str:
    valid = valid_tensor_parallel_sizes(view)
    return (
        f"Valid --tensor-model-parallel-size: {', '.join(map(str, valid))}."
        if valid
        else "Change TP."
    )


HEADS_TP = Rule(
    id="attention-heads-tensor-parallel",
    about="num_attention_heads",
    reads=("num_attention_heads", "tensor_model_parallel_size"),
    broken=lambda v: (
        isinstance(v["num_attention_heads"], int)
        and v["num_attention_heads"] % (v["tensor_model_parallel_size"] or 1) != 0
    ),
    given=lambda v: (
        f"{v.named('num_attention_heads')} with {v.named('tensor_model_parallel_size')}"
    ),
    says=lambda v: (
        f"num_attention_heads ({v['num_attention_heads']}) must be a multiple of "
        f"tensor_model_parallel_size ({v['tensor_model_parallel_size']})."
    ),
    fix=_tp_fix,
    source=cite(CONFIG, 924, 1056, 1195, 1323, 1446),
    verb="raises ValueError",
    topic="parallel",
)

QUERY_GROUPS_TP = Rule(
    id="query-groups-tensor-parallel",
    about="num_query_groups",
    reads=("group_query_attention", "num_query_groups", "tensor_model_parallel_size"),
    broken=lambda v: (
        bool(v["group_query_attention"])
        and isinstance(v["num_query_groups"], int)
        and not _groups_fit(v["num_query_groups"], v["tensor_model_parallel_size"] or 1)
    ),
    given=lambda v: f"{v.named('num_query_groups')} with {v.named('tensor_model_parallel_size')}",
    says=lambda v: (
        f"num_query_groups ({v['num_query_groups']}) must be a multiple or divisor of "
        f"tensor_model_parallel_size ({v['tensor_model_parallel_size']})."
    ),
    fix=_tp_fix,
    source=cite(CONFIG, 940, 1072, 1211, 1339, 1462),
    verb="raises ValueError",
    topic="parallel",
)

PARALLEL_RULES: tuple[Rule, ...] = (
    *HIERARCHICAL_CP,
    SEQ_CP,
    *POSITIONS,
    *HYBRID_CP,
    VPP_P2P,
    *OVERLAP_PARAM_GATHER,
    *WITH_OPTIMIZER_STEP,
    EP_EXPERTS,
    HEADS_TP,
    QUERY_GROUPS_TP,
    *LAYOUT_RULES,
)
