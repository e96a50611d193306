"""The coverage rows of CUDA graphs (full-iteration, layer and optimizer graphs), combined 1F1B and
the delayed weight gradient, and Megatron's rerun state machine. Pure Python; the table is
:data:`megatron_ga_ext.config.coverage.rows.ROWS`, in this order.
"""

from __future__ import annotations

from megatron_ga_ext.config.coverage.conditions import (
    any_given,
    batch_schedule,
    full_iteration_graph,
    in_token_mode,
    is_on,
    layer_graphs,
    nan_check_by_megatron,
)
from megatron_ga_ext.config.coverage.proofs import (
    FAULTS,
    GPU_GRAPHS,
    NO_GPU,
    NOT_YET,
    ON_GPU,
    verify_layouts,
)
from megatron_ga_ext.config.coverage.row import Proof, Row

__all__ = ["GRAPH_ROWS"]

#: verify's combined 1F1B layouts (verify/layouts.py).
COMBINED_1F1B = (
    "EP2 x DP2 x GA4 (MoE, combined 1F1B)",
    "EP2 x DP2 x GA4 (MoE, combined 1F1B, delayed wgrad)",
    "EP2 x DP2 x GA4 (MoE + MTP, combined 1F1B)",
    "TP2 x EP2 x ETP1 x DP2 x GA4 (MoE, sequence parallel, combined 1F1B)",
    "PP2 x VPP2 x EP2 x DP2 x GA4 (MoE, combined 1F1B)",
)

FULL_ITERATION = (
    "a full-iteration CUDA graph (--cuda-graph-impl full_iteration, or --cuda-graph-scope "
    "full_iteration)"
)

