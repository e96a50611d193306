"""``--ga-noise-scale`` and ``--ga-lr-scaling``: typed errors naming the flag, at install() and in
``check``."""

import argparse
import shlex

import pytest

from megatron_ga_ext import GAConfig
from megatron_ga_ext.config.noise_scale_layout import check_noise_scale_layout
from megatron_ga_ext.errors import OptionError
from megatron_ga_ext.launch.check import launch_problems
from megatron_ga_ext.launch.line import parse_launch

LINE = (
    "torchrun --nproc_per_node 8 pretrain_gpt.py --calculate-per-token-loss --micro-batch-size 1 "
    "--global-batch-size 64 --seq-length 2048 --ga-noise-scale 10 "
)


def problems(extra: str) -> list[str]:
    return launch_problems(parse_launch(shlex.split(LINE + extra)), None)[1]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"noise_scale": -1}, r"--ga-noise-scale -1 is not a whole number >= 0"),
        ({"noise_scale": True}, r"--ga-noise-scale True is not a whole number >= 0"),
        (
            {"noise_scale": 4, "noise_scale_decay": 1.0},
            r"--ga-noise-scale-decay 1.0 is not in \[0, 1\)",
        ),
        (
            {"noise_scale": 4, "noise_scale_decay": float("nan")},
            r"--ga-noise-scale-decay nan is not in \[0, 1\)",
        ),
        (
            {"noise_scale": 4, "loss_reduction": "microbatch"},
            r"--ga-noise-scale 4 needs --ga-loss-reduction token",
        ),
    ],
)
def test_config_refuses_what_cannot_be_measured(fields, message):
    with pytest.raises(OptionError, match=message):
        GAConfig(**fields)


def test_off_by_default_and_decay_zero_is_the_last_measurement_only():
    assert GAConfig().noise_scale == 0
    assert GAConfig(noise_scale=1, noise_scale_decay=0.0).noise_scale_decay == 0.0


@pytest.mark.parametrize(
    "dp, settings, message",
    [
        (1, {}, r"--ga-noise-scale 8 with data-parallel size 1: .* needs DP >= 2"),
        (
            4,
            {"context_parallel_size": 2},
            r"--ga-noise-scale with --context-parallel-size 2: the CP shards",
        ),
        (
            4,
            {"num_distributed_optimizer_instances": 2},
            r"--ga-noise-scale with --num-distributed-optimizer-instances 2",
        ),
        (
            4,
            {"use_megatron_fsdp": True},
            r"--ga-noise-scale with --use-megatron-fsdp: Megatron-FSDP keeps the",
        ),
        (
            4,
            {"use_torch_fsdp2": True},
            r"--ga-noise-scale with --use-torch-fsdp2: torch FSDP2 reduce-scatters each",
        ),
    ],
)
def test_layouts_it_cannot_measure_are_refused_naming_the_flag(dp, settings, message):
    with pytest.raises(OptionError, match=message):
        check_noise_scale_layout(8, data_parallel_size=dp, settings=settings)
    check_noise_scale_layout(0, data_parallel_size=dp, settings=settings)  # off: nothing to refuse


def test_install_refuses_megatrons_args_with_dp_1():
    from megatron_ga_ext.config.install_check import check_args

    args = argparse.Namespace(
        calculate_per_token_loss=True,
        world_size=2,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        ga_noise_scale=5,
    )
    with pytest.raises(OptionError, match="--ga-noise-scale 5 with data-parallel size 1"):
        check_args(GAConfig.from_args(args), args)
    args.world_size = 4
    check_args(GAConfig.from_args(args), args)  # DP 2


def test_check_reports_each_rule_on_a_launch_line():
    assert problems("") == []
    assert problems("--context-parallel-size 2") == [
        "--ga-noise-scale with --context-parallel-size 2: the CP shards of one sequence are "
        "parts of one sample, not independent replicas, and a replica's gradient would "
        "need a reduction over CP before the one over DP x CP. Drop --ga-noise-scale, or "
        "--context-parallel-size 1."
    ]
    assert any("needs DP >= 2" in p for p in problems("--tensor-model-parallel-size 8"))
    assert any(
        "--ga-noise-scale-decay 2.0 is not in [0, 1)" in p
        for p in problems("--ga-noise-scale-decay 2")
    )
    assert any(
        "--ga-noise-scale-decay 'x' is not in [0, 1)" in p
        for p in problems("--ga-noise-scale-decay x")
    )


def test_check_reports_lr_scaling_without_a_schedule():
    line = LINE.replace("--ga-noise-scale 10 ", "")
    found = launch_problems(parse_launch(shlex.split(line + "--ga-lr-scaling sqrt")), None)[1]
    assert any(p.startswith("--ga-lr-scaling sqrt scales the learning rate") for p in found), found
    scheduled = line.replace(
        "--global-batch-size 64", "--step-batch-size-schedule '0:32 1000000:64'"
    )
    assert (
        launch_problems(parse_launch(shlex.split(scheduled + "--ga-lr-scaling sqrt")), None)[1]
        == []
    )
