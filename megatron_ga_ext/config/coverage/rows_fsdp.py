"""The coverage rows of Megatron's FSDP paths: torch FSDP2 and Megatron-FSDP (each sharding
strategy, and its checkpoint). Pure Python; the table is
:data:`megatron_ga_ext.config.coverage.rows.ROWS`, in this order.
"""

from __future__ import annotations

from megatron_ga_ext.config.coverage.conditions import (
    has_moe,
    in_microbatch_mode,
    in_token_mode,
    is_on,
    megatron_fsdp_with,
)
from megatron_ga_ext.config.coverage.proofs import verify_layouts
from megatron_ga_ext.config.coverage.row import Proof, Row, Setting, Upstream

__all__ = ["FSDP_ROWS"]

FSDP = "tests/test_fsdp.py::"
FSDP_E2E = "tests/e2e/test_fsdp.py::"
#: Megatron-FSDP's sharding strategies: what a rank holds, why --ga-noise-scale refuses it, the
#: verify layouts.
_WHOLE = (
    "a rank holds its replica's gradient before the reduction, but in Megatron-FSDP's buffer, "
    "not the DDP buckets the meter reads"
)
_SHARDED = "the gradient is reduce-scattered into shards, so no rank holds its replica's gradient"
_ON_0_16 = (
    " On megatron-core {} upstream's own step {} --overlap-grad-reduce misses both targets, with "
    "or without the extension (verify skips the row there; exact from {})."
)
_ONE_RANK = (
    " A gradient buffer whose data-parallel group has one rank (DP 1, or the experts' when EP "
    "takes every DP rank): megatron-core 0.16 adds its accumulated gradient to itself at "
    "every micro-batch's reduction (Megatron-LM #6660, 2x at GA 1, about 2^GA after GA), "
    "and the first step stops naming it. From 0.17.1 on token mode is exact there; in "
    "microbatch mode at GA > 1 megatron-core multiplies that buffer, which holds the "
    "accumulated gradient, by 1 / DP before every micro-batch's reduction where the "
    "reduction is not fused (bf16 gradients, --no-gradient-reduce-div-fusion, gloo), so "
    "the expert gradients miss the mean of means (relative error 0.53 to 1.03 measured "
    "at GA 2 and 4), and the first step stops, naming --ga-loss-reduction token as the "
    "fix."
)


def _experts_may_share_one_rank(s: Setting) -> bool:
    """Microbatch mode with experts split over EP > 1 ranks: EP may take every DP rank (the launch's
    DP decides)."""
    return (
        not s.on("calculate_per_token_loss")
        and has_moe(s)
        and s.number("expert_model_parallel_size") > 1
    )


def _one_rank_upstream(strategy: str) -> Upstream:
    sharded = megatron_fsdp_with(strategy)
    return Upstream(
        given=f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy} with "
        "--expert-model-parallel-size equal to the data-parallel size, without "
        "--calculate-per-token-loss",
        effect="the experts' gradient buffer, whose data-parallel group has one rank, is "
        "multiplied by 1 / DP before "
        "every micro-batch's reduction where it is not fused (bf16 gradients, "
        "--no-gradient-reduce-div-fusion), "
        "so earlier micro-batches are scaled again at each later one (0.16: doubled, Megatron-LM "
        "#6660)",
        severity="careful",
        fix="Use --calculate-per-token-loss (exact there), --data-parallel-sharding-strategy "
        "optim or no_shard, or "
        "an expert data-parallel size (DP / EP) above 1.",
        brief="If EP takes every DP rank, Megatron-FSDP rescales the experts' accumulated "
        "gradient at each "
        "micro-batch (unfused reduction). Use --calculate-per-token-loss, or optim or no_shard.",
        applies=lambda s: sharded(s) and _experts_may_share_one_rank(s),
    )


