"""The features loop (integration/features/, installation.py): a feature is one class and one entry
in FEATURES; each phase runs every feature in that order and hands values on; every --ga-* flag acts
in exactly one place."""

from __future__ import annotations

import json
import re
from typing import ClassVar

import pytest

pytest.importorskip("megatron.core.pipeline_parallel.schedules")

import torch

from megatron_ga_ext import GAConfig
from megatron_ga_ext.config.flags import GA_OPTIONS
from megatron_ga_ext.integration import installation
from megatron_ga_ext.integration.features import Entry, Feature, Finalized, Finalizing
from megatron_ga_ext.integration.hooks import optimizer_step
from megatron_ga_ext.integration.lifecycle import install, uninstall
from megatron_ga_ext.integration.sidecar import sidecar_path
from tools import doc_design


@pytest.fixture(autouse=True)
def clean():
    uninstall()
    yield
    uninstall()


def test_every_ga_flag_acts_in_exactly_one_place():
    """A reader finds where a --ga-* flag acts in one hop: one feature, or the one core place
    CORE_FLAGS names."""
    features = [entry.load() for entry in installation.FEATURES]
    places = [flag for feature in features for flag in feature.flags] + list(doc_design.CORE_FLAGS)
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

    def finalize(self, step):
        self.seen.append(("finalize", step.mode, step.num_tokens))

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


def test_a_feature_added_in_one_line_runs_in_every_phase_in_order_and_keeps_its_state(
    monkeypatch, tmp_path
):
    Recorder.seen = []
    monkeypatch.setattr(installation, "FEATURES", (*installation.FEATURES, Entry(Recorder)))
    state = install(GAConfig(loss_reduction="microbatch"))
    names = [type(f).__name__ for f in state.features]
    assert names == ["TorchFSDP2", "LossReduction", "Guards", "AuxLosses", "Recorder"]
    recorder, chunk, optimizer = state.feature(Recorder), torch.nn.Linear(1, 1), Optimizer()
    stepping = optimizer_step(optimizer.step, state, optimizer)

    step = state.begin_step({"num_microbatches": 1})
    loss_func = state.micro_batch(chunk, lambda output: output)
    state.finalized(
        Finalizing([chunk], "microbatch"), Finalized()
    )  # what finalize hands on (finalize.py)
    state.end_step(step)
    stepping()
    state.after_log()
    assert loss_func is not None and recorder.seen == [
        ("begin_step", True, True),  # the start-up checks' verdict, on the first call only
        ("micro_batch", chunk),
        ("finalize", "microbatch", None),
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


def test_the_installation_holds_at_most_15_fields_and_every_module_450_lines():
    import dataclasses
    from pathlib import Path

    assert len(dataclasses.fields(installation.Installation)) <= 15
    package = Path(installation.__file__).resolve().parent.parent
    long = {
        str(path.relative_to(package)): n
        for path in package.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 450
    }
    assert long == {}


def test_a_loop_stepping_its_own_optimizer_takes_finalizes_verdict_once():
    """No optimizer install() hooked: the verdicts of the steps wait, a skip kept until the loop
    takes them."""
    state = install(GAConfig())
    state.finalized(
        Finalizing([], "token"), Finalized(0, True, None)
    )  # 0 tokens under --ga-zero-token-policy skip
    state.finalized(Finalizing([], "token"), Finalized(5, False, None))
    assert state.take_verdict() == Finalized(5, True, None) and state.take_verdict() is None


#: What each file:line the walk of N in docs/design.md cites holds (a line that moves fails here:
#: update the page).
WALK = {
    ("features/loss_reduction.py", 78): "self.wrap_loss(loss_func)",
    ("loss_contract.py", 172): "def check(",
    ("loss_contract.py", 192): "self._counts.append(num_tokens)",
    ("loss_contract.py", 200): "self._host_tokens += num_tokens",
    ("loss_contract.py", 219): "def collect(",
    ("loss_contract.py", 267): "vector = torch.stack(",
    ("finalize.py", 157): "contract.collect(",
    ("finalize.py", 160): "torch.distributed.broadcast(vector",
    ("finalize.py", 162): "vector[SLOT_TOKENS].clone()",
    ("finalize.py", 163): "torch.distributed.all_reduce(vector",
    ("finalize.py", 164): "tokens = vector[SLOT_TOKENS]",
    ("finalize.py", 166): "self._verdict(vector",
    ("finalize.py", 167): "step = Finalizing(",
    ("finalize.py", 170): "self.reads.finalized(step",
    ("finalize.py", 173): "torch.clamp(tokens, min=1).reciprocal()",
    ("finalize.py", 175): "scale_gradients(chunk, scaling)",
    ("finalize.py", 184): "vector.tolist()",
    ("installation.py", 269): "def finalized(",
    ("installation.py", 280): "feature.finalize(step)",
    ("installation.py", 281): "self.keep(verdict)",
    ("installation.py", 313): "OptimizerStep(optimizer, liveness, verdict)",
    ("division.py", 35): "chunk.scale_gradients(scaling)",
    ("division.py", 40): "mul_(scaling)",
}


def test_the_walk_of_n_in_design_md_cites_the_lines_it_names():
    from pathlib import Path

    root = Path(installation.__file__).resolve().parent
    page = (root.parent.parent / "docs" / "design.md").read_text()
    walk = page[page.index("**The walk of N**") : page.index("**The features**")]
    cited, last = set(), None
    for name, line in re.findall(r"([\w/]+\.py)?:(\d+)", walk):
        last = name or last
        cited.add((last, int(line)))
    assert cited == set(WALK)
    for (name, line), fragment in WALK.items():
        assert fragment in (root / name).read_text().splitlines()[line - 1], (name, line)
