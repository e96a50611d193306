"""Megatron's flags off the loss, gradient, step and batch path, each with the reason it is off.
Pure Python.

The path is what the extension guarantees and checks: which tokens count (the loss mask and N), how
each micro-batch's summed loss and each auxiliary loss term is weighted, how the gradients are
accumulated over micro-batches, reduced over DP x CP (and TP, PP, EP where finalize does) and
divided by N, in what precision that accumulation and reduction runs, how many micro-batches and
samples a step has, when the optimizer steps or skips, whether the extension's hooks run (schedule,
loss, finalize, optimizer step), and what a resume restores. The coverage table (config/coverage/)
has a row for every flag on it. Every other flag of every tested Megatron parser is listed here, one
by one, under a theme whose reason holds for each flag of it (read from the flag's help and its use
in megatron/training and megatron/core at the tested sources): what only changes the values the
model computes for a token (architecture, initialization, kernels and their numeric formats), what
the optimizer does with the reduced, 1/N-scaled gradient, and what lies outside training steps
(data, tokenizer, logging, profiling, inference, rollout generation, checkpoint storage, fault
tolerance).

tests/test_coverage_complete.py holds every tested parser to the two lists: a flag in neither (one a
new source adds) fails it until someone reads it and gives it a row or a reason here. ``make docs``
renders the themes into docs/coverage.md. The themes outside training steps are in
config/off_path_outside.py; the Theme type is config/off_path_theme.py.
"""

from __future__ import annotations

from megatron_ga_ext.config.off_path_outside import OUTSIDE_STEPS
from megatron_ga_ext.config.off_path_theme import Theme

__all__ = ["OFF_PATH", "PENDING", "THEMES", "Theme"]


