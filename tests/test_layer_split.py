"""The layer split and virtual pipeline size, as Megatron's arguments.py and TransformerConfig
derive them."""

import pytest

from megatron_ga_ext.errors import LayerSplitError
from megatron_ga_ext.launch.layer_split import LayerSplit, virtual_pipeline
from megatron_ga_ext.launch.pipeline_layout import layout_stage_count


@pytest.mark.parametrize(
    "layout, stages",
    [
        (
            "Ettt|(tt|)*29,m|L",
            32,
        ),  # Megatron's own docstring example: [E t t t] + [t t] x 29 + [m] + [L]
        ("xy(ab|cd|ef)*2,pq", 5),  # its unrolling examples
        ("(|ab)*2,cd", 3),
        ("E|t*3|t*3|L", 4),
        ("Et|tt|tt|tL", 4),
    ],
)
def test_pipeline_layout_stages_unroll_as_megatron_does(layout, stages):
    assert layout_stage_count(layout) == stages


def test_a_layout_that_unrolls_too_far_is_refused_before_it_is_built():
    with pytest.raises(LayerSplitError, match=r"unrolls to more than 1,000,000 layers"):
        layout_stage_count("(t|)*999999999999")
    with pytest.raises(LayerSplitError, match=r"repeat count value"):
        layout_stage_count("(t|)*" + "9" * 100)


@pytest.mark.parametrize(
    "split, size, given",
    [
        (
            LayerSplit(
                pipeline_model_parallel_size=4,
                num_layers=32,
                num_layers_per_virtual_pipeline_stage=2,
            ),
            4,
            "--num-layers 32 / --pipeline-model-parallel-size 4 / "
            "--num-layers-per-virtual-pipeline-stage 2",
        ),
        (
            LayerSplit(
                pipeline_model_parallel_size=4,
                num_layers=30,
                num_layers_per_virtual_pipeline_stage=4,
                account_for_embedding_in_pipeline_split=True,
                account_for_loss_in_pipeline_split=True,
            ),
            2,
            None,
        ),
        (
            LayerSplit(
                pipeline_model_parallel_size=4,
                num_virtual_stages_per_pipeline_rank=3,
                num_layers=24,
            ),
            3,
            "--num-virtual-stages-per-pipeline-rank 3",
        ),
        (
            LayerSplit(
                pipeline_model_parallel_size=4,
                num_virtual_stages_per_pipeline_rank=1,
                num_layers=24,
            ),
            None,
            None,
        ),
        (
            LayerSplit(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="E|t|t|tL"),
            2,
            "--pipeline-model-parallel-layout: 4 stages / --pipeline-model-parallel-size 2",
        ),
        (
            LayerSplit(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tL"),
            None,
            None,
        ),
        (
            LayerSplit(pipeline_model_parallel_size=2, hybrid_layer_pattern="M*|M*|M*|M*/MM"),
            2,
            "--hybrid-layer-pattern: 4 segments / --pipeline-model-parallel-size 2",
        ),
        (LayerSplit(pipeline_model_parallel_size=2, hybrid_layer_pattern="M*|M*"), None, None),
    ],
)
def test_virtual_pipeline_size(split, size, given):
    result = virtual_pipeline(split)
    assert result.problems == []
    assert result.size == size
    if given is not None:
        assert result.given == given


@pytest.mark.parametrize(
    "split, message",
    [
        (
            LayerSplit(
                pipeline_model_parallel_size=4,
                num_layers=30,
                num_virtual_stages_per_pipeline_rank=2,
            ),
            r"--num-layers 30 is not a multiple of --pipeline-model-parallel-size 4",
        ),
        (
            LayerSplit(
                pipeline_model_parallel_size=4,
                num_layers=24,
                num_virtual_stages_per_pipeline_rank=4,
            ),
            r"the 6 layers of each pipeline rank .* do not divide by the virtual pipeline size 4",
        ),
        (
            LayerSplit(pipeline_model_parallel_size=4, num_layers_per_virtual_pipeline_stage=2),
            r"--num-layers-per-virtual-pipeline-stage 2 needs --num-layers",
        ),
        (
            LayerSplit(
                pipeline_model_parallel_size=3,
                num_layers=12,
                num_layers_per_virtual_pipeline_stage=3,
            ),
            r"--num-layers-per-virtual-pipeline-stage 3 does not divide the 4 layers of each "
            r"pipeline stage .*valid values: 1, 2, 4",
        ),
        (
            LayerSplit(
                pipeline_model_parallel_size=4,
                num_layers=30,
                num_virtual_stages_per_pipeline_rank=2,
                pipeline_model_parallel_layout="Et|tL",
            ),
            r"--num-virtual-stages-per-pipeline-rank and --pipeline-model-parallel-layout are "
            r"both given",
        ),
        (
            LayerSplit(
                pipeline_model_parallel_size=4,
                num_layers=32,
                num_virtual_stages_per_pipeline_rank=2,
                decoder_first_pipeline_num_layers=5,
            ),
            r"--decoder-first-pipeline-num-layers 5 must be at least 1 and a multiple of the "
            r"virtual pipeline size 2",
        ),
        (
            LayerSplit(
                pipeline_model_parallel_size=4,
                num_layers=32,
                decoder_last_pipeline_num_layers=4,
                account_for_loss_in_pipeline_split=True,
            ),
            r"cannot be combined with --account-for-embedding-in-pipeline-split or "
            r"--account-for-loss-in-pipeline-split",
        ),
        (
            LayerSplit(
                pipeline_model_parallel_size=2,
                pipeline_model_parallel_layout="Et|tL",
                account_for_embedding_in_pipeline_split=True,
            ),
            r"--account-for-embedding-in-pipeline-split is given with "
            r"--pipeline-model-parallel-layout; Megatron refuses",
        ),
        (
            LayerSplit(pipeline_model_parallel_size=2, hybrid_layer_pattern="M*|M*|M*"),
            r"has 3 pipeline segments \('\|' separated\), not a multiple of "
            r"--pipeline-model-parallel-size 2",
        ),
        (
            LayerSplit(
                pipeline_model_parallel_size=2,
                hybrid_layer_pattern="M*|M*",
                decoder_first_pipeline_num_layers=1,
            ),
            r"--decoder-first-pipeline-num-layers is given with --hybrid-layer-pattern",
        ),
    ],
)
def test_layer_split_problems_are_megatrons(split, message):
    problems = virtual_pipeline(split).problems
    assert len(problems) == 1 and isinstance(problems[0], AssertionError)
    with pytest.raises(LayerSplitError, match=message):
        raise problems[0]
