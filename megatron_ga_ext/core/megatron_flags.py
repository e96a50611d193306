"""Megatron's and the launcher's flags that megatron-ga-ext reads, each declared once, as the parsers spell
them. Pure Python. The ``--ga-*`` flags (ours) are declared in ``config/flags.py``.

Which flags exist is Megatron-LM's own parser at each tested release and commit (core_v0.16.1 ... main):
tests/test_options_upstream.py builds each snapshot's parser and checks every declaration (``since``
included) and :data:`NOT_MEGATRON` against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "BY_DEST",
    "COVERED_OPTIONS",
    "LAUNCHER_OPTIONS",
    "MEGATRON_OPTIONS",
    "NOT_MEGATRON",
    "STEP_SCHEDULE",
    "VIRTUAL_PIPELINE",
    "Option",
    "switch",
]


@dataclass(frozen=True, kw_only=True)
class Option:
    """One command-line flag, declared once."""

    flag: str
    """As the command line spells it, e.g. ``--ga-loss-reduction`` or ``--micro-batch-size``."""
    dest: str
    """The argparse destination: the attribute of Megatron's ``args`` that holds the value."""
    type: type = int
    """``int``, ``str`` or ``bool`` (a switch)."""
    nargs: int | str = 1
    """Values after the flag: 0 for a switch, 3 for ``--rampup-batch-size``, ``"+"`` for one or more."""
    default: Any = None
    choices: tuple[str, ...] = ()
    negatable: bool = False
    """A switch that also has ``--no-<name>`` (argparse's BooleanOptionalAction)."""
    help: str = ""
    since: str | None = None
    """The first tested Megatron source whose parser defines the flag, by its ref in compat.UPSTREAM: a release tag
    (``core_v0.18.2``) or a main-branch commit (``e8fef4ebb23e``, after every release) (None: all of them)."""

    @property
    def spellings(self) -> tuple[str, ...]:
        """The flag, and ``--no-<name>`` for a negatable switch."""
        return (self.flag, "--no-" + self.flag[2:]) if self.negatable else (self.flag,)


def switch(flag: str, dest: str, help: str = "", **kwargs: Any) -> Option:
    """A flag without a value (``store_true``, or BooleanOptionalAction when ``negatable``)."""
    return Option(flag=flag, dest=dest, type=bool, nargs=0, default=kwargs.pop("default", False), help=help, **kwargs)


STEP_SCHEDULE = Option(
    flag="--step-batch-size-schedule", dest="step_batch_size_schedule", type=str, since="core_v0.18.2",
    help="'THRESHOLD:GBS ...' (thresholds in tokens when --seq-length is set), validated up front by megatron_ga_ext; "
    "add_args adds it on releases that lack it (0.16, 0.17: the backport).",
)

# -- Megatron's flags that decide the batch arithmetic, as its parser spells them ------------------

