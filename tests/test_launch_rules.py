"""The one rule pass (config/launch_rules.py): GAConfig, install()'s check_args and ``megatron-ga
check`` refuse a setting with the same typed error, because they run the same pass."""

from __future__ import annotations

import argparse
import re
import shlex

import pytest

from megatron_ga_ext.config import launch_rules
from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.config.install_check import check_args
from megatron_ga_ext.config.launch_rules import BETWEEN, check_launch, launch_errors
from megatron_ga_ext.config.megatron_args import MegatronArgs
from megatron_ga_ext.errors import GAError, OptionError, ScheduleError
from megatron_ga_ext.launch.check import launch_problems
from megatron_ga_ext.launch.line import parse_launch

LINE = (
    "torchrun --nproc_per_node 8 --nnodes 2 -m megatron_ga_ext pretrain_gpt.py "
    "--calculate-per-token-loss --micro-batch-size 1 --seq-length 2048 --train-samples "
    "100000"
)
#: Megatron's args of LINE, as its parser and validate_args leave them.
ARGS = {
    "calculate_per_token_loss": True,
    "micro_batch_size": 1,
    "seq_length": 2048,
    "world_size": 16,
    "data_parallel_size": 16,
    "train_samples": 100000,
    "global_batch_size": 16,
}


def problems(extra: str) -> list[str]:
    return launch_problems(parse_launch(shlex.split(f"{LINE} {extra}")), None)[1]


def namespace(**changes: object) -> argparse.Namespace:
    return argparse.Namespace(**{**ARGS, **changes})


#: (GAConfig fields, Megatron's args changed, the same on a launch line, the error type, its start).
BETWEEN_CASES = [
    (
        {},
        {"hybrid_context_parallel": True},
        "--global-batch-size 16 --hybrid-context-parallel",
        OptionError,
        "--hybrid-context-parallel run(s) another number of forward passes",
    ),
    (
        {"lr_scaling": "sqrt"},
        {},
        "--global-batch-size 16 --ga-lr-scaling sqrt",
        OptionError,
        "--ga-lr-scaling sqrt scales the learning rate",
    ),
    (
        {"loss_reduction": "microbatch"},
        {},
        "--global-batch-size 16 --ga-loss-reduction microbatch",
        OptionError,
        "--ga-loss-reduction microbatch is upstream's mean of means",
    ),
    (
        {},
        {"step_batch_size_schedule": "0:16 1000:32", "train_iters": 100, "global_batch_size": None},
        "--step-batch-size-schedule '0:16 1000:32' --train-iters 100",
        ScheduleError,
        "--step-batch-size-schedule with --train-iters 100",
    ),
    (
        {"batch_size_warmup": "auto", "noise_scale": 10, "batch_size_warmup_max": 64},
        {"train_iters": 100},
        "--global-batch-size 16 --ga-batch-size-warmup auto --ga-noise-scale 10 "
        "--ga-batch-size-warmup-max 64 --train-iters 100",
        ScheduleError,
        "--ga-batch-size-warmup auto with --train-iters 100",
    ),
    (
        {"batch_size_warmup": "auto", "noise_scale": 10, "batch_size_warmup_max": 8},
        {},
        "--global-batch-size 16 --ga-batch-size-warmup auto --ga-noise-scale 10 "
        "--ga-batch-size-warmup-max 8",
        OptionError,
        "--ga-batch-size-warmup auto starts at --global-batch-size (16)",
    ),
    (
        {"noise_scale": 10},
        {"context_parallel_size": 2, "data_parallel_size": 8},
        "--global-batch-size 16 --ga-noise-scale 10 --context-parallel-size 2",
        OptionError,
        "--ga-noise-scale with --context-parallel-size 2",
    ),
    (
        {"noise_scale": 10},
        {"tensor_model_parallel_size": 16, "data_parallel_size": 1},
        "--global-batch-size 16 --ga-noise-scale 10 --tensor-model-parallel-size 16",
        OptionError,
        "--ga-noise-scale 10 with data-parallel size 1",
    ),
]


