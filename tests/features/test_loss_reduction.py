"""LossReduction alone (integration/features/loss_reduction.py), with a stand-in handle: the loss
functions it wraps, and a step split over several forward/backward calls left open until its one
finalize."""

import pytest
import torch

from megatron_ga_ext import GAConfig, GuardError, LossContractError
from megatron_ga_ext.integration.features import Finalizing, OptimizerStep, Step
from megatron_ga_ext.integration.features.loss_reduction import LossReduction
from tests.support.stand_in import Liveness, StandIn

CHUNK = object()


def loss(tokens: int):
    return lambda *args, **kwargs: (torch.tensor(2.0 * tokens), torch.tensor(tokens), {})


def call(
    reduction: LossReduction,
    num_microbatches: int,
    *,
    forward_only: bool = False,
    finalize: bool = False,
):
    """One forward/backward call of ``num_microbatches`` (each loss function run), finalize at its
    end or not."""
    step = Step({"num_microbatches": num_microbatches, "forward_only": forward_only})
    reduction.begin_step(step)
    for _ in range(num_microbatches):
        reduction.micro_batch(CHUNK, loss(3))()
    if finalize:
        reduction.finalize(Finalizing([], "token"))
    reduction.end_step(step)
    return step


def test_token_mode_checks_each_loss_function_into_the_installations_contract():
    handle = StandIn(GAConfig(loss_reduction="token"))
    reduction = LossReduction(handle)
    wrapped = reduction.micro_batch(CHUNK, loss(5))
    assert (
        wrapped() == (torch.tensor(10.0), torch.tensor(5), {}) and handle.contract.microbatches == 1
    )
    with pytest.raises(
        LossContractError, match=r"^the loss function returned a loss of type float; it must be"
    ):
        reduction.micro_batch(CHUNK, lambda: (1.0, 5, {}))()
    assert (
        reduction.micro_batch(CHUNK, None) is None
    )  # a forward step without a loss function (not a last stage)


def test_microbatch_mode_reports_each_micro_batchs_mean():
    reduction = LossReduction(StandIn(GAConfig(loss_reduction="microbatch")))
    wrapped = reduction.micro_batch(
        CHUNK, lambda: (torch.tensor(6.0), 3, {"lm loss": torch.tensor([6.0, 3.0])})
    )
    _, _, report = wrapped()
    assert reduction.contract is None and report["lm loss"].tolist() == [2.0, 1.0]


def test_a_call_that_reaches_finalize_closes_its_step():
    reduction = LossReduction(StandIn(GAConfig(), steps_bounded=True))
    step = call(reduction, 4, finalize=True)
    assert (step.left_open, step.earlier, reduction.open_microbatches()) == (False, 0, 0)
    reduction.before_optimizer_step(OptimizerStep(None, Liveness()))


def test_a_split_step_stays_open_until_its_one_finalize_and_stops_where_it_never_came():
    reduction = LossReduction(StandIn(GAConfig(), steps_bounded=True))
    first = call(reduction, 2)
    assert first.left_open and reduction.open_microbatches() == 2
    evaluation = call(
        reduction, 1, forward_only=True
    )  # set aside and taken back: the open step's losses stay
    assert not evaluation.left_open and reduction.contract.microbatches == 2
    last = call(reduction, 2, finalize=True)
    assert (last.left_open, last.earlier) == (
        False,
        2,
    )  # the guards check 2 + 2 against the calculator
    call(reduction, 3)
    with pytest.raises(
        GuardError, match=r"^this training step's forward_backward_func calls never called"
    ):
        reduction.before_optimizer_step(OptimizerStep(None, Liveness()))
    assert reduction.open_microbatches() == 0  # the next step starts afresh


def test_without_an_optimizer_marking_the_steps_an_unfinalized_call_stops():
    reduction = LossReduction(StandIn(GAConfig(), steps_bounded=False))
    with pytest.raises(
        GuardError, match=r"needs an optimizer built by megatron.core.optimizer.get_megatron_optim"
    ):
        call(reduction, 2)


def test_microbatch_mode_leaves_no_step_open():
    reduction = LossReduction(StandIn(GAConfig(loss_reduction="microbatch"), steps_bounded=True))
    assert not call(reduction, 2).left_open
