"""The ledger's memory estimate against what Megatron-LM's own loop allocates on one CUDA device.

A small GPT (4 layers, h 1024, 16 heads, seq 1024, vocabulary 4,096, bf16, Adam, selective
recompute: the activations upstream's formula models) trains two iterations of GBS 16 in
pretrain_gpt.py (upstream's loop, no extension) at MBS 2 and MBS 8. Megatron prints, after the
iterations, its theoretical memory (report_theoretical_memory) and
torch.cuda.max_memory_allocated ("max allocated", MB). Checked:

* the ledger's weights-and-optimizer and activation numbers (check's costs for the same line) equal
  the theoretical ones Megatron prints in the run (to its two printed decimals);
* the measured peak is within [0.7, 1.6] of the ledger's total at each MBS, and the peak's growth
  from MBS 2 to MBS 8 within [0.7, 1.6] of the ledger's activations' growth (what the micro-batch
  moves). The estimate leaves out the CUDA allocator's workspaces and the loss's fp32 logits, so the
  measured numbers run above it.

The numbers go to the junit xml's properties (make gpu-check: gpu-tests.xml). Skipped without a
CUDA device.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_ga_ext.core.memory import MiB
from megatron_ga_ext.launch.check import check_launch
from megatron_ga_ext.launch.costs import launch_costs
from megatron_ga_ext.launch.line import parse_launch
from tests.support.pretrain_runs import TINY_GPT, Run

pytestmark = pytest.mark.gpu

MODEL = [
    "--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
    "--seq-length", "1024", "--max-position-embeddings", "1024",
    # NullTokenizer adds one (its end of document): 4,095 + 1 is padded to 4,096 as 4,095 is.
    "--vocab-size", "4095",
    "--bf16", "--recompute-activations",
    "--global-batch-size", "16", "--train-samples", "32",
]  # fmt: skip
MBS = (2, 8)
_MAX = re.compile(
    r"\(after 2 iterations\) memory \(MB\) \| allocated: [\d.]+ \| max allocated: (?P<max>[\d.]+)"
)
_THEORY = re.compile(r"weight and optimizer=(?P<weights>[\d.]+) MB, activation=(?P<acts>[\d.]+) MB")
_PADDED = re.compile(
    r"padded vocab \(size: \d+\) with \d+ dummy tokens \(new size: (?P<size>\d+)\)"
)


@pytest.fixture(autouse=True)
def _cuda_device() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip(
            "no CUDA device: the estimate is compared with torch.cuda.max_memory_allocated on one"
        )


def _flags(mbs: int) -> list[str]:
    return [*MODEL, "--micro-batch-size", str(mbs)]


def _estimate(mbs: int) -> tuple[float, float]:
    """(weights and optimizer, activations at the peak) in bytes, as check computes them for the
    same line."""
    tokens = ["torchrun", "--nproc-per-node", "1", "pretrain_gpt.py", *TINY_GPT, *_flags(mbs)]
    launch = parse_launch(tokens)
    report = check_launch(launch)
    costs = launch_costs(tokens, launch, report, check_launch)
    assert costs.own is not None, (costs.why_none, [p.message for p in report.problems])
    return costs.own.memory.weights_and_optimizer, costs.own.memory.activations_peak


def _measured(run: Run) -> tuple[float, float, float, int | None]:
    """(max allocated, theoretical weights and optimizer, theoretical activations) in bytes, the
    padded vocab where the run logs it (None where its logger is quiet)."""
    peak, theory, padded = (
        _MAX.search(run.output),
        _THEORY.search(run.output),
        _PADDED.search(run.output),
    )
    assert peak and theory, run.describe()
    return (
        float(peak["max"]) * MiB,
        float(theory["weights"]) * MiB,
        float(theory["acts"]) * MiB,
        int(padded["size"]) if padded else None,
    )


def test_estimate_against_max_memory_allocated(launches, newest_release: Path, record_property):
    rows = {}
    for mbs in MBS:
        run = launches.get(
            newest_release, "dp1", f"memory-mbs{mbs}", _flags(mbs), extension=False, device="cuda"
        )
        assert run.rc == 0, run.describe()
        peak, weights, acts, padded = _measured(run)
        assert padded in (None, 4096)
        ours_weights, ours_acts = _estimate(mbs)
        assert ours_weights == pytest.approx(weights, rel=1e-3, abs=0.01 * MiB)
        assert ours_acts == pytest.approx(acts, rel=1e-3, abs=0.01 * MiB)
        rows[mbs] = (peak, ours_weights + ours_acts, ours_acts)
        record_property(f"mbs{mbs}_max_allocated_MiB", round(peak / MiB, 1))
        record_property(f"mbs{mbs}_estimate_MiB", round((ours_weights + ours_acts) / MiB, 1))
    for peak, estimate, _ in rows.values():
        assert 0.7 <= peak / estimate <= 1.6, rows
    (low_peak, _, low_acts), (high_peak, _, high_acts) = rows[MBS[0]], rows[MBS[1]]
    growth = (high_peak - low_peak) / (high_acts - low_acts)
    record_property("growth_measured_over_estimated", round(growth, 3))
    assert 0.7 <= growth <= 1.6, rows
