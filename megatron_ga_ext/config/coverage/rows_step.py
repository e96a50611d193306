"""The coverage rows of the step and the schedule (precision, the loss, the batch arithmetic,
pipelines, batch-size schedules, the LR schedule), and checkpoints, resume and restarts. Pure
Python; the table is
:data:`megatron_ga_ext.config.coverage.rows.ROWS`, in this order.
"""

from __future__ import annotations

from megatron_ga_ext.config.coverage.conditions import (
    above_one,
    any_given,
    batch_schedule,
    in_token_mode,
    is_on,
)
from megatron_ga_ext.config.coverage.proofs import (
    E2E,
    NO_GPU,
    NOT_YET,
    RESUME,
    TOKEN_LOOP,
    verify_layouts,
)
from megatron_ga_ext.config.coverage.row import Proof, Row

__all__ = ["STEP_ROWS"]

#: Megatron's batch and layout flags the extension reads itself (core/megatron_flags.py), beyond
#: those other rows name.
BATCH_ARITHMETIC = (
    "--micro-batch-size",
    "--global-batch-size",
    "--decrease-batch-size-if-needed",
    "--seq-length",
    "--encoder-seq-length",
    "--decoder-seq-length",
    "--expert-tensor-parallel-size",
    "--num-experts",
    "--num-layers",
    "--decoder-num-layers",
    "--microbatch-group-size-per-virtual-pipeline-stage",
    "--pipeline-model-parallel-layout",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split",
    "--train-iters",
    "--train-samples",
)

