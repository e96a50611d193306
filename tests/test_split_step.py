"""One finalize per optimizer step (integration/liveness.py), in a user's own megatron-core loop
through install(): 2 gloo ranks, DP 2 x GA 4, a tiny GPT, megatron's optimizer from
get_megatron_optimizer, each step split over two forward_backward_func calls of 2 micro-batches
each.

* Each call running finalize (an RL framework calling forward_backward_func once per subset of the
  step's micro-batches, finalize_model_grads_func set on every call) stops at the second finalize:
  that finalize would reduce the first call's already reduced and divided gradients again and divide
  by the second call's tokens. With megatron's num-microbatches calculator live, the micro-batch
  guard stops the first call already (2 of the calculator's 4), and says how a step is split.
* Finalize on the last call only (an evaluation call in between), or called once after the last
  call, trains the step as one: N counts both calls' tokens, the gradient is the unpartitioned
  token-level one, and the optimizer steps, step after step.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core.pipeline_parallel.schedules")
pytest.importorskip("megatron.core.optimizer")  # imported here: the forked ranks inherit it

from megatron_ga_ext.errors import GuardError
from megatron_ga_ext.testing.distributed import LaunchConfig, run_on_ranks

pytestmark = pytest.mark.slow

DP, GA, STEPS = 2, 4, 2
SPLIT = 2  # micro-batches of the first call; the second runs the rest


def rank_main(pattern: str, calculator: bool) -> list[dict]:
    """One rank: STEPS steps of ``pattern`` (see :func:`split_step`), with megatron's
    num-microbatches calculator (GBS = MBS x DP x GA) or without one (a loop that passes its own
    counts); per step, N, the gradient's relative error to the unpartitioned token-level reference
    and what the optimizer's step returned."""
    from megatron_ga_ext.testing.shims import cpu_shims

    with cpu_shims(device_count=1):  # megatron's optimizer asks for a device
        return _rank_main(pattern, calculator)


def _rank_main(pattern: str, calculator: bool) -> list[dict]:
    from megatron.core import num_microbatches_calculator as calculators
    from megatron.core import parallel_state

    import megatron_ga_ext
    from megatron_ga_ext import GAConfig
    from megatron_ga_ext.verify.harness import build_ddp, gradients, relative_error
    from megatron_ga_ext.verify.layouts import DEFAULT_LENGTHS, Layout, make_global_batch
    from megatron_ga_ext.verify.models import init_model_parallel
    from megatron_ga_ext.verify.references import reference_grads
    from megatron_ga_ext.verify.run_config import VerifyConfig

    cfg = VerifyConfig()
    layout = Layout(data_parallel_size=DP, num_microbatches=GA)
    lengths = tuple(
        DEFAULT_LENGTHS[i % len(DEFAULT_LENGTHS)] for i in range(layout.global_batch_size)
    )
    batch = make_global_batch(lengths, cfg.model.seq_length, cfg.model.vocab_size, seed=3)
    reference = reference_grads(cfg.model, [layout], batch)[
        (layout.name, "token")
    ]  # TP = PP = 1 state: first
    state = megatron_ga_ext.install(GAConfig(loss_reduction="token"))
    init_model_parallel()
    if calculator:
        calculators.init_num_microbatches_calculator(
            0, None, layout.global_batch_size, layout.micro_batch_size, DP
        )
    try:
        ddp, names, config = build_ddp(layout, cfg, calculate_per_token_loss=True)
        from megatron.core.optimizer import (
            OptimizerConfig,
            get_megatron_optimizer,
        )  # the extension's, after install()

        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="sgd", lr=0.0, clip_grad=0.0), [ddp]
        )
        rows = []
        for _ in range(STEPS):  # lr 0: the parameters, so the reference, stay as they are
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            split_step(pattern, ddp, config, layout, cfg, batch)
            error = relative_error(gradients(ddp, names), reference)
            rows.append(
                {
                    # finalize's verdict, before the optimizer step takes it
                    "N": state.verdict.num_tokens,
                    "rel_err": error,
                    "tokens": int(batch.loss_mask.sum()),
                    "stepped": optimizer.step()[0],
                }
            )
        return rows
    finally:
        megatron_ga_ext.uninstall()
        if calculator:
            calculators.unset_num_microbatches_calculator()
        parallel_state.destroy_model_parallel()


