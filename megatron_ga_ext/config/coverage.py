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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Mapping

from megatron_ga_ext.config.flags import BY_DEST, CHECKS, CONVERT_RAMPUP, LOSS_REDUCTION, OPTIONS, ZERO_TOKEN_POLICY
from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.core.megatron_flags import COVERED_OPTIONS, MEGATRON_OPTIONS
from megatron_ga_ext.errors import CoverageError
from megatron_ga_ext.logs import get_logger

__all__ = [
    "ROWS", "Proof", "Row", "Setting", "Verdict", "coverage_doc", "coverage_table", "enforce", "unclassified", "verdict",
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
INSTEAD_OF_1F1B = (
    "Drop --overlap-moe-expert-parallel-comm (and --delay-wgrad-compute), or train with --ga-loss-reduction microbatch "
    "(without --calculate-per-token-loss).")

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
    Row(id="full-iteration-graph-microbatch", flags=("--cuda-graph-impl", "--cuda-graph-scope"), given=FULL_ITERATION,
        when="in microbatch mode", support="limited",
        text="the micro-batch guards run in the warm-up and capture iterations only; every replay runs the captured "
        f"schedule, upstream's mean of means included (the per-iteration liveness check is off); {ON_GPU}.",
        proofs=(Proof(test=GPU_GRAPHS + "test_full_iteration_graph_in_microbatch_mode_trains_as_upstream"),),
        replays=True,
        applies=lambda s: not s.token and _full_iteration(s) and not _batch_schedule(s)),
    Row(id="layer-graphs", flags=("--cuda-graph-impl", "--enable-cuda-graph", "--external-cuda-graph"),
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
    Row(id="combined-1f1b-microbatch", flags=("--overlap-moe-expert-parallel-comm",),
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
    # MoE
    Row(id="router-aux-loss", flags=("--moe-router-load-balancing-type",),
        given="--moe-router-load-balancing-type aux_loss (the default)", support="supported",
        text="token mode: each micro-batch's load-balancing and z-loss terms are computed over its loss tokens and "
        "weighted by its share of the global batch's loss tokens; microbatch mode: as upstream.",
        proofs=(*MOE_LOOP, *_verify("DP2 x GA4 (MoE)", "EP2 x DP2 x GA4 (MoE)"),
                Proof(test="tests/test_verify_aux.py::test_install_meets_the_token_mode_target")),
        applies=_balancing("aux_loss")),
    Row(id="router-seq-global-aux-loss", flags=("--moe-router-load-balancing-type",),
        given="--moe-router-load-balancing-type seq_aux_loss or global_aux_loss", support="limited",
        text="the router computes them from the same statistics as aux_loss, with the padding mask in token mode; "
        f"{NOT_YET}.",
        applies=_balancing("seq_aux_loss", "global_aux_loss")),
    Row(id="router-sinkhorn-none", flags=("--moe-router-load-balancing-type",),
        given="--moe-router-load-balancing-type sinkhorn or none", support="limited",
        text="no load-balancing loss; in token mode the z-loss and the expert-bias counts exclude padding; "
        f"{NOT_YET}.",
        applies=_balancing("sinkhorn", "none")),
    Row(id="router-quantile-balancing-token", flags=("--moe-router-load-balancing-type",),
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
    Row(id="dispatcher-allgather-alltoall", flags=("--moe-token-dispatcher-type", "--expert-model-parallel-size"),
        given="--moe-token-dispatcher-type allgather or alltoall, --expert-model-parallel-size N",
        support="supported", text="the token count, the loss contract and the auxiliary-loss weights hold.",
        proofs=MOE_LOOP + _verify("EP2 x DP2 x GA4 (MoE)"),
        applies=lambda s: _moe(s) and s.value("moe_token_dispatcher_type") in ("allgather", "alltoall")),
    Row(id="dispatcher-flex", flags=("--moe-token-dispatcher-type",), given="--moe-token-dispatcher-type flex",
        support="limited", text=f"the dispatch does not touch the loss or the token count; {NO_GPU} (DeepEP, "
        "HybridEP).",
        applies=lambda s: _moe(s) and s.value("moe_token_dispatcher_type") == "flex"),
    Row(id="rank-capacity-stash", flags=("--moe-expert-rank-capacity-factor",),
        given="--moe-expert-rank-capacity-factor (0.18 and later)", support="limited",
        text="Megatron wraps the forward/backward in a PagedStashRunner that, when a static buffer overflows, resets "
        "the gradients and runs the step's forward/backward once more (synced dropless): each attempt runs the "
        "extension's schedule hook and finalize and is checked on its own (under --ga-checks sync a broken first "
        f"attempt stops the run before the retry); {NO_GPU} (HybridEP).",
        applies=lambda s: s.value("moe_expert_rank_capacity_factor") is not None),
    Row(id="dsa-indexer-loss-token", flags=("--experimental-attention-variant",),
        given="--experimental-attention-variant dsa", when="in token mode", support="limited",
        text="the extension does not reweight the DSA indexer loss: it is scaled as upstream's "
        "--calculate-per-token-loss scales it (its scaler is given the loss scale, and finalize divides by N); "
        f"{NOT_YET}.",
        applies=_token(lambda s: "dsa" in s.names("experimental_attention_variant"))),
    # MTP and hybrid models
    Row(id="mtp", flags=("--mtp-num-layers",), given="--mtp-num-layers N", support="supported",
        text="the MTP loss weighs each micro-batch by its share of the loss tokens (on megatron-core 0.16 each MTP "
        "token weighs 1/N instead, said at the first step).",
        proofs=(Proof(test=MOE_MTP + "test_mtp_token_mode_equals_upstream"),
                *_verify("DP2 x GA4 (MTP)", "DP2 x GA4 (MoE + MTP)")),
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
    Row(id="torch-fsdp2-token", flags=("--use-torch-fsdp2",), given="--use-torch-fsdp2", when="in token mode",
        support="refused",
        text="megatron-core's TorchFullyShardedDataParallel keeps the base class's scale_gradients, which does "
        "nothing, so the division by the global token count N never reaches the gradients, and FSDP2's "
        "reduce-scatter averages over the data-parallel ranks: the update would be the summed token loss / "
        "(DP x CP), not / N.",
        instead="Use Megatron-FSDP (--use-megatron-fsdp) or Megatron's DDP with --use-distributed-optimizer, or "
        "train with --ga-loss-reduction microbatch (without --calculate-per-token-loss).",
        applies=_token(_on("use_torch_fsdp2"))),
    Row(id="torch-fsdp2-microbatch", flags=("--use-torch-fsdp2",), given="--use-torch-fsdp2",
        when="in microbatch mode", support="limited",
        text=f"FSDP2 averages over the data-parallel ranks as upstream's mean of means expects; {NO_GPU}.",
        applies=_microbatch(_on("use_torch_fsdp2"))),
    Row(id="megatron-fsdp", flags=("--use-megatron-fsdp",), given="--use-megatron-fsdp", support="limited",
        text="Megatron-FSDP builds its gradient buffers without the 1 / (DP x CP) factor under "
        "--calculate-per-token-loss and scales by 1 / N in finalize; the extension checks those factors at the "
        f"first step; {NO_GPU}.",
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
    Row(id="overlap-param-gather", flags=("--overlap-param-gather",), given="--overlap-param-gather",
        support="limited",
        text="the parameters' all-gather after the optimizer step overlaps the next forward; a step skipped under "
        f"--ga-zero-token-policy skip changes no parameter; {NOT_YET}.",
        applies=_on("overlap_param_gather")),
    # context parallelism, packed sequences
    Row(id="context-parallel", flags=("--context-parallel-size",), given="--context-parallel-size N (N > 1)",
        support="supported",
        text="each CP shard counts its own loss tokens and N sums them over DP x CP; microbatch mode is upstream's "
        "per-shard mean.",
        proofs=_verify("CP2 x DP2 x GA4 (position-wise)"), applies=_above_one("context_parallel_size")),
    Row(id="hybrid-context-parallel", flags=("--hybrid-context-parallel",), given="--hybrid-context-parallel",
        support="limited",
        text="it regroups sequences into micro-batches of its own, so the micro-batch guards must be off "
        f"(--no-ga-guards, checked); the token count and its checks hold; {NOT_YET}.",
        applies=_on("hybrid_context_parallel")),
    Row(id="rl-sequence-packing", flags=("--perform-rl-step", "--rl-use-sequence-packing"),
        given="--perform-rl-step --rl-use-sequence-packing", support="limited",
        text="packed RL batches count bins, not samples, so the micro-batch guards must be off (--no-ga-guards, "
        f"checked); the token count and its checks hold; {NOT_YET}.",
        applies=lambda s: s.on("perform_rl_step") and s.on("rl_use_sequence_packing")),
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
    Row(id="fp16", flags=("--fp16",), given="--fp16", support="limited",
        text="the loss scale multiplies the summed token loss before backward and the optimizer divides it out; an "
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
    Row(id="pipeline-parallel", flags=("--pipeline-model-parallel-size",),
        given="--pipeline-model-parallel-size N (N > 1)", support="supported",
        text="the last stage's count is broadcast with upstream's; PP never multiplies the global batch (guarded).",
        proofs=(TOKEN_LOOP[1], Proof(test=E2E + "test_pp_guard_stops_a_pp_multiplied_step"),
                *_verify("PP2 x DP2 x GA4")),
        applies=_above_one("pipeline_model_parallel_size")),
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


def unclassified(flags: Iterable[str], known: Iterable[str]) -> list[str]:
    """The flags of a checkout's parser (``flags``) that no tested source's parser defines (``known``) and that
    neither a row nor a declaration names: new upstream flags, to read and classify before the table speaks for
    that checkout. Sorted."""
    named = {flag for row in ROWS for flag in row.flags} | set(OPTIONS)
    return sorted(set(flags) - set(known) - named)


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


def coverage_doc() -> str:
    """docs/coverage.md."""
    return f"{DOC_HEADER}\n{coverage_table()}\n"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")