# fmt: off
STEP_ROWS: tuple[Row, ...] = (
    # the step and the schedule
    Row(id="iterations-to-skip", flags=("--iterations-to-skip",), given="--iterations-to-skip", support="limited",
        brief="--iterations-to-skip consumes those steps' batches without training, as upstream "
            "does. Not run by a "
              "test here.", severity="info",
        text="a listed iteration runs no forward/backward: its stage's global batch is consumed "
            "without training, "
        f"as upstream, with nothing to check; {NOT_YET}.",
        applies=lambda s: bool(s.names("iterations_to_skip"))),
    Row(id="fp16", flags=("--fp16", "--loss-scale", "--initial-loss-scale", "--min-loss-scale", "--loss-scale-window",
                          "--hysteresis"),
        given="--fp16", support="limited",
        brief="--fp16: the loss scale is multiplied in and divided out, and overflow steps are "
            "skipped as upstream. "
              "Not run here (needs a GPU).", severity="info",
        text="the loss scale (static --loss-scale, or the dynamic one's settings) multiplies the "
            "summed token loss "
        "before backward and the optimizer divides it out; an "
        "overflow step is skipped as upstream, and --ga-zero-token-policy skip skips a step the "
            "same way; "
        f"{NO_GPU}.",
        applies=is_on("fp16")),
    Row(id="bf16", flags=("--bf16",), given="--bf16", support="limited",
        brief="--bf16: losses reach the loss function in fp32 and token counts are int64. Not "
            "run here (needs a GPU).",
        severity="info",
        text=f"the losses reach the loss function in fp32 and the token count is int64; {NO_GPU}.",
        applies=is_on("bf16")),
    Row(id="per-token-loss", flags=("--calculate-per-token-loss",), given="--calculate-per-token-loss",
        when="in token mode", support="supported",
        text="every non-padding token of the global batch weighs the same, checked every step; "
            "equal to upstream's "
        "own per-token run in its loop.",
        proofs=(*TOKEN_LOOP, *verify_layouts("DP2 x GA4", "DP4 x GA2")),
        applies=in_token_mode(lambda s: True)),
    Row(id="loss-mask", flags=("--eod-mask-loss", "--allow-ambiguous-pad-tokens"),
        given="--eod-mask-loss (and --allow-ambiguous-pad-tokens)", support="supported",
        text="they decide which tokens the dataset's loss mask keeps (EOD tokens out with "
            "--eod-mask-loss; tokens "
        "whose id the pad token shares kept with --allow-ambiguous-pad-tokens); N counts what "
            "the mask keeps, and "
        "every kept token weighs the same: the end-to-end runs mask EOD tokens, a different "
            "share in every "
        "micro-batch.",
        proofs=TOKEN_LOOP,
        applies=any_given("eod_mask_loss", "allow_ambiguous_pad_tokens")),
    Row(id="logits-distillation", flags=("--logits-load-dir", "--logits-load-kd-loss-alpha",
                                         "--logits-load-ignore-errors"),
        given="--logits-load-dir (offline distillation from cached teacher logits, 0.19 and "
            "later)", support="limited",
        brief="offline distillation: the teacher KL and the LM loss are summed over loss tokens, "
            "so every token keeps "
              "its weight. Not run by a test.", severity="info",
        text="pretrain_gpt's loss function returns alpha x the KL to the teacher's "
            "log-probabilities summed over the "
        "loss tokens plus (1 - alpha) x the summed LM loss (--logits-load-kd-loss-alpha), with "
            "the loss mask's token "
        "count, so every token keeps its weight; with --logits-load-ignore-errors a micro-batch "
            "whose teacher logits "
        f"fail takes the LM loss alone; {NOT_YET}.",
        applies=lambda s: s.value("logits_load_dir") is not None),
    Row(id="batch-arithmetic", flags=BATCH_ARITHMETIC,
        given="the batch and layout flags (--micro-batch-size, --global-batch-size, "
            "--train-iters or --train-samples, "
        "--seq-length, the pipeline layer split)", support="supported",
        text="the extension's own inputs: the ledger and check compute DP = world / (TP x PP x "
            "CP), GA = GBS / "
        "(MBS x DP), each stage of a schedule and the pipeline layer split from them, and every "
            "training step is "
        "guarded against them (GA micro-batches per model chunk, one global batch of samples per "
            "step).",
        proofs=(*TOKEN_LOOP, Proof(test=E2E + "test_pp_guard_stops_a_pp_multiplied_step"),
                Proof(test=E2E + "test_step_schedule_and_resume_mid_schedule[dp2]")),
        applies=lambda s: True),
    Row(id="pipeline-parallel", flags=("--pipeline-model-parallel-size",),
        given="--pipeline-model-parallel-size N (N > 1)", support="supported",
        text="the last stage's count is broadcast with upstream's; PP never multiplies the "
            "global batch (guarded).",
        proofs=(TOKEN_LOOP[1], Proof(test=E2E + "test_pp_guard_stops_a_pp_multiplied_step"),
                *verify_layouts("PP2 x DP2 x GA4")),
        applies=above_one("pipeline_model_parallel_size")),
    Row(id="deferred-embedding-wgrad", flags=("--defer-embedding-wgrad-compute", "--wgrad-deferral-limit"),
        given="--defer-embedding-wgrad-compute", support="limited",
        brief="deferred output-layer gradients finish inside the step, before they are summed "
            "and divided. Not run by "
              "a test here.", severity="info",
        text="the last stage computes the output layer's weight gradients of its last "
            "micro-batches during the "
        "pipeline flush, inside the schedule and so before finalize sums and divides them; "
            f"{NOT_YET}.",
        applies=is_on("defer_embedding_wgrad_compute")),
    Row(id="virtual-pipeline", flags=("--num-layers-per-virtual-pipeline-stage",
                                      "--num-virtual-stages-per-pipeline-rank"),
        given="--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank", support="supported",
        text="every model chunk runs num_microbatches micro-batches (guarded), and the "
            "interleaved rule is checked "
        "for every stage of a schedule.",
        proofs=verify_layouts("PP2 x VPP2 x DP2 x GA4"),
        applies=lambda s: s.number("num_layers_per_virtual_pipeline_stage") > 0
        or s.number("num_virtual_stages_per_pipeline_rank") > 1),
    Row(id="step-schedule", flags=("--step-batch-size-schedule",), given="--step-batch-size-schedule",
        support="supported",
        text="every stage is validated up front; the run's steps, samples and learning rate "
            "follow the schedule, and "
        "a resume mid-schedule runs the uninterrupted steps (backported on 0.16 and 0.17).",
        proofs=(Proof(test=E2E + "test_step_schedule_and_resume_mid_schedule[dp2]"),
                Proof(test=E2E + "test_step_schedule_and_resume_mid_schedule[pp2dp2]")),
        applies=lambda s: bool(s.value("step_batch_size_schedule"))),
    Row(id="rampup-converted", flags=("--rampup-batch-size",), given="--rampup-batch-size with "
        "--ga-convert-rampup",
        support="supported", text="the rampup runs as its exact equivalent step schedule on "
            "every release.",
        proofs=(Proof(test=E2E + "test_converted_rampup_runs_its_plan[dp2]"),
                Proof(test=E2E + "test_converted_rampup_runs_its_plan[pp2dp2]")),
        applies=lambda s: bool(s.value("rampup_batch_size")) and s.convert_rampup),
    Row(id="rampup", flags=("--rampup-batch-size",), given="--rampup-batch-size without "
        "--ga-convert-rampup",
        support="limited",
        brief="megatron-core >= 0.18 ignores --rampup-batch-size and logs nothing; "
            "--ga-convert-rampup "
              "runs it as a step schedule.", severity="careful",
        text="megatron-core 0.18 and later ignore it and train at the constant "
            "--global-batch-size (0.16 and 0.17 "
        "run their own rampup); --ga-convert-rampup runs it as a step schedule.",
        applies=lambda s: bool(s.value("rampup_batch_size")) and not s.convert_rampup),
    Row(id="lr-schedule", flags=("--lr-decay-samples", "--lr-warmup-samples", "--lr-warmup-fraction",
                                 "--lr-wsd-decay-samples", "--lr-decay-style", "--lr-decay-iters", "--lr-warmup-iters",
                                 "--lr-wsd-decay-iters"),
        given="the learning rate's warmup, decay and WSD lengths (--lr-warmup-samples or "
            "--lr-warmup-fraction, "
        "--lr-decay-samples, --lr-wsd-decay-samples; the --lr-*-iters)", when="with a batch-size "
            "schedule",
        support="limited",
        brief="the learning rate's warmup and decay follow consumed samples across the stages; a "
            "test runs only "
              "linear decay over --train-samples.", severity="careful",
        text="Megatron's scheduler counts samples, each step advancing it by that step's global "
            "batch size; with a "
        "batch-size schedule the extension requires the run's length in samples "
            "(--train-samples: --train-iters is "
        "refused, since Megatron would convert the --lr-*-iters lengths at one constant global "
            "batch), so these "
        "lengths are samples and the learning rate follows the samples consumed across the "
            "stages, and "
        "--ga-batch-size-warmup auto keeps the batch fixed through the LR warmup and a WSD final "
            "decay as they give "
        "them; only the default linear decay over --train-samples is run (step-schedule); "
            f"{NOT_YET} otherwise.",
        applies=lambda s: batch_schedule(s) and any_given("lr_warmup_samples", "lr_warmup_fraction", "lr_decay_samples",
                                                        "lr_wsd_decay_samples", "lr_decay_iters", "lr_warmup_iters",
                                                        "lr_wsd_decay_iters")(s)),
    Row(id="override-iteration-schedule", flags=("--override-ckpt-iteration", "--freeze-all-layers"),
        given="--override-ckpt-iteration (0.19 and later; --freeze-all-layers sets it on a resume)",
        when="with a batch-size schedule (--step-batch-size-schedule or --rampup-batch-size)", support="refused",
        brief="--override-ckpt-iteration assumes one global batch size for every past step, so a "
            "scheduled run would "
              "resume at the wrong stage.",
        text="Megatron sets consumed_train_samples = that iteration x args.global_batch_size, as "
            "if every step before "
        "it had one global batch size: under a batch-size schedule that is not what the run "
            "consumed by that "
        "iteration, so the resumed run would take another stage's batch from there, and its "
            "steps and samples would "
        "not be the uninterrupted run's.",
        instead="Resume from the checkpoint's own iteration (--load, with --ckpt-step to pick "
            "one), or train at a "
        "constant --global-batch-size.",
        applies=lambda s: (s.value("override_ckpt_iteration") is not None or s.on("freeze_all_layers"))
        and batch_schedule(s)),
    Row(id="phase-transitions-schedule", flags=("--phase-transition-iterations",),
        given="--phase-transition-iterations", when="with a batch-size schedule "
            "(--step-batch-size-schedule or "
        "--rampup-batch-size)", support="refused",
        brief="--phase-transition-iterations sizes each phase with one global batch size, so a "
            "schedule's phases "
              "would get the wrong data.",
        text="Megatron puts each phase's boundaries at iteration x args.global_batch_size "
            "samples (its help: it "
        "requires a fixed global batch size across phases), to size each phase's dataset and to "
            "place a resumed run "
        "within its phase: under a batch-size schedule those are not the samples consumed by "
            "each transition "
        "iteration, so a phase's data would be sized for another batch than the schedule trains.",
        instead="Train the phases at a constant --global-batch-size, or drop "
            "--phase-transition-iterations.",
        applies=lambda s: s.value("phase_transition_iterations") is not None and batch_schedule(s)),
    # checkpoints, resume and restarts
    Row(id="checkpoint-resume", flags=("--save", "--load", "--save-interval", "--persistent-save-interval",
                                       "--ckpt-step"),
        given="--save with --save-interval, and --load (with --ckpt-step)", support="supported",
        text="a resumed run reads its iteration, consumed samples and the schedule's stage from "
            "Megatron's checkpoint "
        "and takes the uninterrupted run's steps; under --ga-noise-scale the sidecar saved next "
            "to each persistent "
        "checkpoint continues the EMAs and --ga-batch-size-warmup auto's stages (the tests save "
            "with --ckpt-format "
        "torch).",
        proofs=(*RESUME, Proof(test=E2E + "test_step_schedule_and_resume_mid_schedule[dp2]")),
        applies=any_given("save", "load")),
    Row(id="non-persistent-checkpoints", flags=("--non-persistent-save-interval", "--non-persistent-ckpt-type",
                                                "--non-persistent-global-ckpt-dir", "--non-persistent-local-ckpt-dir",
                                                "--non-persistent-local-ckpt-algo"),
        given="--non-persistent-save-interval N (global or local non-persistent checkpoints)", support="limited",
        brief="a resume from a non-persistent checkpoint restarts the noise-scale averages and "
            "the batch-size warmup. "
              "Not run by a test here.", severity="careful",
        text="a resume from a non-persistent checkpoint restores the iteration, consumed samples "
            "and the schedule's "
        "stage as any checkpoint does, but the extension's sidecar (the --ga-noise-scale EMAs and "
        "--ga-batch-size-warmup auto's stages) is written next to persistent checkpoints only: "
            "resumed from a "
        "non-persistent one, the EMAs start afresh and the batch-size warmup starts again from "
            "--global-batch-size "
        f"(both logged); {NOT_YET}.",
        applies=any_given("non_persistent_save_interval")),
    Row(id="finetune", flags=("--finetune", "--pretrained-checkpoint"),
        given="--finetune (or --pretrained-checkpoint, taken where --load holds no checkpoint)", support="limited",
        brief="--finetune starts at iteration 0, so a batch-size schedule starts from its first "
            "stage. Not run by a "
              "test here.", severity="info",
        text="Megatron loads the weights only and starts at iteration 0 with no consumed "
            "samples: a batch-size "
        "schedule runs from its first stage, and the noise-scale EMAs and --ga-batch-size-warmup "
            "auto start afresh "
        f"(iteration 0 reads no sidecar); {NOT_YET}.",
        applies=any_given("finetune", "pretrained_checkpoint")),
    Row(id="checkpoint-args", flags=("--use-checkpoint-args", "--use-mp-args-from-checkpoint-args"),
        given="--use-checkpoint-args or --use-mp-args-from-checkpoint-args", support="limited",
        brief="--use-checkpoint-args may replace --seq-length and the parallel sizes, so this "
            "ledger can differ from "
              "the run's. Not run by a test.", severity="careful",
        text="Megatron replaces the model's settings (layers, hidden size, --seq-length, ...) or "
            "its tensor- and "
        "pipeline-parallel sizes by the checkpoint's: the run's --seq-length (which turns a "
            "schedule's token "
        "thresholds into samples) and its layout (DP = world / (TP x PP x CP)) can then differ "
            "from the launch "
        "line's, which megatron-ga check reads; install() checks the args Megatron runs with; "
            f"{NOT_YET}.",
        applies=any_given("use_checkpoint_args", "use_mp_args_from_checkpoint_args")),
    Row(id="inprocess-restart", flags=("--inprocess-restart",), given="--inprocess-restart", support="limited",
        brief="--inprocess-restart restarts training in the same process, and the extension's "
            "state carries over. Not "
              "run by a test here.", severity="info",
        text="after a fault, nvidia-resiliency-ext restarts the wrapped training function in the "
            "same process: the "
        "extension's installation (its patches and its state) carries over into the restarted "
            f"run; {NOT_YET}.",
        applies=is_on("inprocess_restart")),
)
# fmt: on