MEGATRON_OPTIONS = (
    Option(flag="--micro-batch-size", dest="micro_batch_size"),
    Option(flag="--global-batch-size", dest="global_batch_size"),
    Option(flag="--rampup-batch-size", dest="rampup_batch_size", nargs=3),
    STEP_SCHEDULE,
    switch("--decrease-batch-size-if-needed", "decrease_batch_size_if_needed"),
    Option(flag="--seq-length", dest="seq_length"),
    Option(flag="--encoder-seq-length", dest="encoder_seq_length"),
    Option(flag="--decoder-seq-length", dest="decoder_seq_length"),
    Option(flag="--tensor-model-parallel-size", dest="tensor_model_parallel_size", default=1),
    Option(flag="--pipeline-model-parallel-size", dest="pipeline_model_parallel_size", default=1),
    Option(flag="--context-parallel-size", dest="context_parallel_size", default=1),
    Option(flag="--expert-model-parallel-size", dest="expert_model_parallel_size", default=1),
    Option(flag="--expert-tensor-parallel-size", dest="expert_tensor_parallel_size"),
    Option(flag="--num-experts", dest="num_experts"),
    Option(flag="--num-layers", dest="num_layers"),
    Option(flag="--decoder-num-layers", dest="decoder_num_layers"),
    Option(flag="--num-layers-per-virtual-pipeline-stage", dest="num_layers_per_virtual_pipeline_stage"),
    Option(flag="--num-virtual-stages-per-pipeline-rank", dest="num_virtual_stages_per_pipeline_rank"),
    Option(flag="--microbatch-group-size-per-virtual-pipeline-stage", dest="microbatch_group_size_per_vp_stage"),
    Option(flag="--pipeline-model-parallel-layout", dest="pipeline_model_parallel_layout", type=str),
    Option(flag="--decoder-first-pipeline-num-layers", dest="decoder_first_pipeline_num_layers"),
    Option(flag="--decoder-last-pipeline-num-layers", dest="decoder_last_pipeline_num_layers"),
    switch("--account-for-embedding-in-pipeline-split", "account_for_embedding_in_pipeline_split"),
    switch("--account-for-loss-in-pipeline-split", "account_for_loss_in_pipeline_split"),
    Option(flag="--hybrid-layer-pattern", dest="hybrid_layer_pattern", type=str, since="core_v0.17.1"),
    Option(flag="--hybrid-override-pattern", dest="hybrid_override_pattern", type=str),
    Option(flag="--train-iters", dest="train_iters"),
    Option(flag="--train-samples", dest="train_samples"),
    switch("--calculate-per-token-loss", "calculate_per_token_loss"),
    switch("--hybrid-context-parallel", "hybrid_context_parallel"),
    switch("--perform-rl-step", "perform_rl_step"),
    switch("--rl-use-sequence-packing", "rl_use_sequence_packing", negatable=True),
)

# -- Megatron's flags on the loss, gradient, step or schedule path, beyond the ones above --------------
# Each is classified by the coverage table (config/coverage.py). Defaults are Megatron's, so a launch line that
# leaves a flag out reads as Megatron runs it.

