"""A non-finite loss under Megatron's rerun state machine (integration/finalize.py): deferred to
Megatron where its NaN check runs, the extension's own error where it does not, and a deferred one
that reaches the optimizer step stops there. The real loop: tests/e2e/test_faults.py (the nan-loss
faults)."""

import argparse

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_ga_ext import GAConfig, LossContractError
from megatron_ga_ext.integration import finalize as finalizing
from megatron_ga_ext.integration import megatron_lm
from megatron_ga_ext.integration.features import Deferred, Finalized
from megatron_ga_ext.integration.loss_contract import LossContract, StepChecks
from megatron_ga_ext.integration.step_verdict import describe_decision, megatron_judges_nonfinite

NAN = StepChecks(tokens=100, negative=0, nonfinite=1, unchecked=0)
FINITE = StepChecks(tokens=100, negative=0, nonfinite=0, unchecked=0)


def vector(checks: StepChecks) -> torch.Tensor:
    """The reduced vector finalize reads (loss_contract.StepChecks' order)."""
    return torch.tensor(list(checks), dtype=torch.int64)


def finalize(monkeypatch, **args) -> finalizing.FinalizeModelGrads:
    monkeypatch.setattr(
        megatron_lm.MEGATRON_LM, "parsed_args", lambda: argparse.Namespace(**args) if args else None
    )
    return finalizing.FinalizeModelGrads(lambda *a, **k: None, LossContract(), GAConfig())


@pytest.mark.parametrize(
    "args, judged",
    [
        ({"rerun_mode": "validate_results", "check_for_nan_in_loss_and_grad": True}, True),
        (
            {"rerun_mode": "report_stats", "check_for_nan_in_loss_and_grad": True},
            False,
        ),  # refused at start-up
        ({"rerun_mode": "validate_results", "check_for_nan_in_loss_and_grad": False}, False),
        ({"rerun_mode": "disabled", "check_for_nan_in_loss_and_grad": True}, False),
        ({}, False),  # a megatron-core loop: no rerun machine judges it
    ],
)
def test_a_nonfinite_loss_is_megatrons_only_where_its_check_runs(monkeypatch, args, judged):
    step = finalize(monkeypatch, **args)
    assert megatron_judges_nonfinite() is judged
    checks = step._judged(NAN, 3)
    assert checks.nonfinite == (0 if judged else 1)  # not judged: _raise_on_violations raises on it
    assert (step._deferred is not None) is judged


def test_a_finite_rerun_clears_the_deferral_and_a_deferred_step_stops_at_the_optimizer(
    monkeypatch, caplog
):
    step = finalize(monkeypatch, rerun_mode="validate_results", check_for_nan_in_loss_and_grad=True)
    with caplog.at_level("WARNING"):
        first = step._verdict(vector(NAN), 3)
    assert (
        "1 micro-batch(es) of iteration 3 returned a non-finite loss; Megatron's rerun state "
        "machine" in caplog.text
    )
    second = step._verdict(
        vector(FINITE), 3
    )  # Megatron re-ran iteration 3 in place: finite this time
    assert step.check_deferred() is None  # nothing to stop at the optimizer step
    # the verdicts, as the installation keeps them: the deferral until its decision is reported
    assert first.then(second) == Finalized(100, False, Deferred(3, 1))
    step._judged(
        NAN, 1
    )  # the first iteration: Megatron does not validate it, the step goes on to the optimizer
    with pytest.raises(
        LossContractError,
        match=r"^iteration 1: 1 micro-batch\(es\) returned a non-finite loss .* "
        r"Megatron's rerun state machine let the step reach the optimizer",
    ):
        step.check_deferred()
    step._judged(NAN, 4)  # --ga-checks async: read late, then the next iteration's verdict comes
    with pytest.raises(LossContractError, match=r"^iteration 4: "):
        step._judged(FINITE, 5)


def test_a_contract_violation_is_not_deferred(monkeypatch):
    step = finalize(monkeypatch, rerun_mode="validate_results", check_for_nan_in_loss_and_grad=True)
    checks = step._judged(NAN._replace(unchecked=1), 3)
    assert checks.nonfinite == 1 and step._deferred is None


@pytest.mark.parametrize(
    "decision, words",
    [
        ((False, True, 17), "exit with code 17"),
        ((True, True, 16), "save a checkpoint and exit with code 16"),
        ((True, False, 0), "save a checkpoint and go on"),
        ((False, False, 0), "go on training"),
    ],
)
def test_megatrons_decision_in_words(decision, words):
    assert describe_decision(*decision) == words


class Copy:
    """A step's checks on their way to the host (step_verdict.PendingChecks): ``landed`` False while
    the copy is not done."""

    def __init__(self, checks: StepChecks, iteration: int, step: int, landed: bool) -> None:
        self._checks, self.iteration, self.step, self.landed, self.read = (
            checks,
            iteration,
            step,
            landed,
            False,
        )

    def ready(self) -> bool:
        return self.landed

    def checks(self) -> StepChecks:
        self.read = True  # a real one waits for its copy here
        return self._checks


def async_finalize(monkeypatch) -> finalizing.FinalizeModelGrads:
    monkeypatch.setattr(
        megatron_lm.MEGATRON_LM,
        "parsed_args",
        lambda: argparse.Namespace(
            rerun_mode="validate_results", check_for_nan_in_loss_and_grad=True
        ),
    )
    return finalizing.FinalizeModelGrads(
        lambda *a, **k: None, LossContract(), GAConfig(checks="async")
    )


def rerun(monkeypatch, second: StepChecks) -> finalizing.FinalizeModelGrads:
    """--ga-checks async, Megatron re-running iteration 3 in place: the first run's NaN verdict is
    read at the re-run's finalize (poll(wait=True)), the re-run's verdict is pending, its copy not
    landed when the optimizer step ends."""
    step = async_finalize(monkeypatch)
    step._pending = Copy(NAN, 3, 1, landed=True)
    step.poll(wait=True)
    assert step._deferred is not None
    step._pending = Copy(second, 3, 2, landed=False)
    return step


def test_async_a_finite_rerun_whose_copy_has_not_landed_clears_the_deferral(monkeypatch):
    step = rerun(monkeypatch, FINITE)
    copy = step._pending
    assert step.poll() is None  # after the optimizer step: not landed yet
    late = step.check_deferred()  # reads the re-run's own verdict first: finite, nothing to stop
    assert copy.read and step._pending is None and step._deferred is None
    assert late == Finalized(100, False, None)


def test_async_a_nonfinite_rerun_still_stops_at_the_optimizer(monkeypatch):
    step = rerun(monkeypatch, NAN)
    step.poll()
    with pytest.raises(
        LossContractError, match=r"^iteration 3: 1 micro-batch\(es\) returned a non-finite loss"
    ):
        step.check_deferred()


def test_async_an_earlier_iterations_deferral_read_with_the_next_verdict_still_stops(monkeypatch):
    step = async_finalize(monkeypatch)
    step._pending = Copy(NAN, 3, 1, landed=True)
    step.poll(wait=True)
    step._pending = Copy(
        FINITE, 4, 2, landed=False
    )  # iteration 3 reached its optimizer step: a later verdict
    with pytest.raises(LossContractError, match=r"^iteration 3: "):
        step.check_deferred()
