"""The off-path themes outside training steps: evaluation, runs that do not train, data, tokenizer,
logging, monitoring, profiling, debug dumps, checkpoint storage and contents, run control, fault
tolerance, inference, RL rollout generation, cached logits and the vision and retrieval models.
Pure Python.

Each flag here acts before, between or after the steps the extension checks, or on what a run
reads and writes; config/off_path.py joins these themes to the ones on the model and the optimizer
(in that order: docs/coverage.md renders them so).
"""

from __future__ import annotations

from megatron_ga_ext.config.off_path_theme import Theme

__all__ = ["OUTSIDE_STEPS"]

# fmt: off
OUTSIDE_STEPS: tuple[Theme, ...] = (
    Theme(name="evaluation", reason="evaluation: forward-only schedule calls between training "
        "steps (no gradient, no "
          "optimizer step, no training samples consumed), where the guards check that each model "
              "chunk runs the "
          "call's own micro-batch count.",
          flags=("--eval-global-batch-size", "--eval-micro-batch-size", "--eval-interval", "--eval-iters",
                 "--full-validation", "--multiple-validation-sets", "--start-eval-at-iter", "--validation-set-names")),
    Theme(name="no training", reason="no training loop: Megatron evaluates and exits, so no "
        "training step runs.",
          flags=("--skip-train",)),
    Theme(name="upstream test switch", reason="upstream's test switch (its help: run all "
        "real-time tests alongside "
          "the experiment; attention skips one code path under it), not a setting of the loss, "
              "the gradient or the "
          "step.",
          flags=("--test-mode",)),
    Theme(name="data", reason="data sources, splits, caching and loading (paths, blends, mock "
        "data, storage clients, "
          "workers, index caches, the loader's kind, FIM, masking and attention-mask transforms "
              "of samples, SFT "
          "formats): which samples a micro-batch holds; each still reaches the loss with its "
              "loss mask, which N "
          "counts.",
          flags=("--data-path", "--data-args-path", "--per-split-data-args-path", "--train-data-path",
                 "--valid-data-path", "--test-data-path", "--split", "--data-cache-path",
                 "--per-dataset-sequences-path", "--mid-level-dataset-surplus", "--mock-data",
                 "--object-storage-cache-path", "--enable-msc", "--dataloader-type",
                 "--dataloader-defer-npy-index-mmap", "--dataloader-fast-cache-load", "--no-mmap-bin-files",
                 "--num-dataset-builder-threads", "--num-workers", "--no-create-attention-mask-in-dataloader",
                 "--reset-attention-mask", "--reset-position-ids", "--sample-rate", "--short-seq-prob", "--mask-prob",
                 "--fim-data", "--fim-rate", "--fim-spm-rate", "--fim-split-sample", "--fim-fragment-rate",
                 "--fim-no-prefix", "--fim-prefix-token", "--fim-middle-token", "--fim-suffix-token", "--fim-pad-token",
                 "--fim-eod-token", "--sft-tokenizer-prompt-format", "--sft-mock-dataset-config-json",
                 "--varlen-mock-dataset-config-json")),
    Theme(name="tokenizer", reason="the tokenizer: how text becomes token ids, the vocabulary "
        "and its padding, and "
          "whether a checkpoint carries the tokenizer's files; the loss mask over the ids is "
              "what N counts.",
          flags=("--tokenizer-type", "--tokenizer-model", "--tokenizer-metadata", "--tokenizer-special-tokens",
                 "--tokenizer-sentencepiece-legacy", "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces",
                 "--no-tokenizer-sentencepiece-ignore-extra-whitespaces", "--tokenizer-hf-use-fast",
                 "--tokenizer-hf-no-use-fast", "--tokenizer-hf-include-special-tokens",
                 "--tokenizer-hf-no-include-special-tokens", "--tiktoken-pattern", "--tiktoken-num-special-tokens",
                 "--tiktoken-special-tokens", "--legacy-tokenizer", "--use-gigatoken", "--trust-remote-code",
                 "--chat-template", "--vocab-file", "--merge-file", "--vocab-size", "--vocab-extra-ids",
                 "--padded-vocab-size", "--disable-pad-vocab-size", "--no-pad-vocab-size", "--null-tokenizer-eod-id",
                 "--null-tokenizer-pad-id", "--disable-save-tokenizer-assets", "--no-save-tokenizer-assets",
                 "--disable-use-tokenizer-model-from-checkpoint-args",
                 "--no-use-tokenizer-model-from-checkpoint-args")),
    Theme(name="logging", reason="logging and metrics (intervals, levels, TensorBoard, W&B, "
        "timers, memory, "
          "throughput, energy, progress, norms and zero counts of gradients or parameters, "
              "attention logits, router "
          "traces, config dumps, rejected-result records): reads values, changes none.",
          flags=("--log-interval", "--logging-level", "--tensorboard-dir", "--tensorboard-log-interval",
                 "--tensorboard-queue-size", "--log-timers-to-tensorboard", "--timing-log-level", "--timing-log-option",
                 "--no-barrier-with-level-1-timing", "--log-memory-to-tensorboard", "--log-memory-interval",
                 "--log-device-memory-used", "--log-throughput", "--log-energy", "--log-progress",
                 "--log-num-zeros-in-grad", "--log-params-norm", "--log-max-attention-logit",
                 "--log-validation-ppl-to-tensorboard", "--log-world-size-to-tensorboard",
                 "--disable-log-loss-scale-to-tensorboard", "--no-log-loss-scale-to-tensorboard", "--wandb-project",
                 "--wandb-entity", "--wandb-exp-name", "--wandb-save-dir", "--moe-per-layer-logging",
                 "--moe-routing-trace-path", "--moe-routing-trace-capture-hidden-states",
                 "--moe-routing-trace-capture-logits", "--moe-routing-trace-dump-weights",
                 "--moe-routing-trace-max-training-iters", "--config-logger-dir",
                 "--result-rejected-tracker-filename")),
    Theme(name="monitoring", reason="monitoring of the job (straggler detection, GPU sniff "
        "tests, weight-hash checks "
          "across data-parallel replicas, one-logger, OpenTelemetry, the workload inspector): "
              "measures or compares, "
          "changes no value.",
          flags=("--log-straggler", "--disable-straggler-on-startup", "--straggler-ctrlr-port",
                 "--straggler-minmax-count", "--gpu-sniff-test-interval",
                 "--check-weight-hash-across-dp-replicas-interval", "--no-one-logger", "--one-logger-async",
                 "--one-logger-project", "--one-logger-run-name", "--app-tag-run-name", "--app-tag-run-version",
                 "--otel-enabled", "--otel-service-name", "--otel-span-groups", "--run-workload-inspector-server")),
    Theme(name="profiling", reason="profiling (nsys ranges and steps, the PyTorch profiler, "
        "memory history and "
          "snapshots): records what runs, changes no value.",
          flags=("--profile", "--profile-ranks", "--profile-step-start", "--profile-step-end", "--nvtx-ranges",
                 "--record-shapes", "--use-pytorch-profiler", "--pytorch-profiler-collect-callstack",
                 "--pytorch-profiler-collect-chakra", "--pytorch-profiler-collect-shapes", "--record-memory-history",
                 "--memory-snapshot-path")),
    Theme(name="debug dumps", reason="debug dumps of gradients, parameters, activations or "
        "routing counts every N "
          "iterations: reads the tensors, changes none.",
          flags=("--save-dgrads-interval", "--save-wgrads-interval", "--save-params-interval",
                 "--save-activations-interval", "--save-tokens-per-expert-interval")),
    Theme(name="checkpoint storage", reason="checkpoint storage (format, async and parallel save "
        "and load, strictness, "
          "sharding checks, replication, conversion, retention, integrity): how Megatron writes "
              "and reads its state; "
          "the iteration and consumed samples it restores, and the sidecar next to each "
              "persistent checkpoint, are the "
          "same.",
          flags=("--ckpt-format", "--auto-detect-ckpt-format", "--use-dist-ckpt", "--dist-ckpt-format", "--async-save",
                 "--async-strategy", "--async-ckpt-cpu-priority", "--async-ckpt-io-priority",
                 "--async-ckpt-use-cpu-shm", "--use-persistent-ckpt-worker", "--dist-ckpt-workers",
                 "--ckpt-assume-constant-structure", "--ckpt-fully-parallel-load",
                 "--ckpt-fully-parallel-load-exchange-algo", "--ckpt-fully-parallel-load-per-rank-objects",
                 "--ckpt-fully-parallel-load-process-group", "--ckpt-fully-parallel-save",
                 "--no-ckpt-fully-parallel-save", "--disable-ckpt-fully-parallel-save",
                 "--ckpt-fully-parallel-save-process-group", "--ckpt-pg-tensors-cache-create",
                 "--ckpt-pg-tensors-cache-path", "--ckpt-drop-redundant-extra-state",
                 "--disable-ckpt-load-validate-sharding-integrity", "--no-ckpt-load-validate-sharding-integrity",
                 "--disable-stream-ckpt-dequant", "--no-stream-ckpt-dequant", "--disable-strict-fsdp-dtensor-load",
                 "--no-strict-fsdp-dtensor-load", "--dist-ckpt-strictness", "--dist-ckpt-optim-fully-reshardable",
                 "--distrib-optim-fully-reshardable-mem-efficient", "--dist-ckpt-save-pre-mcore-014",
                 "--ckpt-convert-format", "--ckpt-convert-save", "--ckpt-convert-update-legacy-dist-opt-format",
                 "--replication", "--replication-factor", "--replication-jump", "--save-retain-interval",
                 "--verify-integrity", "--exit-on-missing-checkpoint")),
    Theme(name="checkpoint contents", reason="which optimizer, RNG or main-parameter state a "
        "checkpoint saves or "
          "restores: the iteration and consumed samples are restored either way.",
          flags=("--no-load-optim", "--no-load-rng", "--no-save-optim", "--no-save-rng",
                 "--load-main-params-from-ckpt")),
    Theme(name="run control", reason="when the run stops (after a duration, an iteration, a "
        "signal, an autoresume "
          "request), at a step boundary and through save_checkpoint where --save is set, or how "
              "far the host may run "
          "ahead of the device: no step changes.",
          flags=("--exit-duration-in-mins", "--exit-interval", "--exit-signal", "--exit-signal-handler",
                 "--exit-signal-handler-for-dataloader", "--exit-signal-handler-for-training", "--adlr-autoresume",
                 "--adlr-autoresume-interval", "--train-sync-interval")),
    Theme(name="fault tolerance", reason="fault tolerance (in-process restart's timeouts, "
        "reserves and monitoring, "
          "the FT package's timeouts, the fault injector's hangs and crashes): detects, injects "
              "or waits out a "
          "failure; a step that completes is unchanged (in-process restart itself is a row).",
          flags=("--inprocess-active-world-size", "--inprocess-barrier-timeout", "--inprocess-completion-timeout",
                 "--inprocess-empty-cuda-cache", "--inprocess-granularity", "--inprocess-hard-timeout",
                 "--inprocess-heartbeat-interval", "--inprocess-heartbeat-timeout", "--inprocess-last-call-wait",
                 "--inprocess-max-iterations", "--inprocess-monitor-process-interval",
                 "--inprocess-monitor-thread-interval", "--inprocess-progress-watchdog-interval",
                 "--inprocess-soft-timeout", "--inprocess-termination-grace-time", "--enable-ft-package",
                 "--calc-ft-timeouts", "--ft-num-warmup-iters", "--fault-injector-delay-start-iteration",
                 "--fault-injector-fault-delay", "--fault-injector-fault-probabilities", "--fault-injector-fault-types",
                 "--fault-injector-mtti-seconds", "--fault-injector-num-ranks", "--fault-injector-offset-seconds",
                 "--fault-injector-ranks", "--fault-injector-seed")),
    Theme(name="inference", reason="inference (the text-generation server, dynamic batching, the "
        "KV cache, decode and "
          "prefill CUDA graphs, sampling, inference-only kernels and dispatchers, BERT "
              "embeddings): generation outside "
          "training steps.",
          flags=("--inference-batch-times-seqlen-threshold", "--inference-coordinator-port",
                 "--inference-cuda-graph-all-prefills", "--inference-cuda-graph-max-tokens",
                 "--inference-cuda-graph-scope", "--inference-disable-ep-consensus",
                 "--no-inference-disable-ep-consensus", "--inference-disable-triton-nvls-kernels",
                 "--inference-dynamic-batching", "--inference-dynamic-batching-async-sched-mode",
                 "--inference-dynamic-batching-block-size", "--inference-dynamic-batching-buffer-size-gb",
                 "--inference-dynamic-batching-cuda-graph-max-tokens",
                 "--inference-dynamic-batching-cuda-graph-mixed-prefill-count",
                 "--inference-dynamic-batching-cuda-graph-sizing-distribution",
                 "--inference-dynamic-batching-logprobs-mode", "--inference-dynamic-batching-mamba-memory-ratio",
                 "--inference-dynamic-batching-max-requests", "--inference-dynamic-batching-max-tokens",
                 "--inference-dynamic-batching-num-cuda-graphs", "--inference-dynamic-batching-paused-buffer-size-gb",
                 "--inference-dynamic-batching-prefix-caching", "--no-inference-dynamic-batching-prefix-caching",
                 "--inference-dynamic-batching-prefix-caching-coordinator-policy",
                 "--inference-dynamic-batching-prefix-caching-eviction-policy",
                 "--inference-dynamic-batching-prefix-caching-mamba-gb",
                 "--inference-dynamic-batching-prefix-caching-routing-alpha",
                 "--inference-dynamic-batching-sampling-backend",
                 "--inference-dynamic-batching-track-generated-token-events",
                 "--inference-dynamic-batching-track-paused-request-events",
                 "--inference-dynamic-batching-unified-memory-level", "--inference-fuse-tp-communication",
                 "--inference-grouped-gemm-backend", "--inference-logging-step-interval", "--inference-max-batch-size",
                 "--inference-max-requests", "--inference-max-seq-length",
                 "--inference-moe-disable-fused-quant-kernels", "--inference-moe-token-dispatcher-type",
                 "--inference-shards", "--inference-text-gen-server-logging", "--no-inference-text-gen-server-logging",
                 "--inference-use-synchronous-zmq-collectives", "--no-inference-use-synchronous-zmq-collectives",
                 "--inference-wandb-logging", "--no-inference-wandb-logging", "--decode-only-cuda-graphs",
                 "--enable-chunked-prefill", "--disable-chunked-prefill", "--flash-decode", "--cache-mla-latents",
                 "--mlp-chunks-for-prefill", "--nccl-all-reduce-for-prefill",
                 "--moe-pad-experts-for-cuda-graph-inference", "--mamba-inference-conv-states-dtype",
                 "--mamba-inference-ssm-states-dtype", "--max-tokens-to-oom", "--num-speculative-tokens",
                 "--use-legacy-static-engine", "--use-same-sampling-seed-across-dp-ranks", "--bert-embedder-type",
                 "--output-bert-embeddings")),
    Theme(name="RL rollout generation", reason="RL rollout generation (the inference model's "
        "parallel sizes and "
          "memory, its KV cache and CUDA graphs, sampling, weight refit, environments and "
              "parsers, generation in "
          "flight, the rollout bank, profiling): produces the samples; the training steps on "
              "them are the rl-step "
          "row's.",
          flags=("--rl-inference-tensor-model-parallel-size", "--rl-inference-pipeline-model-parallel-size",
                 "--rl-inference-expert-model-parallel-size", "--rl-inference-expert-tensor-model-parallel-size",
                 "--rl-inference-model-unified-memory-level", "--rl-inference-parsers",
                 "--rl-offload-inference-model-weights-when-idle", "--no-rl-offload-inference-model-weights-when-idle",
                 "--rl-offload-kv-cache-during-training", "--no-rl-offload-kv-cache-during-training",
                 "--rl-remove-kv-cache-during-training", "--no-rl-remove-kv-cache-during-training",
                 "--rl-kv-cache-management-mode", "--rl-offload-optimizer-during-inference", "--rl-persist-cuda-graphs",
                 "--no-rl-persist-cuda-graphs", "--rl-reset-cuda-graphs", "--no-rl-reset-cuda-graphs",
                 "--rl-training-cuda-graphs", "--no-rl-training-cuda-graphs", "--rl-verify-model-weights-swap",
                 "--no-rl-verify-model-weights-swap", "--refit-method", "--rl-default-temperature",
                 "--rl-default-top-k", "--rl-default-top-p", "--langrl-env-config", "--langrl-external-server",
                 "--no-langrl-external-server", "--langrl-inference-server-conversation-template",
                 "--langrl-inference-server-type", "--rl-generation-batch-size", "--rl-num-parallel-generation-batches",
                 "--rl-num-parallel-generations", "--rl-parallel-generation-tasks", "--rl-durable-rollout-bank",
                 "--rl-rollout-bank-dir", "--rl-rollout-bank-max-bytes", "--rl-prompts-per-eval", "--rl-profile",
                 "--rl-profile-dir")),
    Theme(name="cached-logits I/O", reason="reading the cached teacher log-probabilities (decode "
        "threads, prefetch): "
          "the I/O of the logits-distillation row's loss, not its arithmetic.",
          flags=("--logits-load-decode-threads", "--logits-load-prefetch-factor", "--logits-load-msc-prefetch-depth")),
    Theme(name="logits dump", reason="writes this run's top-k or top-p log-probabilities to disk "
        "for a later "
          "distillation: reads the logits, changes no value.",
          flags=("--logits-save-dir", "--logits-save-dtype", "--logits-save-top-k", "--logits-save-top-p",
                 "--logits-save-top-p-min-k")),
    Theme(name="vision and retrieval", reason="the vision and retrieval models (DINO, Swin, ViT "
        "classification, "
          "ICT/REALM biencoders) and their data: model and data settings of those scripts, not "
              "the loss weighting or "
          "the gradient reduction.",
          flags=("--vision-pretraining", "--vision-pretraining-type", "--vision-backbone-type", "--swin-backbone-type",
                 "--img-h", "--img-w", "--num-channels", "--patch-dim", "--num-classes", "--classes-fraction",
                 "--data-per-class-fraction", "--no-data-sharding", "--head-lr-mult", "--iter-per-epoch", "--mask-type",
                 "--mask-factor", "--dino-local-img-size", "--dino-local-crops-number", "--dino-head-hidden-size",
                 "--dino-bottleneck-size", "--dino-freeze-last-layer", "--dino-norm-last-layer",
                 "--dino-warmup-teacher-temp", "--dino-teacher-temp", "--dino-warmup-teacher-temp-epochs",
                 "--ict-head-size", "--biencoder-projection-dim", "--biencoder-shared-query-context-model",
                 "--ict-load", "--bert-load", "--titles-data-path", "--query-in-block-prob", "--use-one-sent-docs",
                 "--evidence-data-path", "--retriever-report-topk-accuracies", "--retriever-score-scaling",
                 "--block-data-path", "--embedding-path", "--indexer-batch-size", "--indexer-log-interval")),
)
# fmt: on
