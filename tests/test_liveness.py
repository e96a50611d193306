"""Liveness: each optimizer step checks that its iteration ran the extension's schedule hook and
finalize (integration/liveness.py); the real loop's bypass is tests/e2e/test_faults.py's
``bypass-hooks`` fault."""

import re

import pytest

pytest.importorskip("megatron.core.pipeline_parallel.schedules")

from megatron_ga_ext import GAConfig, GuardError
from megatron_ga_ext.integration.features.guards import Guards
from megatron_ga_ext.integration.features.loss_reduction import LossReduction
from megatron_ga_ext.integration.hooks import optimizer_step
from megatron_ga_ext.integration.lifecycle import install, uninstall
from megatron_ga_ext.integration.liveness import bypass_message, check_one_finalize


@pytest.fixture(autouse=True)
def clean():
    uninstall()
    yield
    uninstall()


@pytest.mark.parametrize(
    "scheduled, finalized, token, expected",
    [
        (True, True, True, None),
        (True, False, False, None),  # microbatch mode: a loop may finalize by itself
        (
            False,
            True,
            True,
            r"not through its guarded forward/backward schedule: .* not taken from "
            r"megatron\.core\.pipeline_parallel\.get_forward_backward_func\(\)",
        ),
        (
            False,
            False,
            True,
            r"neither its guarded forward/backward schedule nor its finalize_model_grads .* "
            r"replayed full-iteration CUDA graph \(--cuda-graph-impl full_iteration",
        ),
        (False, False, False, r"replayed full-iteration CUDA graph"),
        (
            True,
            False,
            True,
            r"ran megatron-ga-ext's guarded schedule but not its finalize_model_grads",
        ),
    ],
)
def test_bypass_message_names_what_most_likely_went_around_the_hooks(
    scheduled, finalized, token, expected
):
    message = bypass_message(scheduled=scheduled, finalized=finalized, token=token, iteration=7)
    if expected is None:
        assert message is None
    else:
        assert message.startswith("training iteration 7 ") and re.search(expected, message), message


class Optimizer:
    """An optimizer's step as Megatron's builders return it: (update_successful, grad_norm,
    num_zeros)."""

    def __init__(self) -> None:
        self.steps = 0

    def step(self):
        self.steps += 1
        return True, 1.0, None


def iteration(state, *, scheduled: bool = True, finalized: bool = True) -> None:
    """What one iteration's hooks count: a training call through the guarded schedule, one finalize
    call."""
    state.counts.training_schedules += scheduled
    state.counts.finalizes += finalized


def wrapped(state) -> tuple[Optimizer, object]:
    optimizer = Optimizer()
    return optimizer, optimizer_step(optimizer.step, state)


@pytest.mark.parametrize("checks", ["sync", "async"])
def test_an_iteration_without_the_hooks_raises_at_its_optimizer_step(checks):
    state = install(GAConfig(checks=checks))
    optimizer, step = wrapped(state)
    iteration(state)
    assert step() == (True, 1.0, None)
    iteration(state, scheduled=False)  # finalize ran, the schedule hook did not
    with pytest.raises(GuardError, match=r"not through its guarded forward/backward schedule"):
        step()
    # sync: raised before the optimizer stepped; async: after, as the step's other verdicts are read
    assert optimizer.steps == (1 if checks == "sync" else 2)
    iteration(state, scheduled=False, finalized=False)
    prefix = "^--ga-checks async, after the optimizer step: " if checks == "async" else "^"
    with pytest.raises(
        GuardError,
        match=prefix + r"a training iteration reached the optimizer step without running "
        r"megatron-ga-ext's hooks",
    ):
        step()
    iteration(state)  # a healthy iteration after: checked afresh
    assert step() == (True, 1.0, None)


def test_each_optimizer_keeps_its_own_count_and_replays_by_design_are_exempt():
    state = install(GAConfig())
    (_, first), (_, second) = wrapped(state), wrapped(state)
    iteration(state)
    first()
    second()  # two optimizers stepping in one iteration: each saw the iteration's hooks
    state.feature(
        Guards
    ).replays_expected = True  # a full-iteration graph in microbatch mode (coverage row `replays`)
    iteration(state, scheduled=False, finalized=False)
    first()


def test_after_uninstall_the_step_calls_straight_through():
    state = install(GAConfig())
    optimizer, step = wrapped(state)
    uninstall()
    iteration(state, scheduled=False, finalized=False)
    assert step() == (True, 1.0, None) and optimizer.steps == 1


def test_an_optimizer_built_before_a_reinstall_follows_the_new_installation():
    """install() with another config after Megatron built its optimizer: the step keeps checking,
    against the new installation's hooks and with its --ga-checks."""
    first = install(GAConfig())
    optimizer, step = wrapped(first)
    second = install(GAConfig(checks="async"))
    iteration(second)
    assert step() == (True, 1.0, None)
    iteration(second, scheduled=False)
    with pytest.raises(
        GuardError,
        match=r"^--ga-checks async, after the optimizer step: .* not through its guarded",
    ):
        step()
    assert optimizer.steps == 2


def test_a_second_finalize_before_the_optimizer_step_is_named_unless_megatron_reruns_the_iteration(
    monkeypatch,
):
    """The real loop: tests/test_split_step.py."""
    check_one_finalize(1, 7)
    with pytest.raises(
        GuardError,
        match=r"^megatron-ga-ext's finalize_model_grads ran 2 times in training iteration 7 "
        r"before its optimizer step: the step is split over several "
        r"forward_backward_func calls",
    ):
        check_one_finalize(2, 7)
    from megatron.core import rerun_state_machine as reruns

    machine = type("Machine", (), {"state": reruns.RerunState.RERUNNING_IN_PLACE})()
    monkeypatch.setattr(reruns, "_GLOBAL_RERUN_STATE_MACHINE", machine)
    check_one_finalize(
        2, 7
    )  # train_step zeroed the gradients and runs the iteration again, finalize included
    machine.state = reruns.RerunState.INITIAL_RUN
    with pytest.raises(GuardError, match=r"ran 2 times"):
        check_one_finalize(2, 7)


def test_building_an_optimizer_arms_the_count_and_its_steps_reset_it():
    state = install(GAConfig())
    assert (
        state.counts.finalizes_at_step is None and not state.steps_bounded
    )  # no optimizer install() hooked
    _, step = wrapped(state)
    assert state.counts.finalizes_at_step == state.counts.finalizes and state.steps_bounded
    iteration(state)
    step()
    assert state.counts.finalizes_at_step == state.counts.finalizes == 1


@pytest.mark.parametrize("checks", ["sync", "async"])
def test_a_split_step_still_open_at_its_optimizer_step_stops_before_it(checks):
    """A step whose calls all returned without finalize: stopped before the optimizer step under
    either --ga-checks (a host fact), and the next step starts afresh."""
    state = install(GAConfig(checks=checks))
    optimizer, step = wrapped(state)
    state.counts.training_schedules += 2
    reduction = state.feature(LossReduction)
    reduction.open_step = (4, reduction.finalizes)
    with pytest.raises(
        GuardError,
        match=r"^this training step's forward_backward_func calls never called "
        r"megatron-ga-ext's finalize_model_grads",
    ):
        step()
    assert optimizer.steps == 0 and reduction.open_microbatches() == 0
    iteration(state)
    assert step() == (True, 1.0, None)