MEGATRON_FSDP_STRATEGIES = (
    (
        "no_shard",
        "nothing sharded",
        _WHOLE,
        ("DP2 x GA4 (Megatron-FSDP no_shard)",),
        _ON_0_16.format("0.16.1 and 0.17.1", "without", "0.18.2"),
    ),
    (
        "optim",
        "the optimizer state sharded",
        _WHOLE,
        ("DP2 x GA4 (Megatron-FSDP optim)",),
        _ON_0_16.format("0.16.1", "with", "0.17.1"),
    ),
    (
        "optim_grads",
        "optimizer state and gradients sharded",
        _SHARDED,
        ("DP2 x GA4 (Megatron-FSDP optim_grads, overlapped grad reduce)",),
        _ONE_RANK,
    ),
    (
        "optim_grads_params",
        "optimizer state, gradients and parameters sharded",
        _SHARDED,
        ("DP4 x GA2 (Megatron-FSDP optim_grads_params, overlapped grad reduce)",),
        _ONE_RANK,
    ),
)
#: Why a Megatron-FSDP checkpoint with a sharded optimizer state does not save (every tested source,
#: 0.16.1 to main).
_SHARDED_SAVE_WHY = (
    "a rank whose shard of a parameter is empty (in practice always: a parameter no shard "
    "boundary cuts lies wholly in one rank's shard) gets no gradient for it "
    "(Megatron-FSDP's update_main_grads, param_and_grad_buffer.py:3393 in core_v0.19.0), "
    "so its optimizer keeps no state for it (DP 2, the e2e GPT: rank 0 holds state for 8 "
    "of the 29 parameters, rank 1 for 24); the fsdp_dtensor save gathers each DTensor's "
    "chunk metadata with one all_gather_object per DTensor of the rank's own state dict "
    "(uneven_dtensor.py:51 and 249-252, called from checkpointing.py:1395), so the ranks "
    "run different numbers of collectives and pair different tensors' metadata, and the "
    "save never finishes (here over gloo; Megatron-LM #4910, open, reports it over NCCL)"
)
_SHARDED_SAVE = f"Megatron-FSDP's own checkpoint save: {_SHARDED_SAVE_WHY}."


def _without_distributed_optimizer(s: Setting) -> bool:
    return s.on("use_megatron_fsdp") and not s.on("use_distributed_optimizer")


def _sharded_save(s: Setting) -> bool:
    """Megatron-FSDP saving a checkpoint with its optimizer state sharded (every strategy but
    no_shard)."""
    return (
        s.on("use_megatron_fsdp")
        and s.value("save") is not None
        and not megatron_fsdp_with("no_shard")(s)
    )


#: Megatron-FSDP's sharding, buffer and precision options (the megatron-fsdp rows).
MEGATRON_FSDP = (
    "--data-parallel-sharding-strategy",
    "--outer-dp-sharding-strategy",
    "--enable-full-sharding-in-hsdp",
    "--megatron-fsdp-grad-comm-dtype",
    "--megatron-fsdp-main-grads-dtype",
    "--megatron-fsdp-main-params-dtype",
    "--fsdp-double-buffer",
    "--fsdp-manual-registration",
    "--suggested-communication-unit-size",
    "--keep-fp8-transpose-cache",
    "--init-model-with-meta-device",
    "--megatron-fsdp-version",
    "--megatron-fsdp-enable-fine-grained-param-gather",
    "--fsdp-db-use-persist-buf-on-alloc-fail",
    "--megatron-fsdp-max-pool-double-buffer",
    "--no-gradient-reduce-div-fusion",
)


