"""What `megatron-ga schedule` plans for a run, step by step, and what a launch saved: the
yardsticks of test_pretrain_gpt.py, test_faults.py and test_resume.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.pretrain_runs import MICRO_BATCH_SIZE, SEQ_LENGTH, Run

DATA_PARALLEL_SIZE = 2  # both layouts: dp2, and pp2dp2 (4 ranks over PP 2)
#: Every launch here bounds each collective (Megatron's process-group timeout) besides the launch's
#: own timeout.
BOUNDED = ["--distributed-timeout-minutes", "1"]

Step = tuple[int, int, int, int]


def planned_steps(
    schedule: list[str], train_samples: int, consumed_samples: int = 0, iteration: int = 0
) -> list[Step]:
    """(iteration, consumed samples after it, GBS, num_microbatches) of each step from
    ``consumed_samples`` (after ``iteration`` steps) to ``train_samples``, from `megatron-ga
    schedule --json`; ``schedule``: its arguments (a schedule with --seq-length, or --from-rampup
    ... --global-batch-size)."""
    exe = Path(sys.executable).with_name("megatron-ga")
    out = subprocess.run(
        [
            str(exe),
            "schedule",
            *schedule,
            "--micro-batch-size",
            str(MICRO_BATCH_SIZE),
            "--data-parallel-size",
            str(DATA_PARALLEL_SIZE),
            "--train-samples",
            str(train_samples),
            "--consumed-samples",
            str(consumed_samples),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    steps, consumed = [], consumed_samples
    for stage in json.loads(out)["stages"]:
        for _ in range(stage["steps"]):
            consumed += stage["global_batch_size"]
            steps.append(
                (
                    iteration + len(steps) + 1,
                    consumed,
                    stage["global_batch_size"],
                    stage["num_microbatches"],
                )
            )
    return steps


def ran_steps(run: Run) -> list[Step]:
    return [
        (r["iteration"], r["consumed_samples"], r["global_batch_size"], r["num_microbatches"])
        for r in run.iterations
    ]


def saved(checkpoints: Path) -> tuple[int | None, list[int]]:
    """(the iteration Megatron's tracker file names, or None; every iteration saved), of a --save
    directory."""
    tracker = checkpoints / "latest_checkpointed_iteration.txt"
    latest = int(tracker.read_text().strip()) if tracker.exists() else None
    return latest, sorted(int(path.name[len("iter_") :]) for path in checkpoints.glob("iter_*"))


def save_every_step(checkpoints: Path) -> list[str]:
    return ["--save", str(checkpoints), "--save-interval", "1", "--ckpt-format", "torch"]


def seq_length_schedule(text: str) -> list[str]:
    """`megatron-ga schedule` arguments of a --step-batch-size-schedule as pretrain_gpt reads it
    (tokens)."""
    return [text, "--seq-length", str(SEQ_LENGTH)]