# fmt: off
THEMES: tuple[Theme, ...] = (
    Theme(name="argparse", reason="argparse's help: it prints the flags and exits before "
        "anything runs.",
          flags=("-h", "--help")),
    Theme(name="retired", reason="retired: Megatron's validate_args stops at start-up when it is "
        "given, naming the "
          "flag to use instead.",
          flags=("--batch-size", "--warmup", "--model-parallel-size")),
    Theme(name="no-op", reason="a deprecated no-op (its help says so): the parser takes it and "
        "nothing acts on it.",
          flags=("--disable-async-tensor-model-parallel-allreduce", "--no-async-tensor-model-parallel-allreduce",
                 "--moe-extended-tp", "--fp8-interval", "--use-mcore-models", "--disable-msc")),
    Theme(name="attention and positions", reason="model architecture (attention, heads, "
        "positions, rotary and YaRN "
          "settings, MLA, DSA's indexer, linear attention): what the model computes for each "
              "token, not which tokens "
          "count, how their losses are weighted or how the gradient is reduced.",
          flags=("--add-qkv-bias", "--attention-dropout", "--attention-output-gate", "--group-query-attention",
                 "--kv-channels", "--num-attention-heads", "--num-query-groups", "--qk-l2-norm", "--softmax-type",
                 "--window-size", "--window-attn-skip-freq", "--position-embedding-type", "--max-position-embeddings",
                 "--no-position-embedding", "--use-rotary-position-embeddings", "--rotary-base", "--rotary-percent",
                 "--rotary-interleaved", "--rotary-seq-len-interpolation-factor", "--rope-scaling-factor",
                 "--use-rope-scaling", "--rope-type", "--no-rope-freq", "--mrope-section", "--yarn-beta-fast",
                 "--yarn-beta-slow", "--yarn-correction-range-round-to-int", "--no-yarn-correction-range-round-to-int",
                 "--yarn-original-max-position-embeddings", "--relative-attention-max-distance",
                 "--relative-attention-num-buckets", "--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank",
                 "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim", "--rotary-scaling-factor", "--mscale",
                 "--mscale-all-dim", "--dsa-indexer-head-dim", "--dsa-indexer-k-norm-epsilon",
                 "--dsa-indexer-k-norm-fp32", "--dsa-indexer-n-heads", "--dsa-indexer-rope-interleaved",
                 "--dsa-indexer-skip-topk-offset", "--dsa-indexer-topk", "--dsa-indexer-topk-freq",
                 "--disable-dsa-indexer-rotate-activation", "--no-dsa-indexer-rotate-activation",
                 "--disable-dsa-indexer-scoring-relu", "--no-dsa-indexer-scoring-relu", "--linear-attention-freq",
                 "--linear-conv-kernel-dim", "--linear-key-head-dim", "--linear-num-key-heads",
                 "--linear-num-value-heads", "--linear-value-head-dim")),
    Theme(name="layers and sizes", reason="model architecture (sizes, activations, biases, "
        "dropout, normalization, "
          "residual streams, Mamba and gated-delta layers, the layer spec and mix, vocabulary "
              "padding): what the model "
          "computes for each token, not which tokens count, how their losses are weighted or how "
              "the gradient is "
          "reduced.",
          flags=("--hidden-size", "--ffn-hidden-size", "--activation-func-clamp-value", "--glu-linear-offset",
                 "--swiglu", "--squared-relu", "--quick-geglu", "--openai-gelu", "--disable-bias-linear",
                 "--hidden-dropout", "--normalization", "--norm-epsilon", "--apply-layernorm-1p",
                 "--apply-residual-connection-post-layernorm", "--enable-mhc-connections", "--mhc-init-gating-factor",
                 "--mhc-num-residual-streams", "--mhc-sinkhorn-iterations", "--mamba-head-dim", "--mamba-num-groups",
                 "--mamba-num-heads", "--mamba-state-dim", "--gdp-num-householder",
                 "--heterogeneous-layers-config-path", "--heterogeneous-layers-config-encoded-json", "--spec",
                 "--hybrid-attention-ratio", "--hybrid-mlp-ratio", "--encoder-num-layers",
                 "--make-vocab-size-divisible-by", "--bert-no-binary-head")),
    Theme(name="MoE architecture and routing", reason="MoE architecture and routing (expert "
        "sizes and layers, shared "
          "experts, the router's top-k, scores, groups, dtype, jitter, forced or replayed "
              "routes): which experts a "
          "token goes to and how their outputs mix, not the token count; the weighting of the "
              "load-balancing terms is "
          "the router rows'.",
          flags=("--moe-ffn-hidden-size", "--moe-layer-freq", "--moe-latent-size",
                 "--moe-shared-expert-intermediate-size", "--moe-shared-expert-gate", "--moe-apply-probs-on-input",
                 "--moe-router-topk", "--moe-router-score-function", "--moe-router-pre-softmax",
                 "--moe-router-num-groups", "--moe-router-group-topk", "--moe-router-topk-scaling-factor",
                 "--moe-router-dtype", "--moe-input-jitter-eps", "--moe-router-force-biased",
                 "--moe-router-force-load-balancing", "--moe-enable-routing-replay")),
    Theme(name="expert capacity", reason="expert capacity and token dropping: which routed "
        "tokens an expert computes "
          "(a dropped token keeps its residual path), not which tokens the loss counts.",
          flags=("--moe-expert-capacity-factor", "--moe-token-drop-policy", "--moe-pad-expert-input-to-capacity")),
    Theme(name="dispatch padding", reason="the token dispatcher pads each expert's tokens to a "
        "multiple of 16 or 32 "
          "for quantized GEMMs, after routing: the router's statistics and the loss tokens are "
              "unchanged.",
          flags=("--moe-router-padding-for-quantization", "--moe-router-padding-for-fp8")),
    Theme(name="ncclep static shape", reason="an option of the flex dispatcher's ncclep backend "
        "(the experts get its "
          "fixed-size receive buffer, not the received count), classified with the flex "
              "dispatcher (the "
          "dispatcher-flex row) but not named there: only core_v0.19.0 and main@9f3fe8c925fb "
              "define it.",
          flags=("--moe-ncclep-static-shape",)),
    Theme(name="MTP architecture", reason="multi-token prediction's layers, inputs and pipeline "
        "placement: which "
          "parameters the MTP loss reaches, not how it is weighted (the mtp row).",
          flags=("--mtp-detach-heads", "--mtp-hsm", "--mtp-hybrid-override-pattern", "--mtp-standalone",
                 "--mtp-use-repeated-layer")),
    Theme(name="MuP", reason="MuP's width multipliers (initialization, attention scale, "
        "embedding and output "
          "activations, learning rates per parameter group): model and optimizer settings, not "
              "the loss weighting or "
          "the gradient reduction.",
          flags=("--use-mup", "--mup-attn-scale-power", "--mup-base-head-dim", "--mup-base-hidden-size",
                 "--mup-embedding-mult", "--mup-output-mult", "--mup-width-mult")),
    Theme(name="initialization", reason="initialization: the weights a run starts from (with "
        "--no-initialization, "
          "left to a checkpoint load; with upcycling, a dense checkpoint converted to MoE).",
          flags=("--init-method-std", "--embedding-init-method-std", "--init-method-xavier-uniform",
                 "--no-initialization", "--use-cpu-initialization", "--moe-use-upcycling",
                 "--moe-upcycling-granularity")),
    Theme(name="per-replica initialization", reason="each data-parallel replica starts from its "
        "own random weights "
          "(Megatron then skips the broadcast from DP rank 0): initialization, not how the "
              "replicas' gradients are "
          "weighted or summed.",
          flags=("--data-parallel-random-init",)),
    Theme(name="random numbers", reason="random-number generators: which random draws "
        "(initialization, dropout, "
          "sampling) a run makes.",
          flags=("--seed", "--te-rng-tracker", "--inference-rng-tracker")),
    Theme(name="kernels and implementations", reason="the implementation or kernel of a "
        "computation in the forward "
          "and backward passes (Transformer Engine, Megatron-Core's local modules or the legacy "
              "models, attention "
          "backends, fusions, grouped GEMMs, deterministic or batch-invariant kernels, chunked "
              "MLPs): the same "
          "arithmetic by other code.",
          flags=("--transformer-impl", "--use-legacy-models", "--attention-backend", "--flash-attention-version",
                 "--use-flash-attn", "--use-kitchen-attention", "--kitchen-attention-backend",
                 "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "--no-bias-dropout-fusion",
                 "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-masked-softmax-fusion",
                 "--no-persist-layer-norm", "--no-rope-fusion", "--fused-residual-rmsnorm",
                 "--use-fused-weighted-squared-relu", "--use-te-activation-func", "--use-transformer-engine-op-fuser",
                 "--use-grouped-gemm-for-dense-mlp", "--use-grouped-gemm-for-shared-expert", "--moe-grouped-gemm",
                 "--moe-use-grouped-tensor", "--moe-single-grouped-weight", "--moe-single-grouped-bias",
                 "--moe-use-legacy-grouped-gemm", "--moe-permute-fusion", "--moe-mlp-glu-interleave-size",
                 "--moe-shared-expert-glu-interleave-size", "--moe-shared-expert-overlap", "--disable-jit-fuser",
                 "--batch-invariant-mode", "--batch-invariant-backend", "--deterministic-mode",
                 "--mla-down-proj-fusion", "--gdp-cutedsl-kernel", "--dsa-kernel-backend",
                 "--disable-mamba-mem-eff-path", "--mlp-chunks-for-training", "--onnx-safe")),
    Theme(name="numeric formats", reason="the numeric format of the forward and backward "
        "computation (FP8 or FP4 "
          "GEMMs and their recipes, layers kept in bf16, fp32 softmax or residuals, the dtype of "
              "the logits and of the "
          "per-token cross entropy): the values each token's loss and gradient take, not which "
              "tokens count, their "
          "weights or the precision of the gradient's accumulation and reduction.",
          flags=("--fp8-format", "--fp8-recipe", "--fp8-margin", "--fp8-amax-history-len", "--fp8-amax-compute-algo",
                 "--fp8-quantizer-factory", "--fp8-output-proj", "--fp4-format", "--fp4-recipe",
                 "--fp4-quantizer-factory", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16",
                 "--num-layers-at-end-in-bf16", "--disable-fp8-wgrad", "--no-fp8-wgrad", "--te-precision-config-file",
                 "--disable-bf16-reduced-precision-matmul", "--attention-softmax-in-fp32",
                 "--apply-query-key-layer-scaling", "--fp32-residual-connection", "--fp16-lm-cross-entropy",
                 "--output-logit-dtype", "--mamba-training-ssm-states-dtype")),
    Theme(name="quantized parameter gather", reason="parameters kept in FP8 or FP4 and "
        "all-gathered in that format "
          "after the optimizer step (MXFP8 may stage the gather in the gradient buffer, which "
              "upstream clears after "
          "it): after the step has consumed the reduced gradient.",
          flags=("--fp8-param-gather", "--fp4-param-gather", "--reuse-grad-buf-for-mxfp8-param-ag")),
    Theme(name="activation memory", reason="activation memory and garbage collection "
        "(recomputation, CPU offloading, "
          "buffer release, emptying the cache): what is kept, recomputed or moved between the "
              "forward and the "
          "backward, not what is computed.",
          flags=("--recompute-granularity", "--recompute-method", "--recompute-modules", "--recompute-num-layers",
                 "--recompute-activations", "--checkpoint-activations", "--moe-layer-recompute",
                 "--distribute-saved-activations", "--cpu-offloading-num-layers",
                 "--cpu-offloading-retain-pinned-cpu-buffers", "--fine-grained-activation-offloading",
                 "--fine-grained-offloading-max-inflight-offloads", "--offload-modules", "--min-offloaded-tensor-size",
                 "--activation-offload-fraction", "--delay-offload-until-cuda-graph",
                 "--delta-offload-bytes-across-pp-ranks", "--mhc-recompute-layer-num",
                 "--gdp-num-chunk-states-to-recompute", "--disable-clone-scatter-output-in-embedding",
                 "--no-clone-scatter-output-in-embedding", "--empty-unused-memory-level", "--manual-gc",
                 "--manual-gc-interval", "--disable-manual-gc-eval", "--no-manual-gc-eval")),
    Theme(name="tensor-parallel communication overlap", reason="how the tensor-parallel "
        "collectives of activations "
          "and their gradients overlap GEMMs inside the forward and backward (userbuffers, bulk "
              "and split overlaps, "
          "their bootstrap and config file): when they run, not what they compute.",
          flags=("--tp-comm-overlap", "--tp-comm-overlap-rs-dgrad", "--tp-comm-overlap-cfg",
                 "--tp-comm-bootstrap-backend", "--disable-tp-comm-bulk-dgrad", "--no-tp-comm-bulk-dgrad",
                 "--disable-tp-comm-bulk-wgrad", "--no-tp-comm-bulk-wgrad", "--disable-tp-comm-overlap-ag",
                 "--no-tp-comm-overlap-ag", "--disable-tp-comm-overlap-rs", "--no-tp-comm-overlap-rs",
                 "--disable-tp-comm-split-ag", "--no-tp-comm-split-ag", "--disable-tp-comm-split-rs",
                 "--no-tp-comm-split-rs")),
    Theme(name="context-parallel communication", reason="how attention exchanges keys and values "
        "between "
          "context-parallel ranks (p2p, a2a, all-gather, their hierarchy): each CP shard's "
              "tokens, their count and the "
          "gradient reduction over DP x CP are the same.",
          flags=("--cp-comm-type", "--hierarchical-context-parallel-sizes")),
    Theme(name="pipeline communication", reason="how activations and their gradients pass "
        "between pipeline stages "
          "(overlap, ring exchange, scatter/gather, the backend): each stage runs the same "
              "micro-batches.",
          flags=("--no-overlap-p2p-communication", "--overlap-p2p-communication-warmup-flush",
                 "--use-ring-exchange-p2p", "--pipeline-model-parallel-comm-backend",
                 "--no-scatter-gather-tensors-in-pipeline")),
    Theme(name="collective transport", reason="the transport of collectives (NCCL user buffers "
        "and symmetric "
          "registration, symmetric all-reduce, SHARP, communicator configs, stream priorities, "
              "an extra all-gather "
          "group, the backend, its timeouts, Gloo groups, the flight recorder): where and how a "
              "collective runs, not "
          "what it sums.",
          flags=("--use-nccl-ub", "--disable-symmetric-registration", "--symmetric-ar-type", "--use-sharp",
                 "--sharp-enabled-group", "--nccl-communicator-config-path", "--high-priority-stream-groups",
                 "--create-all-gather-group", "--distributed-backend", "--distributed-timeout-minutes",
                 "--distributed-timeout-seconds-after-init", "--disable-gloo-process-groups",
                 "--flight-recorder-dump-path", "--flight-recorder-include-stack-trace",
                 "--flight-recorder-trace-buffer-size", "--disable-flight-recorder-dump-on-timeout",
                 "--no-flight-recorder-dump-on-timeout", "--disable-flight-recorder-extra-dump-on-exec",
                 "--no-flight-recorder-extra-dump-on-exec", "--disable-flight-recorder-include-only-active",
                 "--no-flight-recorder-include-only-active")),
    Theme(name="rank order", reason="the order in which ranks are assigned to groups "
        "(tp-cp-ep-pp-dp instead of "
          "tp-cp-ep-dp-pp): which ranks form each group, not the groups' sizes, so DP and the "
              "batch arithmetic are "
          "the same.",
          flags=("--use-tp-pp-dp-mapping",)),
    Theme(name="launcher hand-over", reason="how the launcher hands over the local rank, and "
        "when the model-parallel "
          "groups are built (--lazy-mpu-init, for an external DDP manager): the same groups once "
              "built.",
          flags=("--local-rank", "--lazy-mpu-init")),
    Theme(name="optimizer", reason="the optimizer's update rule and settings (its kind, betas, "
        "epsilon, momentum, "
          "Muon's Newton-Schulz settings, weight decay and its schedule, gradient clipping, q/k "
              "clipping, CPU offload, "
          "state dtypes and layout, parameter groups): what the step does with the reduced, "
              "1/N-scaled gradient; "
          "Megatron builds every choice through get_megatron_optimizer (or, on 0.16, "
              "get_megatron_muon_optimizer), "
          "whose optimizer's step the extension wraps.",
          flags=("--optimizer", "--adam-beta1", "--adam-beta2", "--adam-eps", "--sgd-momentum", "--lion-beta1",
                 "--lion-beta2", "--muon-coefficient-type", "--muon-extra-scale-factor", "--muon-fp32-matmul-prec",
                 "--muon-momentum", "--muon-nesterov", "--muon-use-nesterov", "--muon-no-split-qkv",
                 "--muon-num-ns-steps", "--muon-scalar-optimizer", "--muon-scale-mode", "--muon-tp-mode",
                 "--muon-use-syrk", "--weight-decay", "--start-weight-decay", "--end-weight-decay",
                 "--weight-decay-incr-style", "--no-weight-decay-cond-type", "--apply-wd-to-qk-layernorm",
                 "--clip-grad", "--qk-clip", "--qk-clip-alpha", "--qk-clip-threshold", "--optimizer-cpu-offload",
                 "--optimizer-offload-fraction", "--overlap-cpu-optimizer-d2h-h2d",
                 "--use-torch-optimizer-for-cpu-offload", "--no-pin-cpu-grads", "--no-pin-cpu-params",
                 "--exp-avg-dtype", "--exp-avg-sq-dtype", "--main-params-dtype", "--no-use-layer-wise-param-layout",
                 "--dump-param-to-param-group-map")),
    Theme(name="learning-rate values", reason="the learning rate's values and their source "
        "(peak, minimum, warm-up "
          "start, the decoupled input/output rate, the WSD anneal's shape, the command line's or "
              "the checkpoint's): "
          "what the scheduler gives the optimizer, which --ga-lr-scaling multiplies by its stage "
              "factor; the "
          "schedule's lengths are the lr-schedule row's.",
          flags=("--lr", "--min-lr", "--lr-warmup-init", "--decoupled-lr", "--decoupled-min-lr", "--lr-wsd-decay-style",
                 "--override-opt-param-scheduler", "--override-opt_param-scheduler",
                 "--use-checkpoint-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler")),
    *OUTSIDE_STEPS,
    Theme(name="experimental switch", reason="lets megatron-core's APIs marked experimental be "
        "called "
          "(ENABLE_EXPERIMENTAL): what runs is decided by the flags of those features.",
          flags=("--enable-experimental",)),
)
# fmt: on

#: Each flag off the path -> the reason of its theme.
OFF_PATH: dict[str, str] = {flag: theme.reason for theme in THEMES for flag in theme.flags}

#: Flags of a tested parser that another change classifies (flag -> which change);
#: tests/test_coverage_complete.py lets them be in neither list while they are here, and fails once
#: one of them is classified.
PENDING: dict[str, str] = {}
