"""``--ga-batch-size-warmup auto``'s decisions on the extension's real calculator, its restore and
its refusals (the run itself: tests/e2e/test_batch_warmup.py)."""

import argparse
import logging

import pytest

from megatron_ga_ext import GAConfig
from megatron_ga_ext.config.launch_rules import check_batch_size_warmup_launch
from megatron_ga_ext.core.schedule.step_schedule import StepSchedule
from megatron_ga_ext.errors import OptionError, ScheduleError
from megatron_ga_ext.integration.calculator import StepScheduleCalculator
from megatron_ga_ext.science.integration.batch_warmup import BatchSizeWarmup, frozen_ranges

AUTO = {"noise_scale": 1, "batch_size_warmup": "auto", "batch_size_warmup_max": 32}


def calculator() -> StepScheduleCalculator:
    return StepScheduleCalculator(StepSchedule.constant(8), 1, 2)  # MBS 1 x DP 2


def row(consumed: int, b_simple: float | None, iteration: int = 1) -> dict:
    return {"iteration": iteration, "consumed_samples": consumed, "b_simple_samples": b_simple}


def test_it_doubles_where_trust_times_b_simple_reaches_twice_the_batch_up_to_the_cap(caplog):
    caplog.set_level(logging.INFO)
    warmup, live = BatchSizeWarmup(GAConfig(**AUTO)), calculator()
    assert not warmup.decide(row(8, 15.9), live)  # 15.9 < 2 x 8
    assert warmup.decide(row(16, 16.0), live)  # 16 >= 2 x 8: GBS 16 from 16 samples
    assert not warmup.decide(row(32, 31.0), live)
    assert warmup.decide(
        row(48, 400.0), live
    )  # one doubling per measurement, however large the estimate
    assert not warmup.decide(row(80, 400.0), live)  # 2 x 32 passes the cap
    assert not warmup.decide(row(112, None), live)  # not measurable
    assert list(live.step_schedule.stages) == [(0, 8), (16, 16), (48, 32)]
    assert warmup.decisions == [(1, 16, 16), (1, 48, 32)]
    live.update(48, consistency_check=True)
    assert (live.get_current_global_batch_size(), live.get()) == (32, 16)
    assert "held by the cap --ga-batch-size-warmup-max 32" in caplog.text
    assert BatchSizeWarmup.stages(live) == [[0, 8], [16, 16], [48, 32]]


def test_trust_scales_the_estimate():
    warmup, live = BatchSizeWarmup(GAConfig(**AUTO, batch_size_warmup_trust=2.0)), calculator()
    assert warmup.decide(row(16, 8.0), live)  # 2 x 8 >= 2 x 8


def test_a_resume_restores_the_stages_from_the_same_first_batch():
    warmup, live = BatchSizeWarmup(GAConfig(**AUTO)), calculator()
    warmup.restore([[0, 8], [16, 16], [48, 32]], live)
    assert list(live.step_schedule.stages) == [(0, 8), (16, 16), (48, 32)]
    with pytest.raises(
        ScheduleError,
        match="the checkpoint's batch-size warmup starts at 16 from sample 0, this run's "
        "--global-batch-size gives 8",
    ):
        warmup.restore([[0, 16]], calculator())


def test_no_calculator_of_the_extension_is_an_error():
    with pytest.raises(ScheduleError, match="none is live"):
        BatchSizeWarmup(GAConfig(**AUTO)).decide(row(16, 100.0), None)


def test_the_lr_warmup_and_a_wsd_final_decay_hold_the_batch():
    args = argparse.Namespace(
        lr_warmup_samples=100,
        lr_decay_samples=1000,
        lr_wsd_decay_samples=200,
        lr_decay_style="WSD",
        train_samples=1200,
    )
    assert [(f.start, f.end) for f in frozen_ranges(args)] == [(0, 100), (800, None)]
    fraction = argparse.Namespace(
        lr_warmup_samples=0,
        lr_warmup_fraction=0.1,
        lr_decay_samples=None,
        train_samples=1000,
        lr_decay_style="cosine",
        lr_wsd_decay_samples=None,
    )
    assert [(f.start, f.end) for f in frozen_ranges(fraction)] == [(0, 100)]
    assert frozen_ranges(None) == ()


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"batch_size_warmup": "auto", "batch_size_warmup_max": 32},
            r"auto decides from the measured noise scale",
        ),
        (
            {**AUTO, "batch_size_warmup_max": None},
            r"auto needs --ga-batch-size-warmup-max \(a whole number >= 1",
        ),
        (
            {**AUTO, "batch_size_warmup_trust": 0.0},
            r"--ga-batch-size-warmup-trust 0.0 is not a positive finite number",
        ),
        (
            {**AUTO, "batch_size_warmup": "on"},
            r"--ga-batch-size-warmup 'on' is not one of off, auto",
        ),
    ],
)
def test_config_refusals_name_the_flag(fields, message):
    with pytest.raises(OptionError, match=message):
        GAConfig(**fields)


