"""Megatron's and the launcher's flags that megatron-ga-ext reads, each declared once, as the
parsers spell them. Pure Python. The ``--ga-*`` flags (ours) are declared in ``config/flags.py``.

Which flags exist is Megatron-LM's own parser at each tested release and commit (core_v0.16.1 ...
main): tests/test_megatron_flags_upstream.py builds each snapshot's parser and checks every
declaration (``since`` included) and :data:`NOT_MEGATRON` against it.
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
    "RULE_OPTIONS",
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
    """Values after the flag: 0 for a switch, 3 for ``--rampup-batch-size``, ``"+"`` for one or
    more."""
    default: Any = None
    choices: tuple[str, ...] = ()
    negatable: bool = False
    """A switch that also has ``--no-<name>`` (argparse's BooleanOptionalAction)."""
    help: str = ""
    since: str | None = None
    """The first tested Megatron source whose parser defines the flag, by its ref in
    compat.UPSTREAM: a release tag (``core_v0.18.2``) or a main-branch commit (``e8fef4ebb23e``,
    after every release) (None: all of them)."""

    @property
    def spellings(self) -> tuple[str, ...]:
        """The flag, and ``--no-<name>`` for a negatable switch."""
        return (self.flag, "--no-" + self.flag[2:]) if self.negatable else (self.flag,)


def switch(flag: str, dest: str, help: str = "", **kwargs: Any) -> Option:
    """A flag without a value (``store_true``, or BooleanOptionalAction when ``negatable``)."""
    return Option(
        flag=flag,
        dest=dest,
        type=bool,
        nargs=0,
        default=kwargs.pop("default", False),
        help=help,
        **kwargs,
    )


STEP_SCHEDULE = Option(
    flag="--step-batch-size-schedule",
    dest="step_batch_size_schedule",
    type=str,
    since="core_v0.18.2",
    help="'THRESHOLD:GBS ...' (thresholds in tokens when --seq-length is set), validated up "
    "front by megatron_ga_ext; "
    "add_args adds it on releases that lack it (0.16, 0.17: the backport).",
)

# -- Megatron's flags that decide the batch arithmetic, as its parser spells them ------------------

# fmt: off
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
# fmt: on

# -- Megatron's flags that only check's rules of validate_args read (launch/rules_*.py)
# ------------------ Not the ledger's (they decide no size of the batch): megatron-ga ledger does
# not take them.

# fmt: off
RULE_OPTIONS = (
    Option(flag="--transformer-impl", dest="transformer_impl", type=str, default="transformer_engine"),
    Option(flag="--eval-micro-batch-size", dest="eval_micro_batch_size", since="core_v0.18.2"),
    Option(flag="--eval-global-batch-size", dest="eval_global_batch_size", since="core_v0.18.2"),
    Option(flag="--batch-size", dest="batch_size", help="removed: validate_args refuses it"),
    Option(flag="--hierarchical-context-parallel-sizes", dest="hierarchical_context_parallel_sizes", nargs="+"),
    Option(flag="--cp-comm-type", dest="cp_comm_type", type=str, nargs="+", default=("p2p",)),
    Option(flag="--max-position-embeddings", dest="max_position_embeddings"),
    Option(flag="--num-attention-heads", dest="num_attention_heads"),
    Option(flag="--num-query-groups", dest="num_query_groups"),
    switch("--group-query-attention", "group_query_attention"),
    Option(flag="--no-overlap-p2p-communication", dest="overlap_p2p_comm", type=bool, nargs=0, default=True),
    Option(flag="--ckpt-format", dest="ckpt_format", type=str, default="torch_dist"),
    Option(flag="--optimizer", dest="optimizer", type=str, default="adam"),
    Option(flag="--dataloader-type", dest="dataloader_type", type=str),
    switch("--tp-comm-overlap", "tp_comm_overlap"),
    Option(flag="--disable-bias-linear", dest="add_bias_linear", type=bool, nargs=0, default=True),
    Option(flag="--position-embedding-type", dest="position_embedding_type", type=str, default="learned_absolute"),
)
# fmt: on

# -- Megatron's flags on the loss, gradient, step or schedule path, beyond the ones above
# -------------- Each is classified by the coverage table (config/coverage/). Defaults are
# Megatron's, so a launch line that leaves a flag out reads as Megatron runs it.

# fmt: off
COVERED_OPTIONS = (
    Option(flag="--cuda-graph-impl", dest="cuda_graph_impl", type=str, default="none",
           choices=("none", "local", "transformer_engine", "full_iteration"),
           help="full_iteration is a choice from core_v0.18.2 on; before, --cuda-graph-impl "
               "local with "
           "--cuda-graph-scope full_iteration"),
    Option(flag="--cuda-graph-scope", dest="cuda_graph_scope", type=str, nargs="+",
           help="argparse dest cuda_graph_scope up to 0.17, cuda_graph_scope_deprecated from "
               "0.18 (moved into "
           "cuda_graph_modules, its full_iteration into --cuda-graph-impl full_iteration)"),
    Option(flag="--cuda-graph-modules", dest="cuda_graph_modules", type=str, nargs="+", since="core_v0.18.2"),
    switch("--enable-cuda-graph", "enable_cuda_graph", help="deprecated: --cuda-graph-impl local"),
    switch("--external-cuda-graph", "external_cuda_graph", help="deprecated: --cuda-graph-impl "
        "transformer_engine"),
    switch("--optimizer-cuda-graph", "optimizer_cuda_graph", since="core_v0.17.1"),
    switch("--overlap-moe-expert-parallel-comm", "overlap_moe_expert_parallel_comm"),
    switch("--delay-wgrad-compute", "delay_wgrad_compute"),
    Option(flag="--rerun-mode", dest="rerun_mode", type=str, default="validate_results",
           choices=("disabled", "validate_results", "report_stats")),
    # Megatron's parser has only the negative spelling (store_false, dest default True): Launch.on()
    # of this flag reads as the value of check_for_nan_in_loss_and_grad (True unless given).
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
           choices=("gated_delta_net", "dsa", "gdn", "gdn2"), help="gdn and gdn2 only on some "
               "main-branch commits"),
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
           help="selects --sequence-packing-scheduler dp_balanced, unless "
               "--varlen-sbhd-validation"),
    switch("--varlen-sbhd-validation", "varlen_sbhd_validation", since="e8fef4ebb23e"),
    switch("--fp16", "fp16"),
    switch("--bf16", "bf16"),
    # parallel layouts and weight sharding
    Option(flag="--tensor-parallel-num-weight-shards", dest="tensor_parallel_num_weight_shards", since="core_v0.19.0"),
    Option(flag="--expert-tensor-parallel-num-weight-shards",
           dest="expert_tensor_parallel_num_weight_shards", since="core_v0.19.0"),
    switch("--gtp-remat-reduce-scatter-with-fp32-accumulation",
           "gtp_remat_reduce_scatter_with_fp32_accumulation", since="9f3fe8c925fb"),
    Option(flag="--gtp-remat-opt-in-modules",
           dest="gtp_remat_opt_in_modules", type=str, nargs="+", default=(), since="dd8c825b3ad5"),
    switch("--gtp-remat-nccl-ub", "gtp_remat_nccl_ub", since="d98e8a64ddf3"),
    switch("--gtp-expert-remat-nccl-ub", "gtp_expert_remat_nccl_ub", since="d98e8a64ddf3"),
    switch("--sequence-parallel", "sequence_parallel"),
    switch("--qk-layernorm", "qk_layernorm"),
    switch("--untie-embeddings-and-output-weights", "untie_embeddings_and_output_weights"),
    Option(flag="--max-seqlen-per-dp-cp-rank", dest="max_seqlen_per_dp_cp_rank"),
    switch("--fake-process-group", "fake_process_group"),
    # the gradient's accumulation and reduction
    switch("--grad-reduce-in-bf16", "grad_reduce_in_bf16"),
    switch("--accumulate-allreduce-grads-in-fp32", "accumulate_allreduce_grads_in_fp32"),
    switch("--ddp-reduce-scatter-with-fp32-accumulation", "ddp_reduce_scatter_with_fp32_accumulation"),
    Option(flag="--ddp-param-name-patterns-for-fp32-local-accumulation",
           dest="ddp_param_name_patterns_for_fp32_local_accumulation", type=str, nargs="+", default=(),
           since="core_v0.17.1"),
    switch("--use-precision-aware-optimizer", "use_precision_aware_optimizer"),
    Option(flag="--main-grads-dtype", dest="main_grads_dtype", type=str, default="fp32"),
    Option(flag="--ddp-bucket-size", dest="ddp_bucket_size"),
    Option(flag="--ddp-num-buckets", dest="ddp_num_buckets"),
    switch("--ddp-pad-buckets-for-high-nccl-busbw", "ddp_pad_buckets_for_high_nccl_busbw"),
    Option(flag="--no-align-grad-reduce", dest="align_grad_reduce", type=bool, nargs=0, default=True),
    # store_false spelled without --no-: a launch line's reading takes it as given, not as off (the
    # args have it off)
    Option(flag="--disable-align-grad-reduce",
           dest="align_grad_reduce", type=bool, nargs=0, default=True, since="core_v0.17.1"),
    Option(flag="--num-distributed-optimizer-instances", dest="num_distributed_optimizer_instances", default=1),
    Option(flag="--no-gradient-accumulation-fusion",
           dest="gradient_accumulation_fusion", type=bool, nargs=0, default=True),
    switch("--defer-embedding-wgrad-compute", "defer_embedding_wgrad_compute"),
    Option(flag="--wgrad-deferral-limit", dest="wgrad_deferral_limit", default=0),
    switch("--overlap-dispatch-backward-with-experts-wgrad",
           "overlap_dispatch_backward_with_experts_wgrad", since="core_v0.18.2"),
    switch("--overlap-param-gather-with-optimizer-step", "overlap_param_gather_with_optimizer_step"),
    Option(flag="--no-align-param-gather", dest="align_param_gather", type=bool, nargs=0, default=True),
    # store_false spelled without --no- (read as a switch; no row reads its value)
    Option(flag="--torch-fsdp2-no-reshard-after-forward",
           dest="torch_fsdp2_reshard_after_forward", type=bool, nargs=0, default=True),
    # Megatron-FSDP's options
    Option(flag="--data-parallel-sharding-strategy",
           dest="data_parallel_sharding_strategy", type=str, default="optim_grads_params"),
    Option(flag="--outer-dp-sharding-strategy", dest="outer_dp_sharding_strategy", type=str, default="no_shard"),
    switch("--enable-full-sharding-in-hsdp", "enable_full_sharding_in_hsdp"),
    Option(flag="--megatron-fsdp-grad-comm-dtype",
           dest="megatron_fsdp_grad_comm_dtype", type=str, default="auto", since="core_v0.17.1"),
    Option(flag="--megatron-fsdp-main-grads-dtype",
           dest="megatron_fsdp_main_grads_dtype", type=str, default="auto", since="core_v0.17.1"),
    Option(flag="--megatron-fsdp-main-params-dtype",
           dest="megatron_fsdp_main_params_dtype", type=str, default="fp32", since="core_v0.17.1"),
    switch("--fsdp-double-buffer", "fsdp_double_buffer"),
    switch("--fsdp-manual-registration", "fsdp_manual_registration"),
    Option(flag="--suggested-communication-unit-size", dest="suggested_communication_unit_size"),
    switch("--keep-fp8-transpose-cache", "keep_fp8_transpose_cache"),
    switch("--init-model-with-meta-device", "init_model_with_meta_device"),
    Option(flag="--megatron-fsdp-version", dest="megatron_fsdp_version", default=1, since="9f3fe8c925fb"),
    switch("--megatron-fsdp-enable-fine-grained-param-gather",
           "megatron_fsdp_enable_fine_grained_param_gather", since="core_v0.18.2"),
    switch("--fsdp-db-use-persist-buf-on-alloc-fail", "fsdp_db_use_persist_buf_on_alloc_fail", since="core_v0.19.0"),
    switch("--megatron-fsdp-max-pool-double-buffer", "megatron_fsdp_max_pool_double_buffer", since="core_v0.19.0"),
    Option(flag="--no-gradient-reduce-div-fusion", dest="gradient_reduce_div_fusion", type=bool, nargs=0, default=True),
    # loss scaling
    Option(flag="--loss-scale", dest="loss_scale", type=float),
    Option(flag="--initial-loss-scale", dest="initial_loss_scale", type=float, default=2.0**32),
    Option(flag="--min-loss-scale", dest="min_loss_scale", type=float, default=1.0),
    Option(flag="--loss-scale-window", dest="loss_scale_window", type=float, default=1000),
    Option(flag="--hysteresis", dest="hysteresis", default=2),
    # loss terms and the loss mask
    Option(flag="--moe-aux-loss-coeff", dest="moe_aux_loss_coeff", type=float, nargs="+", default=0.0),
    Option(flag="--mtp-loss-scaling-factor", dest="mtp_loss_scaling_factor", type=float, default=0.1),
    Option(flag="--dsa-indexer-loss-coeff", dest="dsa_indexer_loss_coeff", type=float),
    switch("--dsa-indexer-use-sparse-loss", "dsa_indexer_use_sparse_loss"),
    switch("--eod-mask-loss", "eod_mask_loss"),
    switch("--allow-ambiguous-pad-tokens", "allow_ambiguous_pad_tokens"),
    Option(flag="--logits-load-dir", dest="logits_load_dir", type=str, since="core_v0.19.0"),
    Option(flag="--logits-load-kd-loss-alpha",
           dest="logits_load_kd_loss_alpha", type=float, default=1.0, since="core_v0.19.0"),
    switch("--logits-load-ignore-errors", "logits_load_ignore_errors", since="core_v0.19.0"),
    # MoE routing statistics, dispatch and overlap
    switch("--moe-router-enable-expert-bias", "moe_router_enable_expert_bias"),
    Option(flag="--moe-router-bias-update-rate", dest="moe_router_bias_update_rate", type=float, default=0.001),
    Option(flag="--moe-router-quantile-balancing-ema",
           dest="moe_router_quantile_balancing_ema", type=float, default=0.0, since="core_v0.19.0"),
    switch("--moe-router-fusion", "moe_router_fusion"),
    Option(flag="--moe-flex-dispatcher-backend", dest="moe_flex_dispatcher_backend", type=str, default="deepep"),
    switch("--moe-enable-deepep", "moe_enable_deepep"),
    Option(flag="--moe-deepep-num-sms", dest="moe_deepep_num_sms"),
    Option(flag="--moe-hybridep-num-sms", dest="moe_hybridep_num_sms"),
    Option(flag="--moe-flex-dispatcher-num-sms", dest="moe_flex_dispatcher_num_sms", since="core_v0.19.0"),
    Option(flag="--moe-hybridep-num-blocks-permute", dest="moe_hybridep_num_blocks_permute", since="core_v0.17.1"),
    Option(flag="--moe-hybridep-num-blocks-unpermute", dest="moe_hybridep_num_blocks_unpermute", since="core_v0.17.1"),
    Option(flag="--moe-hybridep-num-sms-preprocessing",
           dest="moe_hybridep_num_sms_preprocessing", default=108, since="core_v0.18.2"),
    switch("--moe-hybridep-pad-uneven-dispatch-inputs",
           "moe_hybridep_pad_uneven_dispatch_inputs", since="core_v0.19.0"),
    switch("--moe-permute-fusion-into-hybridep", "moe_permute_fusion_into_hybridep", since="core_v0.17.1"),
    switch("--moe-ncclep-zero-copy", "moe_ncclep_zero_copy", since="core_v0.19.0"),
    Option(flag="--moe-dispatch-fwd-dtype",
           dest="moe_dispatch_fwd_dtype", type=str, default="bf16", since="d98e8a64ddf3"),
    Option(flag="--moe-combine-bwd-dtype",
           dest="moe_combine_bwd_dtype", type=str, default="bf16", since="d98e8a64ddf3"),
    switch("--moe-paged-stash", "moe_paged_stash", since="core_v0.18.2"),
    Option(flag="--moe-paged-stash-page-size", dest="moe_paged_stash_page_size", default=64, since="core_v0.18.2"),
    Option(flag="--moe-paged-stash-buffer-size-factor-cuda",
           dest="moe_paged_stash_buffer_size_factor_cuda", type=float, default=1.1, since="core_v0.18.2"),
    Option(flag="--moe-paged-stash-buffer-size-factor-cpu",
           dest="moe_paged_stash_buffer_size_factor_cpu", type=float, default=0.0, since="core_v0.18.2"),
    switch("--ep-overlap-early-attn-memory-release", "ep_overlap_early_attn_memory_release"),
    switch("--high-priority-a2a-comm-stream", "high_priority_a2a_comm_stream", since="core_v0.18.2"),
    Option(flag="--cuda-graph-warmup-steps", dest="cuda_graph_warmup_steps", default=3),
    # checkpoints and resume
    Option(flag="--save", dest="save", type=str),
    Option(flag="--load", dest="load", type=str),
    Option(flag="--save-interval", dest="save_interval"),
    Option(flag="--persistent-save-interval", dest="save_interval"),
    Option(flag="--ckpt-step", dest="ckpt_step"),
    Option(flag="--non-persistent-save-interval", dest="non_persistent_save_interval"),
    Option(flag="--non-persistent-ckpt-type", dest="non_persistent_ckpt_type", type=str),
    Option(flag="--non-persistent-global-ckpt-dir", dest="non_persistent_global_ckpt_dir", type=str),
    Option(flag="--non-persistent-local-ckpt-dir", dest="non_persistent_local_ckpt_dir", type=str),
    Option(flag="--non-persistent-local-ckpt-algo",
           dest="non_persistent_local_ckpt_algo", type=str, default="fully_parallel"),
    switch("--finetune", "finetune"),
    Option(flag="--pretrained-checkpoint", dest="pretrained_checkpoint", type=str),
    switch("--use-checkpoint-args", "use_checkpoint_args"),
    switch("--use-mp-args-from-checkpoint-args", "use_mp_args_from_checkpoint_args"),
    Option(flag="--override-ckpt-iteration", dest="override_ckpt_iteration", since="core_v0.19.0"),
    switch("--freeze-all-layers", "freeze_all_layers", since="core_v0.19.0"),
    switch("--inprocess-restart", "inprocess_restart"),
    # the learning-rate schedule's lengths and the data's phases
    Option(flag="--lr-decay-iters", dest="lr_decay_iters"),
    Option(flag="--lr-warmup-iters", dest="lr_warmup_iters", default=0),
    Option(flag="--lr-wsd-decay-iters", dest="lr_wsd_decay_iters"),
    Option(flag="--lr-decay-samples", dest="lr_decay_samples"),
    Option(flag="--lr-warmup-samples", dest="lr_warmup_samples", default=0),
    Option(flag="--lr-wsd-decay-samples", dest="lr_wsd_decay_samples"),
    Option(flag="--lr-warmup-fraction", dest="lr_warmup_fraction", type=float),
    Option(flag="--lr-decay-style", dest="lr_decay_style", type=str, default="linear"),
    Option(flag="--phase-transition-iterations", dest="phase_transition_iterations", type=str),
    # Megatron's rerun state machine
    switch("--check-for-spiky-loss", "check_for_spiky_loss"),
    switch("--check-for-large-grads", "check_for_large_grads"),
    Option(flag="--error-injection-rate", dest="error_injection_rate", default=0),
    Option(flag="--error-injection-type", dest="error_injection_type", type=str, default="transient_error"),
    # the RL loop (GRPO)
    Option(flag="--grpo-prompts-per-step", dest="grpo_prompts_per_step", default=32),
    Option(flag="--grpo-group-size", dest="grpo_group_size", default=2),
    Option(flag="--grpo-iterations", dest="grpo_iterations", default=2),
    Option(flag="--grpo-clamp-eps-lower", dest="grpo_clamp_eps_lower", type=float, default=0.01),
    Option(flag="--grpo-clamp-eps-upper", dest="grpo_clamp_eps_upper", type=float, default=0.01),
    Option(flag="--grpo-kl-beta", dest="grpo_kl_beta", type=float, default=0.001),
    Option(flag="--grpo-entropy-term-weight", dest="grpo_entropy_term_weight", type=float, default=0.0),
    switch("--grpo-filter-groups-with-same-reward", "grpo_filter_groups_with_same_reward"),
    Option(flag="--rl-importance-sampling-truncation-coef", dest="rl_importance_sampling_truncation_coef", type=float),
    switch("--rl-inference-logprobs-is-correction", "rl_inference_logprobs_is_correction", negatable=True),
    switch("--rl-skip-bos-token", "rl_skip_bos_token", negatable=True),
    switch("--rl-partial-rollouts", "rl_partial_rollouts", negatable=True),
    Option(flag="--rl-generation-lag", dest="rl_generation_lag", type=float, since="core_v0.19.0"),
    Option(flag="--rl-consumption-granularity",
           dest="rl_consumption_granularity", type=str, default="B", since="core_v0.19.0"),
    Option(flag="--rl-submission-granularity",
           dest="rl_submission_granularity", type=str, default="B", since="core_v0.19.0"),
    Option(flag="--rl-max-inflight-requests", dest="rl_max_inflight_requests", since="dd8c825b3ad5"),
    Option(flag="--rl-sequence-packing-algo", dest="rl_sequence_packing_algo", type=str, default="fifo"),
    Option(flag="--rl-sequence-packing-max-sequences-per-bin",
           dest="rl_sequence_packing_max_sequences_per_bin", default=50),
)
# fmt: on

