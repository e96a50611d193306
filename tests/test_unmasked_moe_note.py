"""The first step's note on MoE layers that routed without a padding mask (aux_report.py), said
where it happened.

In token mode install() routes MoE layers with padding_mask = (loss_mask == 0), derived from the
loss mask the model call gets; a stage whose call gets none keeps upstream's (routed positions /
loss tokens) factor on its aux and z-loss gradients, and rank 0 says so once. Megatron-LM's
pretrain_gpt (0.18 on) gives the loss mask to the last pipeline stage only; verify's forward step
gives it to every stage, where the note would be false. One 2-rank launch, the tiny MoE GPT of
verify, one step each: PP 2 with the mask on every stage (no note), on the last stage only (the note
names stage 0), on the first stage only (stage 1, which rank 0 learns from the pipeline group), and
DP 2 without PP, with the mask and without it.
"""

from __future__ import annotations

import logging
from functools import partial

import pytest

pytestmark = pytest.mark.slow

NOTE = "without a padding mask"

#: case: (pipeline stages, data-parallel ranks, the stages whose model call gets the loss mask)
CASES = {
    "PP 2, every stage given the mask (verify)": (2, 1, (0, 1)),
    "PP 2, the last stage only (pretrain_gpt)": (2, 1, (1,)),
    "PP 2, the first stage only": (2, 1, (0,)),
    "DP 2, given the mask": (1, 2, (0,)),
    "DP 2, no mask": (1, 2, ()),
}


def _forward_step(masked_stages: tuple[int, ...], data_iterator, model, *, loss_func):
    """verify's forward step, the loss mask given to the model on ``masked_stages`` only (the loss
    function always gets it, as pretrain_gpt's does on the last stage)."""
    from megatron.core import parallel_state

    micro = next(data_iterator)
    given = parallel_state.get_pipeline_model_parallel_rank() in masked_stages
    kwargs = {"loss_mask": micro["loss_mask"]} if given else {}
    output = model(micro["tokens"], micro["position_ids"], None, labels=micro["labels"], **kwargs)
    return output, partial(_loss, loss_func, micro["loss_mask"])


def _loss(loss_func, loss_mask, output_tensor):
    return loss_func(output_tensor, loss_mask)


def _one_step(pipeline: int, data_parallel: int, masked_stages: tuple[int, ...]) -> list[str]:
    """One token-mode step through install(); the warnings rank 0's extension logged."""
    from megatron.core import num_microbatches_calculator as calculators
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    import megatron_ga_ext
    from megatron_ga_ext.integration.loss_contract import masked_loss
    from megatron_ga_ext.verify.harness import build_chunks
    from megatron_ga_ext.verify.layouts import DEFAULT_LENGTHS, Layout, make_global_batch
    from megatron_ga_ext.verify.models import init_model_parallel
    from megatron_ga_ext.verify.run_config import VerifyConfig
    from megatron_ga_ext.verify.step import train_step

    cfg = VerifyConfig(progress=False)
    layout = Layout(
        pipeline_model_parallel_size=pipeline,
        data_parallel_size=data_parallel,
        num_microbatches=len(DEFAULT_LENGTHS) // data_parallel,
        model="moe",
    )
    batch = make_global_batch(DEFAULT_LENGTHS, cfg.model.seq_length, cfg.model.vocab_size)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(
        "megatron_ga_ext.integration.features.aux_losses"
    )  # AuxLosses' report
    logger.addHandler(handler)
    init_model_parallel(pipeline_model_parallel_size=pipeline)
    megatron_ga_ext.install(
        megatron_ga_ext.GAConfig(loss_reduction="token", pipeline_model_parallel_size=pipeline)
    )
    calculators.init_num_microbatches_calculator(
        0, None, layout.global_batch_size, 1, data_parallel
    )
    try:
        chunks, _, config = build_chunks(layout, cfg, calculate_per_token_loss=True)
        train_step(
            chunks,
            config,
            layout,
            cfg,
            batch,
            finalize=finalize_model_grads,
            loss_func=partial(masked_loss, mode="token"),
            forward_step_func=partial(_forward_step, masked_stages),
        )
    finally:
        logger.removeHandler(handler)
        megatron_ga_ext.uninstall()
        calculators.unset_num_microbatches_calculator()
        parallel_state.destroy_model_parallel()
    return [record.getMessage() for record in records]


def _every_case() -> dict[str, list[str]]:
    from megatron_ga_ext.testing.shims import cpu_shims

    with cpu_shims():
        return {case: _one_step(*sizes) for case, sizes in CASES.items()}


@pytest.fixture(scope="module")
def warnings_of_rank_0():
    from megatron_ga_ext.testing.distributed import run_on_ranks

    per_rank = run_on_ranks(_every_case, 2)
    assert all(
        not any(NOTE in line for lines in rank.values() for line in lines) for rank in per_rank[1:]
    )
    return per_rank[0]


def notes(warnings: list[str]) -> list[str]:
    return [line for line in warnings if NOTE in line]


def test_no_note_where_every_stage_routes_with_the_mask(warnings_of_rank_0):
    assert notes(warnings_of_rank_0["PP 2, every stage given the mask (verify)"]) == []
    assert notes(warnings_of_rank_0["DP 2, given the mask"]) == []


def test_the_note_names_the_stages_that_got_no_mask(warnings_of_rank_0):
    (pretrain_gpt,) = notes(warnings_of_rank_0["PP 2, the last stage only (pretrain_gpt)"])
    assert (
        "the MoE layers on pipeline stage 0 of PP 2 routed without a padding mask" in pretrain_gpt
    )
    assert (
        "(routed positions / loss tokens) times their target weight: 128 / 72 = 1.778"
        in pretrain_gpt
    )
    (first_only,) = notes(
        warnings_of_rank_0["PP 2, the first stage only"]
    )  # rank 0 is stage 0: gathered
    assert "on pipeline stage 1 of PP 2 routed" in first_only


def test_a_step_without_pipeline_parallelism_is_said_too(warnings_of_rank_0):
    (note,) = notes(warnings_of_rank_0["DP 2, no mask"])
    assert "on pipeline stage 0 routed without a padding mask" in note
