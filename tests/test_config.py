"""config/: GAConfig's validation, the rules between flags, and how the batch schedule is resolved
(the flag declarations themselves: tests/test_flag_declarations.py)."""

import argparse
import importlib
import logging

import pytest

from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.config.launch_rules import check_guards, check_loss_mode, check_train_length
from megatron_ga_ext.config.resolve import ScheduleInputs, resolve_schedule
from megatron_ga_ext.core.schedule.rampup import rampup_triple
from megatron_ga_ext.errors import (
    InterleaveError,
    OptionError,
    ScheduleError,
    ScheduleParseError,
    SizeError,
)
from megatron_ga_ext.integration.calculator import StepScheduleCalculator

# The module: the package's ``install`` is the function.
install_module = importlib.import_module("megatron_ga_ext.integration.lifecycle")


# -- GAConfig -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(loss_reduction="tokens"),
            r"^--ga-loss-reduction 'tokens' is not one of token, microbatch; did you mean "
            r"--ga-loss-reduction token\?",
        ),
        (
            dict(zero_token_policy="ignore"),
            r"^--ga-zero-token-policy 'ignore' is not one of error, skip",
        ),
        (dict(checks="later"), r"^--ga-checks 'later' is not one of sync, async; pick one"),
        (
            dict(checks="async", zero_token_policy="skip"),
            r"^--ga-checks async reads a step's token count only after its optimizer step, so "
            r"--ga-zero-token-policy skip cannot skip a step with 0 tokens\. Drop one of "
            r"them",
        ),
    ],
)
def test_gaconfig_validates_at_construction(kwargs, message):
    with pytest.raises(OptionError, match=message):
        GAConfig(**kwargs)


def test_gaconfig_from_args_reads_megatrons_names():
    args = argparse.Namespace(
        rampup_batch_size=["16", "8", "300000"],
        microbatch_group_size_per_vp_stage=6,
        virtual_pipeline_model_parallel_size=2,
        pipeline_model_parallel_size=4,
        seq_length=4096,
    )
    config = GAConfig.from_args(args)
    assert (
        config.rampup_batch_size == (16, 8, 300000)
        and config.microbatch_group_size_per_vp_stage == 6
    )
    assert (config.loss_reduction, config.guards, config.strict) == ("token", True, True)


@pytest.mark.parametrize(
    "values, message",
    [
        (
            [16, 8],
            r"takes three values, START INCREMENT SAMPLES \(e\.g\. 16 8 300000\); got 2: 16 8",
        ),
        (["16", "8", "1e5"], r"--rampup-batch-size ramp-up samples '1e5' is not a whole number"),
        (
            ["16", "8", "9" * 5000],
            r"--rampup-batch-size ramp-up samples value '999999999999\.\.\.9999' has 5000 "
            r"characters",
        ),
        ("16 8 100", r"takes three values.*got 1: 16 8 100"),
    ],
)
def test_rampup_values_are_typed_errors(values, message):
    with pytest.raises(SizeError, match=message):
        rampup_triple(values)


# -- the rules ------------------------------------------------------------------------------------


def test_loss_mode_rule():
    check_loss_mode("token", True)
    check_loss_mode("microbatch", False)
    with pytest.raises(
        OptionError,
        match=r"^--ga-loss-reduction token needs --calculate-per-token-loss: without it "
        r"Megatron divides each micro-batch by its own token count",
    ):
        check_loss_mode("token", False)
    with pytest.raises(OptionError, match=r"^--ga-loss-reduction token \(the default\) needs"):
        check_loss_mode("token", False, explicit=False)
    with pytest.raises(
        OptionError,
        match=r"--ga-loss-reduction microbatch is upstream's mean of means, but "
        r"--calculate-per-token-loss makes Megatron run the token mean; drop one",
    ):
        check_loss_mode("microbatch", True)
    with pytest.raises(OptionError, match=r"'mean' is not one of token, microbatch"):
        check_loss_mode("mean", True)


def test_guards_rule():
    check_guards(True)
    check_guards(False, hybrid_context_parallel=True, rl_sequence_packing=True)
    with pytest.raises(
        OptionError,
        match=r"^--hybrid-context-parallel run\(s\) another number of forward passes.*"
        r"Add --no-ga-guards\.$",
    ):
        check_guards(True, hybrid_context_parallel=True)


def test_train_length_rule():
    check_train_length(None, 1000)
    check_train_length("--step-batch-size-schedule", None)
    with pytest.raises(
        ScheduleError,
        match=r"^--step-batch-size-schedule with --train-iters 1000: Megatron converts "
        r"LR warmup/decay iterations and the dataset size with GBS = MBS x DP.*"
        r"Give --train-samples",
    ):
        check_train_length("--step-batch-size-schedule", 1000)


# -- the one schedule of a launch -----------------------------------------------------------------