#: The launcher's flags (torchrun; ``--world-size`` is megatron-ga's way to give the world
#: outright).
LAUNCHER_OPTIONS = (
    Option(
        flag="--nnodes",
        dest="nnodes",
        type=str,
        help="torchrun nodes: N, or an elastic range MIN:MAX",
    ),
    Option(
        flag="--nproc-per-node", dest="nproc_per_node", type=str, help="torchrun ranks per node"
    ),
    Option(
        flag="--world-size",
        dest="world_size",
        help="the number of ranks, in place of --nnodes x --nproc-per-node",
    ),
)

#: Flags people write that no tested Megatron parser defines (Megatron stops with "unrecognized
#: arguments"), with what to give instead. Our own ledger and schedule commands accept the first
#: one.
NOT_MEGATRON = {
    "--virtual-pipeline-model-parallel-size": (
        "Megatron sets the virtual pipeline size from --num-virtual-stages-per-pipeline-rank N, "
        "from --num-layers-per-virtual-pipeline-stage N (with --num-layers), or from the "
        "stages of --pipeline-model-parallel-layout"
    ),
}
VIRTUAL_PIPELINE = Option(
    flag="--virtual-pipeline-model-parallel-size",
    dest="virtual_pipeline_model_parallel_size",
    help="model chunks per pipeline rank (VPP), as Megatron's args name it",
)

#: Megatron's and the launcher's flags by argparse destination.
BY_DEST: dict[str, Option] = {
    option.dest: option
    for option in (*MEGATRON_OPTIONS, *RULE_OPTIONS, *COVERED_OPTIONS, *LAUNCHER_OPTIONS)
}
