"""``--ga-on-violation`` (integration/violations.py): each run-time check stops training under
``stop`` (the default), and under ``log`` is logged once per rule with its iteration, counted to the
loop's writers, and training goes on: finalize's step checks (sync and async), the packing
scheduler's count, the micro-batches per chunk, one finalize per step, liveness."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_ga_ext import GAConfig, GuardError, LossContractError
from megatron_ga_ext.errors import OptionError
from megatron_ga_ext.integration import finalize as finalizing
from megatron_ga_ext.integration import megatron_lm, violations
from megatron_ga_ext.integration.features import Finalized, Finalizing, OptimizerStep, Step
from megatron_ga_ext.integration.features.guards import Guards
from megatron_ga_ext.integration.loss_contract import LossContract, StepChecks
from tests.support.stand_in import StandIn

NEGATIVE = StepChecks(tokens=100, negative=1, nonfinite=0, unchecked=0)
NAN = StepChecks(tokens=100, negative=0, nonfinite=2, unchecked=0)


class Host:
    """The loop's host port as violations.py asks it: the iteration and the writers' scalars."""

    def __init__(self) -> None:
        self.at = 7
        self.scalars: list[tuple[dict[str, float], int]] = []

    def iteration(self) -> int:
        return self.at

    def record_metrics(self, scalars: dict[str, float], iteration: int) -> None:
        self.scalars.append((scalars, iteration))


@pytest.fixture
def host(monkeypatch) -> Host:
    stand_in = Host()
    monkeypatch.setattr(violations, "current_host", lambda: stand_in)
    monkeypatch.setattr(violations, "VIOLATIONS", violations.Violations())
    monkeypatch.setattr(megatron_lm.MEGATRON_LM, "parsed_args", lambda: argparse.Namespace())
    return stand_in


def vector(checks: StepChecks) -> torch.Tensor:
    return torch.tensor(list(checks), dtype=torch.int64)


class RaisingLiveness:
    """An optimizer's liveness whose iteration bypassed the hooks."""

    def check(self, *, after_step: bool, exempt: bool = False) -> None:
        raise GuardError("iteration 7 did not run megatron-ga-ext's schedule (a bypass)")


def violate_each_guard(guards: Guards) -> None:
    """Break each of the guards' run-time rules once."""
    guards.scheduled(3, requested=4)
    guards.begin_step(Step({"num_microbatches": 2, "forward_only": True}))  # the scheduler packed 3
    chunk = object()
    guards.micro_batch(chunk, print)  # 1 forward step of 2
    guards.end_step(Step({"num_microbatches": 2, "forward_only": True}))
    guards.finalize(Finalizing([], "token", repeated=2, iteration=7))
    guards.before_optimizer_step(OptimizerStep(None, RaisingLiveness()))


def test_the_flag_takes_stop_or_log_and_stop_is_the_default():
    assert GAConfig().on_violation == "stop" and GAConfig(on_violation="log").on_violation == "log"
    with pytest.raises(OptionError, match=r"--ga-on-violation 'observe' is not one of stop, log"):
        GAConfig(on_violation="observe")


def test_finalizes_step_checks_stop_or_are_logged_once_counted_and_trained_on(host, caplog):
    stop = finalizing.FinalizeModelGrads(lambda *a, **k: None, LossContract(), GAConfig())
    with pytest.raises(
        LossContractError, match=r"1 micro-batch\(es\) returned a negative num_tokens"
    ):
        stop._verdict(vector(NEGATIVE), 7)
    log = finalizing.FinalizeModelGrads(
        lambda *a, **k: None, LossContract(), GAConfig(on_violation="log")
    )
    with caplog.at_level(logging.WARNING, logger="megatron_ga_ext.integration.violations"):
        assert log._verdict(vector(NEGATIVE), 7) == Finalized(
            100, False, None
        )  # N = 100 divides the step
        host.at = 8
        assert log._verdict(vector(NEGATIVE), 8) == Finalized(100, False, None)
    said = [r.getMessage() for r in caplog.records]
    assert (
        len(said) == 1
        and "iteration 7 broke the rule 'step token checks' (LossContractError: " in said[0]
    )
    assert "returned a negative num_tokens" in said[0]
    assert host.scalars == [
        ({"ga-violations/step token checks": 1.0}, 7),
        ({"ga-violations/step token checks": 2.0}, 8),
    ]


def test_async_step_checks_stop_or_are_logged(host):
    config = {"checks": "async"}
    stop = finalizing.FinalizeModelGrads(lambda *a, **k: None, LossContract(), GAConfig(**config))
    stop._verdict(vector(NAN), 7)
    with pytest.raises(
        LossContractError, match=r"verdict of training step .*2 micro-batch\(es\) .* non-finite"
    ):
        stop.poll(wait=True)
    log = finalizing.FinalizeModelGrads(
        lambda *a, **k: None, LossContract(), GAConfig(on_violation="log", **config)
    )
    log._verdict(vector(NAN), 7)
    assert log.poll(wait=True) is not None
    assert violations.VIOLATIONS.counts == {"step token checks": 1}


def test_each_guard_stops_under_stop(host):
    guards = Guards(StandIn(GAConfig(guards=True)))
    guards.scheduled(3, requested=4)
    with pytest.raises(GuardError, match=r"num_microbatches=2.* 3"):
        guards.begin_step(Step({"num_microbatches": 2, "forward_only": True}))
    guards.micro_batch(object(), print)
    with pytest.raises(GuardError, match=r"ran forward steps per model chunk \(chunk 0: 1\)"):
        guards.end_step(Step({"num_microbatches": 2, "forward_only": True}))
    with pytest.raises(
        GuardError, match=r"finalize_model_grads ran 2 times in training iteration 7"
    ):
        guards.finalize(Finalizing([], "token", repeated=2, iteration=7))
    with pytest.raises(GuardError, match=r"a bypass"):
        guards.before_optimizer_step(OptimizerStep(None, RaisingLiveness()))


def test_each_guard_is_logged_once_counted_and_trained_on_under_log(host, caplog):
    guards = Guards(StandIn(GAConfig(guards=True, on_violation="log")))
    with caplog.at_level(logging.WARNING, logger="megatron_ga_ext.integration.violations"):
        violate_each_guard(guards)
        violate_each_guard(guards)
    rules = [
        "scheduled micro-batches",
        "micro-batches per chunk",
        "one finalize per step",
        "liveness",
    ]
    assert violations.VIOLATIONS.counts == dict.fromkeys(rules, 2)
    said = [r.getMessage() for r in caplog.records]
    assert [
        rule for rule in rules for line in said if f"broke the rule '{rule}'" in line
    ] == rules  # once each
    assert {name for scalars, _ in host.scalars for name in scalars} == {
        f"ga-violations/{rule}" for rule in rules
    }