# fmt: off
FSDP_ROWS: tuple[Row, ...] = (
    Row(id="torch-fsdp2-token", flags=("--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"),
        given="--use-torch-fsdp2", when="in token mode", support="supported",
        text="install() sets every FSDP2 unit megatron builds to sum over DP x CP (gradient "
            "divide factor 1, sum-only "
        "reduction) before the step's first reduce-scatter, and divides the local gradient "
            "shards by N in finalize "
        "while megatron-core's scale_gradients for FSDP2 is the base class's no-op (an upstream "
            "that implements it "
        "scales instead, never both); a unit whose factor or reduction is changed after that "
            "stops the step, naming "
        "it; --ga-noise-scale refuses it (FSDP2 reduce-scatters each micro-batch's gradient as "
            "its backward ends, so "
        "no rank holds its replica's gradient). Before megatron-core 0.19 upstream's FSDP2 stops "
            "at the first step "
        "in either mode (finalize passes finish_grad_sync a force_all_reduce its wrapper does "
            "not take).",
        proofs=(*verify_layouts("DP2 x GA4 (untied, torch FSDP2)", "DP4 x GA2 (untied, torch "
            "FSDP2)",
                                "CP2 x DP2 x GA4 (position-wise, torch FSDP2)"),
                Proof(test=FSDP + "test_torch_fsdp2_token_mode_is_exact_where_upstream_is_n_over_dp_off"),
                Proof(test=FSDP + "test_torch_fsdp2_fails_with_the_fix_reverted"),
                Proof(test=FSDP + "test_fsdp2_units_checked_each_step_and_upstream_never_scaled_twice"),
                Proof(test=FSDP_E2E + "test_torch_fsdp2_equals_ddp_where_upstream_is_n_over_dp_off")),
        applies=in_token_mode(is_on("use_torch_fsdp2")),
        upstream=(Upstream(
            given="--use-torch-fsdp2 with --calculate-per-token-loss",
            effect="megatron-core's FSDP2 wrapper keeps the base class's scale_gradients, which "
                "does nothing, and "
            "FSDP2 averages the summed token loss over the DP x CP ranks, so every gradient is N "
                "/ (DP x CP) times "
            "the per-token mean (17x at DP 2 with N = 34 loss tokens)",
            severity="wrong",
            fix="Run the script through the extension (python -m megatron_ga_ext pretrain_gpt.py "
                "...), which makes "
            "FSDP2 sum and divides by N; or train with --use-megatron-fsdp, whose per-token path "
                "is exact; or drop "
            "--calculate-per-token-loss for the mean of means FSDP2 averages as upstream expects.",
            applies=lambda s: s.on("calculate_per_token_loss") and s.on("use_torch_fsdp2"),
            drop=("--calculate-per-token-loss",), entry=True),)),
    Row(id="torch-fsdp2-microbatch", flags=("--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"),
        given="--use-torch-fsdp2", when="in microbatch mode", support="supported",
        text="FSDP2 averages each micro-batch's gradient over DP x CP in its reduce-scatter, "
            "which is upstream's mean "
        "of means; the extension checks each step that no unit's divide factor or reduction was "
            "changed (megatron-core "
        "0.19 and later, as the token row).",
        proofs=(*verify_layouts("DP2 x GA4 (untied, torch FSDP2)", "DP4 x GA2 (untied, torch "
            "FSDP2)",
                                "CP2 x DP2 x GA4 (position-wise, torch FSDP2)"),
                Proof(test=FSDP + "test_torch_fsdp2_microbatch_mode_is_upstream_mean_of_means")),
        applies=in_microbatch_mode(is_on("use_torch_fsdp2"))),
    *(Row(id=f"megatron-fsdp-{strategy.replace('_', '-')}", flags=("--use-megatron-fsdp", *MEGATRON_FSDP),
          given=f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}", support="supported",
          text=f"Megatron-FSDP ({strategy}: {held}) builds its gradient buffers without the 1 / "
              "(DP x CP) factor under --calculate-per-token-loss (checked at the first step) and "
                  "its finalize scales them by 1 / N: exact in both modes, with and without "
                  "--overlap-grad-reduce, with the distributed optimizer (see "
                  "megatron-fsdp-optimizer); its buffer and precision options change how the "
                  "gradient is sharded, sent and stored (in the dtypes they name), not that "
                  "factor; --ga-noise-scale refuses it "
              f"({noise}). With --clip-grad "
          "0 Megatron-LM logs its grad norm as 0.0: Megatron-FSDP's optimizer computes the norm "
              "only to clip (DDP's chained optimizer always does); with a clip the norm and "
              "the clipped step equal "
              f"DDP's.{limit}",
          proofs=(*verify_layouts(*layouts),
                  Proof(test=FSDP + f"test_megatron_fsdp_is_exact_in_every_strategy_and_mode[{strategy}]"),
                  *((Proof(test=FSDP + "test_expert_data_parallel_group_of_one_rank"),) if limit == _ONE_RANK else ()),
                  *((Proof(test=FSDP_E2E + f"test_megatron_fsdp_equals_ddp[{strategy}]"),)
                    if strategy in ("no_shard", "optim_grads_params") else ())),
          applies=megatron_fsdp_with(strategy),
          upstream=(_one_rank_upstream(strategy),) if limit == _ONE_RANK else ())
      for strategy, held, noise, layouts, limit in MEGATRON_FSDP_STRATEGIES),
    Row(id="megatron-fsdp-optimizer", flags=("--use-megatron-fsdp", "--use-distributed-optimizer"),
        given="--use-megatron-fsdp without --use-distributed-optimizer", support="limited",
        brief="Megatron-LM 0.16 and 0.17 do not turn on the distributed optimizer for "
            "Megatron-FSDP, and such a run "
              "barely trains. Add --use-distributed-optimizer.",
        text="Megatron-FSDP needs the distributed optimizer: Megatron-LM turns it on for "
            "--use-megatron-fsdp from "
        "0.18 (arguments.py:1113-1119 in core_v0.18.2), 0.16 and 0.17 leave it off, and the "
            "launch steps an "
        "FP32Optimizer that barely trains, with or without the extension, while the gradients "
            "are exact (DP 2, lm "
        "loss 7.0017, 7.0047, 6.9985, 6.9922 on 0.16.1 against DDP's 7.0017, 6.5309, 5.3517, "
            "4.3812); given "
        "--use-distributed-optimizer, the same launch's losses equal DDP's.",
        proofs=(Proof(test=FSDP_E2E + "test_megatron_fsdp_equals_ddp[optim_grads_params]"),),
        applies=_without_distributed_optimizer,
        upstream=(Upstream(
            given="--use-megatron-fsdp without --use-distributed-optimizer (Megatron-LM 0.16, "
                "0.17)",
            effect="Megatron-LM leaves the distributed optimizer off and steps an FP32Optimizer, "
                "which barely trains",
            severity="careful",
            fix="Add --use-distributed-optimizer (Megatron-LM 0.18 and later add it themselves).",
            brief="Megatron-LM 0.16 and 0.17 do not turn on the distributed optimizer for "
                "Megatron-FSDP, and such a "
                  "run barely trains. Add --use-distributed-optimizer.",
            applies=_without_distributed_optimizer),)),
    Row(id="megatron-fsdp-checkpoint", flags=("--use-megatron-fsdp", "--save", "--data-parallel-sharding-strategy"),
        given="--use-megatron-fsdp with --save, the optimizer state sharded "
            "(--data-parallel-sharding-strategy optim, "
        "optim_grads or optim_grads_params)", support="limited", severity="info",
        brief="Megatron-FSDP hangs saving a checkpoint with its optimizer state sharded, with or "
            "without the "
              "extension; no_shard saves and resumes exactly.",
        text=_SHARDED_SAVE + " The reduction is not involved: the same launch without the "
            "extension hangs alike. "
        "no_shard, where every rank holds every parameter's state, saves and resumes exactly "
            "(the resumed steps "
        "equal the uninterrupted run's, grad norm included); a checkpoint of the weights alone "
            "(--no-save-optim, "
        "resumed with --no-load-optim, the optimizer's moments restarting) saves and loads (not "
            "run by a test).",
        proofs=(Proof(test=FSDP_E2E + "test_megatron_fsdp_no_shard_resumes_as_the_uninterrupted_run"),
                Proof(test=FSDP_E2E + "test_sharded_megatron_fsdp_keeps_optimizer_state_apart_per_rank"
                      "[optim_grads_params]")),
        applies=_sharded_save,
        upstream=(Upstream(
            given="--use-megatron-fsdp with --save and the optimizer state sharded",
            effect="the first checkpoint save hangs: " + _SHARDED_SAVE_WHY,
            severity="careful",
            fix="Train with --data-parallel-sharding-strategy no_shard where a run must resume "
                "exactly, or save the "
            "weights alone (--no-save-optim).",
            brief="Megatron-FSDP with its optimizer state sharded hangs at the first checkpoint "
                "save. Use no_shard "
            "to checkpoint, or save the weights alone.",
            applies=_sharded_save),)),
)
# fmt: on