def split_step(pattern: str, ddp, config, layout, cfg, batch) -> None:
    """One step over two forward_backward_func calls. ``pattern``: ``finalize-per-call`` (the
    extension's finalize on both calls), ``finalize-on-last`` (on the second only; an evaluation
    call between them) or ``finalize-after`` (on neither; called once after the second)."""
    from functools import partial

    from megatron.core.distributed import (
        finalize_model_grads,
    )  # the extension's, bound after install()
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ga_ext.integration.loss_contract import masked_loss
    from megatron_ga_ext.verify.step import forward_step, microbatches

    data = microbatches(layout, batch, cfg.device)
    config.no_sync_func = ddp.no_sync

    def call(part: list, finalize, *, forward_only: bool = False) -> None:
        config.finalize_model_grads_func = finalize
        get_forward_backward_func()(
            forward_step_func=partial(forward_step, loss_func=masked_loss),
            data_iterator=iter(part),
            model=[ddp],
            num_microbatches=len(part),
            seq_length=cfg.model.seq_length,
            micro_batch_size=layout.micro_batch_size,
            forward_only=forward_only,
        )

    last = finalize_model_grads if pattern != "finalize-after" else None
    call(data[:SPLIT], finalize_model_grads if pattern == "finalize-per-call" else None)
    if pattern == "finalize-on-last":
        call(data, None, forward_only=True)  # its losses are not the step's
    call(data[SPLIT:], last)
    if pattern == "finalize-after":
        finalize_model_grads([ddp], None)


def launch(pattern: str, *, calculator: bool) -> list[list[dict]]:
    return run_on_ranks(
        rank_main, world_size=DP, args=(pattern, calculator), config=LaunchConfig(timeout_s=240)
    )


def test_a_finalize_on_every_call_of_a_split_step_is_stopped_at_the_second():
    with pytest.raises(
        GuardError,
        match=(
            r"^megatron-ga-ext's finalize_model_grads ran 2 times in this training step before "
            r"its optimizer step: the step is split over several forward_backward_func "
            r"calls, each running finalize_model_grads .*Each finalize all-reduces the "
            r"partial gradients accumulated so far and divides them by a partial token "
            r"count .* Run one forward_backward_func call per optimizer step with all of "
            r"its micro-batches .* set config\.finalize_model_grads_func on its last "
            r"call only \(None on the others\), or leave it None and call "
            r"megatron\.core\.distributed\.finalize_model_grads once after the last call"
        ),
    ):
        launch("finalize-per-call", calculator=False)


def test_with_the_calculator_the_guard_stops_the_first_finalized_call_and_says_how_to_split():
    with pytest.raises(
        GuardError,
        match=(
            r"^forward_backward_func was called with num_microbatches=2, but the calculator's "
            r"num_microbatches = GBS / \(MBS x DP\) is 4\. Where a step is split over "
            r"several forward_backward_func calls, only its last call may run "
            r"finalize_model_grads \(config\.finalize_model_grads_func None on the "
            r"others; .*\), and the calls' counts add up to 4\."
        ),
    ):
        launch("finalize-per-call", calculator=True)


@pytest.mark.parametrize(
    "pattern, calculator",
    [("finalize-on-last", True), ("finalize-after", True), ("finalize-on-last", False)],
)
def test_a_split_step_with_one_finalize_trains_as_one_step(pattern, calculator):
    ranks = launch(pattern, calculator=calculator)
    for rows in ranks:
        assert len(rows) == STEPS
        for row in rows:
            assert row["N"] == row["tokens"], (
                row
            )  # both calls' tokens, over both ranks; not the evaluation's
            assert row["rel_err"] < 1e-6, row
            assert row["stepped"] is True, row