# fmt: off
GRAPH_ROWS: tuple[Row, ...] = (
    # CUDA graphs
    Row(id="full-iteration-graph-token", flags=("--cuda-graph-impl", "--cuda-graph-scope", "--cuda-graph-modules"),
        given=FULL_ITERATION, when="in token mode", support="refused",
        brief="a full-iteration CUDA graph replays each step without the extension's Python, so "
            "no step would be "
              "checked.",
        text="after capture, Megatron's FullCudaGraphWrapper replays the captured "
            "forward/backward and none of the "
        "extension's Python runs again: the loss contract, the non-finite, negative and "
            "unchecked token counts, the "
        "zero-token error or skip, the --ga-checks async verdict and the micro-batch guards "
            "would go silent (only the "
        "division by N, a device op, replays); the per-iteration liveness check would stop the "
            "first replay.",
        instead="Capture layers instead (--cuda-graph-impl local or transformer_engine), which "
            "leaves the schedule, "
        "the loss function and finalize in Python, or leave CUDA graphs off.",
        applies=in_token_mode(full_iteration_graph)),
    Row(id="full-iteration-graph-schedule", flags=("--cuda-graph-impl", "--step-batch-size-schedule",
                                                   "--rampup-batch-size"),
        given=FULL_ITERATION, when="with a batch-size schedule (--step-batch-size-schedule or "
        "--rampup-batch-size)", support="refused",
        brief="a full-iteration CUDA graph replays its captured number of micro-batches, so part "
            "of each larger "
              "scheduled batch would go untrained.",
        text="the graph replays the micro-batches of its capture step: FullCudaGraphWrapper "
            "copies a later stage's "
        "num_microbatches batches into its static buffers, but the replay computes only the "
            "captured number, so the "
        "rest of each larger global batch is consumed without being trained on.",
        instead="Train at a constant --global-batch-size under a full-iteration graph, or "
            "capture layers instead "
        "(--cuda-graph-impl local or transformer_engine).",
        applies=lambda s: full_iteration_graph(s) and batch_schedule(s)),
    Row(id="full-iteration-graph-microbatch", flags=("--cuda-graph-impl", "--cuda-graph-scope",
                                                     "--cuda-graph-warmup-steps"),
        given=FULL_ITERATION,
        when="in microbatch mode", support="limited",
        brief="a full-iteration CUDA graph: the micro-batch guards run until capture; replays "
            "run upstream's mean of "
              "means.", severity="info",
        text="the micro-batch guards run in the warm-up and capture iterations only; every "
            "replay runs the captured "
        "schedule, upstream's mean of means included (the per-iteration liveness check is off); "
            f"{ON_GPU}.",
        proofs=(Proof(test=GPU_GRAPHS + "test_full_iteration_graph_in_microbatch_mode_trains_as_upstream"),),
        replays=True,
        applies=lambda s: not s.token and full_iteration_graph(s) and not batch_schedule(s)),
    Row(id="layer-graphs", flags=("--cuda-graph-impl", "--enable-cuda-graph", "--external-cuda-graph",
                                  "--cuda-graph-warmup-steps"),
        given="--cuda-graph-impl local or transformer_engine (--enable-cuda-graph, "
            "--external-cuda-graph)",
        support="limited",
        brief="CUDA graphs of layers: every check runs each step; whether a captured MoE router "
            "gets the padding mask "
              "on replay is not verified.", severity="careful",
        text="graphs of layers replay inside the forward pass; the schedule, the loss function "
            "and finalize run in "
        "Python every step, so every check runs (whether a captured MoE router is given the "
            "padding mask on replay "
        f"is not verified); {ON_GPU}.",
        proofs=(Proof(test=GPU_GRAPHS + "test_layer_graphs_keep_every_check_and_equal_upstream_per_token"),),
        applies=layer_graphs),
    Row(id="optimizer-graph-skip", flags=("--optimizer-cuda-graph",), given="--optimizer-cuda-graph",
        when="with --ga-zero-token-policy skip", support="refused",
        brief="--optimizer-cuda-graph replays the optimizer step, so --ga-zero-token-policy skip "
            "could not skip a "
              "step without loss tokens.",
        text="Megatron's OptimizerCudaGraphWrapper replays the captured optimizer.step without "
            "calling it, and that "
        "call is where the skip policy skips a step: a step without a loss token would still run "
            "the optimizer on "
        "zeroed gradients (momentum and weight decay move the weights), the learning rate would "
            "advance, and the "
        "skip would stay pending.",
        instead="Keep --ga-zero-token-policy error (the default: such a step stops the run "
            "before its optimizer "
        "step), or drop --optimizer-cuda-graph.",
        applies=lambda s: s.on("optimizer_cuda_graph") and s.zero_token_policy == "skip"),
    Row(id="optimizer-graph-async", flags=("--optimizer-cuda-graph",), given="--optimizer-cuda-graph",
        when="with --ga-checks async", support="limited",
        brief="with --optimizer-cuda-graph, --ga-checks async reports a broken step one step "
            "late, possibly after its "
              "checkpoint is saved.", severity="careful",
        text="the replayed optimizer step does not call the extension's step hook, so a broken "
            "step's verdict is "
        "read at the next forward/backward call, after Megatron may have saved that iteration's "
            "checkpoint "
        f"(--ga-checks sync raises in finalize, before the optimizer step); {ON_GPU}.",
        proofs=(Proof(test=GPU_GRAPHS + "test_optimizer_graph_async_verdict_stops_the_next_forward_backward"),),
        applies=lambda s: s.on("optimizer_cuda_graph") and s.token and s.checks == "async"),
    Row(id="optimizer-graph", flags=("--optimizer-cuda-graph",), given="--optimizer-cuda-graph", support="limited",
        brief="--optimizer-cuda-graph: each step is checked before the captured optimizer step; "
            "--ga-noise-scale "
              "cannot run with it.", severity="info",
        text="each step's checks run in finalize, before the captured optimizer step (the default "
        "--ga-zero-token-policy error and --ga-checks sync); --ga-noise-scale refuses it (the "
            "replayed step takes no "
        "measurement, so neither the meter nor --ga-batch-size-warmup auto would go on); "
            f"{ON_GPU}.",
        proofs=(Proof(test=GPU_GRAPHS + "test_optimizer_graph_checks_each_step_in_finalize_before_the_replayed_step"),),
        applies=lambda s: s.on("optimizer_cuda_graph") and s.zero_token_policy != "skip"
        and not (s.token and s.checks == "async")),
    Row(id="optimizer-graph-liveness", flags=("--optimizer-cuda-graph", "--cuda-graph-warmup-steps"),
        given="--optimizer-cuda-graph", support="limited",
        brief="once --optimizer-cuda-graph has captured, a step that goes around the checked "
            "schedule is no longer "
              "named.", severity="careful",
        text="from its capture on (core_v0.19.0 optimizer/optimizer_cuda_graph.py:31-50: at "
            "--cuda-graph-warmup-steps, "
        "then replay(); training.py:3633-3638 wraps the built optimizer's step, the extension's "
            "hook inside it) no "
        "Python of the optimizer step runs: the per-iteration liveness check stops, so an "
            "iteration that goes around "
        "the guarded schedule is no longer named; the token-mode checks run in finalize every "
            "step, before the "
        "replay (optimizer-graph), but for a non-finite loss left to Megatron's rerun state "
            "machine that reaches the "
        "step anyway (a loss function that does not call its validate_result), which is stopped "
            "at the next step's "
        "finalize instead of before its own optimizer step, and not at all at the last iteration.",
        applies=is_on("optimizer_cuda_graph")),
    # combined 1F1B
    Row(id="combined-1f1b", flags=("--overlap-moe-expert-parallel-comm",
                                   "--ep-overlap-early-attn-memory-release",
                                   "--high-priority-a2a-comm-stream"),
        given="--overlap-moe-expert-parallel-comm", support="supported",
        text="combined 1F1B runs the model through pretrain_gpt's model.build_schedule_plan(...), "
             "whose plan stores a padding mask and routes without it (fine_grained_callables.py "
             "calls layer.mlp.route(hidden_states), core_v0.19.0 :130). In token mode install() "
             "gives the plan padding_mask = (loss_mask == 0), this TP rank's part under sequence "
             "parallelism, and the router takes it while the plan runs: load balancing and the "
             "z-loss count loss tokens, as on GPTModel.forward's path; an MTP layer's router "
             "takes the mask its layer rolled in the plan's chunk state, as MTP's forward does "
             "(moe-in-mtp-token states where that roll falls short). The loss still goes through "
             "forward_step_calc_loss, so microbatch mode is upstream's mean of means. verify runs "
             "it on the CPU in fp32 (the config validated with bf16, which upstream requires); "
             "Megatron-LM's own loop runs it in bf16 through the drop-in, as the forward path.",
        proofs=(*verify_layouts(*COMBINED_1F1B), Proof(
            test="tests/e2e/test_moe_mtp.py::test_combined_1f1b_token_mode_trains_as_the_forward_path")),
        applies=is_on("overlap_moe_expert_parallel_comm")),
    Row(id="delayed-wgrad", flags=("--delay-wgrad-compute",), given="--delay-wgrad-compute",
        support="limited", severity="info",
        brief="--delay-wgrad-compute: the delayed schedule runs here; Transformer Engine's deferred "
              "weight GEMMs need a GPU.",
        text="Megatron-LM takes it only with --transformer-impl transformer_engine "
             "(arguments.py:1823 at core_v0.19.0), whose grouped GEMMs defer the weight gradients "
             "to backward_dw, still inside the schedule and before finalize divides by N; no test "
             "here runs that (it needs a GPU). The schedule's delayed order runs here on "
             "megatron-core alone (verify, with the local layers, whose backward_dw computes "
             "nothing: their weight gradients come in the backward).",
        proofs=verify_layouts(COMBINED_1F1B[1]),
        applies=is_on("delay_wgrad_compute")),
    Row(id="expert-wgrad-overlap", flags=("--overlap-dispatch-backward-with-experts-wgrad",),
        given="--overlap-dispatch-backward-with-experts-wgrad (0.18 and later)", support="limited",
        brief="expert weight gradients finish on a side stream; the extension trusts upstream to "
            "finish them before "
              "the reduction. Not run here.", severity="careful",
        text="the experts' weight gradients are computed on a side stream after their data "
            "gradients, overlapping the "
        "dispatch's backward; the extension relies on upstream to finish them before their "
            "gradients are reduced "
        f"and does not check it; {NO_GPU} (Transformer Engine's grouped GEMM).",
        applies=is_on("overlap_dispatch_backward_with_experts_wgrad")),
    # the rerun state machine
    Row(id="rerun-report-stats", flags=("--rerun-mode",), given="--rerun-mode report_stats", support="refused",
        brief="Megatron itself stops at start-up: report_stats is not a --rerun-mode it knows "
            "(it spells it "
              "report_determinism_stats).",
        text="Megatron-LM's initialize_megatron builds RerunMode(args.rerun_mode), and "
            "report_stats is not one of its "
        "modes (the enum spells it report_determinism_stats): Megatron itself stops at start-up "
            "with a ValueError on "
        "every tested source, before any step the extension could check.",
        instead="Use --rerun-mode validate_results (the default) or disabled.",
        applies=lambda s: s.value("rerun_mode") == "report_stats"),
    Row(id="rerun-machine-token", flags=("--rerun-mode", "--no-check-for-nan-in-loss-and-grad"),
        given="--rerun-mode validate_results with Megatron's NaN check (the defaults)",
        when="in token mode", support="supported",
        text="a NaN or Inf loss is Megatron's to judge: the extension's finalize defers the "
            "non-finite flag to "
        "Megatron's rerun state machine (the contract's other checks still raise), says so, and "
            "logs what Megatron "
        "decided (its re-run, its fault attribution, its checkpoint-and-exit and exit code); a "
            "non-finite step that "
        "reaches the optimizer step anyway (Megatron does not validate the first iteration, nor "
            "a loss function that "
        "does not call its validate_result) stops there with a LossContractError.",
        proofs=(Proof(test=FAULTS + "test_a_nan_loss_is_left_to_megatrons_rerun_state_machine_which_decides"),),
        applies=in_token_mode(nan_check_by_megatron)),
    Row(id="no-megatron-nan-check-token", flags=("--rerun-mode", "--no-check-for-nan-in-loss-and-grad"),
        given="--no-check-for-nan-in-loss-and-grad or --rerun-mode disabled", when="in token mode",
        support="supported",
        text="without Megatron's check the extension's own stops a step whose loss is NaN or Inf "
            "with a "
        "LossContractError, in finalize before the optimizer step (with --ga-checks async after "
            "it, before its "
        "checkpoint); with --rerun-mode disabled and the check on, Megatron's loss function "
            "raises its own error "
        "first.",
        proofs=(Proof(test=FAULTS + "test_a_nan_loss_on_one_rank_stops_that_step"),
                Proof(test=FAULTS
                      + "test_async_checks_stop_a_nan_step_after_its_optimizer_step_before_its_checkpoint")),
        applies=in_token_mode(lambda s: not nan_check_by_megatron(s))),
    Row(id="rerun-checks", flags=("--check-for-spiky-loss", "--check-for-large-grads", "--error-injection-rate",
                                  "--error-injection-type"),
        given="--check-for-spiky-loss, --check-for-large-grads or --error-injection-rate N", support="limited",
        brief="Megatron's rerun checks rerun or stop a flagged step; a rerun goes through the "
            "same checks. Not run by "
              "a test here.", severity="info",
        text="Megatron's rerun state machine judges a spiky loss (in pretrain_gpt's loss "
            "function), unexpectedly large "
        "gradients (before the data-parallel reduction) and the errors it injects as it judges a "
            "non-finite loss "
        "(rerun-machine-token): a flagged step is run again, through the same hooks, or stops "
            "the run; "
        f"{NOT_YET}.",
        applies=any_given("check_for_spiky_loss", "check_for_large_grads", "error_injection_rate")),
)
# fmt: on
