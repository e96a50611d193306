"""--ga-lr-scaling on megatron-core's own OptimizerParamScheduler, stepped as Megatron-LM's loop
steps it, with the calculator install() puts behind get_num_microbatches()."""

import argparse
import logging
import math

import pytest

pytest.importorskip("megatron.core.pipeline_parallel.schedules")
import torch
from megatron.core import num_microbatches_calculator as calculators
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_ga_ext import GAConfig
from megatron_ga_ext.config.launch_rules import check_lr_scaling
from megatron_ga_ext.core.lr_factor import lr_factor
from megatron_ga_ext.core.schedule.step_schedule import StepSchedule
from megatron_ga_ext.errors import OptionError
from megatron_ga_ext.integration.lifecycle import install, installed, uninstall
from tests.test_lifecycle import STEP_SCHEDULES, init_calculator, parsed

SCHEDULE = "0:16 64:32 160:64"
FIRST_GBS = 16
#: Each stage's factor: (GBS / 16) ** 1/2 and ** 1.
FACTORS = {"sqrt": {16: 1.0, 32: math.sqrt(2), 64: 2.0}, "linear": {16: 1.0, 32: 2.0, 64: 4.0}}
TRAIN_SAMPLES = 400
#: Megatron's max_lr / min_lr per param group: the default, and a decoupled-LR group (embeddings,
#: output layer).
DECOUPLED = {"max_lr": 5e-3, "min_lr": 5e-4}


pytestmark = pytest.mark.usefixtures("clean_install")


def scheduler() -> OptimizerParamScheduler:
    """Megatron-LM's scheduler of a --train-samples run: warmup and cosine decay in samples, two
    param groups."""
    weights, embedding = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD(
        [{"params": [weights]}, {"params": [embedding], **DECOUPLED}], lr=1e-3
    )
    return OptimizerParamScheduler(
        optimizer,
        init_lr=1e-5,
        max_lr=1e-3,
        min_lr=1e-4,
        lr_warmup_steps=48,
        lr_decay_steps=TRAIN_SAMPLES,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=TRAIN_SAMPLES,
        wd_incr_style="constant",
    )


def run(global_batch_sizes=None) -> list[tuple[int, list[float]]]:
    """Megatron-LM's order per iteration: update the calculator at the consumed samples, the
    optimizer step at the param groups' rates (recorded with the step's GBS), then
    ``scheduler.step(GBS)``. ``global_batch_sizes``: the schedule's GBS per consumed samples where
    no calculator is live (the unscaled reference)."""
    lr_scheduler, steps, consumed = scheduler(), [], 0
    while consumed < TRAIN_SAMPLES:
        if global_batch_sizes is None:
            calculators.update_num_microbatches(consumed, consistency_check=True)
            batch = calculators.get_current_global_batch_size()
        else:
            batch = global_batch_sizes.global_batch_size_at(consumed)
        steps.append((batch, [group["lr"] for group in lr_scheduler.optimizer.param_groups]))
        lr_scheduler.step(increment=batch)
        consumed += batch
    return steps


def reference() -> list[tuple[int, list[float]]]:
    """The same steps with Megatron's rates as they are (no installation)."""
    return run(StepSchedule.parse(SCHEDULE))


def install_schedule(lr_scaling: str) -> None:
    install(GAConfig(step_batch_size_schedule=SCHEDULE, lr_scaling=lr_scaling))
    init_calculator(None if STEP_SCHEDULES else FIRST_GBS, 2, 4)


@pytest.mark.parametrize("lr_scaling", ["sqrt", "linear"])
def test_each_step_runs_at_the_rate_times_its_stages_factor(lr_scaling, caplog):
    expected = reference()
    install_schedule(lr_scaling)
    with caplog.at_level(logging.INFO, logger="megatron_ga_ext"):
        scaled = run()
    assert [batch for batch, _ in scaled] == [batch for batch, _ in expected]
    assert {batch for batch, _ in scaled} == {16, 32, 64}
    for (batch, rates), (_, megatron_rates) in zip(scaled, expected):
        factor = FACTORS[lr_scaling][batch]
        assert rates == [rate * lr_factor(batch, FIRST_GBS, lr_scaling) for rate in megatron_rates]
        assert rates == pytest.approx([rate * factor for rate in megatron_rates], rel=1e-15)
    # The first step of each stage already runs at its stage's factor; warmup (step 1-3) and decay
    # are scaled too.
    assert scaled[0][1] == expected[0][1] and scaled[0][1][0] == 1e-5
    first_of_stage = {batch: i for i, (batch, _) in reversed(list(enumerate(scaled)))}
    for batch, i in first_of_stage.items():
        assert scaled[i][1][1] == expected[i][1][1] * lr_factor(batch, FIRST_GBS, lr_scaling)
    factors = ", ".join(
        f"x {FACTORS[lr_scaling][b]:.6g} from sample {t} (GBS {b})"
        for t, b in ((0, 16), (64, 32), (160, 64))
    )
    assert f"--ga-lr-scaling {lr_scaling}: the learning rate {factors}" in caplog.text


def test_none_leaves_megatrons_rates_and_uninstall_restores_get_lr():
    original = OptimizerParamScheduler.__dict__["get_lr"]
    expected = reference()
    install_schedule("none")
    assert (
        OptimizerParamScheduler.__dict__["get_lr"] is original
    )  # not wired: no feature scales the rate
    assert run() == expected
    uninstall()
    calculators.unset_num_microbatches_calculator()
    install_schedule("sqrt")
    assert run() != expected
    uninstall()
    assert OptimizerParamScheduler.__dict__["get_lr"] is original
    assert (
        run() == expected
    )  # the step calculator stays live after uninstall: Megatron's rates again


