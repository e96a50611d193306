"""NoiseScale alone (science/integration/noise_scale_feature.py), with a stand-in handle: what it
hands its meter in each phase, the trace row it hands on, and its EMAs across a resume
(tests/test_noise_scale_*.py: the meter itself)."""

import pytest
import torch

from megatron_ga_ext import GAConfig
from megatron_ga_ext.errors import NoiseScaleError
from megatron_ga_ext.integration.features import Finalizing, Loaded, OptimizerStep, Step
from megatron_ga_ext.science.core.noise_scale import NoiseEstimate, NoiseScaleEMA
from megatron_ga_ext.science.integration.noise_scale_feature import NoiseScale
from tests.support.stand_in import Liveness, StandIn

LOADED = Loaded(iteration=3, scheduler=None, consumed_samples=96)


class Meter:
    """The meter's side of each phase, recorded (noise_scale.NoiseScaleMeter)."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []
        self.last_row = {"b_simple_tokens": 1234.0}

    def before_grad_sync(self, group, chunks):
        self.seen.append(("before_grad_sync", group, chunks))

    def after_reduction(self, model, local_tokens, is_last_stage):
        self.seen.append(("after_reduction", model, int(local_tokens), is_last_stage))

    def before_optimizer_step(self, optimizer):
        self.seen.append(("before_optimizer_step", optimizer))

    def after_optimizer_step(self, optimizer):
        self.seen.append(("after_optimizer_step", optimizer))
        return object()  # a measurement was read


def feature(**config) -> tuple[NoiseScale, Meter]:
    noise_scale = NoiseScale(StandIn(GAConfig(noise_scale=1, **config)))
    noise_scale.meter = Meter()
    return noise_scale, noise_scale.meter


def test_finalize_hands_the_meter_the_replicas_count_and_where_the_rank_stands():
    noise_scale, meter = feature()
    model = [torch.nn.Linear(1, 1)]
    noise_scale.finalize(
        Finalizing(model, "token", torch.tensor(40), torch.tensor(10), is_last_stage=True)
    )
    noise_scale.finalize(Finalizing(model, "microbatch"))  # no count: nothing measured
    assert meter.seen == [("after_reduction", model, 10, True)]


def test_a_bucket_groups_read_names_the_schedules_first_chunk():
    noise_scale, meter = feature()
    chunk = torch.nn.Linear(1, 1)
    noise_scale.before_grad_sync("group 0")
    noise_scale.begin_step(
        Step({"num_microbatches": 1, "model": [chunk]})
    )  # not the first call: no layout check
    noise_scale.before_grad_sync("group 1")
    assert meter.seen == [
        ("before_grad_sync", "group 0", ()),
        ("before_grad_sync", "group 1", (chunk,)),
    ]


def test_a_measured_steps_trace_row_is_handed_on_in_the_step():
    noise_scale, meter = feature()
    step = OptimizerStep("optimizer", Liveness())
    noise_scale.before_optimizer_step(step)
    noise_scale.after_optimizer_step(step)
    assert step.measurement == {"b_simple_tokens": 1234.0}
    assert meter.seen == [
        ("before_optimizer_step", "optimizer"),
        ("after_optimizer_step", "optimizer"),
    ]


def test_the_emas_continue_across_a_resume_under_one_decay_only():
    saving = NoiseScale(StandIn(GAConfig(noise_scale=1, noise_scale_decay=0.9)))
    saving.meter.ema.update(NoiseEstimate(grad_sq=2.0, trace_sigma=10.0, tokens=64))
    saving.meter.measurements = 1
    saved = saving.state_dict()
    resumed = NoiseScale(StandIn(GAConfig(noise_scale=1, noise_scale_decay=0.9)))
    resumed.load_state_dict(saved, 1, LOADED, "sidecar")
    assert resumed.meter.measurements == 1 and resumed.meter.ema.state_dict() == saved["ema"]
    other = NoiseScale(StandIn(GAConfig(noise_scale=1, noise_scale_decay=0.95)))
    other.load_state_dict(saved, 1, LOADED, "sidecar")
    assert other.meter.measurements == 0 and other.meter.ema == NoiseScaleEMA(decay=0.95)


@pytest.mark.parametrize(
    "saved, version, message",
    [
        ({"ema": {}}, 1, r"has layout 1 \{'ema': \{\}\}, not 1 with 'ema' and 'measurements'"),
        ({"ema": {}, "measurements": 1}, 2, r"has layout 2"),
        ({"ema": {}, "measurements": -1}, 1, r"has measurements -1, not a whole number >= 0"),
    ],
)
def test_a_state_it_cannot_read_is_refused(saved, version, message):
    noise_scale = NoiseScale(StandIn(GAConfig(noise_scale=1)))
    with pytest.raises(NoiseScaleError, match=message):
        noise_scale.load_state_dict(saved, version, LOADED, "sidecar")
