#!/usr/bin/env bash
# upstream / extension / --ga-checks async in Megatron-LM's own pretrain_gpt.py on one GPU over NCCL, side by side:
# a GPT of about 350M parameters (24 layers, hidden 1024, 16 heads, seq 2048), bf16, Transformer Engine when it is
# installed (else the local implementation), mock data, MBS 1, GA 8 and 32 (DP 1). Each run trains ITERS iterations;
# the median of Megatron's "elapsed time per iteration" past the first WARMUP is compared.
#
#   benchmarks/gpu_overhead.sh MEGATRON_LM_DIR        # a Megatron-LM checkout (its pretrain_gpt.py)
#   ITERS=40 GA_VALUES="8 32" benchmarks/gpu_overhead.sh ~/Megatron-LM
#
# Writes benchmarks/results/gpu-overhead-<date>.json and prints a table. Needs torch with CUDA, megatron-core and
# this package installed in the Python it runs (PYTHON, default python3).
set -euo pipefail
MEGATRON_LM=${1:?usage: benchmarks/gpu_overhead.sh MEGATRON_LM_DIR (a Megatron-LM checkout)}
HERE=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
ITERS=${ITERS:-30}
WARMUP=${WARMUP:-5}
GA_VALUES=${GA_VALUES:-"8 32"}
OUT=${OUT:-$HERE/benchmarks/results/gpu-overhead-$(date -u +%F).json}
LOGS=$(mktemp -d)

"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_overhead.sh: no CUDA device")'
IMPL=local
if "$PYTHON" -c 'import transformer_engine.pytorch' 2>/dev/null; then IMPL=transformer_engine; fi

MODEL=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048
       --bf16 --transformer-impl "$IMPL" --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
       --micro-batch-size 1 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0
       --train-iters "$ITERS" --log-interval 1 --eval-iters 0 --eval-interval 1000000 --eod-mask-loss
       --calculate-per-token-loss --distributed-backend nccl --seed 1234)

UPSTREAM=("$MEGATRON_LM/pretrain_gpt.py")
EXTENSION=(-m megatron_ga_ext "$MEGATRON_LM/pretrain_gpt.py")  # the drop-in entry: pretrain_gpt.py unmodified
run() {  # run NAME GA PROGRAM... -- [extra flags...]
  local name=$1 ga=$2 program=(); shift 2
  while [ "$1" != -- ]; do program+=("$1"); shift; done; shift
  echo "== $name, GA $ga" >&2
  (cd "$MEGATRON_LM" && PYTHONPATH="$HERE:$MEGATRON_LM" "$PYTHON" -m torch.distributed.run --nproc-per-node 1 \
     "${program[@]}" "${MODEL[@]}" --global-batch-size "$ga" "$@") > "$LOGS/$name-$ga.log" 2>&1 \
     || { tail -n 40 "$LOGS/$name-$ga.log" >&2; exit 1; }
}

for ga in $GA_VALUES; do
  # Interleaved per GA, so the three see the same machine state.
  run upstream "$ga" "${UPSTREAM[@]}" --
  run extension "$ga" "${EXTENSION[@]}" --
  run extension_async "$ga" "${EXTENSION[@]}" -- --ga-checks async
done

"$PYTHON" - "$LOGS" "$OUT" "$WARMUP" "$IMPL" $GA_VALUES <<'EOF'
import datetime, json, platform, re, statistics, sys
from pathlib import Path

import torch

logs, out, warmup, impl, *ga_values = sys.argv[1:]
pattern = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
rows = []
for ga in ga_values:
    ms = {}
    for variant in ("upstream", "extension", "extension_async"):
        times = [float(m) for m in pattern.findall(Path(logs, f"{variant}-{ga}.log").read_text())][int(warmup):]
        ms[variant] = statistics.median(times)
    rows.append({"num_microbatches": int(ga), "iteration_ms": ms,
                 "ratio": {v: round(ms[v] / ms["upstream"], 4) for v in ("extension", "extension_async")},
                 "extra_us_per_microbatch": {v: round(1e3 * (ms[v] - ms["upstream"]) / int(ga), 1)
                                             for v in ("extension", "extension_async")}})
result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version(),
          "transformer_impl": impl, "model": "GPT, 24 layers, hidden 1024, seq 2048, bf16, MBS 1, DP 1", "rows": rows}
Path(out).parent.mkdir(parents=True, exist_ok=True)
Path(out).write_text(json.dumps(result, indent=2) + "\n")
print("| GA | upstream (ms) | extension (ms) | async (ms) | ratio (extension, async) |")
print("|---|---|---|---|---|")
for r in rows:
    m = r["iteration_ms"]
    print(f"| {r['num_microbatches']} | {m['upstream']:.1f} | {m['extension']:.1f} | {m['extension_async']:.1f} "
          f"| {r['ratio']['extension']:.3f}, {r['ratio']['extension_async']:.3f} |")
print(json.dumps(result))
EOF
