"""The coverage table: Megatron's flags on the loss, gradient, step or schedule path, and what the extension does
under each. Pure Python.

A row is a flag, where it matters with a value, the loss mode or another ``--ga-*`` flag, and one behaviour:

* ``supported``: every check of every step runs, and a test proves it (Megatron-LM's own loop in tests/e2e, a
  ``megatron-ga verify`` layout);
* ``limited``: it runs, with the limit stated (in the start-up log, and by ``megatron-ga check`` as a note);
* ``refused``: install() stops at start-up with a :class:`CoverageError` and ``check`` reports a problem, naming
  the flag, why the extension cannot keep its guarantee there, and what to do instead.

Each row was decided by reading Megatron-LM at the tested sources (core_v0.16.1 ... main): the training loop's
wrappers (``FullCudaGraphWrapper``, ``OptimizerCudaGraphWrapper``), pretrain_gpt's ``build_schedule_plan`` path,
the router and the data-parallel wrappers. :func:`verdict` applies the table to one launch; :func:`coverage_doc`
renders it (docs/coverage.md, written by ``make docs``); tests/test_coverage.py holds every row to its test or its refusal.

Every other flag of a tested parser is off the path, with its reason, in config/off_path.py. :func:`unclassified`
lists the flags of a parser that neither names (tests/test_coverage_complete.py requires none for every tested source;
``make regress`` lists them for a checkout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Mapping

from megatron_ga_ext.config.flags import BY_DEST, CHECKS, CONVERT_RAMPUP, LOSS_REDUCTION, OPTIONS, ZERO_TOKEN_POLICY
from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.config.off_path import OFF_PATH, THEMES
from megatron_ga_ext.core.megatron_flags import COVERED_OPTIONS, MEGATRON_OPTIONS
from megatron_ga_ext.errors import CoverageError
from megatron_ga_ext.logs import get_logger

__all__ = [
    "ROWS", "Proof", "Row", "Setting", "Verdict", "coverage_doc", "coverage_table", "enforce", "named_by_rows",
    "off_path_table", "unclassified", "verdict",
]

logger = get_logger(__name__)

Support = Literal["supported", "limited", "refused"]

#: Where 0.18 and later parse --cuda-graph-scope (validate_args moves it into cuda_graph_modules, and a
#: full_iteration scope into --cuda-graph-impl full_iteration).
SCOPE_DEPRECATED = "cuda_graph_scope_deprecated"
#: Megatron's args the rows read: argparse destinations.
READ = (*dict.fromkeys(o.dest for o in (*MEGATRON_OPTIONS, *COVERED_OPTIONS)), SCOPE_DEPRECATED)


@dataclass(frozen=True)
class Setting:
    """One launch as the rows see it: Megatron's values by argparse destination (absent: Megatron's default) and
    the extension's settings."""

    values: Mapping[str, Any] = field(default_factory=dict)
    loss_reduction: str = LOSS_REDUCTION.default
    zero_token_policy: str = ZERO_TOKEN_POLICY.default
    checks: str = CHECKS.default
    convert_rampup: bool = CONVERT_RAMPUP.default

    @classmethod
    def of(cls, args: Any, config: GAConfig) -> "Setting":
        """From Megatron's parsed ``args`` (None: a megatron-core loop without them) and the installed ``config``."""
        values = {} if args is None else {dest: getattr(args, dest) for dest in READ if hasattr(args, dest)}
        return cls(values, config.loss_reduction, config.zero_token_policy, config.checks, config.convert_rampup)

    def value(self, dest: str) -> Any:
        if dest in self.values:
            return self.values[dest]
        return BY_DEST[dest].default if dest in BY_DEST else None

    def names(self, dest: str) -> list[str]:
        """A value as a list of names: an enum by its name (0.16's CudaGraphScope), one string as a list of one."""
        value = self.value(dest)
        if value is None:
            return []
        items = value if isinstance(value, (list, tuple)) else [value]
        return [str(getattr(item, "name", item)) for item in items]

    def on(self, dest: str) -> bool:
        return bool(self.value(dest))

    def number(self, dest: str) -> int:
        """An integer value (a launch line gives text); 0 where absent or not a number."""
        try:
            return int(self.value(dest) or 0)
        except (TypeError, ValueError):
            return 0

    @property
    def token(self) -> bool:
        return self.loss_reduction == "token"


@dataclass(frozen=True, kw_only=True)
class Proof:
    """A test that runs the row: a pytest node id, and the row of that test's table where it checks many."""

    test: str
    case: str = ""

    def __str__(self) -> str:
        return f"`{self.test}`" + (f" ({self.case})" if self.case else "")


@dataclass(frozen=True, kw_only=True)
class Row:
    """One row of the table; see the module docstring."""

    id: str
    """A short name: the parametrize id of the row's tests."""
    flags: tuple[str, ...]
    """The flags of Megatron's parser the row is about (a test checks each against the parsers)."""
    given: str
    """The flags and values as the table and the messages name them."""
    when: str = ""
    """The condition beyond the flags: the loss mode, another ``--ga-*`` flag ("" for any)."""
    support: Support
    text: str
    """supported: what holds; limited: the limit; refused: why the guarantee cannot hold."""
    instead: str = ""
    """refused: what to do instead."""
    proofs: tuple[Proof, ...] = ()
    replays: bool = False
    """The launch's iterations replay a captured graph without the extension's Python hooks, by design: the
    per-iteration liveness check (integration/liveness.py) does not count them."""
    applies: Callable[[Setting], bool]

    @property
    def case(self) -> str:
        return self.given + (f" {self.when}" if self.when else "")

    def message(self) -> str:
        if self.support == "refused":
            return f"megatron-ga-ext refuses {self.case}: {self.text} {self.instead}"
        return f"{self.case}: {self.text}"


# -- what the rows look at -------------------------------------------------------------------------


def _moe(s: Setting) -> bool:
    """MoE layers: --num-experts, or an E (MoE) layer in a hybrid model's pattern."""
    patterns = s.names("hybrid_override_pattern") + s.names("hybrid_layer_pattern")
    return s.number("num_experts") > 0 or any("E" in p for p in patterns)


def _hybrid(s: Setting) -> bool:
    return s.on("is_hybrid_model") or bool(s.names("hybrid_override_pattern") + s.names("hybrid_layer_pattern"))


def _full_iteration(s: Setting) -> bool:
    """A full-iteration CUDA graph: --cuda-graph-impl full_iteration (0.18+, where a full_iteration scope or module
    migrates to it), or a full_iteration scope with the local implementation (0.16, 0.17)."""
    impl = s.value("cuda_graph_impl")
    scopes = s.names("cuda_graph_scope") + s.names(SCOPE_DEPRECATED) + s.names("cuda_graph_modules")
    return impl == "full_iteration" or ("full_iteration" in scopes and impl != "transformer_engine")


def _layer_graphs(s: Setting) -> bool:
    graphs = s.value("cuda_graph_impl") in ("local", "transformer_engine") or s.on("enable_cuda_graph") \
        or s.on("external_cuda_graph")
    return graphs and not _full_iteration(s)


def _batch_schedule(s: Setting) -> bool:
    """The global batch size changes during the run: a step schedule, or a rampup (0.16 and 0.17 run their own;
    --ga-convert-rampup runs it on every release)."""
    return bool(s.value("step_batch_size_schedule") or s.value("rampup_batch_size"))


def _balancing(*kinds: str) -> Callable[[Setting], bool]:
    return lambda s: _moe(s) and any(kind in s.names("moe_router_load_balancing_type") for kind in kinds)


def _quantile(s: Setting) -> bool:
    return _balancing("quantile_balancing")(s)


def _quantile_unmasked_losses(s: Setting) -> bool:
    """Under quantile balancing the model routes without a padding mask: a z-loss or an aux-loss type in the same
    list then counts padding positions."""
    aux = {"aux_loss", "seq_aux_loss", "global_aux_loss"} & set(s.names("moe_router_load_balancing_type"))
    return bool(s.value("moe_z_loss_coeff")) or bool(aux)


def _nan_check_by_megatron(s: Setting) -> bool:
    return s.on("check_for_nan_in_loss_and_grad") and s.value("rerun_mode") == "validate_results"


def _token(check: Callable[[Setting], bool]) -> Callable[[Setting], bool]:
    return lambda s: s.token and check(s)


def _microbatch(check: Callable[[Setting], bool]) -> Callable[[Setting], bool]:
    return lambda s: not s.token and check(s)


def _on(dest: str) -> Callable[[Setting], bool]:
    return lambda s: s.on(dest)


def _above_one(dest: str) -> Callable[[Setting], bool]:
    return lambda s: s.number(dest) > 1


def _given(*dests: str) -> Callable[[Setting], bool]:
    """Any of ``dests`` set otherwise than Megatron's default."""
    return lambda s: any(s.value(dest) != BY_DEST[dest].default for dest in dests)


