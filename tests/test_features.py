"""The features loop (integration/features.py, installation.py): a feature is one class and one entry in FEATURES;
each phase runs every feature in that order and hands values on; every --ga-* flag acts in exactly one place."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest

pytest.importorskip("megatron.core.pipeline_parallel.schedules")

import torch

from megatron_ga_ext import GAConfig
from megatron_ga_ext.config.flags import GA_OPTIONS
from megatron_ga_ext.integration import installation
from megatron_ga_ext.integration.features import Feature
from megatron_ga_ext.integration.hooks import optimizer_step
from megatron_ga_ext.integration.lifecycle import install, uninstall
from megatron_ga_ext.integration.sidecar import sidecar_path


@pytest.fixture(autouse=True)
def clean():
    uninstall()
    yield
    uninstall()


def test_every_ga_flag_acts_in_exactly_one_place():
    """A reader finds where a --ga-* flag acts in one hop: one feature, or the one core place CORE_FLAGS names."""
    places = [flag for feature in installation.FEATURES for flag in feature.flags] + list(installation.CORE_FLAGS)
    assert sorted(places) == sorted(option.flag for option in GA_OPTIONS)


class Recorder(Feature):
    """A feature a test adds: it records what each phase hands it."""

    name = "recorder"
    version = 2
    seen: ClassVar[list] = []

    def begin_step(self, step):
        self.seen.append(("begin_step", step.training, step.startup is not None))

    def micro_batch(self, model_chunk, loss_func):
        self.seen.append(("micro_batch", model_chunk))
        return loss_func

    def end_step(self, step):
        self.seen.append(("end_step", step.left_open, step.earlier))

    def before_optimizer_step(self, step):
        self.seen.append(("before_optimizer_step", step.optimizer))

    def after_optimizer_step(self, step):
        self.seen.append(("after_optimizer_step", step.measurement))

    def after_log(self):
        self.seen.append(("after_log",))

    def state_dict(self):
        return {"steps": sum(1 for event in self.seen if event[0] == "after_optimizer_step")}

    def load_state_dict(self, saved, version, loaded, where):
        self.seen.append(("load", saved, version, loaded.iteration))


class Optimizer:
    def step(self):
        return True, 1.0, None


def test_a_feature_added_in_one_line_runs_in_every_phase_in_order_and_keeps_its_state(monkeypatch, tmp_path):
    Recorder.seen = []
    monkeypatch.setattr(installation, "FEATURES", (*installation.FEATURES, Recorder))
    state = install(GAConfig(loss_reduction="microbatch"))
    assert [type(f).__name__ for f in state.features] == ["LossReduction", "Guards", "AuxLosses", "Recorder"]
    recorder, chunk, optimizer = state.feature(Recorder), torch.nn.Linear(1, 1), Optimizer()
    stepping = optimizer_step(optimizer.step, state, optimizer)

    step = state.begin_step({"num_microbatches": 1})
    loss_func = state.micro_batch(chunk, lambda output: output)
    state.end_step(step)
    stepping()
    state.after_log()
    assert loss_func is not None and recorder.seen == [
        ("begin_step", True, True),  # the start-up checks' verdict, on the first call only
        ("micro_batch", chunk),
        ("end_step", False, 0),  # the loss reduction ran first and handed on its values
        ("before_optimizer_step", optimizer),
        ("after_optimizer_step", None),  # no noise scale: nothing measured
        ("after_log",),
    ]

    state.after_save(str(tmp_path), 3)
    saved = json.loads(sidecar_path(tmp_path, 3).read_text())
    assert saved["features"] == {"recorder": {"version": 2, "state": {"steps": 1}}}
    resumed = install(GAConfig(loss_reduction="microbatch", guards=False))
    resumed.after_load(str(tmp_path), 3, None, 0)
    assert resumed.feature(Recorder).seen[-1] == ("load", {"steps": 1}, 2, 3)