def test_resolve_schedule_paths(caplog):
    assert resolve_schedule(ScheduleInputs(global_batch_size=64)) is None
    assert resolve_schedule(
        ScheduleInputs(step_batch_size_schedule="0:8 250K:16", seq_length=1000)
    ).stages == [
        (0, 8),
        (250, 16),
    ]
    converted = resolve_schedule(
        ScheduleInputs(
            rampup_batch_size=("16", "8", "300000"), global_batch_size=1024, convert_rampup=True
        )
    )
    assert len(converted.stages) == 127
    with caplog.at_level(logging.WARNING, logger="megatron_ga_ext.config.resolve"):
        assert (
            resolve_schedule(
                ScheduleInputs(rampup_batch_size=(16, 8, 300000), global_batch_size=1024)
            )
            is None
        )
        assert not caplog.records  # upstream runs the rampup itself (0.16, 0.17)
        assert (
            resolve_schedule(
                ScheduleInputs(
                    rampup_batch_size=(16, 8, 300000),
                    global_batch_size=1024,
                    rampup_ignored_upstream=True,
                )
            )
            is None
        )
    assert (
        "--rampup-batch-size 16 8 300000: megatron-core >= 0.18 ignores the rampup on the "
        "training path" in caplog.text
    ) and "logs nothing" in caplog.text
    assert "Pass --ga-convert-rampup" in caplog.text


@pytest.mark.parametrize(
    "inputs, error, message",
    [
        (
            ScheduleInputs(step_batch_size_schedule="0:8", rampup_batch_size=(16, 8, 100)),
            ScheduleError,
            r"^--rampup-batch-size 16 8 100 and --step-batch-size-schedule are both given",
        ),
        (
            ScheduleInputs(step_batch_size_schedule="0:8", decrease_batch_size_if_needed=True),
            ScheduleError,
            r"^--decrease-batch-size-if-needed cannot be combined with a step batch-size schedule",
        ),
        (
            ScheduleInputs(
                rampup_batch_size=(16, 8, "x"), global_batch_size=64, convert_rampup=True
            ),
            SizeError,
            r"ramp-up samples 'x' is not a whole number",
        ),
        (
            ScheduleInputs(rampup_batch_size=(16, 8, 100), convert_rampup=True),
            SizeError,
            r"--global-batch-size is required with --rampup-batch-size",
        ),
        (
            ScheduleInputs(
                rampup_batch_size=(16, 10, 100), global_batch_size=64, convert_rampup=True
            ),
            ScheduleError,
            r"increment 10 does not divide",
        ),
        (
            ScheduleInputs(step_batch_size_schedule="0:8 1G:16"),
            ScheduleParseError,
            r"unknown suffix 'G'",
        ),
    ],
)
def test_resolve_schedule_refusals(inputs, error, message):
    with pytest.raises(error, match=message):
        resolve_schedule(inputs)


def test_install_check_and_calculator_see_the_same_schedule_and_layout():
    """'0:48 100:80' with PP 4, VPP 2 and N = 6 runs (M = 6, 10) only if install() passes N on to
    the calculator as check does: without N, the default N = PP refuses M = 6."""
    config = GAConfig(
        step_batch_size_schedule="0:48 100:80",
        pipeline_model_parallel_size=4,
        virtual_pipeline_model_parallel_size=2,
        microbatch_group_size_per_vp_stage=6,
    )
    arguments = {
        "rank": 0,
        "global_batch_size": None,
        "micro_batch_size": 1,
        "data_parallel_size": 8,
        "decrease_batch_size_if_needed": False,
    }  # a 0.16/0.17 call: no schedule, rampup passed as None
    arguments["rampup_batch_size"] = None
    inputs = ScheduleInputs.from_calculator_call(config, arguments)
    schedule = resolve_schedule(inputs)  # what install()'s calculator hook resolves
    assert schedule.stages == [(0, 48), (100, 80)]
    assert schedule.problems(**inputs.layout()) == []
    calculator = StepScheduleCalculator.for_launch(schedule, inputs)
    calculator.update(0, consistency_check=True)
    calculator.update(100, consistency_check=True)
    assert calculator.get() == 10
    with pytest.raises(
        InterleaveError, match=r"entry 1 '0:48'"
    ):  # without N the default N = PP refuses M = 6
        StepScheduleCalculator(schedule, 1, 8, 0, 4, 2).update(0, consistency_check=True)


def test_install_refuses_a_rampup_with_a_schedule_and_reads_rampups_typed():
    """Through install() and megatron-core's own init, as Megatron's set_global_variables calls
    it."""
    calculators = pytest.importorskip("megatron.core.num_microbatches_calculator")
    for config, error, message in (
        (
            GAConfig(step_batch_size_schedule="0:16", rampup_batch_size=(16, 8, 100)),
            ScheduleError,
            "are both given",
        ),
    ):
        install_module.install(config)
        try:
            with pytest.raises(error, match=message):
                calculators.init_num_microbatches_calculator(0, None, 64, 1, 8)
        finally:
            install_module.uninstall()
            calculators.unset_num_microbatches_calculator()
    with pytest.raises(SizeError, match=r"ramp-up samples 'many' is not a whole number"):
        resolve_schedule(
            ScheduleInputs.from_calculator_call(
                GAConfig(convert_rampup=True),
                {"global_batch_size": 64, "rampup_batch_size": [16, 8, "many"]},
            )
        )
