"""How long ``megatron-ga check`` takes to answer, side by side with ``megatron-ga --version`` (the
console script's start: Python and the CLI's imports), on lines of the newcomer's set.

    python benchmarks/check_time.py [--rounds 15] [--out benchmarks/results/check-time-DATE.json]

Each round runs every command once, interleaved, as a user runs it (a subprocess of the installed
console script), so a load that comes and goes touches all of them alike; the table gives each
command's median wall time and the median of its per-round difference from ``--version``. Whether
torch or megatron is imported is checked in-process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "megatron-ga"
GPT = [
    "torchrun",
    "--nproc_per_node",
    "8",
    "pretrain_gpt.py",
    "--micro-batch-size",
    "1",
    "--seq-length",
    "2048",
]
PASTED = """GPUS_PER_NODE=8
NUM_NODES=16
DISTRIBUTED_ARGS=( --nproc_per_node $GPUS_PER_NODE --nnodes $NUM_NODES )
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 1536 --seq-length 2048
    --rampup-batch-size 16 16 5859375 --train-iters 500000 --lr-decay-iters 430000  # the ramp (of 96 stages)
)
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${TRAINING_ARGS[@]} \\
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
"""

COMMANDS = {
    "--version": ["--version"],
    "check, clean line": ["check", "--", *GPT, "--global-batch-size", "64"],
    "check, schedule never reached": [
        "check",
        "--world-size",
        "128",
        "--",
        *GPT,
        "--tensor-model-parallel-size",
        "8",
        "--pipeline-model-parallel-size",
        "16",
        "--step-batch-size-schedule",
        "0:16 2.4B:320 4.8B:624 12B:1536",
        "--train-samples",
        "1000000",
    ],
    "check, pasted script with a 96-stage rampup": ["check", "--", PASTED],
    "check, srun line": [
        "check",
        "--",
        "srun",
        "--nodes",
        "32",
        "--ntasks-per-node",
        "8",
        "python",
        "pretrain_gpt.py",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "256",
    ],
    "check, GPT-3 175B, model flags (memory)": [
        "check",
        "--gpu-memory",
        "H100",
        "--",
        "torchrun --nnodes 128 --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 8"
        " --pipeline-model-parallel-size 16 --num-layers 96 --hidden-size 12288"
        " --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048"
        " --micro-batch-size 1 --global-batch-size 1536 --bf16 --use-distributed-optimizer"
        " --sequence-parallel --recompute-activations",
    ],
    "check, FSDP2 trap (--json)": [
        "check",
        "--json",
        "--",
        *GPT,
        "--global-batch-size",
        "16",
        "--calculate-per-token-loss",
        "--use-torch-fsdp2",
    ],
}


def wall(argv: list[str]) -> float:
    start = time.perf_counter()
    result = subprocess.run([str(SCRIPT), *argv], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode not in (0, 1):
        raise SystemExit(
            f"megatron-ga {' '.join(argv)[:60]} exited {result.returncode}: {result.stderr}"
        )
    return seconds


def imports_torch() -> bool:
    code = (
        "import sys; from megatron_ga_ext.cli.main import main; "
        f"main({COMMANDS['check, schedule never reached']!r}); "
        "print('torch' in sys.modules or 'megatron' in sys.modules, file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return result.stderr.strip().splitlines()[-1] == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.rounds):
        for name, argv in COMMANDS.items():
            times[name].append(wall(argv))
    base = times["--version"]
    rows = []
    print(f"{'command':48} {'median s':>9} {'over --version':>15}")
    for name, values in times.items():
        over = statistics.median(v - b for v, b in zip(values, base))
        rows.append(
            {
                "command": name,
                "median_s": round(statistics.median(values), 3),
                "over_version_s": round(over, 3),
            }
        )
        print(f"{name:48} {statistics.median(values):9.3f} {over:15.3f}")
    torch = imports_torch()
    print(f"torch or megatron imported by check: {torch}")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "date": datetime.date.today().isoformat(),
                    "rounds": args.rounds,
                    "python": sys.version.split()[0],
                    "imports_torch": torch,
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
