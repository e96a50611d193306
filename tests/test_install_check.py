"""config/install_check.py: what install() refuses on Megatron's parsed args, on every rank, before
any model is built: the trace file's directory (``--ga-noise-scale-trace``), and what ``megatron-ga
check`` refuses on a launch line too (a local non-persistent checkpoint under
``--ga-batch-size-warmup auto``)."""

import argparse
import os
import shlex

import pytest

from megatron_ga_ext import GAConfig
from megatron_ga_ext.config import launch_rules
from megatron_ga_ext.config.install_check import check_args
from megatron_ga_ext.errors import OptionError

WARMUP = {"noise_scale": 10, "batch_size_warmup": "auto", "batch_size_warmup_max": 512}


def megatron(**values) -> argparse.Namespace:
    """Megatron's parsed args of a token-mode DP 2 launch that --ga-noise-scale can measure."""
    return argparse.Namespace(
        calculate_per_token_loss=True,
        data_parallel_size=2,
        global_batch_size=64,
        train_samples=100000,
        **values,
    )


def test_a_trace_in_a_missing_directory_is_refused_at_start_up(tmp_path):
    trace = tmp_path / "missing" / "noise.jsonl"
    with pytest.raises(
        OptionError,
        match=rf"^--ga-noise-scale-trace {trace}: its directory {trace.parent} does not "
        rf"exist, so the last rank would fail at the first measured iteration "
        rf"\(--ga-noise-scale 10\) while the other ranks wait\. Create the directory "
        rf"\(mkdir -p {trace.parent}\)",
    ):
        check_args(GAConfig(noise_scale=10, noise_scale_trace=str(trace)), megatron())


def test_a_trace_in_a_read_only_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(
        os, "access", lambda path, mode: False
    )  # a read-only mount (root passes a chmod)
    with pytest.raises(OptionError, match=rf"its directory {tmp_path} is not writable"):
        launch_rules.check_trace_path(10, str(tmp_path / "noise.jsonl"))
    (tmp_path / "noise.jsonl").touch()
    with pytest.raises(OptionError, match=r"noise\.jsonl: it is not writable"):
        launch_rules.check_trace_path(10, str(tmp_path / "noise.jsonl"))


def test_a_trace_that_is_a_directory_is_refused(tmp_path):
    with pytest.raises(
        OptionError, match=rf"^--ga-noise-scale-trace {tmp_path}: it is a directory"
    ):
        launch_rules.check_trace_path(10, str(tmp_path))


def test_a_writable_trace_or_none_passes(tmp_path, monkeypatch):
    check_args(
        GAConfig(noise_scale=10, noise_scale_trace=str(tmp_path / "noise.jsonl")), megatron()
    )
    monkeypatch.chdir(tmp_path)
    launch_rules.check_trace_path(
        10, "noise.jsonl"
    )  # relative to the working directory, as the meter opens it
    launch_rules.check_trace_path(
        0, str(tmp_path / "missing" / "noise.jsonl")
    )  # not measuring: never written
    launch_rules.check_trace_path(10, None)


LOCAL = (
    r"^--ga-batch-size-warmup auto with --non-persistent-ckpt-type local: the warmup's stages "
    r"are kept beside each checkpoint's iter_NNNNNNN directory, .* Use "
    r"--non-persistent-ckpt-type global"
)


def test_warmup_refuses_local_non_persistent_checkpoints_at_start_up():
    with pytest.raises(OptionError, match=LOCAL):
        check_args(
            GAConfig(**WARMUP),
            megatron(non_persistent_ckpt_type="local", non_persistent_save_interval=5),
        )
    check_args(
        GAConfig(**WARMUP),
        megatron(non_persistent_ckpt_type="global", non_persistent_save_interval=5),
    )
    check_args(
        GAConfig(noise_scale=10), megatron(non_persistent_ckpt_type="local")
    )  # the EMAs start afresh only
    launch_rules.check_warmup_checkpoints("off", "local")


def test_check_reports_the_local_non_persistent_refusal_on_a_launch_line():
    from megatron_ga_ext.launch.check import launch_problems
    from megatron_ga_ext.launch.line import parse_launch

    line = (
        "torchrun --nproc_per_node 8 pretrain_gpt.py --calculate-per-token-loss "
        "--micro-batch-size 1 --global-batch-size 64 --seq-length 2048 --train-samples "
        "100000 --ga-batch-size-warmup auto --ga-noise-scale 10 "
        "--ga-batch-size-warmup-max 512 --non-persistent-save-interval 5 "
    )

    def problems(extra: str) -> list[str]:
        return launch_problems(parse_launch(shlex.split(line + extra)), None)[1]

    assert problems("--non-persistent-ckpt-type global") == []
    assert any(
        "--ga-batch-size-warmup auto with --non-persistent-ckpt-type local" in p
        for p in problems(
            "--non-persistent-ckpt-type local --non-persistent-local-ckpt-dir /tmp/local"
        )
    )