def _gtp(s: Setting) -> bool:
    """GTP weight rematerialization: more weight shards than tensor-parallel ranks (Megatron's gtp_weight_remat_size
    = shards / TP > 1), for the dense layers or the experts."""
    tp = max(s.number("tensor_model_parallel_size"), 1)
    expert_tp = s.number("expert_tensor_parallel_size") or tp
    return (s.number("tensor_parallel_num_weight_shards") > tp
            or s.number("expert_tensor_parallel_num_weight_shards") > expert_tp)


def _pipeline_tied(untied: bool) -> Callable[[Setting], bool]:
    return lambda s: (s.number("pipeline_model_parallel_size") > 1
                      and s.on("untie_embeddings_and_output_weights") == untied)


# -- the tests that prove rows ----------------------------------------------------------------------

E2E = "tests/e2e/test_pretrain_gpt.py::"
MOE_MTP = "tests/e2e/test_moe_mtp.py::"
FAULTS = "tests/e2e/test_faults.py::"
GPU_GRAPHS = "tests/gpu/test_cuda_graphs.py::"
VERIFY = "tests/test_verify.py::test_verify_command_end_to_end"
PACKING = "tests/test_packing_scheduler.py::test_upstream_train_step_with_the_packing_scheduler_through_install"
PACKING_E2E = "tests/e2e/test_packing.py::test_pretrain_gpt_trains_the_schedulers_packed_steps"
PACKING_FAULT = "tests/e2e/test_packing.py::test_a_pp_multiplied_packed_count_is_stopped"
TOKEN_LOOP = (Proof(test=E2E + "test_token_mode_equals_upstream_per_token_loss[dp2]"),
              Proof(test=E2E + "test_token_mode_equals_upstream_per_token_loss[pp2dp2]"))
MOE_LOOP = (Proof(test=MOE_MTP + "test_moe_token_mode_counts_loss_tokens[EP 1 allgather]"),
            Proof(test=MOE_MTP + "test_moe_token_mode_counts_loss_tokens[EP 2 alltoall]"))


def _verify(*layouts: str) -> tuple[Proof, ...]:
    """Rows of ``megatron-ga verify``: each layout in both modes against an unpartitioned reference."""
    return tuple(Proof(test=VERIFY, case=layout) for layout in layouts)


NO_GPU = "no test here runs it (it needs a GPU)"
ON_GPU = "proven by a GPU-marked test that CPU CI does not run"
NOT_YET = "no test runs it yet"
RESUME = (Proof(test="tests/e2e/test_resume.py::test_a_resume_at_every_step_boundary_runs_the_uninterrupted_steps"),
          Proof(test="tests/e2e/test_noise_scale.py::test_a_resume_continues_the_emas"),
          Proof(test="tests/e2e/test_batch_warmup.py::test_a_resume_replays_the_decisions"))
INSTEAD_OF_1F1B = (
    "Drop --overlap-moe-expert-parallel-comm (and --delay-wgrad-compute), or train with --ga-loss-reduction microbatch "
    "(without --calculate-per-token-loss).")

#: Megatron's batch and layout flags the extension reads itself (core/megatron_flags.py), beyond those other rows name.
BATCH_ARITHMETIC = (
    "--micro-batch-size", "--global-batch-size", "--decrease-batch-size-if-needed", "--seq-length",
    "--encoder-seq-length", "--decoder-seq-length", "--expert-tensor-parallel-size", "--num-experts", "--num-layers",
    "--decoder-num-layers",
    "--microbatch-group-size-per-virtual-pipeline-stage", "--pipeline-model-parallel-layout",
    "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
    "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split", "--train-iters",
    "--train-samples")
#: The GRPO loop's loss and batch flags (the rl-step row).
GRPO = (
    "--grpo-prompts-per-step", "--grpo-group-size", "--grpo-iterations", "--grpo-clamp-eps-lower",
    "--grpo-clamp-eps-upper", "--grpo-kl-beta", "--grpo-entropy-term-weight", "--grpo-filter-groups-with-same-reward",
    "--rl-importance-sampling-truncation-coef", "--rl-inference-logprobs-is-correction", "--rl-skip-bos-token",
    "--rl-partial-rollouts", "--rl-generation-lag", "--rl-consumption-granularity", "--rl-submission-granularity",
    "--rl-max-inflight-requests")
#: The flex dispatcher's backends and their options (the dispatcher-flex row).
FLEX_DISPATCHER = (
    "--moe-flex-dispatcher-backend", "--moe-enable-deepep", "--moe-deepep-num-sms", "--moe-hybridep-num-sms",
    "--moe-flex-dispatcher-num-sms", "--moe-hybridep-num-blocks-permute", "--moe-hybridep-num-blocks-unpermute",
    "--moe-hybridep-num-sms-preprocessing", "--moe-hybridep-pad-uneven-dispatch-inputs",
    "--moe-permute-fusion-into-hybridep", "--moe-ncclep-zero-copy", "--moe-dispatch-fwd-dtype",
    "--moe-combine-bwd-dtype")
#: Megatron-FSDP's sharding, buffer and precision options (the megatron-fsdp row).
MEGATRON_FSDP = (
    "--data-parallel-sharding-strategy", "--outer-dp-sharding-strategy", "--enable-full-sharding-in-hsdp",
    "--megatron-fsdp-grad-comm-dtype", "--megatron-fsdp-main-grads-dtype", "--megatron-fsdp-main-params-dtype",
    "--fsdp-double-buffer", "--fsdp-manual-registration", "--suggested-communication-unit-size",
    "--keep-fp8-transpose-cache", "--init-model-with-meta-device", "--megatron-fsdp-version",
    "--megatron-fsdp-enable-fine-grained-param-gather", "--fsdp-db-use-persist-buf-on-alloc-fail",
    "--megatron-fsdp-max-pool-double-buffer", "--no-gradient-reduce-div-fusion")

FULL_ITERATION = "a full-iteration CUDA graph (--cuda-graph-impl full_iteration, or --cuda-graph-scope full_iteration)"

# -- the table --------------------------------------------------------------------------------------