def test_launch_refusals_name_the_flag():
    with pytest.raises(OptionError, match="does not go with --step-batch-size-schedule"):
        check_batch_size_warmup_launch(16, 64, "--step-batch-size-schedule")
    with pytest.raises(
        OptionError,
        match=r"starts at --global-batch-size \(128\) and grows up to "
        r"--ga-batch-size-warmup-max 64",
    ):
        check_batch_size_warmup_launch(128, 64, None)
    check_batch_size_warmup_launch(16, 64, None)


def test_check_reports_the_warmup_rules_on_a_launch_line():
    import shlex

    from megatron_ga_ext.launch.check import launch_problems
    from megatron_ga_ext.launch.line import parse_launch

    line = (
        "torchrun --nproc_per_node 8 pretrain_gpt.py --calculate-per-token-loss "
        "--micro-batch-size 1 --global-batch-size 64 --seq-length 2048 --train-samples "
        "100000 --ga-batch-size-warmup auto "
    )

    def problems(extra: str) -> list[str]:
        return launch_problems(parse_launch(shlex.split(line + extra)), None)[1]

    assert problems("--ga-noise-scale 10 --ga-batch-size-warmup-max 512 --ga-lr-scaling sqrt") == []
    assert any(
        "auto decides from the measured noise scale" in p
        for p in problems("--ga-batch-size-warmup-max 512")
    )
    assert any(
        "auto needs --ga-batch-size-warmup-max" in p for p in problems("--ga-noise-scale 10")
    )
    assert any(
        "grows up to --ga-batch-size-warmup-max 32" in p
        for p in problems("--ga-noise-scale 10 --ga-batch-size-warmup-max 32")
    )


def test_the_warmup_starts_from_the_constant_schedule_the_one_resolver_gives():
    from megatron_ga_ext.config.resolve import ScheduleInputs, resolve_schedule

    inputs = ScheduleInputs.from_calculator_call(
        GAConfig(**AUTO), {"global_batch_size": 16, "micro_batch_size": 1}
    )
    assert list(resolve_schedule(inputs).stages) == [(0, 16)]
    assert (
        resolve_schedule(ScheduleInputs.from_calculator_call(GAConfig(), {"global_batch_size": 16}))
        is None
    )
    with pytest.raises(ScheduleError, match="--decrease-batch-size-if-needed cannot be combined"):
        resolve_schedule(
            ScheduleInputs.from_calculator_call(
                GAConfig(**AUTO), {"global_batch_size": 16, "decrease_batch_size_if_needed": True}
            )
        )


def measured(consumed: int, b_simple: float, ema: float) -> dict:
    """A trace row with its step's parts: |G|^2 = 1 and tr(Sigma) per sample = ``b_simple`` (one
    loss token per sample), and the EMA's B_simple ``ema``."""
    return {
        "iteration": consumed // 8,
        "consumed_samples": consumed,
        "b_simple_samples": ema,
        "grad_sq": 1.0,
        "trace_sigma": b_simple,
        "tokens_per_sample": 1.0,
    }


def test_one_spike_never_doubles_the_batch():
    """B_simple 4 samples at every step but one, whose tr(Sigma) is 1,000x: the EMA jumps past 2 x
    GBS 8 and stays there for many measurements; the rule's statistic (at most the median ratio of
    the last 8 steps) does not."""
    warmup, live = BatchSizeWarmup(GAConfig(**AUTO)), calculator()
    ema = 4.0
    for k in range(1, 30):
        spike = 4000.0 if k == 10 else 4.0
        ema = 0.9 * ema + 0.1 * spike
        assert not warmup.decide(measured(8 * k, spike, ema), live), (k, ema)
    assert ema > 16.0  # the EMA alone would have doubled
    assert list(live.step_schedule.stages) == [(0, 8)]


def test_a_sustained_rise_doubles_once_the_median_passes():
    """B_simple 4, then 40 from the 5th step on: the median of the last 8 passes 2 x 8 at the 4th
    such step (4 of 8 at 40: the median is (4 + 40) / 2 = 22)."""
    warmup, live = BatchSizeWarmup(GAConfig(**AUTO)), calculator()
    decided = [
        warmup.decide(measured(8 * k, 4.0 if k < 5 else 40.0, 100.0), live) for k in range(1, 13)
    ]
    assert decided.index(True) == 7  # k = 8
    assert list(live.step_schedule.stages)[1] == (64, 16)
