"""The batch arithmetic of the seed note, and a typed error for every bad input."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_ga_ext import BatchLayout, BatchSizeError, InterleaveError, LayoutError, SizeError


def test_seed_gbs_128_two_ways_same_samples_different_syncs_and_work():
    a = BatchLayout(world_size=8, micro_batch_size=4, global_batch_size=128)
    b = BatchLayout(world_size=16, micro_batch_size=8, global_batch_size=128)
    assert (a.data_parallel_size, a.num_microbatches) == (8, 4)
    assert (b.data_parallel_size, b.num_microbatches) == (16, 1)
    assert a.samples_per_step == b.samples_per_step == 128
    assert a.samples_per_rank_per_step == 16 and b.samples_per_rank_per_step == 8
    every = BatchLayout(
        world_size=8, micro_batch_size=4, global_batch_size=128, grad_sync="microbatch"
    )
    assert (a.dp_syncs_per_step, every.dp_syncs_per_step, b.dp_syncs_per_step) == (1, 4, 1)


def test_sc21_gpt3_tokens_per_step():
    # SC21: B = 1536 at seq_length 2048 on 1024 GPUs (TP 8 x PP 16 gives DP 8, MBS 1).
    layout = BatchLayout(
        world_size=1024,
        tensor_model_parallel_size=8,
        pipeline_model_parallel_size=16,
        micro_batch_size=1,
        global_batch_size=1536,
        seq_length=2048,
    )
    assert layout.tokens_per_step == 3_145_728
    assert layout.num_microbatches == 1536 // 8


def test_dp_one_has_no_dp_sync():
    layout = BatchLayout(
        world_size=4, tensor_model_parallel_size=4, micro_batch_size=2, global_batch_size=16
    )
    assert layout.data_parallel_size == 1 and layout.num_microbatches == 8
    assert layout.dp_syncs_per_step == 0
    assert (
        BatchLayout(
            world_size=4,
            tensor_model_parallel_size=4,
            micro_batch_size=2,
            global_batch_size=16,
            grad_sync="microbatch",
        ).dp_syncs_per_step
        == 0
    )


def test_raising_pp_keeps_gbs_and_only_moves_dp_and_ga():
    layouts = [
        BatchLayout(
            world_size=64,
            pipeline_model_parallel_size=pp,
            micro_batch_size=2,
            global_batch_size=512,
        )
        for pp in (1, 2, 4, 8)
    ]
    assert [x.micro_batch_size * x.data_parallel_size * x.num_microbatches for x in layouts] == [
        512
    ] * 4
    assert [x.data_parallel_size for x in layouts] == [64, 32, 16, 8]
    assert [x.num_microbatches for x in layouts] == [4, 8, 16, 32]
    assert layouts[0].pipeline_bubble_fraction == 0.0


def test_bubble_and_default_gbs():
    layout = BatchLayout(
        world_size=8,
        pipeline_model_parallel_size=4,
        virtual_pipeline_model_parallel_size=2,
        micro_batch_size=1,
        global_batch_size=16,
    )
    assert layout.num_microbatches == 8
    assert layout.pipeline_bubble_fraction == pytest.approx(3 / (2 * 8 + 3))
    default = BatchLayout(world_size=8, tensor_model_parallel_size=2, micro_batch_size=3)
    assert default.global_batch_size == 12 and default.num_microbatches == 1


@given(
    mbs=st.integers(1, 16),
    dp=st.integers(1, 64),
    ga=st.integers(1, 64),
    tp=st.sampled_from([1, 2, 4, 8]),
    pp=st.sampled_from([1, 2, 4]),
    cp=st.sampled_from([1, 2]),
)
def test_gbs_is_mbs_dp_ga_whatever_tp_pp_cp(mbs, dp, ga, tp, pp, cp):
    layout = BatchLayout(
        world_size=dp * tp * pp * cp,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        micro_batch_size=mbs,
        global_batch_size=mbs * dp * ga,
    )
    assert layout.data_parallel_size == dp
    assert layout.num_microbatches == ga
    assert layout.samples_per_step == mbs * dp * ga


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (
            dict(world_size=0, micro_batch_size=1),
            SizeError,
            r"--world-size 0 must be at least 1; give an integer >= 1",
        ),
        (
            dict(world_size=8, micro_batch_size=-2),
            SizeError,
            r"--micro-batch-size -2 must be at least 1",
        ),
        (
            dict(world_size=8, micro_batch_size=2.5),
            SizeError,
            r"--micro-batch-size 2\.5 is not a whole number.*e\.g\. 2 or 3",
        ),
        (
            dict(world_size=8, micro_batch_size="4"),
            SizeError,
            r"--micro-batch-size '4' is not a whole number",
        ),
        (
            dict(world_size=8, micro_batch_size=1, global_batch_size=0),
            SizeError,
            r"--global-batch-size 0 must be at least 1",
        ),
        (
            dict(world_size=8, micro_batch_size=1, pipeline_model_parallel_size=True),
            SizeError,
            r"--pipeline-model-parallel-size True is not a whole number",
        ),
        (
            dict(world_size=12, micro_batch_size=1, tensor_model_parallel_size=8),
            LayoutError,
            r"--world-size 12 is not divisible by --tensor-model-parallel-size 8 x "
            r"--pipeline-model-parallel-size 1 x --context-parallel-size 1 = 8.*Nearest "
            r"valid world sizes: 8, 16",
        ),
        (
            dict(world_size=16, micro_batch_size=4, global_batch_size=96),
            BatchSizeError,
            r"--global-batch-size 96 is not a multiple of --micro-batch-size 4 x data-parallel "
            r"size 16 = 64.*Nearest valid --global-batch-size: 64, 128; or "
            r"--micro-batch-size in \{1, 2, 3, 6\}",
        ),
        (
            dict(world_size=8, micro_batch_size=4, global_batch_size=16),
            BatchSizeError,
            r"--global-batch-size 16 is not a multiple of.*= 32.*Nearest valid "
            r"--global-batch-size: 32, 64",
        ),
        (
            dict(
                world_size=16,
                micro_batch_size=1,
                global_batch_size=24,
                pipeline_model_parallel_size=4,
                virtual_pipeline_model_parallel_size=2,
            ),
            InterleaveError,
            r"num_microbatches = 24 / \(MBS 1 x DP 4\) = 6 .*% N == 0.*Nearest valid "
            r"--global-batch-size: 16, 32",
        ),
        (
            dict(
                world_size=8,
                micro_batch_size=1,
                global_batch_size=2,
                pipeline_model_parallel_size=4,
                virtual_pipeline_model_parallel_size=2,
            ),
            InterleaveError,
            r"= 1 with --virtual-pipeline-model-parallel-size 2.*needs num_microbatches >= N = "
            r"4.*Nearest valid --global-batch-size: 8, 16",
        ),
        (
            dict(world_size=8, micro_batch_size=1, virtual_pipeline_model_parallel_size=2),
            LayoutError,
            r"--virtual-pipeline-model-parallel-size 2 needs --pipeline-model-parallel-size > 1",
        ),
        (
            dict(world_size=8, micro_batch_size=1, expert_model_parallel_size=3),
            LayoutError,
            r"--world-size 8 is not divisible by --expert-tensor-parallel-size 1 x "
            r"--expert-model-parallel-size 3",
        ),
        (
            dict(world_size=8, micro_batch_size=1, expert_model_parallel_size=4, num_experts=6),
            LayoutError,
            r"--num-experts 6 is not divisible by --expert-model-parallel-size 4.*"
            # EP divides the experts and world / (ETP x PP)
            r"Valid --expert-model-parallel-size: 1, 2\.",
        ),
    ],
)
def test_bad_input_is_a_typed_error_naming_flag_value_and_fix(kwargs, error, pattern):
    with pytest.raises(error, match=pattern) as info:
        BatchLayout(**kwargs)
    assert type(info.value) is error  # pytest.raises also passes a subclass


def test_upstream_assertion_catchers_still_catch_gbs_error():
    with pytest.raises(
        BatchSizeError, match="--global-batch-size 8 is not a multiple of --micro-batch-size 3"
    ) as info:
        BatchLayout(world_size=8, micro_batch_size=3, global_batch_size=8)
    assert isinstance(info.value, AssertionError)  # what upstream's callers catch


def test_problems_collects_every_violation():
    layout, errors = BatchLayout.problems(world_size=12, micro_batch_size=0, global_batch_size=-1)
    assert layout is None
    assert [type(e) for e in errors] == [SizeError, SizeError]
    layout, errors = BatchLayout.problems(world_size=8, micro_batch_size=2, global_batch_size=32)
    assert errors == [] and layout.num_microbatches == 2


def test_interleave_with_explicit_group_size():
    # N = 6 > PP = 4: M % N may be 0 or >= PP.
    ok = BatchLayout(
        world_size=4,
        pipeline_model_parallel_size=4,
        virtual_pipeline_model_parallel_size=2,
        microbatch_group_size_per_vp_stage=6,
        micro_batch_size=1,
        global_batch_size=10,
    )
    assert ok.num_microbatches == 10
    with pytest.raises(InterleaveError, match=r"in \{0\} or \[4, 6\)"):
        BatchLayout(
            world_size=4,
            pipeline_model_parallel_size=4,
            virtual_pipeline_model_parallel_size=2,
            microbatch_group_size_per_vp_stage=6,
            micro_batch_size=1,
            global_batch_size=8,
        )


def test_valid_world_sizes_are_only_those_where_the_global_batch_divides():
    """TP 3 on 8 ranks, GBS 8: 9 ranks would give DP 3, and 8 is no multiple of 3 (the issue's "6,
    9")."""
    _, errors = BatchLayout.problems(
        world_size=8, micro_batch_size=1, global_batch_size=8, tensor_model_parallel_size=3
    )
    assert "Nearest valid world sizes: 6, 12." in str(errors[0])
    _, errors = BatchLayout.problems(
        world_size=8, micro_batch_size=1, expert_model_parallel_size=3, num_experts=6
    )
    assert "Nearest valid world sizes: 6, 9; Valid --expert-model-parallel-size: 1, 2." in str(
        errors[0]
    )