ROWS: tuple[Row, ...] = (
    # CUDA graphs
    Row(id="full-iteration-graph-token", flags=("--cuda-graph-impl", "--cuda-graph-scope", "--cuda-graph-modules"),
        given=FULL_ITERATION, when="in token mode", support="refused",
        text="after capture, Megatron's FullCudaGraphWrapper replays the captured forward/backward and none of the "
        "extension's Python runs again: the loss contract, the non-finite, negative and unchecked token counts, the "
        "zero-token error or skip, the --ga-checks async verdict and the micro-batch guards would go silent (only the "
        "division by N, a device op, replays); the per-iteration liveness check would stop the first replay.",
        instead="Capture layers instead (--cuda-graph-impl local or transformer_engine), which leaves the schedule, "
        "the loss function and finalize in Python, or leave CUDA graphs off.",
        applies=_token(_full_iteration)),
    Row(id="full-iteration-graph-schedule", flags=("--cuda-graph-impl", "--step-batch-size-schedule",
                                                   "--rampup-batch-size"),
        given=FULL_ITERATION, when="with a batch-size schedule (--step-batch-size-schedule or "
        "--rampup-batch-size)", support="refused",
        text="the graph replays the micro-batches of its capture step: FullCudaGraphWrapper copies a later stage's "
        "num_microbatches batches into its static buffers, but the replay computes only the captured number, so the "
        "rest of each larger global batch is consumed without being trained on.",
        instead="Train at a constant --global-batch-size under a full-iteration graph, or capture layers instead "
        "(--cuda-graph-impl local or transformer_engine).",
        applies=lambda s: _full_iteration(s) and _batch_schedule(s)),
    Row(id="full-iteration-graph-microbatch", flags=("--cuda-graph-impl", "--cuda-graph-scope",
                                                     "--cuda-graph-warmup-steps"),
        given=FULL_ITERATION,
        when="in microbatch mode", support="limited",
        text="the micro-batch guards run in the warm-up and capture iterations only; every replay runs the captured "
        f"schedule, upstream's mean of means included (the per-iteration liveness check is off); {ON_GPU}.",
        proofs=(Proof(test=GPU_GRAPHS + "test_full_iteration_graph_in_microbatch_mode_trains_as_upstream"),),
        replays=True,
        applies=lambda s: not s.token and _full_iteration(s) and not _batch_schedule(s)),
    Row(id="layer-graphs", flags=("--cuda-graph-impl", "--enable-cuda-graph", "--external-cuda-graph",
                                  "--cuda-graph-warmup-steps"),
        given="--cuda-graph-impl local or transformer_engine (--enable-cuda-graph, --external-cuda-graph)",
        support="limited",
        text="graphs of layers replay inside the forward pass; the schedule, the loss function and finalize run in "
        "Python every step, so every check runs (whether a captured MoE router is given the padding mask on replay "
        f"is not verified); {ON_GPU}.",
        proofs=(Proof(test=GPU_GRAPHS + "test_layer_graphs_keep_every_check_and_equal_upstream_per_token"),),
        applies=_layer_graphs),
    Row(id="optimizer-graph-skip", flags=("--optimizer-cuda-graph",), given="--optimizer-cuda-graph",
        when="with --ga-zero-token-policy skip", support="refused",
        text="Megatron's OptimizerCudaGraphWrapper replays the captured optimizer.step without calling it, and that "
        "call is where the skip policy skips a step: a step without a loss token would still run the optimizer on "
        "zeroed gradients (momentum and weight decay move the weights), the learning rate would advance, and the "
        "skip would stay pending.",
        instead="Keep --ga-zero-token-policy error (the default: such a step stops the run before its optimizer "
        "step), or drop --optimizer-cuda-graph.",
        applies=lambda s: s.on("optimizer_cuda_graph") and s.zero_token_policy == "skip"),
    Row(id="optimizer-graph-async", flags=("--optimizer-cuda-graph",), given="--optimizer-cuda-graph",
        when="with --ga-checks async", support="limited",
        text="the replayed optimizer step does not call the extension's step hook, so a broken step's verdict is "
        "read at the next forward/backward call, after Megatron may have saved that iteration's checkpoint "
        f"(--ga-checks sync raises in finalize, before the optimizer step); {ON_GPU}.",
        proofs=(Proof(test=GPU_GRAPHS + "test_optimizer_graph_async_verdict_stops_the_next_forward_backward"),),
        applies=lambda s: s.on("optimizer_cuda_graph") and s.token and s.checks == "async"),
    Row(id="optimizer-graph", flags=("--optimizer-cuda-graph",), given="--optimizer-cuda-graph", support="limited",
        text="each step's checks run in finalize, before the captured optimizer step (the default "
        f"--ga-zero-token-policy error and --ga-checks sync); {ON_GPU}.",
        proofs=(Proof(test=GPU_GRAPHS + "test_optimizer_graph_checks_each_step_in_finalize_before_the_replayed_step"),),
        applies=lambda s: s.on("optimizer_cuda_graph") and s.zero_token_policy != "skip"
        and not (s.token and s.checks == "async")),
    # combined 1F1B
    Row(id="combined-1f1b-token", flags=("--overlap-moe-expert-parallel-comm",),
        given="--overlap-moe-expert-parallel-comm", when="in token mode", support="refused",
        text="combined 1F1B runs the model through pretrain_gpt's model.build_schedule_plan(...), not "
        "GPTModel.forward, so the extension's MoE correction (routing with padding_mask = loss_mask == 0) is "
        "skipped: the load-balancing and z-loss gradients would count padding positions while the run reports "
        "them over loss tokens.",
        instead=INSTEAD_OF_1F1B, applies=_token(_on("overlap_moe_expert_parallel_comm"))),
    Row(id="combined-1f1b-microbatch", flags=("--overlap-moe-expert-parallel-comm",
                                              "--ep-overlap-early-attn-memory-release",
                                              "--high-priority-a2a-comm-stream"),
        given="--overlap-moe-expert-parallel-comm", when="in microbatch mode", support="limited",
        text="the loss still goes through forward_step_calc_loss, so the micro-batch guards and upstream's mean of "
        f"means hold; {NO_GPU} (bf16 or fp16 with expert parallelism).",
        applies=_microbatch(_on("overlap_moe_expert_parallel_comm"))),
    Row(id="delayed-wgrad-token", flags=("--delay-wgrad-compute",), given="--delay-wgrad-compute",
        when="in token mode", support="refused",
        text="Megatron takes it only with --overlap-moe-expert-parallel-comm (combined 1F1B), whose MoE forward "
        "skips the extension's padding-mask correction.",
        instead=INSTEAD_OF_1F1B, applies=_token(_on("delay_wgrad_compute"))),
    Row(id="delayed-wgrad-microbatch", flags=("--delay-wgrad-compute",), given="--delay-wgrad-compute",
        when="in microbatch mode", support="limited",
        text=f"the delayed weight gradients are computed inside the schedule, before finalize; {NO_GPU}.",
        applies=_microbatch(_on("delay_wgrad_compute"))),
    Row(id="expert-wgrad-overlap", flags=("--overlap-dispatch-backward-with-experts-wgrad",),
        given="--overlap-dispatch-backward-with-experts-wgrad (0.18 and later)", support="limited",
        text="the experts' weight gradients are computed on a side stream after their data gradients, overlapping the "
        "dispatch's backward; the extension relies on upstream to finish them before their gradients are reduced "
        f"and does not check it; {NO_GPU} (Transformer Engine's grouped GEMM).",
        applies=_on("overlap_dispatch_backward_with_experts_wgrad")),
    # the rerun state machine
    Row(id="rerun-report-stats", flags=("--rerun-mode",), given="--rerun-mode report_stats", support="refused",
        text="Megatron-LM's initialize_megatron builds RerunMode(args.rerun_mode), and report_stats is not one of its "
        "modes (the enum spells it report_determinism_stats): Megatron itself stops at start-up with a ValueError on "
        "every tested source, before any step the extension could check.",
        instead="Use --rerun-mode validate_results (the default) or disabled.",
        applies=lambda s: s.value("rerun_mode") == "report_stats"),
    Row(id="rerun-machine-token", flags=("--rerun-mode", "--no-check-for-nan-in-loss-and-grad"),
        given="--rerun-mode validate_results with Megatron's NaN check (the defaults)",
        when="in token mode", support="supported",
        text="a NaN or Inf loss is Megatron's to judge: the extension's finalize defers the non-finite flag to "
        "Megatron's rerun state machine (the contract's other checks still raise), says so, and logs what Megatron "
        "decided (its re-run, its fault attribution, its checkpoint-and-exit and exit code); a non-finite step that "
        "reaches the optimizer step anyway (Megatron does not validate the first iteration, nor a loss function that "
        "does not call its validate_result) stops there with a LossContractError.",
        proofs=(Proof(test=FAULTS + "test_a_nan_loss_is_left_to_megatrons_rerun_state_machine_which_decides"),),
        applies=_token(_nan_check_by_megatron)),
    Row(id="no-megatron-nan-check-token", flags=("--rerun-mode", "--no-check-for-nan-in-loss-and-grad"),
        given="--no-check-for-nan-in-loss-and-grad or --rerun-mode disabled", when="in token mode",
        support="supported",
        text="without Megatron's check the extension's own stops a step whose loss is NaN or Inf with a "
        "LossContractError, in finalize before the optimizer step (with --ga-checks async after it, before its "
        "checkpoint); with --rerun-mode disabled and the check on, Megatron's loss function raises its own error first.",
        proofs=(Proof(test=FAULTS + "test_a_nan_loss_on_one_rank_stops_that_step"),
                Proof(test=FAULTS + "test_async_checks_stop_a_nan_step_after_its_optimizer_step_before_its_checkpoint")),
        applies=_token(lambda s: not _nan_check_by_megatron(s))),
    Row(id="rerun-checks", flags=("--check-for-spiky-loss", "--check-for-large-grads", "--error-injection-rate",
                                  "--error-injection-type"),
        given="--check-for-spiky-loss, --check-for-large-grads or --error-injection-rate N", support="limited",
        text="Megatron's rerun state machine judges a spiky loss (in pretrain_gpt's loss function), unexpectedly large "
        "gradients (before the data-parallel reduction) and the errors it injects as it judges a non-finite loss "
        "(rerun-machine-token): a flagged step is run again, through the same hooks, or stops the run; "
        f"{NOT_YET}.",
        applies=_given("check_for_spiky_loss", "check_for_large_grads", "error_injection_rate")),
    # MoE
    Row(id="router-aux-loss", flags=("--moe-router-load-balancing-type", "--moe-aux-loss-coeff"),
        given="--moe-router-load-balancing-type aux_loss (the default)", support="supported",
        text="token mode: each micro-batch's load-balancing and z-loss terms are computed over its loss tokens and "
        "weighted by its share of the global batch's loss tokens. install() corrects the router's count, which "
        "megatron-core reads back after an in-place all-reduce once a padding mask is given (Megatron-LM #7452, "
        "finding 10: TP x CP times the target from 0.19), and before 0.19 gives the z-loss its missing TP x CP "
        "factor: exact under TP (sequence parallel) and CP, with uneven loss tokens across the shards; a micro-batch "
        "without loss tokens adds no term. Microbatch mode: as upstream.",
        proofs=(*MOE_LOOP, *_verify("DP2 x GA4 (MoE)", "EP2 x DP2 x GA4 (MoE)",
                                    "TP2 x DP2 x GA4 (MoE, sequence parallel)", "CP2 x DP2 x GA4 (MoE, position-wise)"),
                Proof(test="tests/test_verify_aux.py::test_install_meets_the_token_mode_target"),
                Proof(test="tests/test_moe_empty_microbatch.py::test_the_step_matches_the_token_reference")),
        applies=_balancing("aux_loss")),
    Row(id="router-global-aux-loss", flags=("--moe-router-load-balancing-type",),
        given="--moe-router-load-balancing-type global_aux_loss", support="supported",
        text="token mode: each DP rank's piece of a micro-batch's global load-balancing loss (statistics over every "
        "DP rank) weighted by its share of the loss tokens; install() corrects the router's count, which with a "
        "padding mask is the micro-batch's over every DP rank (#7452 finding 10: about DP times the target). "
        "Microbatch mode: as upstream.",
        proofs=(*_verify("DP2 x GA4 (MoE global_aux_loss)"),
                Proof(test="tests/test_verify_aux.py::test_install_meets_the_token_mode_target"),
                Proof(test="tests/test_verify_fuzz.py::test_a_fixed_seed_passes")),
        applies=_balancing("global_aux_loss")),
    Row(id="router-seq-aux-loss", flags=("--moe-router-load-balancing-type",),
        given="--moe-router-load-balancing-type seq_aux_loss", support="limited",
        text="token mode: computed over the loss tokens like aux_loss, with the router's count corrected (drawn by "
        "megatron-ga verify --fuzz). Before 0.19 the router pre-multiplies it by a per-sequence count: with "
        "--micro-batch-size above 1 its gradient is 1 / MBS of the target there (0.19 fixed it).",
        proofs=(Proof(test="tests/test_verify_fuzz.py::test_a_fixed_seed_passes"),),
        applies=_balancing("seq_aux_loss")),
    Row(id="router-sinkhorn-none", flags=("--moe-router-load-balancing-type",),
        given="--moe-router-load-balancing-type sinkhorn or none", support="limited",
        text="no load-balancing loss; in token mode the z-loss and the expert-bias counts exclude padding; "
        f"{NOT_YET}.",
        applies=_balancing("sinkhorn", "none")),
    Row(id="router-quantile-balancing-token", flags=("--moe-router-load-balancing-type",
                                                     "--moe-router-quantile-balancing-ema"),
        given="--moe-router-load-balancing-type quantile_balancing (0.19 and later)", when="in token mode",
        support="supported",
        text="the router is given no padding mask (quantile balancing has no load-balancing loss, and megatron-core's "
        "router refuses a padding mask there): the token count, the loss contract and its checks hold, and every "
        "step's loss and gradient equal upstream's --calculate-per-token-loss run.",
        proofs=(Proof(test=MOE_MTP + "test_quantile_balancing_token_mode_equals_upstream"),),
        applies=_token(lambda s: _quantile(s) and not _quantile_unmasked_losses(s))),
    Row(id="router-quantile-balancing-mixed-token",
        flags=("--moe-router-load-balancing-type", "--moe-z-loss-coeff"),
        given="--moe-router-load-balancing-type quantile_balancing with --moe-z-loss-coeff, or with an aux-loss type "
        "in the same list", when="in token mode", support="limited",
        text="the model is routed without a padding mask (upstream's router refuses one under quantile balancing), so "
        "the z-loss and any aux-loss layers count padding positions: their gradients are (routed positions / loss "
        f"tokens) times their token-mode target, as with upstream's --calculate-per-token-loss; {NOT_YET}.",
        applies=_token(lambda s: _quantile(s) and _quantile_unmasked_losses(s))),
    Row(id="router-quantile-balancing-microbatch", flags=("--moe-router-load-balancing-type",),
        given="--moe-router-load-balancing-type quantile_balancing", when="in microbatch mode", support="limited",
        text=f"no padding mask is passed in microbatch mode; {NOT_YET}.",
        applies=_microbatch(_balancing("quantile_balancing"))),
    Row(id="router-expert-bias", flags=("--moe-router-enable-expert-bias", "--moe-router-bias-update-rate"),
        given="--moe-router-enable-expert-bias", support="supported",
        text="the router counts the tokens routed to each expert, in token mode under the padding mask, and finalize "
        "moves the bias from those counts summed over TP x CP x DP; the bias steers routing and weighs no loss token. "
        "On every tested source before main@d98e8a64ddf3 (core_v0.16.1 to core_v0.19.0, main@9f3fe8c925fb, "
        "main@dd8c825b3ad5) the router masks its [tokens, experts] routing map with the flattened [tokens] padding "
        "mask (a shape error at the first step, or, where a micro-batch routes as many tokens as there are experts, "
        "experts masked instead of padding): install() gives it the mask per token there.",
        proofs=(Proof(test="tests/test_moe_expert_bias.py::test_the_expert_bias_counts_exclude_the_padding_tokens"),
                Proof(test="tests/test_moe_expert_bias.py::test_a_step_with_the_expert_bias_meets_both_references")),
        applies=lambda s: _moe(s) and s.on("moe_router_enable_expert_bias")),
    Row(id="router-fusion", flags=("--moe-router-fusion",), given="--moe-router-fusion", support="limited",
        text="Transformer Engine's fused kernels compute the router's top-k and its auxiliary-loss terms, given the "
        f"padding mask and the token counts as the unfused path is; {NO_GPU} (Transformer Engine 2.7 or later).",
        applies=lambda s: _moe(s) and s.on("moe_router_fusion")),
    Row(id="dispatcher-allgather-alltoall", flags=("--moe-token-dispatcher-type", "--expert-model-parallel-size"),
        given="--moe-token-dispatcher-type allgather or alltoall, --expert-model-parallel-size N",
        support="supported", text="the token count, the loss contract and the auxiliary-loss weights hold.",
        proofs=MOE_LOOP + _verify("EP2 x DP2 x GA4 (MoE)"),
        applies=lambda s: _moe(s) and s.value("moe_token_dispatcher_type") in ("allgather", "alltoall")),
    Row(id="dispatcher-flex", flags=("--moe-token-dispatcher-type", *FLEX_DISPATCHER),
        given="--moe-token-dispatcher-type flex",
        support="limited", text="the dispatch does not touch the loss or the token count, whatever its backend and "
        f"its options (its payload dtypes change the precision of what is sent, not its weight); {NO_GPU} (DeepEP, "
        "HybridEP, NCCL EP).",
        applies=lambda s: _moe(s) and s.value("moe_token_dispatcher_type") == "flex"),
    Row(id="rank-capacity-stash", flags=("--moe-expert-rank-capacity-factor", "--moe-paged-stash",
                                         "--moe-paged-stash-page-size", "--moe-paged-stash-buffer-size-factor-cuda",
                                         "--moe-paged-stash-buffer-size-factor-cpu"),
        given="--moe-expert-rank-capacity-factor (0.18 and later)", support="limited",
        text="Megatron wraps the forward/backward in a PagedStashRunner that, when a static buffer overflows, resets "
        "the gradients and runs the step's forward/backward once more (synced dropless): each attempt runs the "
        "extension's schedule hook and finalize and is checked on its own (under --ga-checks sync a broken first "
        "attempt stops the run before the retry); --moe-paged-stash (which needs the factor) and its page and buffer "
        f"sizes only size the stash; {NO_GPU} (HybridEP).",
        applies=lambda s: s.value("moe_expert_rank_capacity_factor") is not None),
    Row(id="dsa-indexer-loss-token", flags=("--experimental-attention-variant", "--dsa-indexer-loss-coeff",
                                            "--dsa-indexer-use-sparse-loss"),
        given="--experimental-attention-variant dsa", when="in token mode", support="limited",
        text="the extension does not reweight the DSA indexer loss: it is scaled as upstream's "
        "--calculate-per-token-loss scales it (its scaler is given the loss scale, and finalize divides by N); "
        f"{NOT_YET}.",
        applies=_token(lambda s: "dsa" in s.names("experimental_attention_variant"))),
    # MTP and hybrid models
    Row(id="mtp", flags=("--mtp-num-layers", "--mtp-loss-scaling-factor"), given="--mtp-num-layers N",
        support="supported",
        text="token mode: every MTP token weighs its scaling factor / N, the global count every term is divided by; "
        "install() undoes process_mtp_loss's local n_u / m_u weighting (0.17+, Megatron-LM #7452 finding 3; 0.16 "
        "attaches the sum already). Where labels are not given (the RL path) upstream's weighting stands. Microbatch "
        "mode: as upstream.",
        proofs=(Proof(test=MOE_MTP + "test_mtp_token_mode_weighs_every_mtp_token_by_n"),
                *_verify("DP2 x GA4 (MTP)", "DP2 x GA4 (MoE + MTP)"),
                Proof(test="tests/test_verify_aux.py::test_install_meets_the_token_mode_target")),
        applies=lambda s: s.number("mtp_num_layers") > 0),
    Row(id="hybrid-moe-token", flags=("--hybrid-override-pattern", "--hybrid-layer-pattern", "--is-hybrid-model"),
        given="a hybrid (Mamba) model with MoE layers", when="in token mode", support="limited",
        text="the extension's MoE correction wraps GPTModel.forward only: a hybrid model's MoE layers route "
        "without a padding mask, so their load-balancing and z-loss gradients are (routed positions / loss tokens) "
        "times their target weight, as with upstream's --calculate-per-token-loss.",
        applies=_token(lambda s: _hybrid(s) and _moe(s))),
    Row(id="hybrid", flags=("--hybrid-override-pattern", "--hybrid-layer-pattern", "--is-hybrid-model"),
        given="a hybrid (Mamba) model", support="limited",
        text=f"its loss goes through forward_step_calc_loss and finalize as a GPT's does; {NOT_YET}.",
        applies=lambda s: _hybrid(s) and not (s.token and _moe(s))),
    # data parallelism
    Row(id="torch-fsdp2-token", flags=("--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"),
        given="--use-torch-fsdp2", when="in token mode",
        support="refused",
        text="megatron-core's TorchFullyShardedDataParallel keeps the base class's scale_gradients, which does "
        "nothing, so the division by the global token count N never reaches the gradients, and FSDP2's "
        "reduce-scatter averages over the data-parallel ranks: the update would be the summed token loss / "
        "(DP x CP), not / N.",
        instead="Use Megatron-FSDP (--use-megatron-fsdp) or Megatron's DDP with --use-distributed-optimizer, or "
        "train with --ga-loss-reduction microbatch (without --calculate-per-token-loss).",
        applies=_token(_on("use_torch_fsdp2"))),
    Row(id="torch-fsdp2-microbatch", flags=("--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"),
        given="--use-torch-fsdp2",
        when="in microbatch mode", support="limited",
        text=f"FSDP2 averages over the data-parallel ranks as upstream's mean of means expects; {NO_GPU}.",
        applies=_microbatch(_on("use_torch_fsdp2"))),
    Row(id="megatron-fsdp", flags=("--use-megatron-fsdp", *MEGATRON_FSDP), given="--use-megatron-fsdp",
        support="limited",
        text="Megatron-FSDP builds its gradient buffers without the 1 / (DP x CP) factor under "
        "--calculate-per-token-loss and scales by 1 / N in finalize; the extension checks those factors at the "
        "first step; its sharding, buffer and precision options change how the gradient is sharded, sent and stored "
        f"(in the dtypes they name), not that factor; {NO_GPU}.",
        applies=_on("use_megatron_fsdp")),
    Row(id="average-in-collective-token", flags=("--ddp-average-in-collective",),
        given="--ddp-average-in-collective", when="in token mode", support="refused",
        text="an averaging collective divides the summed token loss by DP x CP before finalize divides it by N "
        "(Megatron's DDP asserts it is off under --calculate-per-token-loss).",
        instead="Drop --ddp-average-in-collective (off by default).",
        applies=_token(_on("ddp_average_in_collective"))),
    Row(id="yaml-cfg", flags=("--yaml-cfg",), given="--yaml-cfg", support="refused",
        text="Megatron's parse_args replaces the parsed command line by the YAML file's settings, so the --ga-* flags "
        "and the per-token switch install() sets never reach the args the run is built from.",
        instead="Give the launch's settings as command-line flags (Megatron's and the --ga-* ones) instead of "
        "--yaml-cfg.",
        applies=lambda s: s.value("yaml_cfg") is not None),
    Row(id="distributed-optimizer-overlap", flags=("--use-distributed-optimizer", "--overlap-grad-reduce"),
        given="--use-distributed-optimizer, --overlap-grad-reduce", support="supported",
        text="the gradients are summed over DP x CP (reduce-scatter, overlapped or not), then divided once by N.",
        proofs=_verify("DP2 x GA4 (overlapped grad reduce, distributed optimizer)"),
        applies=lambda s: s.on("use_distributed_optimizer") or s.on("overlap_grad_reduce")),
    Row(id="overlap-param-gather", flags=("--overlap-param-gather", "--overlap-param-gather-with-optimizer-step",
                                          "--no-align-param-gather"),
        given="--overlap-param-gather", support="limited",
        text="the parameters' all-gather after the optimizer step overlaps the next forward (or, with "
        "--overlap-param-gather-with-optimizer-step, its first bucket the step itself; unaligned across pipeline "
        "stages with --no-align-param-gather); a step skipped under "
        f"--ga-zero-token-policy skip changes no parameter; {NOT_YET}.",
        applies=_on("overlap_param_gather")),
    Row(id="distributed-optimizer-instances", flags=("--num-distributed-optimizer-instances",),
        given="--num-distributed-optimizer-instances N (N > 1)", support="limited",
        text="the gradient is reduce-scattered within each optimizer instance and all-reduced across the instances, "
        f"then divided by N: the same sum over DP x CP; --ga-noise-scale refuses it; {NOT_YET}.",
        applies=_above_one("num_distributed_optimizer_instances")),
    Row(id="grad-reduce-buckets", flags=("--ddp-bucket-size", "--ddp-num-buckets",
                                         "--ddp-pad-buckets-for-high-nccl-busbw", "--no-align-grad-reduce",
                                         "--disable-align-grad-reduce"),
        given="--ddp-bucket-size, --ddp-num-buckets, --ddp-pad-buckets-for-high-nccl-busbw or --no-align-grad-reduce",
        support="limited",
        text="they change how Megatron's DDP splits the gradient's sum over DP x CP into buckets and when each "
        "bucket's collective starts (aligned across pipeline stages or not), not the sum or its 1/N; the noise-scale "
        f"meter reads each bucket group as its reduction starts; {NOT_YET}.",
        applies=_given("ddp_bucket_size", "ddp_num_buckets", "ddp_pad_buckets_for_high_nccl_busbw",
                       "align_grad_reduce")),
    Row(id="grad-reduce-bf16", flags=("--grad-reduce-in-bf16",), given="--grad-reduce-in-bf16 (with --bf16)",
        support="limited",
        text="the main gradients are bf16: each micro-batch's gradient is added into them, summed over DP x CP and "
        "divided by N in bf16, so every token keeps its weight and each gradient loses precision (the parameters "
        "--ddp-param-name-patterns-for-fp32-local-accumulation names add their micro-batches in fp32); "
        f"{NOT_YET}.",
        applies=_on("grad_reduce_in_bf16")),
    Row(id="fp32-local-accumulation", flags=("--ddp-param-name-patterns-for-fp32-local-accumulation",),
        given="--ddp-param-name-patterns-for-fp32-local-accumulation (0.17 and later)", support="limited",
        text="the parameters it names add their micro-batch gradients into an fp32 main_grad apart from the bf16 "
        "buffer; upstream copies it into the buffer before the reduction and back after, and scales both by 1/N, "
        "so every token keeps its weight; --ga-noise-scale leaves those parameters out of its norms (their main_grad "
        f"is not in the buffer it reads); {NOT_YET}.",
        applies=lambda s: bool(s.names("ddp_param_name_patterns_for_fp32_local_accumulation"))),
    Row(id="fp32-grad-reduce", flags=("--accumulate-allreduce-grads-in-fp32",
                                      "--ddp-reduce-scatter-with-fp32-accumulation"),
        given="--accumulate-allreduce-grads-in-fp32 or --ddp-reduce-scatter-with-fp32-accumulation", support="limited",
        text="the first keeps the main gradients in fp32 (Megatron turns it on under --bf16 unless "
        "--grad-reduce-in-bf16 or a bf16 --main-grads-dtype), the second sends bf16 over the wire and adds in fp32: "
        f"the same sum over DP x CP and the same 1/N, in another precision; {NOT_YET}.",
        applies=_given("accumulate_allreduce_grads_in_fp32", "ddp_reduce_scatter_with_fp32_accumulation")),
    Row(id="precision-aware-optimizer", flags=("--use-precision-aware-optimizer", "--main-grads-dtype"),
        given="--use-precision-aware-optimizer (with --main-grads-dtype)", support="limited",
        text="Transformer Engine's FusedAdam keeps the main gradients in --main-grads-dtype (fp32 unless given): the "
        "sum over micro-batches and over DP x CP and the 1/N run in that precision, every token's weight unchanged; "
        f"{NO_GPU} (Transformer Engine).",
        applies=_given("use_precision_aware_optimizer", "main_grads_dtype")),
    Row(id="gradient-accumulation-fusion", flags=("--no-gradient-accumulation-fusion",),
        given="--no-gradient-accumulation-fusion", support="supported",
        text="the backward's hook adds each micro-batch's weight gradient into main_grad (rather than the wgrad GEMM, "
        "Megatron's default where its CUDA extension is built): each is added once, then reduced and divided by N; "
        "the end-to-end runs train this way (the fused default is not run here).",
        proofs=TOKEN_LOOP,
        applies=lambda s: not s.value("gradient_accumulation_fusion")),
    Row(id="fake-process-group", flags=("--fake-process-group",), given="--fake-process-group", support="limited",
        text="a memory-profiling mode: every collective is skipped, so N, the gradient's sums and the noise scale "
        f"cover this rank only, and no step trains as the launch would; {NOT_YET}.",
        applies=_on("fake_process_group")),
    # tensor parallelism, weight sharding, tied embeddings
    Row(id="gtp", flags=("--tensor-parallel-num-weight-shards", "--expert-tensor-parallel-num-weight-shards",
                         "--gtp-remat-reduce-scatter-with-fp32-accumulation", "--gtp-remat-opt-in-modules",
                         "--gtp-remat-nccl-ub", "--gtp-expert-remat-nccl-ub"),
        given="--tensor-parallel-num-weight-shards N above --tensor-model-parallel-size (or "
        "--expert-tensor-parallel-num-weight-shards N above the experts' tensor-parallel size): GTP weight "
        "rematerialization (0.19 and later)", support="refused",
        text="GTP shards each weight over an extra axis whose ranks take distinct data (Megatron's data-parallel size "
        "becomes the replicate degree, and the micro-batches are spread over replicate DP x GTP) and reduce-scatters "
        "the weight gradients over that axis inside the backward pass, outside the data-parallel reduction the "
        "extension's finalize, its checks and the noise-scale meter are built around; the token count's group spans "
        "the axis, but no test has run a GTP step, so the extension cannot say that every token keeps its weight.",
        instead="Keep --tensor-parallel-num-weight-shards at --tensor-model-parallel-size (and "
        "--expert-tensor-parallel-num-weight-shards at the experts' tensor-parallel size): no GTP weight "
        "rematerialization.",
        applies=_gtp),
    Row(id="tensor-parallel", flags=("--tensor-model-parallel-size",), given="--tensor-model-parallel-size N (N > 1)",
        support="limited",
        text="every TP rank of a replica computes the same loss over the same tokens, so N sums the count over DP x CP "
        "only, and finalize's reductions over TP (sequence-parallel and q/k layernorm gradients) run before the "
        "division by N; no verify row runs TP > 1 yet (tests/test_noise_scale_gpt.py measures the noise scale on "
        "TP 2 x DP 2).",
        applies=_above_one("tensor_model_parallel_size")),
    Row(id="sequence-parallel", flags=("--sequence-parallel",), given="--sequence-parallel", support="limited",
        text="each TP rank holds the gradient of its sequence shard for the parameters marked sequence_parallel (the "
        "layer norms) until finalize all-reduces them over TP, before the division by N; the noise-scale meter "
        f"leaves those parameters out of its norms; {NOT_YET}.",
        applies=_on("sequence_parallel")),
    Row(id="qk-layernorm", flags=("--qk-layernorm",),
        given="--qk-layernorm with --tensor-model-parallel-size N (N > 1)", support="limited",
        text="each TP rank's q/k layernorm gradient covers only its own attention heads until finalize sums it over TP "
        "(every tested source does, before the division by N), so every token keeps its weight; under "
        "--ga-noise-scale, where these weights carry no sequence_parallel mark (without --sequence-parallel), the "
        "meter counts TP rank 0's partial gradient of them as the replica's whole one (it reads the buckets before "
        f"that sum), so their part of the measured |S_r|^2 is not the replica's; {NOT_YET}.",
        applies=lambda s: s.on("qk_layernorm") and s.number("tensor_model_parallel_size") > 1),
    Row(id="tied-embeddings-pipeline", flags=("--untie-embeddings-and-output-weights",),
        given="tied embeddings (no --untie-embeddings-and-output-weights) with --pipeline-model-parallel-size N "
        "(N > 1)", support="supported",
        text="the first and the last stage each hold the word embedding; finalize sums their gradients of it over the "
        "embedding group before the division by N.",
        proofs=(TOKEN_LOOP[1], *_verify("PP2 x DP2 x GA4")),
        applies=_pipeline_tied(untied=False)),
    Row(id="untied-embeddings-pipeline", flags=("--untie-embeddings-and-output-weights",),
        given="--untie-embeddings-and-output-weights with --pipeline-model-parallel-size N (N > 1)", support="limited",
        text="the input embedding (first stage) and the output layer (last stage) are separate weights, with no "
        f"gradient to sum across stages; {NOT_YET}.",
        applies=_pipeline_tied(untied=True)),
    # context parallelism, packed sequences
    Row(id="context-parallel", flags=("--context-parallel-size",), given="--context-parallel-size N (N > 1)",
        support="supported",
        text="each CP shard counts its own loss tokens and N sums them over DP x CP; microbatch mode is upstream's "
        "per-shard mean.",
        proofs=_verify("CP2 x DP2 x GA4 (position-wise)"), applies=_above_one("context_parallel_size")),
    Row(id="hybrid-context-parallel", flags=("--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank"),
        given="--hybrid-context-parallel",
        support="limited",
        text="it regroups sequences into micro-batches of its own, so the micro-batch guards must be off "
        f"(--no-ga-guards, checked); the token count and its checks hold; {NOT_YET}.",
        applies=_on("hybrid_context_parallel")),
    Row(id="rl-sequence-packing", flags=("--perform-rl-step", "--rl-use-sequence-packing", "--rl-sequence-packing-algo",
                                         "--rl-sequence-packing-max-sequences-per-bin"),
        given="--perform-rl-step --rl-use-sequence-packing", support="limited",
        text="packed RL batches count bins, not samples, so the micro-batch guards must be off (--no-ga-guards, "
        "checked); the token count and its checks hold, but for a bin without loss tokens, which upstream's GRPO loss "
        f"function reports as 1 token (see rl-step); {NOT_YET}.",
        applies=lambda s: s.on("perform_rl_step") and s.on("rl_use_sequence_packing")),
    Row(id="rl-step", flags=("--perform-rl-step", *GRPO), given="--perform-rl-step (GRPO)", support="limited",
        text="Megatron's RL loop trains on the rollouts it generates: a round's --grpo-prompts-per-step x "
        "--grpo-group-size x --grpo-iterations rollouts must be a multiple of --global-batch-size, and each training "
        "step takes one global batch of them; its GRPO loss function (train_rl.py: the clipped ratio, the KL, entropy "
        "and importance-sampling terms) returns the loss summed over the loss mask with the mask's token count, "
        "except that a micro-batch without loss tokens reports 1 token, so N counts one token more per such "
        f"micro-batch and the zero-token policy does not see it; {NOT_YET}.",
        applies=_on("perform_rl_step")),
    Row(id="rl-context-parallel-token", flags=("--perform-rl-step", "--context-parallel-size"),
        given="--perform-rl-step with --context-parallel-size N (N > 1)", when="in token mode", support="refused",
        text="Megatron-LM's GRPO loss function (train_rl.py) multiplies each micro-batch's summed loss by "
        "--context-parallel-size on every tested source before main@dd8c825b3ad5, while the token count it returns "
        "is the CP shard's: there the token-mode gradient would be CP times its target, and no test has run RL under "
        "CP on the sources without that factor.",
        instead="Train RL with --context-parallel-size 1, or with --ga-loss-reduction microbatch (without "
        "--calculate-per-token-loss).",
        applies=_token(lambda s: s.on("perform_rl_step") and s.number("context_parallel_size") > 1)),
    Row(id="packed-sequences", flags=("--sft", "--dataloader-inter-document-masking"),
        given="packed sequences (THD: --sft, --dataloader-inter-document-masking)", support="limited",
        text=f"each micro-batch's loss mask still counts its loss tokens, so N and its checks hold; {NOT_YET}.",
        applies=lambda s: s.on("sft") or s.on("dataloader_inter_document_masking")),
    # the sequence-packing scheduler in the loop (main after d98e8a64, #6742)
    Row(id="sequence-packing-scheduler", flags=("--sequence-packing-scheduler", "--use-varlen-dataset"),
        given="--sequence-packing-scheduler dp_balanced (--use-varlen-dataset selects it; main after d98e8a64)",
        support="limited",
        text="train_step repacks each step's GBS samples into THD micro-batches of the scheduler's own number "
        "(wrap_data_iterator) and calls the schedule with it: the micro-batch guard follows that count for each call "
        "(an integer >= 1, the one the scheduler returned; a call with another is stopped before it reads the packed "
        "iterator), consumed samples and the learning rate still advance by exactly GBS per step (guarded), and N "
        "sums the loss tokens of every packed micro-batch. Proven on the CPU at DP 2 and PP 2 x DP 2: upstream's "
        "train_step and scheduler (a position-wise model: the gradient equals the unpartitioned token-level one), and "
        "pretrain_gpt.py equal to upstream's own per-token run, with two stand-ins for Transformer Engine "
        "(TransformerConfig requires TE >= 2.9 for the scheduler, and the local attention refuses packed sequences, "
        "so it attends a packed micro-batch as one sequence); TE's THD attention, MoE, VPP and CP under the scheduler "
        "are not run.",
        proofs=(Proof(test=PACKING), Proof(test=PACKING_E2E + "[dp2]"), Proof(test=PACKING_E2E + "[pp2dp2]"),
                Proof(test=PACKING_FAULT)),
        applies=lambda s: s.value("sequence_packing_scheduler") is not None
        or (s.on("use_varlen_dataset") and not s.on("varlen_sbhd_validation"))),
    Row(id="varlen-sbhd-validation", flags=("--varlen-sbhd-validation",),
        given="--use-varlen-dataset --varlen-sbhd-validation", support="limited",
        text="no packing scheduler runs (Megatron refuses one there): samples are right-padded to --seq-length and "
        "each micro-batch's loss mask counts its loss tokens, as for any dataset, so the guards and N hold; it needs a "
        f"real dataset (Megatron refuses --mock-data there); {NOT_YET}.",
        applies=lambda s: s.on("use_varlen_dataset") and s.on("varlen_sbhd_validation")),
    # the step and the schedule
    Row(id="iterations-to-skip", flags=("--iterations-to-skip",), given="--iterations-to-skip", support="limited",
        text="a listed iteration runs no forward/backward: its stage's global batch is consumed without training, "
        f"as upstream, with nothing to check; {NOT_YET}.",
        applies=lambda s: bool(s.names("iterations_to_skip"))),
    Row(id="fp16", flags=("--fp16", "--loss-scale", "--initial-loss-scale", "--min-loss-scale", "--loss-scale-window",
                          "--hysteresis"),
        given="--fp16", support="limited",
        text="the loss scale (static --loss-scale, or the dynamic one's settings) multiplies the summed token loss "
        "before backward and the optimizer divides it out; an "
        "overflow step is skipped as upstream, and --ga-zero-token-policy skip skips a step the same way; "
        f"{NO_GPU}.",
        applies=_on("fp16")),
    Row(id="bf16", flags=("--bf16",), given="--bf16", support="limited",
        text=f"the losses reach the loss function in fp32 and the token count is int64; {NO_GPU}.",
        applies=_on("bf16")),
    Row(id="per-token-loss", flags=("--calculate-per-token-loss",), given="--calculate-per-token-loss",
        when="in token mode", support="supported",
        text="every non-padding token of the global batch weighs the same, checked every step; equal to upstream's "
        "own per-token run in its loop.",
        proofs=(*TOKEN_LOOP, *_verify("DP2 x GA4", "DP4 x GA2")),
        applies=_token(lambda s: True)),
    Row(id="loss-mask", flags=("--eod-mask-loss", "--allow-ambiguous-pad-tokens"),
        given="--eod-mask-loss (and --allow-ambiguous-pad-tokens)", support="supported",
        text="they decide which tokens the dataset's loss mask keeps (EOD tokens out with --eod-mask-loss; tokens "
        "whose id the pad token shares kept with --allow-ambiguous-pad-tokens); N counts what the mask keeps, and "
        "every kept token weighs the same: the end-to-end runs mask EOD tokens, a different share in every micro-batch.",
        proofs=TOKEN_LOOP,
        applies=_given("eod_mask_loss", "allow_ambiguous_pad_tokens")),
    Row(id="logits-distillation", flags=("--logits-load-dir", "--logits-load-kd-loss-alpha",
                                         "--logits-load-ignore-errors"),
        given="--logits-load-dir (offline distillation from cached teacher logits, 0.19 and later)", support="limited",
        text="pretrain_gpt's loss function returns alpha x the KL to the teacher's log-probabilities summed over the "
        "loss tokens plus (1 - alpha) x the summed LM loss (--logits-load-kd-loss-alpha), with the loss mask's token "
        "count, so every token keeps its weight; with --logits-load-ignore-errors a micro-batch whose teacher logits "
        f"fail takes the LM loss alone; {NOT_YET}.",
        applies=lambda s: s.value("logits_load_dir") is not None),
    Row(id="batch-arithmetic", flags=BATCH_ARITHMETIC,
        given="the batch and layout flags (--micro-batch-size, --global-batch-size, --train-iters or --train-samples, "
        "--seq-length, the pipeline layer split)", support="supported",
        text="the extension's own inputs: the ledger and check compute DP = world / (TP x PP x CP), GA = GBS / "
        "(MBS x DP), each stage of a schedule and the pipeline layer split from them, and every training step is "
        "guarded against them (GA micro-batches per model chunk, one global batch of samples per step).",
        proofs=(*TOKEN_LOOP, Proof(test=E2E + "test_pp_guard_stops_a_pp_multiplied_step"),
                Proof(test=E2E + "test_step_schedule_and_resume_mid_schedule[dp2]")),
        applies=lambda s: True),
    Row(id="pipeline-parallel", flags=("--pipeline-model-parallel-size",),
        given="--pipeline-model-parallel-size N (N > 1)", support="supported",
        text="the last stage's count is broadcast with upstream's; PP never multiplies the global batch (guarded).",
        proofs=(TOKEN_LOOP[1], Proof(test=E2E + "test_pp_guard_stops_a_pp_multiplied_step"),
                *_verify("PP2 x DP2 x GA4")),
        applies=_above_one("pipeline_model_parallel_size")),
    Row(id="deferred-embedding-wgrad", flags=("--defer-embedding-wgrad-compute", "--wgrad-deferral-limit"),
        given="--defer-embedding-wgrad-compute", support="limited",
        text="the last stage computes the output layer's weight gradients of its last micro-batches during the "
        f"pipeline flush, inside the schedule and so before finalize sums and divides them; {NOT_YET}.",
        applies=_on("defer_embedding_wgrad_compute")),
    Row(id="virtual-pipeline", flags=("--num-layers-per-virtual-pipeline-stage",
                                      "--num-virtual-stages-per-pipeline-rank"),
        given="--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank", support="supported",
        text="every model chunk runs num_microbatches micro-batches (guarded), and the interleaved rule is checked "
        "for every stage of a schedule.",
        proofs=_verify("PP2 x VPP2 x DP2 x GA4"),
        applies=lambda s: s.number("num_layers_per_virtual_pipeline_stage") > 0
        or s.number("num_virtual_stages_per_pipeline_rank") > 1),
    Row(id="step-schedule", flags=("--step-batch-size-schedule",), given="--step-batch-size-schedule",
        support="supported",
        text="every stage is validated up front; the run's steps, samples and learning rate follow the schedule, and "
        "a resume mid-schedule runs the uninterrupted steps (backported on 0.16 and 0.17).",
        proofs=(Proof(test=E2E + "test_step_schedule_and_resume_mid_schedule[dp2]"),
                Proof(test=E2E + "test_step_schedule_and_resume_mid_schedule[pp2dp2]")),
        applies=lambda s: bool(s.value("step_batch_size_schedule"))),
    Row(id="rampup-converted", flags=("--rampup-batch-size",), given="--rampup-batch-size with --ga-convert-rampup",
        support="supported", text="the rampup runs as its exact equivalent step schedule on every release.",
        proofs=(Proof(test=E2E + "test_converted_rampup_runs_its_plan[dp2]"),
                Proof(test=E2E + "test_converted_rampup_runs_its_plan[pp2dp2]")),
        applies=lambda s: bool(s.value("rampup_batch_size")) and s.convert_rampup),
    Row(id="rampup", flags=("--rampup-batch-size",), given="--rampup-batch-size without --ga-convert-rampup",
        support="limited",
        text="megatron-core 0.18 and later ignore it and train at the constant --global-batch-size (0.16 and 0.17 "
        "run their own rampup); --ga-convert-rampup runs it as a step schedule.",
        applies=lambda s: bool(s.value("rampup_batch_size")) and not s.convert_rampup),
    Row(id="lr-schedule", flags=("--lr-decay-samples", "--lr-warmup-samples", "--lr-warmup-fraction",
                                 "--lr-wsd-decay-samples", "--lr-decay-style", "--lr-decay-iters", "--lr-warmup-iters",
                                 "--lr-wsd-decay-iters"),
        given="the learning rate's warmup, decay and WSD lengths (--lr-warmup-samples or --lr-warmup-fraction, "
        "--lr-decay-samples, --lr-wsd-decay-samples; the --lr-*-iters)", when="with a batch-size schedule",
        support="limited",
        text="Megatron's scheduler counts samples, each step advancing it by that step's global batch size; with a "
        "batch-size schedule the extension requires the run's length in samples (--train-samples: --train-iters is "
        "refused, since Megatron would convert the --lr-*-iters lengths at one constant global batch), so these "
        "lengths are samples and the learning rate follows the samples consumed across the stages, and "
        "--ga-batch-size-warmup auto keeps the batch fixed through the LR warmup and a WSD final decay as they give "
        f"them; only the default linear decay over --train-samples is run (step-schedule); {NOT_YET} otherwise.",
        applies=lambda s: _batch_schedule(s) and _given("lr_warmup_samples", "lr_warmup_fraction", "lr_decay_samples",
                                                        "lr_wsd_decay_samples", "lr_decay_iters", "lr_warmup_iters",
                                                        "lr_wsd_decay_iters")(s)),
    Row(id="override-iteration-schedule", flags=("--override-ckpt-iteration", "--freeze-all-layers"),
        given="--override-ckpt-iteration (0.19 and later; --freeze-all-layers sets it on a resume)",
        when="with a batch-size schedule (--step-batch-size-schedule or --rampup-batch-size)", support="refused",
        text="Megatron sets consumed_train_samples = that iteration x args.global_batch_size, as if every step before "
        "it had one global batch size: under a batch-size schedule that is not what the run consumed by that "
        "iteration, so the resumed run would take another stage's batch from there, and its steps and samples would "
        "not be the uninterrupted run's.",
        instead="Resume from the checkpoint's own iteration (--load, with --ckpt-step to pick one), or train at a "
        "constant --global-batch-size.",
        applies=lambda s: (s.value("override_ckpt_iteration") is not None or s.on("freeze_all_layers"))
        and _batch_schedule(s)),
    Row(id="phase-transitions-schedule", flags=("--phase-transition-iterations",),
        given="--phase-transition-iterations", when="with a batch-size schedule (--step-batch-size-schedule or "
        "--rampup-batch-size)", support="refused",
        text="Megatron puts each phase's boundaries at iteration x args.global_batch_size samples (its help: it "
        "requires a fixed global batch size across phases), to size each phase's dataset and to place a resumed run "
        "within its phase: under a batch-size schedule those are not the samples consumed by each transition "
        "iteration, so a phase's data would be sized for another batch than the schedule trains.",
        instead="Train the phases at a constant --global-batch-size, or drop --phase-transition-iterations.",
        applies=lambda s: s.value("phase_transition_iterations") is not None and _batch_schedule(s)),
    # checkpoints, resume and restarts
    Row(id="checkpoint-resume", flags=("--save", "--load", "--save-interval", "--persistent-save-interval",
                                       "--ckpt-step"),
        given="--save with --save-interval, and --load (with --ckpt-step)", support="supported",
        text="a resumed run reads its iteration, consumed samples and the schedule's stage from Megatron's checkpoint "
        "and takes the uninterrupted run's steps; under --ga-noise-scale the sidecar saved next to each persistent "
        "checkpoint continues the EMAs and --ga-batch-size-warmup auto's stages (the tests save with --ckpt-format "
        "torch).",
        proofs=(*RESUME, Proof(test=E2E + "test_step_schedule_and_resume_mid_schedule[dp2]")),
        applies=_given("save", "load")),
    Row(id="non-persistent-checkpoints", flags=("--non-persistent-save-interval", "--non-persistent-ckpt-type",
                                                "--non-persistent-global-ckpt-dir", "--non-persistent-local-ckpt-dir",
                                                "--non-persistent-local-ckpt-algo"),
        given="--non-persistent-save-interval N (global or local non-persistent checkpoints)", support="limited",
        text="a resume from a non-persistent checkpoint restores the iteration, consumed samples and the schedule's "
        "stage as any checkpoint does, but the extension's sidecar (the --ga-noise-scale EMAs and "
        "--ga-batch-size-warmup auto's stages) is written next to persistent checkpoints only: resumed from a "
        "non-persistent one, the EMAs start afresh and the batch-size warmup starts again from --global-batch-size "
        f"(both logged); {NOT_YET}.",
        applies=_given("non_persistent_save_interval")),
    Row(id="finetune", flags=("--finetune", "--pretrained-checkpoint"),
        given="--finetune (or --pretrained-checkpoint, taken where --load holds no checkpoint)", support="limited",
        text="Megatron loads the weights only and starts at iteration 0 with no consumed samples: a batch-size "
        "schedule runs from its first stage, and the noise-scale EMAs and --ga-batch-size-warmup auto start afresh "
        f"(iteration 0 reads no sidecar); {NOT_YET}.",
        applies=_given("finetune", "pretrained_checkpoint")),
    Row(id="checkpoint-args", flags=("--use-checkpoint-args", "--use-mp-args-from-checkpoint-args"),
        given="--use-checkpoint-args or --use-mp-args-from-checkpoint-args", support="limited",
        text="Megatron replaces the model's settings (layers, hidden size, --seq-length, ...) or its tensor- and "
        "pipeline-parallel sizes by the checkpoint's: the run's --seq-length (which turns a schedule's token "
        "thresholds into samples) and its layout (DP = world / (TP x PP x CP)) can then differ from the launch "
        f"line's, which megatron-ga check reads; install() checks the args Megatron runs with; {NOT_YET}.",
        applies=_given("use_checkpoint_args", "use_mp_args_from_checkpoint_args")),
    Row(id="inprocess-restart", flags=("--inprocess-restart",), given="--inprocess-restart", support="limited",
        text="after a fault, nvidia-resiliency-ext restarts the wrapped training function in the same process: the "
        f"extension's installation (its patches and its state) carries over into the restarted run; {NOT_YET}.",
        applies=_on("inprocess_restart")),
)


