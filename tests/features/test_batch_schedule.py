"""BatchSchedule alone (science/integration/batch_schedule.py), with a stand-in handle: the rates of
each step's batch, the warmup's decision on the step's trace row, and its stages across a resume
(tests/test_batch_warmup*.py, tests/test_lr_scaling.py: the warmup and the rates themselves)."""

import pytest

from megatron_ga_ext import GAConfig
from megatron_ga_ext.errors import ScheduleStateError
from megatron_ga_ext.integration.features import Loaded, OptimizerStep
from megatron_ga_ext.science.integration.batch_schedule import BatchSchedule
from tests.support.stand_in import Liveness, StandIn

LOADED = Loaded(iteration=3, scheduler=None, consumed_samples=96)
WARMUP = {"batch_size_warmup": "auto", "batch_size_warmup_max": 256, "noise_scale": 1}


class Recorded:
    """The warmup's and the rates' side (batch_warmup.BatchSizeWarmup, lr_scaling.ScaledRates),
    recorded."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []
        self.cap = 256

    def before_step(self, optimizer):
        self.seen.append(("rates", optimizer))

    def decide(self, row, calculator):
        self.seen.append(("decide", row, calculator))
        return True


@pytest.mark.parametrize("lr_scaling", ["none", "sqrt"])
def test_the_rates_of_each_steps_batch_under_lr_scaling_only(lr_scaling):
    schedule = BatchSchedule(StandIn(GAConfig(lr_scaling=lr_scaling)))
    schedule.rates = recorded = Recorded()
    schedule.before_optimizer_step(OptimizerStep("optimizer", Liveness()))
    assert recorded.seen == ([] if lr_scaling == "none" else [("rates", "optimizer")])
    assert (
        schedule.warmup is None and schedule.extra_samples() == 0 and schedule.state_dict() is None
    )


def test_the_warmup_decides_on_a_measured_steps_row_and_plans_up_to_its_cap():
    schedule = BatchSchedule(StandIn(GAConfig(**WARMUP)))
    schedule.warmup = recorded = Recorded()
    step = OptimizerStep("optimizer", Liveness())
    schedule.after_optimizer_step(step)  # not measured: nothing to decide on
    step.measurement = {"b_simple_samples": 512.0}
    schedule.after_optimizer_step(step)
    assert recorded.seen == [
        ("decide", {"b_simple_samples": 512.0}, None)
    ]  # no live step schedule here
    assert schedule.extra_samples() == 256


def test_a_warmup_state_it_cannot_read_is_refused():
    schedule = BatchSchedule(StandIn(GAConfig(**WARMUP)))
    with pytest.raises(
        ScheduleStateError, match=r"the batch-size warmup state in sidecar has layout 2"
    ):
        schedule.load_state_dict({"stages": []}, 2, LOADED, "sidecar")


def test_a_checkpoint_without_stages_starts_the_warmup_again(caplog):
    schedule = BatchSchedule(StandIn(GAConfig(**WARMUP)))
    schedule.load_state_dict(None, 1, LOADED, "sidecar")
    assert "the checkpoint of iteration 3 keeps no batch-size warmup stages" in caplog.text
