"""MegatronArgs: the one typed view of Megatron's parsed args (config/megatron_args.py)."""

from __future__ import annotations

import argparse

import pytest

from megatron_ga_ext.config.megatron_args import MegatronArgs


@pytest.mark.parametrize(
    "make", [lambda d: argparse.Namespace(**d), dict, lambda d: MegatronArgs.of(dict(d))]
)
def test_a_namespace_a_dict_and_a_view_read_the_same(make):
    args = MegatronArgs.of(
        make(
            {
                "micro_batch_size": 2,
                "world_size": 16,
                "tensor_model_parallel_size": 2,
                "context_parallel_size": 2,
                "calculate_per_token_loss": False,
            }
        )
    )
    assert (args.micro_batch_size, args.data_parallel_size, args.calculate_per_token_loss) == (
        2,
        4,
        False,
    )


def test_absent_flags_read_as_megatrons_declared_defaults():
    args = MegatronArgs.of(None)
    assert (args.pipeline_model_parallel_size, args.num_distributed_optimizer_instances) == (1, 1)
    assert args.get("ga_noise_scale_decay") == 0.95 and args.get("rerun_mode") == "validate_results"
    assert args.get("not_a_flag") is None and args.get("rerun_mode", "given") == "given"
    assert (
        args.calculate_per_token_loss is None
    )  # a loop without Megatron's parser: unknown, not off
    assert args.data_parallel_size is None and args.rampup_batch_size is None


def test_derived_values_follow_megatron():
    assert (
        MegatronArgs({"data_parallel_size": 3, "world_size": 16}).data_parallel_size == 3
    )  # validate_args set it
    packed = MegatronArgs({"perform_rl_step": True, "rl_use_sequence_packing": True})
    assert (
        packed.rl_sequence_packing
        and not MegatronArgs({"rl_use_sequence_packing": True}).rl_sequence_packing
    )
    assert MegatronArgs({"rampup_batch_size": ("16", "8", "1000")}).rampup_batch_size == [
        "16",
        "8",
        "1000",
    ]


def test_the_view_is_read_only():
    args = MegatronArgs({"micro_batch_size": 1})
    with pytest.raises(AttributeError):
        args.values = {}  # type: ignore[misc]