COVERED_OPTIONS = (
    Option(flag="--cuda-graph-impl", dest="cuda_graph_impl", type=str, default="none",
           choices=("none", "local", "transformer_engine", "full_iteration"),
           help="full_iteration is a choice from core_v0.18.2 on; before, --cuda-graph-impl local with "
           "--cuda-graph-scope full_iteration"),
    Option(flag="--cuda-graph-scope", dest="cuda_graph_scope", type=str, nargs="+",
           help="argparse dest cuda_graph_scope up to 0.17, cuda_graph_scope_deprecated from 0.18 (moved into "
           "cuda_graph_modules, its full_iteration into --cuda-graph-impl full_iteration)"),
    Option(flag="--cuda-graph-modules", dest="cuda_graph_modules", type=str, nargs="+", since="core_v0.18.2"),
    switch("--enable-cuda-graph", "enable_cuda_graph", help="deprecated: --cuda-graph-impl local"),
    switch("--external-cuda-graph", "external_cuda_graph", help="deprecated: --cuda-graph-impl transformer_engine"),
    switch("--optimizer-cuda-graph", "optimizer_cuda_graph", since="core_v0.17.1"),
    switch("--overlap-moe-expert-parallel-comm", "overlap_moe_expert_parallel_comm"),
    switch("--delay-wgrad-compute", "delay_wgrad_compute"),
    Option(flag="--rerun-mode", dest="rerun_mode", type=str, default="validate_results",
           choices=("disabled", "validate_results", "report_stats")),
    # Megatron's parser has only the negative spelling (store_false, dest default True): Launch.on() of this
    # flag reads as the value of check_for_nan_in_loss_and_grad (True unless given).
    Option(flag="--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", type=bool, nargs=0,
           default=True),
    Option(flag="--moe-router-load-balancing-type", dest="moe_router_load_balancing_type", type=str, nargs="+",
           default=("aux_loss",), choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn",
                                           "quantile_balancing", "none"),
           help="quantile_balancing is a choice from core_v0.19.0 on"),
    Option(flag="--moe-z-loss-coeff", dest="moe_z_loss_coeff", type=float),
    Option(flag="--moe-token-dispatcher-type", dest="moe_token_dispatcher_type", type=str, default="allgather",
           choices=("allgather", "alltoall", "flex")),
    Option(flag="--moe-expert-rank-capacity-factor", dest="moe_expert_rank_capacity_factor", type=str,
           since="core_v0.18.2"),
    Option(flag="--experimental-attention-variant", dest="experimental_attention_variant", type=str,
           choices=("gated_delta_net", "dsa", "gdn", "gdn2"), help="gdn and gdn2 only on some main-branch commits"),
    Option(flag="--mtp-num-layers", dest="mtp_num_layers"),
    switch("--is-hybrid-model", "is_hybrid_model"),
    switch("--use-megatron-fsdp", "use_megatron_fsdp"),
    switch("--use-torch-fsdp2", "use_torch_fsdp2"),
    switch("--use-distributed-optimizer", "use_distributed_optimizer"),
    switch("--overlap-grad-reduce", "overlap_grad_reduce"),
    switch("--ddp-average-in-collective", "ddp_average_in_collective"),
    Option(flag="--yaml-cfg", dest="yaml_cfg", type=str),
    switch("--overlap-param-gather", "overlap_param_gather"),
    switch("--sft", "sft"),
    switch("--dataloader-inter-document-masking", "dataloader_inter_document_masking", since="core_v0.19.0"),
    Option(flag="--iterations-to-skip", dest="iterations_to_skip", type=str, nargs="+", default=()),
    # main after d98e8a64 (#6742): the sequence-packing scheduler in the training loop
    Option(flag="--sequence-packing-scheduler", dest="sequence_packing_scheduler", type=str, choices=("dp_balanced",),
           since="e8fef4ebb23e"),
    switch("--use-varlen-dataset", "use_varlen_dataset", since="e8fef4ebb23e",
           help="selects --sequence-packing-scheduler dp_balanced, unless --varlen-sbhd-validation"),
    switch("--varlen-sbhd-validation", "varlen_sbhd_validation", since="e8fef4ebb23e"),
    switch("--fp16", "fp16"),
    switch("--bf16", "bf16"),
)

#: The launcher's flags (torchrun; ``--world-size`` is megatron-ga's way to give the world outright).
LAUNCHER_OPTIONS = (
    Option(flag="--nnodes", dest="nnodes", type=str, help="torchrun nodes: N, or an elastic range MIN:MAX"),
    Option(flag="--nproc-per-node", dest="nproc_per_node", type=str, help="torchrun ranks per node"),
    Option(flag="--world-size", dest="world_size", help="the number of ranks, in place of --nnodes x --nproc-per-node"),
)

#: Flags people write that no tested Megatron parser defines (Megatron stops with "unrecognized
#: arguments"), with what to give instead. Our own ledger and schedule commands accept the first one.
NOT_MEGATRON = {
    "--virtual-pipeline-model-parallel-size": (
        "Megatron sets the virtual pipeline size from --num-virtual-stages-per-pipeline-rank N, from "
        "--num-layers-per-virtual-pipeline-stage N (with --num-layers), or from the stages of "
        "--pipeline-model-parallel-layout"
    ),
}
VIRTUAL_PIPELINE = Option(
    flag="--virtual-pipeline-model-parallel-size", dest="virtual_pipeline_model_parallel_size",
    help="model chunks per pipeline rank (VPP), as Megatron's args name it",
)

#: Megatron's and the launcher's flags by argparse destination.
BY_DEST: dict[str, Option] = {
    option.dest: option for option in (*MEGATRON_OPTIONS, *COVERED_OPTIONS, *LAUNCHER_OPTIONS)
}
