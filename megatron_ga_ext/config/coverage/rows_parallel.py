"""The coverage rows of data parallelism (DDP, the distributed optimizer, gradient buckets and
precision; FSDP's are rows_fsdp.py's), tensor parallelism, weight sharding and tied embeddings,
context parallelism, RL and packed sequences. Pure Python; the table is
:data:`megatron_ga_ext.config.coverage.rows.ROWS`, in this order.
"""

from __future__ import annotations

from megatron_ga_ext.config.coverage.conditions import (
    above_one,
    any_given,
    batch_schedule,
    gtp_remat,
    in_token_mode,
    is_on,
    pipeline_tied,
)
from megatron_ga_ext.config.coverage.proofs import (
    NO_GPU,
    NOT_YET,
    PACKING,
    PACKING_E2E,
    PACKING_FAULT,
    TOKEN_LOOP,
    verify_layouts,
)
from megatron_ga_ext.config.coverage.row import Proof, Row, Upstream

__all__ = ["PARALLEL_ROWS"]

#: The GRPO loop's loss and batch flags (the rl-step row).
GRPO = (
    "--grpo-prompts-per-step",
    "--grpo-group-size",
    "--grpo-iterations",
    "--grpo-clamp-eps-lower",
    "--grpo-clamp-eps-upper",
    "--grpo-kl-beta",
    "--grpo-entropy-term-weight",
    "--grpo-filter-groups-with-same-reward",
    "--rl-importance-sampling-truncation-coef",
    "--rl-inference-logprobs-is-correction",
    "--rl-skip-bos-token",
    "--rl-partial-rollouts",
    "--rl-generation-lag",
    "--rl-consumption-granularity",
    "--rl-submission-granularity",
    "--rl-max-inflight-requests",
)
# fmt: off
PARALLEL_ROWS: tuple[Row, ...] = (
    # data parallelism
    Row(id="average-in-collective-token", flags=("--ddp-average-in-collective",),
        given="--ddp-average-in-collective", when="in token mode", support="refused",
        brief="--ddp-average-in-collective would divide the gradients by DP x CP too; Megatron's "
            "DDP refuses it with "
              "a per-token loss as well.",
        text="an averaging collective divides the summed token loss by DP x CP before finalize "
            "divides it by N "
        "(Megatron's DDP asserts it is off under --calculate-per-token-loss).",
        instead="Drop --ddp-average-in-collective (off by default).",
        applies=in_token_mode(is_on("ddp_average_in_collective")),
        upstream=(Upstream(
            given="--ddp-average-in-collective with --calculate-per-token-loss",
            effect="Megatron's DDP stops at start-up (\"Cannot average in collective when "
                "calculating per-token "
            "loss!\", every tested source)",
            severity="wrong", fix="Drop --ddp-average-in-collective.",
            applies=lambda s: s.on("calculate_per_token_loss") and s.on("ddp_average_in_collective"),
            drop=("--ddp-average-in-collective",)),)),
    Row(id="yaml-cfg", flags=("--yaml-cfg",), given="--yaml-cfg", support="refused",
        brief="--yaml-cfg replaces the whole command line, so the --ga-* flags and the per-token "
            "switch would never "
              "reach the run.",
        text="Megatron's parse_args replaces the parsed command line by the YAML file's "
            "settings, so the --ga-* flags "
        "and the per-token switch install() sets never reach the args the run is built from.",
        instead="Give the launch's settings as command-line flags (Megatron's and the --ga-* "
            "ones) instead of "
        "--yaml-cfg.",
        applies=lambda s: s.value("yaml_cfg") is not None),
    Row(id="distributed-optimizer-overlap", flags=("--use-distributed-optimizer", "--overlap-grad-reduce"),
        given="--use-distributed-optimizer, --overlap-grad-reduce", support="supported",
        text="the gradients are summed over DP x CP (reduce-scatter, overlapped or not), then "
            "divided once by N.",
        proofs=verify_layouts("DP2 x GA4 (overlapped grad reduce, distributed optimizer)"),
        applies=lambda s: s.on("use_distributed_optimizer") or s.on("overlap_grad_reduce")),
    Row(id="overlap-param-gather", flags=("--overlap-param-gather", "--overlap-param-gather-with-optimizer-step",
                                          "--no-align-param-gather"),
        given="--overlap-param-gather", support="limited",
        brief="--overlap-param-gather overlaps the weight gather with the next step; a skipped "
            "step changes no "
              "weight. Not run by a test.", severity="info",
        text="the parameters' all-gather after the optimizer step overlaps the next forward (or, "
            "with "
        "--overlap-param-gather-with-optimizer-step, its first bucket the step itself; unaligned "
            "across pipeline "
        "stages with --no-align-param-gather); a step skipped under "
        f"--ga-zero-token-policy skip changes no parameter; {NOT_YET}.",
        applies=is_on("overlap_param_gather")),
    Row(id="distributed-optimizer-instances", flags=("--num-distributed-optimizer-instances",),
        given="--num-distributed-optimizer-instances N (N > 1)", support="limited",
        brief="several distributed-optimizer instances give the same gradient sum; "
            "--ga-noise-scale cannot run with "
              "them. Not run by a test.", severity="info",
        text="the gradient is reduce-scattered within each optimizer instance and all-reduced "
            "across the instances, "
        f"then divided by N: the same sum over DP x CP; --ga-noise-scale refuses it; {NOT_YET}.",
        applies=above_one("num_distributed_optimizer_instances")),
    Row(id="grad-reduce-buckets", flags=("--ddp-bucket-size", "--ddp-num-buckets",
                                         "--ddp-pad-buckets-for-high-nccl-busbw", "--no-align-grad-reduce",
                                         "--disable-align-grad-reduce"),
        given="--ddp-bucket-size, --ddp-num-buckets, --ddp-pad-buckets-for-high-nccl-busbw or "
            "--no-align-grad-reduce",
        support="limited",
        brief="gradient bucket settings change when pieces of the gradient are reduced, not the "
            "sum. Not run by a "
              "test here.", severity="info",
        text="they change how Megatron's DDP splits the gradient's sum over DP x CP into buckets "
            "and when each "
        "bucket's collective starts (aligned across pipeline stages or not), not the sum or its "
            "1/N; the noise-scale "
        f"meter reads each bucket group as its reduction starts; {NOT_YET}.",
        applies=any_given("ddp_bucket_size", "ddp_num_buckets", "ddp_pad_buckets_for_high_nccl_busbw",
                       "align_grad_reduce")),
    Row(id="grad-reduce-bf16", flags=("--grad-reduce-in-bf16",), given="--grad-reduce-in-bf16 "
        "(with --bf16)",
        support="limited",
        brief="--grad-reduce-in-bf16 adds and reduces gradients in bf16: every token keeps its "
            "weight, with less "
              "precision. Not run by a test.", severity="careful",
        text="the main gradients are bf16: each micro-batch's gradient is added into them, "
            "summed over DP x CP and "
        "divided by N in bf16, so every token keeps its weight and each gradient loses precision "
            "(the parameters "
        "--ddp-param-name-patterns-for-fp32-local-accumulation names add their micro-batches in "
            "fp32); "
        f"{NOT_YET}.",
        applies=is_on("grad_reduce_in_bf16")),
    Row(id="fp32-local-accumulation", flags=("--ddp-param-name-patterns-for-fp32-local-accumulation",),
        given="--ddp-param-name-patterns-for-fp32-local-accumulation (0.17 and later)", support="limited",
        brief="the named parameters accumulate in fp32 and every token keeps its weight; "
            "--ga-noise-scale cannot run "
              "with it. Not run by a test.", severity="info",
        text="the parameters it names add their micro-batch gradients into an fp32 main_grad "
            "apart from the bf16 "
        "buffer; upstream copies it into the buffer before the reduction and back after, and "
            "scales both by 1/N, "
        "so every token keeps its weight; --ga-noise-scale refuses it: its norms read only the "
            "parameters whose "
        "main_grad lies in the buffer (core_v0.19.0 param_and_grad_buffer.py:1363-1384 gives the "
            "matched ones a "
        "main_grad apart, which :643-647 copies in only as the reduction starts), so it would "
            "leave them out, and with "
        f"the pattern all every parameter (each estimate 0 / 0); {NOT_YET}.",
        applies=lambda s: bool(s.names("ddp_param_name_patterns_for_fp32_local_accumulation"))),
    Row(id="fp32-grad-reduce", flags=("--accumulate-allreduce-grads-in-fp32",
                                      "--ddp-reduce-scatter-with-fp32-accumulation"),
        given="--accumulate-allreduce-grads-in-fp32 or "
            "--ddp-reduce-scatter-with-fp32-accumulation", support="limited",
        brief="fp32 gradient accumulation or reduction: the same sum in another precision. Not "
            "run by a test here.",
        severity="info",
        text="the first keeps the main gradients in fp32 (Megatron turns it on under --bf16 unless "
        "--grad-reduce-in-bf16 or a bf16 --main-grads-dtype), the second sends bf16 over the "
            "wire and adds in fp32: "
        f"the same sum over DP x CP and the same 1/N, in another precision; {NOT_YET}.",
        applies=any_given("accumulate_allreduce_grads_in_fp32", "ddp_reduce_scatter_with_fp32_accumulation")),
    Row(id="precision-aware-optimizer", flags=("--use-precision-aware-optimizer", "--main-grads-dtype"),
        given="--use-precision-aware-optimizer (with --main-grads-dtype)", support="limited",
        brief="the precision-aware optimizer keeps gradients in --main-grads-dtype; every token "
            "keeps its weight. Not "
              "run here (needs Transformer Engine).", severity="info",
        text="Transformer Engine's FusedAdam keeps the main gradients in --main-grads-dtype "
            "(fp32 unless given): the "
        "sum over micro-batches and over DP x CP and the 1/N run in that precision, every "
            "token's weight unchanged; "
        f"{NO_GPU} (Transformer Engine).",
        applies=any_given("use_precision_aware_optimizer", "main_grads_dtype")),
    Row(id="gradient-accumulation-fusion", flags=("--no-gradient-accumulation-fusion",),
        given="--no-gradient-accumulation-fusion", support="supported",
        text="the backward's hook adds each micro-batch's weight gradient into main_grad (rather "
            "than the wgrad GEMM, "
        "Megatron's default where its CUDA extension is built): each is added once, then reduced "
            "and divided by N; "
        "the end-to-end runs train this way (the fused default is not run here).",
        proofs=TOKEN_LOOP,
        applies=lambda s: not s.value("gradient_accumulation_fusion")),
    Row(id="fake-process-group", flags=("--fake-process-group",), given="--fake-process-group", support="limited",
        brief="--fake-process-group skips every collective: counts and sums cover one rank, so "
            "no step trains as the "
              "real launch would.", severity="careful",
        text="a memory-profiling mode: every collective is skipped, so N, the gradient's sums "
            "and the noise scale "
        f"cover this rank only, and no step trains as the launch would; {NOT_YET}.",
        applies=is_on("fake_process_group")),
    # tensor parallelism, weight sharding, tied embeddings
    Row(id="gtp", flags=("--tensor-parallel-num-weight-shards", "--expert-tensor-parallel-num-weight-shards",
                         "--gtp-remat-reduce-scatter-with-fp32-accumulation", "--gtp-remat-opt-in-modules",
                         "--gtp-remat-nccl-ub", "--gtp-expert-remat-nccl-ub"),
        given="--tensor-parallel-num-weight-shards N above --tensor-model-parallel-size (or "
        "--expert-tensor-parallel-num-weight-shards N above the experts' tensor-parallel size): "
            "GTP weight "
        "rematerialization (0.19 and later)", support="refused",
        brief="GTP weight rematerialization reduces gradients outside the data-parallel "
            "reduction the checks cover, "
              "and no test has run a GTP step.",
        text="GTP shards each weight over an extra axis whose ranks take distinct data "
            "(Megatron's data-parallel size "
        "becomes the replicate degree, and the micro-batches are spread over replicate DP x GTP) "
            "and reduce-scatters "
        "the weight gradients over that axis inside the backward pass, outside the data-parallel "
            "reduction the "
        "extension's finalize, its checks and the noise-scale meter are built around; the token "
            "count's group spans "
        "the axis, but no test has run a GTP step, so the extension cannot say that every token "
            "keeps its weight "
        "(and --ga-noise-scale refuses --tensor-parallel-num-weight-shards above "
            "--tensor-model-parallel-size on its "
        "own account: the gradient it reads before the data-parallel reduction already sums the "
            "GTP ranks' samples).",
        instead="Keep --tensor-parallel-num-weight-shards at --tensor-model-parallel-size (and "
        "--expert-tensor-parallel-num-weight-shards at the experts' tensor-parallel size): no "
            "GTP weight "
        "rematerialization.",
        applies=gtp_remat),
    Row(id="tensor-parallel", flags=("--tensor-model-parallel-size",), given="--tensor-model-parallel-size "
        "N (N > 1)",
        support="limited",
        brief="tensor parallelism: every TP rank counts the same tokens; megatron-ga verify runs "
            "TP 2 only with "
        "sequence parallelism (an MoE model).",
        severity="info",
        text="every TP rank of a replica computes the same loss over the same tokens, so N sums "
            "the count over DP x CP "
        "only, and finalize's reductions over TP (sequence-parallel and q/k layernorm gradients) "
            "run before the "
        "division by N; verify runs TP 2 with sequence parallelism (an MoE GPT, the row below); "
            "TP without sequence "
        "parallelism is not run by a test (tests/test_noise_scale_gpt.py measures the noise "
            "scale on TP 2 x DP 2).",
        applies=above_one("tensor_model_parallel_size")),
    Row(id="sequence-parallel", flags=("--sequence-parallel",), given="--sequence-parallel", support="supported",
        text="each TP rank holds the gradient of its sequence shard for the parameters marked "
            "sequence_parallel (the "
        "layer norms) until finalize all-reduces them over TP, before the division by N; the "
            "noise-scale meter "
        "leaves those parameters out of its norms.",
        proofs=verify_layouts("TP2 x DP2 x GA4 (MoE, sequence parallel)"),
        applies=is_on("sequence_parallel")),
    Row(id="qk-layernorm", flags=("--qk-layernorm",),
        given="--qk-layernorm with --tensor-model-parallel-size N (N > 1)", support="limited",
        brief="--qk-layernorm under TP: gradients are right, but --ga-noise-scale without "
            "--sequence-parallel misses "
              "part of their norm.", severity="careful",
        text="each TP rank's q/k layernorm gradient covers only its own attention heads until "
            "finalize sums it over TP "
        "(every tested source does, before the division by N), so every token keeps its weight; "
            "under "
        "--ga-noise-scale, where these weights carry no sequence_parallel mark (without "
            "--sequence-parallel), the "
        "meter counts TP rank 0's partial gradient of them as the replica's whole one (it reads "
            "the buckets before "
        f"that sum), so their part of the measured |S_r|^2 is not the replica's; {NOT_YET}.",
        applies=lambda s: s.on("qk_layernorm") and s.number("tensor_model_parallel_size") > 1),
    Row(id="tied-embeddings-pipeline", flags=("--untie-embeddings-and-output-weights",),
        given="tied embeddings (no --untie-embeddings-and-output-weights) with "
            "--pipeline-model-parallel-size N "
        "(N > 1)", support="supported",
        text="the first and the last stage each hold the word embedding; finalize sums their "
            "gradients of it over the "
        "embedding group before the division by N.",
        proofs=(TOKEN_LOOP[1], *verify_layouts("PP2 x DP2 x GA4")),
        applies=pipeline_tied(untied=False)),
    Row(id="untied-embeddings-pipeline", flags=("--untie-embeddings-and-output-weights",),
        given="--untie-embeddings-and-output-weights with --pipeline-model-parallel-size N (N > "
            "1)", support="limited",
        brief="untied embeddings under pipeline parallelism: two separate weights, nothing to "
            "sum across stages. Not "
              "run by a test here.", severity="info",
        text="the input embedding (first stage) and the output layer (last stage) are separate "
            "weights, with no "
        f"gradient to sum across stages; {NOT_YET}.",
        applies=pipeline_tied(untied=True)),
    # context parallelism, packed sequences
    Row(id="context-parallel", flags=("--context-parallel-size",), given="--context-parallel-size "
        "N (N > 1)",
        support="supported",
        text="each CP shard counts its own loss tokens and N sums them over DP x CP; microbatch "
            "mode is upstream's "
        "per-shard mean; --ga-noise-scale refuses it (the CP shards of one sequence are not "
            "independent replicas).",
        proofs=verify_layouts("CP2 x DP2 x GA4 (position-wise)"), applies=above_one("context_parallel_size")),
    Row(id="hybrid-context-parallel", flags=("--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank"),
        given="--hybrid-context-parallel",
        support="limited",
        brief="--hybrid-context-parallel regroups sequences, so it needs --no-ga-guards; the "
            "token counts still hold. "
              "Not run by a test here.", severity="careful",
        text="it regroups sequences into micro-batches of its own, so the micro-batch guards "
            "must be off "
        "(--no-ga-guards, checked); the token count and its checks hold; --ga-noise-scale "
            "refuses it (a sequence "
        "split over several data-parallel ranks makes their gradients dependent: core_v0.19.0 "
        f"core/datasets/data_schedule.py:12-26); {NOT_YET}.",
        applies=is_on("hybrid_context_parallel")),
    Row(id="hybrid-context-parallel-schedule", flags=("--hybrid-context-parallel", "--step-batch-size-schedule",
                                                      "--rampup-batch-size"),
        given="--hybrid-context-parallel", when="with a batch-size schedule "
            "(--step-batch-size-schedule or "
        "--rampup-batch-size)", support="refused",
        brief="hybrid context parallelism reads one fixed global batch per step, so a batch-size "
            "schedule would train "
              "other batches than it counts.",
        text="its sampler reads one global batch per step, of args.global_batch_size samples, "
            "fixed when the data "
        "loader is built (core_v0.19.0 training/datasets/data_samplers.py:41 and :49-56; "
            "num_micro_batches at :197; "
        "the same on every tested source; main after d98e8a64 with --sequence-packing-scheduler "
            "packs the batches "
        "itself instead, which no test runs with hybrid CP), while the loop advances consumed "
            "samples by the "
        "schedule's global batch "
        "(training.py:3936-3942): with a step schedule args.global_batch_size is MBS x DP "
            "(arguments.py:684-685), so "
        "each step would train on another batch than the one the schedule, its learning rate and "
            "the checkpoints "
        "count (--ga-batch-size-warmup auto needs --ga-noise-scale, which refuses "
            "--hybrid-context-parallel).",
        instead="Train hybrid context parallelism at a constant --global-batch-size, or drop "
        "--hybrid-context-parallel.",
        applies=lambda s: s.on("hybrid_context_parallel") and batch_schedule(s)),
    Row(id="rl-sequence-packing", flags=("--perform-rl-step", "--rl-use-sequence-packing", "--rl-sequence-packing-algo",
                                         "--rl-sequence-packing-max-sequences-per-bin"),
        given="--perform-rl-step --rl-use-sequence-packing", support="limited",
        brief="packed RL batches need --no-ga-guards; a bin without loss tokens counts as 1 "
            "token (upstream's GRPO "
              "loss). Not run by a test.", severity="careful",
        text="packed RL batches count bins, not samples, so the micro-batch guards must be off "
            "(--no-ga-guards, "
        "checked); the token count and its checks hold, but for a bin without loss tokens, which "
            "upstream's GRPO loss "
        f"function reports as 1 token (see rl-step); {NOT_YET}.",
        applies=lambda s: s.on("perform_rl_step") and s.on("rl_use_sequence_packing")),
    Row(id="rl-step", flags=("--perform-rl-step", *GRPO), given="--perform-rl-step (GRPO)", support="limited",
        brief="RL (GRPO): a micro-batch without loss tokens counts as 1 token, so the token "
            "count runs slightly high. "
              "Not run by a test here.", severity="careful",
        text="Megatron's RL loop trains on the rollouts it generates: a round's "
            "--grpo-prompts-per-step x "
        "--grpo-group-size x --grpo-iterations rollouts must be a multiple of "
            "--global-batch-size, and each training "
        "step takes one global batch of them; its GRPO loss function (train_rl.py: the clipped "
            "ratio, the KL, entropy "
        "and importance-sampling terms) returns the loss summed over the loss mask with the "
            "mask's token count, "
        "except that a micro-batch without loss tokens reports 1 token, so N counts one token "
            "more per such "
        f"micro-batch and the zero-token policy does not see it; {NOT_YET}.",
        applies=is_on("perform_rl_step")),
    Row(id="rl-context-parallel-token", flags=("--perform-rl-step", "--context-parallel-size"),
        given="--perform-rl-step with --context-parallel-size N (N > 1)", when="in token mode", support="refused",
        brief="before Megatron-LM main dd8c825b3ad5, the GRPO loss is CP times too large under "
            "context parallelism.",
        text="Megatron-LM's GRPO loss function (train_rl.py) multiplies each micro-batch's "
            "summed loss by "
        "--context-parallel-size on every tested source before main@dd8c825b3ad5, while the "
            "token count it returns "
        "is the CP shard's: there the token-mode gradient would be CP times its target, and no "
            "test has run RL under "
        "CP on the sources without that factor.",
        instead="Train RL with --context-parallel-size 1, or with --ga-loss-reduction microbatch "
            "(without "
        "--calculate-per-token-loss).",
        applies=in_token_mode(lambda s: s.on("perform_rl_step") and s.number("context_parallel_size") > 1),
        upstream=(Upstream(
            given="--perform-rl-step with --context-parallel-size N (N > 1) and "
                "--calculate-per-token-loss",
            effect="Megatron-LM's GRPO loss multiplies each micro-batch's summed loss by CP "
                "while its token count is "
            "the shard's, so the gradient is CP times the per-token target (every tested source "
                "before "
            "main@dd8c825b3ad5)",
            severity="wrong", fix="Train RL with --context-parallel-size 1, or from Megatron-LM "
                "main at or after "
            "dd8c825b3ad5.",
            applies=lambda s: s.on("calculate_per_token_loss") and s.on("perform_rl_step")
            and s.number("context_parallel_size") > 1),)),
    Row(id="packed-sequences", flags=("--sft", "--dataloader-inter-document-masking"),
        given="packed sequences (THD: --sft, --dataloader-inter-document-masking)", support="limited",
        brief="packed sequences (THD): each micro-batch still counts its own loss tokens. Not "
            "run by a test here.",
        severity="info",
        text="each micro-batch's loss mask still counts its loss tokens, so N and its checks "
            f"hold; {NOT_YET}.",
        applies=lambda s: s.on("sft") or s.on("dataloader_inter_document_masking")),
    # the sequence-packing scheduler in the loop (main after d98e8a64, #6742)
    Row(id="sequence-packing-scheduler", flags=("--sequence-packing-scheduler", "--use-varlen-dataset"),
        given="--sequence-packing-scheduler dp_balanced (--use-varlen-dataset selects it; main "
            "after d98e8a64)",
        support="limited",
        brief="the packing scheduler's own micro-batch count is guarded per call; run on the "
            "CPU, not with TE "
              "attention, MoE, VPP or CP.", severity="info",
        text="train_step repacks each step's GBS samples into THD micro-batches of the "
            "scheduler's own number "
        "(wrap_data_iterator) and calls the schedule with it: the micro-batch guard follows that "
            "count for each call "
        "(an integer >= 1, the one the scheduler returned; a call with another is stopped before "
            "it reads the packed "
        "iterator), consumed samples and the learning rate still advance by exactly GBS per step "
            "(guarded), and N "
        "sums the loss tokens of every packed micro-batch. Proven on the CPU at DP 2 and PP 2 x "
            "DP 2: upstream's "
        "train_step and scheduler (a position-wise model: the gradient equals the unpartitioned "
            "token-level one), and "
        "pretrain_gpt.py equal to upstream's own per-token run, with two stand-ins for "
            "Transformer Engine "
        "(TransformerConfig requires TE >= 2.9 for the scheduler, and the local attention "
            "refuses packed sequences, "
        "so it attends a packed micro-batch as one sequence); TE's THD attention, MoE, VPP and "
            "CP under the scheduler "
        "are not run.",
        proofs=(Proof(test=PACKING), Proof(test=PACKING_E2E + "[dp2]"), Proof(test=PACKING_E2E + "[pp2dp2]"),
                Proof(test=PACKING_FAULT)),
        applies=lambda s: s.value("sequence_packing_scheduler") is not None
        or (s.on("use_varlen_dataset") and not s.on("varlen_sbhd_validation"))),
    Row(id="varlen-sbhd-validation", flags=("--varlen-sbhd-validation",),
        given="--use-varlen-dataset --varlen-sbhd-validation", support="limited",
        brief="variable-length data padded to --seq-length: every check holds. Not run by a test "
            "here (it needs a "
              "real dataset).", severity="info",
        text="no packing scheduler runs (Megatron refuses one there): samples are right-padded "
            "to --seq-length and "
        "each micro-batch's loss mask counts its loss tokens, as for any dataset, so the guards "
            "and N hold; it needs a "
        f"real dataset (Megatron refuses --mock-data there); {NOT_YET}.",
        applies=lambda s: s.on("use_varlen_dataset") and s.on("varlen_sbhd_validation")),
)
# fmt: on