def test_a_scheduler_built_before_install_is_scaled_too():
    lr_scheduler = scheduler()
    install_schedule("linear")
    lr_scheduler.step(increment=64)  # the second stage starts at 64 samples
    assert [g["lr"] for g in lr_scheduler.optimizer.param_groups] == [
        OptimizerParamScheduler.get_lr.__wrapped__(lr_scheduler, g) * 2.0
        for g in lr_scheduler.optimizer.param_groups
    ]


@pytest.mark.parametrize(
    "lr_scaling, schedule",
    [
        ("none", None),
        ("sqrt", "--step-batch-size-schedule"),
        ("linear", "--rampup-batch-size with --ga-convert-rampup"),
    ],
)
def test_rule_passes(lr_scaling, schedule):
    check_lr_scaling(lr_scaling, schedule)


@pytest.mark.parametrize("lr_scaling, exponent", [("sqrt", "1/2"), ("linear", "1")])
def test_rule_refuses_scaling_without_a_schedule(lr_scaling, exponent):
    message = (
        rf"--ga-lr-scaling {lr_scaling} scales the learning rate .* \(GBS / first GBS\) \*\* "
        rf"{exponent}, but "
        r"this launch has no schedule .* Give --step-batch-size-schedule \(or "
        r"--rampup-batch-size with "
        rf"--ga-convert-rampup\), or drop --ga-lr-scaling"
    )
    with pytest.raises(OptionError, match=message):
        check_lr_scaling(lr_scaling, None)
    with pytest.raises(OptionError, match=message):  # where install() reads Megatron's args
        install(parsed("--calculate-per-token-loss", "--ga-lr-scaling", lr_scaling))
    uninstall()
    install(
        parsed(
            "--calculate-per-token-loss",
            "--ga-lr-scaling",
            lr_scaling,
            "--step-batch-size-schedule",
            SCHEDULE,
            "--train-samples",
            "400",
        )
    )  # with a schedule: accepted


def test_a_loop_without_the_schedule_calculator_is_refused_at_the_first_rate():
    install(GAConfig(lr_scaling="sqrt"))  # a megatron-core loop; its calculator is a constant one
    init_calculator(16, 2, 4)
    with pytest.raises(OptionError, match=r"--ga-lr-scaling sqrt .* this launch has no schedule"):
        scheduler()


def run_skipping(
    monkeypatch, state, skipped: set[int]
) -> list[tuple[int, list[float], list[float]]]:
    """Megatron-LM's loop with its args: per iteration the calculator updated at
    ``args.consumed_train_samples``, a training forward/backward call and its finalize, the
    optimizer step as install() wraps the one Megatron's builder returns (its inner step records the
    groups' rates with the step's GBS and Megatron's unscaled rates at the scheduler's count),
    ``scheduler.step(GBS)`` only where the step was not skipped (an fp16 overflow, a zero-token
    skip), and the consumed samples counted after it either way."""
    from megatron_ga_ext.integration import megatron_lm
    from megatron_ga_ext.integration.hooks import optimizer_step

    args = argparse.Namespace(consumed_train_samples=0)
    monkeypatch.setattr(megatron_lm.MEGATRON_LM, "parsed_args", lambda: args)
    lr_scheduler, steps, iteration = scheduler(), [], 0
    unscaled = OptimizerParamScheduler.get_lr.__wrapped__
    groups = lr_scheduler.optimizer.param_groups

    def inner_step() -> tuple[bool, float, int]:
        steps.append(
            (batch, [g["lr"] for g in groups], [unscaled(lr_scheduler, g) for g in groups])
        )
        return iteration not in skipped, 1.0, 0

    step = optimizer_step(inner_step, state, lr_scheduler.optimizer)
    while args.consumed_train_samples < TRAIN_SAMPLES:
        calculators.update_num_microbatches(args.consumed_train_samples, consistency_check=True)
        batch = calculators.get_current_global_batch_size()
        state.counts.training_schedules += (
            1  # the step's forward/backward call (Installation.begin_step counts it)
        )
        if state.finalize is not None:
            state.counts.finalizes += 1  # and its finalize (token mode)
        successful, _, _ = step()
        if successful:
            lr_scheduler.step(increment=batch)
        args.consumed_train_samples += batch
        iteration += 1
    return steps


@pytest.mark.parametrize("lr_scaling", ["sqrt", "linear"])
@pytest.mark.parametrize(
    "skipped, batches",
    [
        ({1}, [16, 16, 16, 16, 32, 32]),  # the second step, at 16 samples: within the first stage
        (
            {3},
            [16, 16, 16, 16, 32, 32],
        ),  # the first stage's last step (at 48 samples): the next is a new stage's first
        ({3, 4}, [16, 16, 16, 16, 32, 32]),  # and that one skipped too
    ],
)
def test_after_a_skipped_step_each_step_runs_at_its_own_batchs_factor(
    monkeypatch, lr_scaling, skipped, batches
):
    """A skipped step holds the scheduler's count while the consumed samples (and the batch)
    advance: the factor follows the batch, so the next stage's first step (at 64 samples, GBS 32)
    already has its stage's factor, also where the skipped step was the last of its stage and its
    rates were written for its own batch (written again before the next optimizer step)."""
    install_schedule(lr_scaling)
    state = installed()
    steps = run_skipping(monkeypatch, state, skipped)
    assert [batch for batch, _, _ in steps[:6]] == batches
    for batch, rates, megatron_rates in steps:
        assert rates == [rate * lr_factor(batch, FIRST_GBS, lr_scaling) for rate in megatron_rates]
    assert {batch for batch, _, _ in steps} == {16, 32, 64}
