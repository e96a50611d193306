"""The CUDA-graph rows of the coverage table (config/coverage/) in Megatron-LM's own
pretrain_gpt.py, on one CUDA device over NCCL (DP 1, micro-batch size 2, GBS 16: 8 micro-batches a
step), through the drop-in entry, on the newest release among the end-to-end tier's sources (0.19 or
later). Every graph captures at the second iteration (--cuda-graph-warmup-steps 1) and replays from
then on; a NaN is injected into the first micro-batch's loss at iteration 5, with Megatron's own NaN
check off so the extension's check is the one that acts:

* layer graphs (--cuda-graph-impl local), token mode: iterations 1-4 equal upstream's
  --calculate-per-token-loss run with the same graphs, N is the loss tokens every step, and the NaN
  stops iteration 5 with a LossContractError;
* the optimizer graph (--optimizer-cuda-graph), --ga-checks sync: the same, the error raised in
  finalize before the captured optimizer step replays;
* the optimizer graph, --ga-checks async: the replayed step does not call the extension's step hook,
  so Megatron logs iteration 5 and the verdict naming it stops the run at the next forward/backward
  call (the row's limit);
* a full-iteration graph (--cuda-graph-impl full_iteration), microbatch mode: every iteration's
  steps, learning rate and grad norm equal upstream's run with the same graph (the logged losses
  differ by design: the extension logs the mean of micro-batch means this mode optimises, upstream
  the token mean);
* a full-iteration graph in token mode: refused at start-up in the real loop too.

Run on a machine with a GPU: ``MEGATRON_LM=<Megatron-LM checkout, 0.19+> pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from megatron_ga_ext.config.coverage import ROWS
from tests.support.plans import ran_steps
from tests.support.pretrain_runs import Run
from tools.compatibility import core_version

pytestmark = pytest.mark.gpu

LAYOUT, DEVICE = "dp1", "cuda"
CONSTANT = ["--global-batch-size", "16", "--train-samples", "128"]
TOKEN = ["--ga-loss-reduction", "token"]  # the drop-in turns on --calculate-per-token-loss
UPSTREAM_TOKEN = ["--calculate-per-token-loss"]
MICROBATCH = ["--ga-loss-reduction", "microbatch"]
# Off in every launch here: a full-iteration graph requires it (validate_args), and with it off a
# NaN is the extension's to stop; upstream's runs get the same flags as ours.
NO_MEGATRON_NAN_CHECK = ["--no-check-for-nan-in-loss-and-grad"]
WARMUP = ["--cuda-graph-warmup-steps", "1"]
LAYER_GRAPHS = ["--cuda-graph-impl", "local", *WARMUP]
OPTIMIZER_GRAPH = ["--optimizer-cuda-graph", *WARMUP]
FULL_ITERATION = ["--cuda-graph-impl", "full_iteration", *WARMUP]
NAN_AT = 5
NAN_FAULT = {"MEGATRON_GA_FAULT": f"nan-loss-at:{NAN_AT}"}
NONFINITE = "1 micro-batch(es) in this global batch returned a non-finite loss"
#: Upstream's run and ours launch the same kernels in the same order, but a CUDA kernel that
#: accumulates with atomics need not repeat its last bits; the token and micro-batch means differ by
#: far more from the first step on.
REL = 1e-6


@pytest.fixture(autouse=True)
def _cuda_device() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the GPU tier launches pretrain_gpt.py over NCCL on one")


@pytest.fixture
def graph_source(newest_release: Path) -> Path:
    """The newest release of the tier's sources, where it has 0.19's graph flags (--cuda-graph-impl
    full_iteration and local, --optimizer-cuda-graph, --cuda-graph-warmup-steps) and log lines."""
    major, minor = (int(part) for part in re.findall(r"\d+", core_version(newest_release))[:2])
    if (major, minor) < (0, 19):
        pytest.skip(
            f"{newest_release.name} is megatron-core {major}.{minor}; these launches are written "
            "for 0.19+"
        )
    return newest_release


@pytest.fixture
def optimizer_graph_kernels() -> None:
    """Megatron's grad norm reads .item() (a host sync, which ends a capture) unless Transformer
    Engine's multi-tensor kernels give it as a tensor (megatron/core/optimizer/clip_grads.py):
    without them the optimizer step cannot be captured, with or without the extension."""
    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip(
            "--optimizer-cuda-graph needs Transformer Engine (the gpu extra) to capture "
            "Megatron's grad norm"
        )


def get(launches, source: Path, name: str, flags: list[str], **kwargs) -> Run:
    return launches.get(
        source, LAYOUT, name, [*flags, *CONSTANT, *NO_MEGATRON_NAN_CHECK], device=DEVICE, **kwargs
    )


def trained(run: Run, iterations: int = 8) -> None:
    assert run.rc == 0 and run.error is None, run.describe()
    assert [r["iteration"] for r in run.iterations] == list(range(1, iterations + 1)), (
        run.describe()
    )


def failed_with(run: Run, error: str, *texts: str) -> None:
    assert run.rc != 0 and run.error is not None, run.describe()
    assert run.error.startswith(error) and all(text in run.error for text in texts), run.error


def same_steps(ours: Run, theirs: Run, count: int, *, loss: bool = True) -> None:
    """The first ``count`` iterations: the same steps and learning rate, grad norm and (``loss``)
    logged loss."""
    mine, upstream = ours.iterations[:count], theirs.iterations[:count]
    assert len(mine) == len(upstream) == count, (ours.describe(), theirs.describe())
    assert ran_steps(ours)[:count] == ran_steps(theirs)[:count]
    for a, b in zip(mine, upstream):
        assert a["learning_rate"] == b["learning_rate"], (a, b)
        assert a["grad_norm"] is not None and a["grad_norm"] == pytest.approx(
            b["grad_norm"], rel=REL
        ), (a, b)
        if loss:
            assert a["loss"] == pytest.approx(b["loss"], rel=REL), (a, b)


def counted_every_token(run: Run) -> None:
    """Token mode: the extension's N is the global batch's loss tokens, every logged iteration."""
    assert [r["num_tokens"] for r in run.iterations] == run.mask_tokens(), run.iterations


def test_layer_graphs_keep_every_check_and_equal_upstream_per_token(launches, graph_source):
    upstream = get(
        launches,
        graph_source,
        "layer-graphs-upstream",
        [*UPSTREAM_TOKEN, *LAYER_GRAPHS],
        extension=False,
    )
    trained(upstream)
    run = get(launches, graph_source, "layer-graphs-nan", [*TOKEN, *LAYER_GRAPHS], env=NAN_FAULT)
    assert re.search(r"Creating [1-9]\d* CUDA graphs", run.output), (
        run.describe()
    )  # captured in iteration 1
    failed_with(run, "LossContractError", NONFINITE)
    assert [r["iteration"] for r in run.iterations] == list(range(1, NAN_AT))
    same_steps(run, upstream, NAN_AT - 1)
    counted_every_token(run)


def optimizer_graph_upstream(launches, source: Path) -> Run:
    run = get(
        launches,
        source,
        "optimizer-graph-upstream",
        [*UPSTREAM_TOKEN, *OPTIMIZER_GRAPH],
        extension=False,
    )
    trained(run)
    return run


def test_optimizer_graph_checks_each_step_in_finalize_before_the_replayed_step(
    launches, graph_source, optimizer_graph_kernels
):
    upstream = optimizer_graph_upstream(launches, graph_source)
    run = get(
        launches, graph_source, "optimizer-graph-nan", [*TOKEN, *OPTIMIZER_GRAPH], env=NAN_FAULT
    )
    assert "Optimizer CUDA graph capture done" in run.output, run.describe()
    failed_with(run, "LossContractError", NONFINITE)
    assert [r["iteration"] for r in run.iterations] == list(range(1, NAN_AT))
    same_steps(run, upstream, NAN_AT - 1)
    counted_every_token(run)


def test_optimizer_graph_async_verdict_stops_the_next_forward_backward(
    launches, graph_source, optimizer_graph_kernels
):
    """The replayed optimizer step of iteration 5 does not call the extension's step hook, where the
    CPU run reads the verdict (test_faults.py): Megatron logs iteration 5, and its verdict stops
    iteration 6's forward/backward."""
    upstream = optimizer_graph_upstream(launches, graph_source)
    run = get(
        launches,
        graph_source,
        "optimizer-graph-async-nan",
        [*TOKEN, *OPTIMIZER_GRAPH, "--ga-checks", "async"],
        env=NAN_FAULT,
    )
    assert "Optimizer CUDA graph capture done" in run.output, run.describe()
    failed_with(
        run,
        "LossContractError",
        f"--ga-checks async, verdict of training step {NAN_AT} (iteration {NAN_AT}): {NONFINITE}",
    )
    assert [r["iteration"] for r in run.iterations] == list(range(1, NAN_AT + 1))
    same_steps(run, upstream, NAN_AT - 1)


def test_full_iteration_graph_in_microbatch_mode_trains_as_upstream(launches, graph_source):
    upstream = get(
        launches, graph_source, "full-iteration-upstream", FULL_ITERATION, extension=False
    )
    trained(upstream)
    run = get(launches, graph_source, "full-iteration-microbatch", [*MICROBATCH, *FULL_ITERATION])
    trained(run)
    assert "CUDA graph capture done for training" in run.output, run.describe()
    same_steps(run, upstream, len(upstream.iterations), loss=False)


def test_full_iteration_graph_in_token_mode_is_refused_in_the_loop(launches, graph_source):
    row = next(row for row in ROWS if row.id == "full-iteration-graph-token")
    run = get(launches, graph_source, "full-iteration-token", [*TOKEN, *FULL_ITERATION])
    failed_with(run, "CoverageError", f"megatron-ga-ext refuses {row.case}")
    assert run.iterations == []
