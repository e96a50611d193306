"""The batch settings every rank and a resumed checkpoint must agree on, and the message naming what
differs (end to end: tests/e2e/test_faults.py)."""

import logging
from argparse import Namespace

import pytest

from megatron_ga_ext import GAConfig, StepSchedule
from megatron_ga_ext.errors import GuardError
from megatron_ga_ext.integration.agreement import (
    StartupChecks,
    batch_settings,
    check_ranks_agree,
    describe_differences,
)
from megatron_ga_ext.integration.calculator import StepScheduleCalculator
from megatron_ga_ext.integration.guards import GuardedCalculator
from megatron_ga_ext.testing.distributed import LaunchConfig, run_on_ranks


def megatron_args(**changes) -> Namespace:
    args = dict(
        micro_batch_size=2,
        global_batch_size=16,
        rampup_batch_size=None,
        step_batch_size_schedule=None,
        decrease_batch_size_if_needed=False,
        seq_length=64,
        train_samples=128,
        calculate_per_token_loss=True,
        ga_loss_reduction="token",
        ga_zero_token_policy="error",
        ga_strict=True,
        ga_convert_rampup=False,
        ga_guards=True,
        data_parallel_size=2,
        consumed_train_samples=0,
        iteration=0,
    )
    return Namespace(**{**args, **changes})


def test_settings_name_the_flags_and_what_the_calculator_computes():
    calculator = GuardedCalculator(
        StepScheduleCalculator(StepSchedule.parse("0:16 3072:32", 64), 2, 2), 1
    )
    settings = batch_settings(megatron_args(), calculator=calculator)
    assert (
        settings["--global-batch-size"] == "16" and settings["--rampup-batch-size"] == "not given"
    )
    assert (
        settings["--calculate-per-token-loss"] == "on"
        and settings["--ga-loss-reduction"] == "token"
    )
    assert settings["data-parallel size"] == "2"
    assert settings["the calculator's schedule"] == "0:16 3072:32"
    assert (settings["global batch size now"], settings["num_microbatches now"]) == ("16", "4")
    without_args = batch_settings(None, GAConfig(step_batch_size_schedule="0:8 100:16"))
    assert (
        without_args["--step-batch-size-schedule"] == "0:8 100:16"
        and without_args["--ga-guards"] == "on"
    )


def test_differences_name_the_ranks_and_the_values():
    same = {"--global-batch-size": "16", "--seq-length": "64"}
    other = {"--global-batch-size": "32", "--seq-length": "64"}
    assert describe_differences([same, same, same, same]) == []
    assert describe_differences([same, other, same, same, other, other, same]) == [
        "--global-batch-size is '16' on ranks 0, 2-3, 6 and '32' on ranks 1, 4-5"
    ]
    assert describe_differences([same, {"--seq-length": "64"}]) == [
        "--global-batch-size is '16' on rank 0 and 'not set' on rank 1"
    ]


def _gather_rank(global_batch_size: dict) -> str | None:
    import torch.distributed as dist

    try:
        check_ranks_agree({"--global-batch-size": str(global_batch_size[dist.get_rank()])})
    except GuardError as error:
        return str(error)
    return None


@pytest.mark.slow
def test_ranks_that_differ_fail_on_every_rank_with_the_same_message():
    config = LaunchConfig(timeout_s=120)
    assert (
        run_on_ranks(_gather_rank, world_size=3, args=({0: 16, 1: 16, 2: 16},), config=config)
        == [None] * 3
    )
    errors = run_on_ranks(_gather_rank, world_size=3, args=({0: 16, 1: 32, 2: 16},), config=config)
    assert len(set(errors)) == 1
    assert errors[0].startswith(
        "the ranks were launched with different batch configurations (compared once, at the "
        "first forward/backward call): --global-batch-size is '16' on ranks 0, 2 and "
        "'32' on rank 1. Data-parallel ranks that run different batches"
    )


def test_without_torch_distributed_there_is_nothing_to_compare(monkeypatch):
    import torch.distributed as dist

    assert not dist.is_initialized()
    gathered = []
    monkeypatch.setattr(dist, "all_gather_object", lambda *args: gathered.append(args))
    assert check_ranks_agree({"--global-batch-size": "16"}) is None
    assert (
        gathered == []
    )  # one process: no collective, which would hang or fail without a process group


def _resumed(checks: StartupChecks, checkpoint: Namespace, now: Namespace, caplog) -> str:
    seen = []  # the wrapper is what Megatron-LM's load_checkpoint calls
    checks.recording(lambda checkpoint_args: seen.append(checkpoint_args))(checkpoint)
    assert seen == [checkpoint]  # upstream's check still runs, on the same args
    with caplog.at_level(logging.WARNING, logger="megatron_ga_ext.integration.agreement"):
        checks.run_once(GAConfig(), now)
        checks.run_once(GAConfig(), now)  # once only
    return caplog.text


def test_a_resume_with_another_schedule_says_what_changed_and_from_where(caplog):
    before = megatron_args(global_batch_size=None, step_batch_size_schedule="0:16 3072:24 6144:32")
    now = megatron_args(
        global_batch_size=None,
        step_batch_size_schedule="0:16 2048:32",
        consumed_train_samples=32,
        iteration=2,
    )
    text = _resumed(StartupChecks(), before, now, caplog)
    assert text.count("resuming from") == 1
    assert (
        "resuming from the checkpoint of iteration 2 (consumed samples 32) with another batch "
        "configuration than it was saved with: --step-batch-size-schedule '0:16 3072:24 "
        "6144:32' when it was saved, '0:16 2048:32' now. The new configuration applies "
        "from iteration 3 (consumed samples 32) on."
    ) in text


def test_a_resume_with_the_same_configuration_is_silent(caplog):
    assert "resuming" not in _resumed(
        StartupChecks(), megatron_args(), megatron_args(consumed_train_samples=64), caplog
    )
