"""``schedule --suggest RUN_DIR``: the noise-scale scalars of a run's TensorBoard event files, under
the tags the run writes them with (science/core/noise_trace.py's ``scalar_tag``)."""

import pytest

from megatron_ga_ext.science.core.noise_trace import scalar_tag


def test_suggest_reads_the_runs_tensorboard_scalars(cli, tmp_path):
    pytest.importorskip("tensorboard")
    summary = pytest.importorskip("torch.utils.tensorboard")
    writer = summary.SummaryWriter(str(tmp_path))
    for step, (consumed, estimate) in enumerate([(16, 5.0), (32, 40.0), (48, 90.0)], 1):
        writer.add_scalar(scalar_tag("consumed_samples"), consumed, step)
        writer.add_scalar(scalar_tag("b_simple_samples"), estimate, step)
    writer.close()
    out = cli(
        "schedule",
        "--suggest",
        str(tmp_path),
        "--micro-batch-size",
        "2",
        "--data-parallel-size",
        "2",
        "--global-batch-size",
        "16",
        "--max-global-batch-size",
        "64",
        "--json",
    ).json()
    assert out["schedule_samples"] == "0:16 32:32 48:64", out
    assert [(d["iteration"], d["consumed_samples"]) for d in out["decisions"]] == [(2, 32), (3, 48)]