# -- applying the table -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """The rows one launch falls under that refuse it, and those whose limits apply to it."""

    refused: tuple[Row, ...]
    limited: tuple[Row, ...]

    def error(self) -> CoverageError | None:
        """One CoverageError naming every refusal, or None."""
        if not self.refused:
            return None
        if len(self.refused) == 1:
            return CoverageError(self.refused[0].message())
        listed = " ".join(f"({i}) {row.message()}" for i, row in enumerate(self.refused, 1))
        return CoverageError(f"{len(self.refused)} settings of this launch are refused: {listed}")

    def notes(self) -> list[str]:
        return [row.message() for row in self.limited]


def verdict(setting: Setting) -> Verdict:
    """The rows of :data:`ROWS` that refuse ``setting``, and the limited ones that apply to it."""
    applied = [row for row in ROWS if row.applies(setting)]
    return Verdict(tuple(r for r in applied if r.support == "refused"),
                   tuple(r for r in applied if r.support == "limited"))


def enforce(args: Any, config: GAConfig) -> Verdict:
    """At start-up: raise the CoverageError of every refused row that applies to Megatron's ``args`` and the
    installed ``config``; log the limits that apply, once. Returns the verdict."""
    result = verdict(Setting.of(args, config))
    error = result.error()
    if error is not None:
        raise error
    for note in result.notes():
        logger.info("megatron-ga-ext coverage, limited: %s", note)
    return result


