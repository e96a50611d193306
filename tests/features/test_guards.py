"""Guards alone (integration/features/guards.py), with a stand-in handle: the packing scheduler's
count, one finalize per optimizer step, and liveness asked at the optimizer step."""

from types import SimpleNamespace

import pytest

from megatron_ga_ext import GAConfig, GuardError
from megatron_ga_ext.integration.features import Finalizing, OptimizerStep, Step
from megatron_ga_ext.integration.features.guards import Guards
from tests.support.stand_in import Liveness, StandIn


def test_a_call_must_run_the_packing_schedulers_count():
    guards = Guards(StandIn(GAConfig(guards=True)))
    guards.scheduled(3, requested=4)
    with pytest.raises(GuardError, match=r"num_microbatches=2.* 3"):
        guards.begin_step(Step({"num_microbatches": 2}))
    with pytest.raises(
        GuardError, match=r"returned num_microbatches=0 for a step from 4 fetched micro-batches"
    ):
        guards.scheduled(0, requested=4)


def test_without_guards_the_schedulers_count_is_not_kept():
    guards = Guards(StandIn(GAConfig(guards=False)))
    guards.scheduled(3, requested=4)
    guards.begin_step(Step({"num_microbatches": 2}))  # not checked


def test_every_chunk_counted_each_call():
    guards = Guards(StandIn(GAConfig(guards=True)))
    first, second = object(), object()
    guards.begin_step(Step({"num_microbatches": 2, "forward_only": True}))
    for chunk in (first, second, first, second):
        assert guards.micro_batch(chunk, print) is print
    guards.end_step(
        Step({"num_microbatches": 2, "forward_only": True})
    )  # an evaluation: no calculator asked
    assert guards.counter.counts == {first: 2, second: 2}


@pytest.mark.parametrize("mode", ["token", "microbatch"])
def test_a_second_finalize_before_the_optimizer_step_stops_in_token_mode(mode):
    guards = Guards(StandIn(GAConfig(loss_reduction=mode)))
    guards.finalize(Finalizing([], mode, repeated=1, iteration=7))
    if mode == "microbatch":  # a loop may finalize by itself
        guards.finalize(Finalizing([], mode, repeated=2, iteration=7))
        return
    with pytest.raises(
        GuardError,
        match=r"^megatron-ga-ext's finalize_model_grads ran 2 times in training iteration 7",
    ):
        guards.finalize(Finalizing([], mode, repeated=2, iteration=7))


def test_liveness_is_asked_before_and_after_the_step_with_replays_by_design_exempt():
    guards, liveness = Guards(StandIn()), Liveness()
    guards.before_optimizer_step(OptimizerStep(None, liveness))
    startup = SimpleNamespace(
        limited=[SimpleNamespace(replays=True)]
    )  # a coverage row with `replays` applies
    guards.begin_step(Step({"num_microbatches": 1}, startup=startup))
    guards.after_optimizer_step(OptimizerStep(None, liveness))
    assert liveness.checks == [(False, False), (True, True)]
