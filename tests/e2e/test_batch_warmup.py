"""``--ga-batch-size-warmup auto`` in Megatron-LM's own training loop (pretrain_gpt.py through the
drop-in entry), DP 2 on the CPU over gloo, on the newest release and main commit of
this Python (conftest.py's newest_source).

The tiny GPT's B_simple is about 0.2 samples (docs/noise-scale.md), so a trust of 2000 makes the
rule fire at every measured step: from GBS 16 the batch doubles after iterations 1, 2 and 3 up to
the cap 128, and --train-samples 368 ends the run after 5 iterations (16 + 32 + 64 + 128 + 128).
Checked:

* every iteration's GBS, consumed samples and num_microbatches are those decisions', and Megatron's
  run stops at the sample count (its train_iters follows the schedule as it grows);
* each decision is logged with the schedule so far as the --step-batch-size-schedule string that
  replays it, and the first step the cap holds back (iteration 4: 2000 x 0.17 >= 2 x 128) once;
* a run saved at iteration 2 and resumed, with --save to the loaded directory, trains iterations 3-5
  as the uninterrupted run: the same GBS (the decisions before the checkpoint restored, the one
  after it taken again from the restored EMAs), LR, loss and grad norm; and it leaves the loaded
  checkpoint alone (no save of iteration 2 again, its files' mtimes unchanged);
* the launch mistakes are refused at start-up, naming the flag.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.plans import BOUNDED

pytestmark = pytest.mark.e2e

SAVE_AT = 2
GBS = [16, 32, 64, 128, 128]
SAMPLES = sum(GBS)
FLAGS = [
    "--calculate-per-token-loss",
    "--global-batch-size",
    "16",
    "--train-samples",
    str(SAMPLES),
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--ga-noise-scale",
    "1",
    "--ga-batch-size-warmup",
    "auto",
    "--ga-batch-size-warmup-trust",
    "2000",
    "--ga-batch-size-warmup-max",
    "128",
    *BOUNDED,
]
#: The schedule after each decision, as logged (thresholds in tokens: --seq-length 64).
LOGGED = ['"0:16 1024:32"', '"0:16 1024:32 3072:64"', '"0:16 1024:32 3072:64 7168:128"']


def warmup_run(launches, source):
    checkpoints = launches.workdir / source.name / "dp2" / "batch-warmup-checkpoints"
    return launches.get(
        source,
        "dp2",
        "batch-warmup",
        [
            *FLAGS,
            "--save",
            str(checkpoints),
            "--save-interval",
            str(SAVE_AT),
            "--ckpt-format",
            "torch",
        ],
    ), checkpoints


def test_the_batch_doubles_as_measured_and_the_run_ends_at_its_samples(launches, newest_source):
    run, _ = warmup_run(launches, newest_source)
    assert run.rc == 0 and run.error is None, run.describe()
    rows = run.iterations
    assert [r["global_batch_size"] for r in rows] == GBS, rows
    assert [r["consumed_samples"] for r in rows] == [sum(GBS[: i + 1]) for i in range(len(GBS))], (
        rows
    )
    assert [r["num_microbatches"] for r in rows] == [g // 4 for g in GBS], rows  # MBS 2 x DP 2
    decisions = [
        line
        for line in run.output.splitlines()
        if "megatron-ga-ext batch-size warmup: iteration" in line
    ]
    assert len(decisions) >= len(LOGGED), run.describe()
    for line, schedule in zip(decisions, LOGGED):
        assert line.endswith(f"--step-batch-size-schedule {schedule}"), line
    assert any(
        "held by the cap --ga-batch-size-warmup-max 128" in line for line in run.output.splitlines()
    ), run.describe()  # iteration 4: 2 x 128 passes the cap


def test_a_resume_replays_the_decisions(launches, newest_source):
    run, checkpoints = warmup_run(launches, newest_source)
    assert run.rc == 0, run.describe()
    # Resumed with --save to the loaded directory (a copy: the uninterrupted run's is shared): the
    # loaded checkpoint is not saved again (the restored stages are live before Megatron reads the
    # micro-batch count after the load).
    directory = launches.workdir / newest_source.name / "dp2" / "batch-warmup-resumed-checkpoints"
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(checkpoints, directory)
    loaded = directory / f"iter_{SAVE_AT:07d}"
    before = _mtimes(loaded)
    resumed = launches.get(
        newest_source,
        "dp2",
        "batch-warmup-resumed",
        [
            *FLAGS,
            "--load",
            str(directory),
            "--ckpt-step",
            str(SAVE_AT),
            "--ckpt-format",
            "torch",
            "--save",
            str(directory),
            "--save-interval",
            str(SAVE_AT),
        ],
    )
    assert resumed.rc == 0 and resumed.error is None, resumed.describe()
    assert f"resumed with --step-batch-size-schedule {LOGGED[1]}" in resumed.output, (
        resumed.describe()
    )
    resaved = f"saving checkpoint at iteration {SAVE_AT:7d}"
    assert not [line for line in resumed.output.splitlines() if resaved in line], resumed.describe()
    assert _mtimes(loaded) == before, resumed.describe()
    whole = run.iterations[SAVE_AT:]
    again = resumed.iterations
    assert (
        [r["iteration"] for r in again]
        == [r["iteration"] for r in whole]
        == list(range(SAVE_AT + 1, len(GBS) + 1))
    )
    for ours, theirs in zip(again, whole, strict=True):
        assert (ours["global_batch_size"], ours["consumed_samples"], ours["num_microbatches"]) == (
            theirs["global_batch_size"],
            theirs["consumed_samples"],
            theirs["num_microbatches"],
        ), (ours, theirs)
        assert (ours["learning_rate"], ours["loss"], ours["grad_norm"]) == (
            theirs["learning_rate"],
            theirs["loss"],
            theirs["grad_norm"],
        ), (ours, theirs)


def _mtimes(directory: Path) -> dict[str, int]:
    """Every file under ``directory``, by relative path: its modification time in ns."""
    files = {
        str(path.relative_to(directory)): path.stat().st_mtime_ns
        for path in directory.rglob("*")
        if path.is_file()
    }
    assert files, f"no checkpoint files under {directory}"
    return files


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--ga-noise-scale", "0"],
            "--ga-batch-size-warmup auto decides from the measured noise scale: add "
            "--ga-noise-scale K",
        ),
        (
            ["--rampup-batch-size", "8", "8", "64", "--ga-convert-rampup"],
            "--ga-batch-size-warmup auto writes the step schedule as it measures, so it does not "
            "go with --rampup-batch-size with --ga-convert-rampup",
        ),
    ],
)
def test_launch_mistakes_are_refused_at_start_up(launches, newest_source, extra, message):
    run = launches.get(newest_source, "dp2", f"batch-warmup-refused-{extra[0]}", [*FLAGS, *extra])
    assert run.rc != 0 and run.iterations == [], run.describe()
    assert message in run.output, run.describe()