def named_by_rows() -> set[str]:
    """Every spelling of every flag a row names (a negatable switch's ``--no-<name>`` too)."""
    return {spelling for row in ROWS for flag in row.flags for spelling in OPTIONS[flag].spellings}


def unclassified(flags: Iterable[str]) -> list[str]:
    """The flags of a Megatron parser (``flags``: its option strings) that neither a row nor the off-path list
    (config/off_path.py) names, whether or not a tested source's parser has them: each is to be read and given a
    row or a reason before the table speaks for that parser. Sorted."""
    return sorted(set(flags) - named_by_rows() - set(OFF_PATH))


# -- docs/coverage.md -------------------------------------------------------------------------------

DOC_HEADER = """# Coverage: Megatron's features on the loss, gradient, step and schedule path

Rendered by `make docs` from `megatron_ga_ext/config/coverage.py` (`coverage_doc()`); `make docs-check` and
tests/test_coverage.py check that this file is its rendering. *supported*: every check of every step runs, and the test named proves it. *limited*: it runs,
with the limit stated (logged at start-up, and a note of `megatron-ga check`). *refused*: `install()` stops at
start-up with a `CoverageError` and `megatron-ga check` reports a problem (the refusal's test:
`tests/test_coverage.py::test_refused_rows_stop_install_and_check[<row>]`).
"""