@pytest.mark.parametrize(
    "fields, changes, extra, error, start", BETWEEN_CASES, ids=[c[4][:40] for c in BETWEEN_CASES]
)
def test_a_rule_between_flags_is_refused_the_same_by_install_and_check(
    fields, changes, extra, error, start
):
    config = GAConfig(**fields)  # the flags alone pass
    with pytest.raises(error) as raised:
        check_args(config, namespace(**changes))
    message = str(raised.value)
    assert message.startswith(start)
    assert message in problems(extra)
    assert (
        launch_errors(config.flag_values(), MegatronArgs.of(namespace(**changes)))[0].args
        == raised.value.args
    )


#: (GAConfig fields, the same on a launch line, the start of the message): rules without Megatron's
#: args.
FLAG_CASES = [
    ({"noise_scale": -1}, "--ga-noise-scale -1", "--ga-noise-scale -1 is not a whole number >= 0"),
    (
        {"noise_scale_decay": 2.0},
        "--ga-noise-scale-decay 2",
        "--ga-noise-scale-decay 2.0 is not in [0, 1)",
    ),
    (
        {"noise_scale_decay": "x"},
        "--ga-noise-scale-decay x",
        "--ga-noise-scale-decay 'x' is not in [0, 1)",
    ),
    (
        {"batch_size_warmup_trust": 0.0},
        "--ga-batch-size-warmup-trust 0",
        "--ga-batch-size-warmup-trust 0.0 is not a positive finite number",
    ),
    (
        {"checks": "async", "zero_token_policy": "skip"},
        "--ga-checks async --ga-zero-token-policy skip",
        "--ga-checks async reads a step's token count only after its optimizer step",
    ),
    (
        {"noise_scale": 10, "loss_reduction": "microbatch"},
        "--ga-noise-scale 10 --ga-loss-reduction microbatch",
        "--ga-noise-scale 10 needs --ga-loss-reduction token",
    ),
    (
        {"batch_size_warmup": "auto", "batch_size_warmup_max": 32},
        "--ga-batch-size-warmup auto --ga-batch-size-warmup-max 32",
        "--ga-batch-size-warmup auto decides from the measured noise scale",
    ),
    (
        {"lr_scaling": "cubic"},
        "--ga-lr-scaling cubic",
        "--ga-lr-scaling 'cubic' is not one of none, sqrt, linear",
    ),
]


@pytest.mark.parametrize("fields, extra, start", FLAG_CASES, ids=[c[1] for c in FLAG_CASES])
def test_a_planted_bad_value_is_refused_identically_everywhere(fields, extra, start):
    """GAConfig(...), GAConfig.from_args (install()), check_args and megatron-ga check: one
    message."""
    with pytest.raises(OptionError) as direct:
        GAConfig(**fields)
    message = str(direct.value)
    assert message.startswith(start)
    with pytest.raises(OptionError, match="^" + re.escape(message) + "$"):
        GAConfig.from_args(namespace(**{f"ga_{name}": value for name, value in fields.items()}))
    assert message in problems("--global-batch-size 16 " + extra)
    with pytest.raises(OptionError) as passed:
        check_launch(fields, MegatronArgs.of(namespace()))
    assert str(passed.value) == message


def test_a_rule_that_reads_a_broken_flag_is_skipped_not_run_on_it():
    errors = launch_errors({"checks": "later", "zero_token_policy": "skip"})
    assert [str(e) for e in errors] == [
        "--ga-checks 'later' is not one of sync, async; pick one of them."
    ]


def test_without_megatrons_args_only_the_rules_of_the_flags_run():
    assert (
        launch_errors({"lr_scaling": "sqrt"}) == []
    )  # it needs to know whether a schedule is given
    assert [type(e) for e in launch_errors({"lr_scaling": "sqrt"}, MegatronArgs())] == [OptionError]
    assert all(isinstance(e, GAError) for e in launch_errors({"noise_scale": -1, "checks": 1}))


def test_the_rule_pass_is_the_only_one():
    """Every rule between flags is one entry of launch_rules.BETWEEN."""
    assert all(rule.reads and callable(rule.check) for rule in BETWEEN)
    assert not hasattr(launch_rules, "check_noise_scale") and not hasattr(
        launch_rules, "check_batch_size_warmup"
    )
