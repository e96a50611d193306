#!/usr/bin/env bash
# A checked launch: `megatron-ga check` reads the very line torchrun will run, and stops the launch
# on any problem (exit 1) or unreadable input (exit 2). Run from the Megatron-LM root:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash /path/to/megatron-ga-ext/examples/launch.sh
set -euo pipefail

LAUNCH=(
  torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "${GPUS_PER_NODE:-8}"
  --master-addr "${MASTER_ADDR:-localhost}" --master-port "${MASTER_PORT:-6000}"
  -m megatron_ga_ext pretrain_gpt.py  # the drop-in entry: pretrain_gpt.py unmodified, the extension installed
  # parallel layout: DP = world / (TP x PP x CP)
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
  --num-layers 24 --num-layers-per-virtual-pipeline-stage 3
  --hidden-size 2048 --num-attention-heads 16 --seq-length 4096 --max-position-embeddings 4096
  # batch: GBS = MBS x DP x GA, growing by stages (thresholds in tokens, since --seq-length is set)
  --micro-batch-size 1
  --step-batch-size-schedule "0:64 20B:128 60B:256"
  --train-samples 50000000 --lr-warmup-samples 200000 --lr-decay-samples 48000000
  # token-level loss, checked every step by megatron-ga-ext
  --ga-loss-reduction token --ga-zero-token-policy error --ga-strict
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --bf16
  --data-path "${DATA_PATH:?set DATA_PATH}" --tokenizer-type GPT2BPETokenizer
  --vocab-file "${VOCAB_FILE:?set VOCAB_FILE}" --merge-file "${MERGE_FILE:?set MERGE_FILE}"
)

megatron-ga check -- "${LAUNCH[@]}"
megatron-ga schedule "0:64 20B:128 60B:256" --micro-batch-size 1 --seq-length 4096 \
  --data-parallel-size $(( ${NNODES:-1} * ${GPUS_PER_NODE:-8} / 4 )) --train-samples 50000000
exec "${LAUNCH[@]}"
