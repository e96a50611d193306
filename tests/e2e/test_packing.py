"""Megatron-LM's pretrain_gpt.py with the sequence-packing scheduler in its loop
(``--use-varlen-dataset``, which selects ``--sequence-packing-scheduler dp_balanced``; main after
d98e8a64, #6742), through the drop-in entry, on the CPU over gloo, against upstream's own run of the
same launch.

pretrain_gpt.py runs it on the CPU only with two stand-ins for Transformer Engine
(tests/support/packed_gpt.py: the TE >= 2.9 check of TransformerConfig, and the local attention
given no ``packed_seq_params``, so a packed micro-batch is attended as one causal sequence);
upstream's run has the same two. Everything else is upstream's: MockVarlenDataset and its loader,
``wrap_data_iterator`` in ``train_step``, the packed get_batch, the loss function and ``train()``.
Each iteration:

* the schedule runs the scheduler's packed count of micro-batches, not GBS / (MBS x DP) (the guard's
  count of forward steps, which it checked against what wrap_data_iterator returned), and the count
  varies;
* consumed samples advance by exactly GBS and the calculator keeps GBS / (MBS x DP);
* N, the token count finalize divides by, is the loss tokens the packed micro-batches' loss
  functions saw;
* the loss and the grad norm equal upstream's own ``--calculate-per-token-loss`` run;

on DP 2 and PP 2 x DP 2; and on PP 2 x DP 2 the loop made to pass num_microbatches x PP is stopped
at its first step (the guard names the scheduler's count). A source whose train_step does not run
the scheduler skips them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ga_ext.integration.guards import PP_RULE
from tests.e2e.test_pretrain_gpt import TOKEN, check_num_tokens, record
from tests.support import pretrain_runs
from tests.support.pretrain_runs import MICRO_BATCH_SIZE
from tools.compatibility import source_name

pytestmark = pytest.mark.e2e

PACKED_GPT = Path(__file__).resolve().parents[1] / "support" / "packed_gpt.py"
GBS, DP, ITERATIONS = 16, 2, 4
NUM_MICROBATCHES = GBS // (MICRO_BATCH_SIZE * DP)
#: Samples of 8 to 64 tokens (lognormal around 32), packed up to 128 tokens per micro-batch.
MOCK_LENGTHS = {
    "mode": "distribution",
    "type": "lognormal",
    "min_seq_len": 8,
    "max_seq_len": 64,
    "mean_seq_len": 32,
    "lognormal_sigma": 1.1,
}
PACKED = [
    "--use-varlen-dataset",
    "--max-seqlen-per-dp-cp-rank",
    "128",
    "--varlen-mock-dataset-config-json",
    json.dumps(MOCK_LENGTHS),
    "--moe-token-dispatcher-type",
    "alltoall",  # TransformerConfig asks it of the scheduler, MoE or not
    "--global-batch-size",
    str(GBS),
    "--train-iters",
    str(ITERATIONS),
]


def runs_the_scheduler(source: Path) -> bool:
    """The source's train_step calls wrap_data_iterator (Megatron-LM main after d98e8a64)."""
    return (
        "wrap_data_iterator(data_iterator, config"
        in (source / "megatron/training/training.py").read_text()
    )


def _packed_program(root: Path, workdir: Path, extension: bool, drop_in: str) -> list[str]:
    """tests/support/packed_gpt.py (``root``'s pretrain_gpt.py with the two CPU stand-ins) by the
    drop-in entry, or bare."""
    return ["-m", "megatron_ga_ext", str(PACKED_GPT)] if extension else [str(PACKED_GPT)]


@pytest.mark.parametrize("layout", ["dp2", "pp2dp2"])
def test_pretrain_gpt_trains_the_schedulers_packed_steps(
    launches, source, layout, monkeypatch, record_property
):
    if not runs_the_scheduler(source):
        pytest.skip(
            "this source's train_step does not run the sequence-packing scheduler (main after "
            "d98e8a64)"
        )
    monkeypatch.setattr(pretrain_runs, "_program", _packed_program)
    upstream = launches.get(source, layout, "packed-upstream", [*TOKEN, *PACKED], extension=False)
    run = launches.get(source, layout, "packed", [*TOKEN, *PACKED])
    assert upstream.rc == 0 and upstream.error is None, upstream.describe()
    assert run.rc == 0 and run.error is None, run.describe()
    rows = run.iterations
    assert [r["iteration"] for r in rows] == list(range(1, ITERATIONS + 1)), run.describe()
    packed = []
    for step, row in enumerate(rows, 1):
        assert row["consumed_samples"] == GBS * step and row["global_batch_size"] == GBS, row
        assert row["num_microbatches"] == NUM_MICROBATCHES, (
            row
        )  # the calculator's: what consumed samples count
        (forward_steps,) = row[
            "forward_steps"
        ]  # one model chunk: the scheduler's count, checked by the guard
        packed.append(forward_steps)
    assert len(set(packed)) >= 2 and NUM_MICROBATCHES not in packed, packed
    assert "the micro-batch guard follows that count" in run.output, (
        run.output_tail
    )  # the coverage row, logged
    for ours, theirs in zip(rows, upstream.iterations, strict=True):
        assert (ours["loss"], ours["grad_norm"]) == (theirs["loss"], theirs["grad_norm"]), (
            ours,
            theirs,
        )
    record(
        record_property,
        source_name(source),
        layout,
        [
            {
                "mode": "token",
                "case": f"packing scheduler (packed {'/'.join(map(str, packed))} of GA "
                f"{NUM_MICROBATCHES})",
                "iterations": f"{len(rows)}",
                "samples": f"{rows[-1]['consumed_samples']} = {GBS} x {len(rows)}",
                "loss_vs_upstream": "equal (loss, grad norm)",
                "N": check_num_tokens(run),
            }
        ],
    )


def test_a_pp_multiplied_packed_count_is_stopped(launches, source, monkeypatch, record_property):
    """The training loop made to pass num_microbatches x PP (upstream's train_step passes the
    scheduler's count): the guard stops the first step before the schedule reads the packed
    iterator, naming the scheduler's count."""
    if not runs_the_scheduler(source):
        pytest.skip(
            "this source's train_step does not run the sequence-packing scheduler (main after "
            "d98e8a64)"
        )
    monkeypatch.setattr(pretrain_runs, "_program", _packed_program)
    run = launches.get(
        source,
        "pp2dp2",
        "packed-pp-fault",
        [*TOKEN, *PACKED],
        env={"MEGATRON_GA_FAULT": "pp-multiplied-microbatches"},
    )
    assert run.rc != 0 and run.iterations == [], run.describe()
    assert run.error is not None and run.error.startswith("GuardError"), run.describe()
    assert "packed this step's samples into" in run.error and PP_RULE in run.error, run.error
    record(
        record_property,
        source_name(source),
        "pp2dp2",
        [
            {
                "mode": "token",
                "case": "packed count x PP",
                "iterations": "0 (stopped at step 1)",
                "N": "GuardError: the scheduler's count",
            }
        ],
    )