def coverage_table() -> str:
    """The table of :data:`ROWS` in Markdown."""
    lines = ["| row | flags | when | behaviour | what holds, the limit, or why refused | test |",
             "|---|---|---|---|---|---|"]
    for row in ROWS:
        text = row.text + (f" {row.instead}" if row.instead else "")
        tests = "<br>".join(str(p) for p in row.proofs)
        if row.support == "refused":
            tests = f"`tests/test_coverage.py::test_refused_rows_stop_install_and_check[{row.id}]`"
        lines.append(f"| `{row.id}` | {_escape(row.given)} | {row.when} | {row.support} | {_escape(text)} | {tests} |")
    return "\n".join(lines)


OFF_PATH_HEADER = """## Flags off the path

{count} flags of the tested Megatron parsers are off the loss, gradient, step and batch path, each listed under the
reason it is off (`megatron_ga_ext/config/off_path.py`). `tests/test_coverage_complete.py` fails on a flag of a tested
parser that neither a row above nor this list names (one a new source adds, too); `make regress` lists those of a
checkout.
"""


def off_path_table() -> str:
    """The themes of config/off_path.py in Markdown: each with its reason and its flags."""
    lines = ["| theme | reason | flags |", "|---|---|---|"]
    for theme in THEMES:
        flags = ", ".join(f"`{flag}`" for flag in theme.flags)
        lines.append(f"| {theme.name} ({len(theme.flags)}) | {_escape(theme.reason)} | {flags} |")
    return "\n".join(lines)


def coverage_doc() -> str:
    """docs/coverage.md."""
    off_path = OFF_PATH_HEADER.format(count=len(OFF_PATH))
    return f"{DOC_HEADER}\n{coverage_table()}\n\n{off_path}\n{off_path_table()}\n"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")
