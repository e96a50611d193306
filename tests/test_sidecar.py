"""integration/sidecar.py: each feature's state beside the loop's checkpoint, through the
installation's save and load phases; and every sidecar an earlier release wrote (versions 1 and 2)
is read."""

import json
import logging

import pytest

pytest.importorskip("torch")
from megatron_ga_ext import GAConfig
from megatron_ga_ext.errors import NoiseScaleError
from megatron_ga_ext.integration.installation import Installation
from megatron_ga_ext.integration.sidecar import SIDECAR, read_sidecar, sidecar_path
from megatron_ga_ext.science.core.noise_scale import NoiseEstimate, NoiseScaleEMA


def meter(state):
    """The installation's noise-scale meter (its NoiseScale feature's), or None without
    --ga-noise-scale."""
    from megatron_ga_ext.science.integration.noise_scale_feature import NoiseScale

    feature = state.feature(NoiseScale)
    return None if feature is None else feature.meter


def ema(decay: float = 0.9, updates: int = 0) -> NoiseScaleEMA:
    kept = NoiseScaleEMA(decay=decay)
    for step in range(updates):
        kept.update(NoiseEstimate(grad_sq=1.0 + step, trace_sigma=10.0, tokens=64))
    return kept


def measuring(decay: float = 0.9, updates: int = 0) -> Installation:
    """An installation with --ga-noise-scale 1 whose meter holds ``updates`` measurements."""
    config = GAConfig(noise_scale=1, noise_scale_decay=decay)
    state = Installation(config=config, version="test")
    state.configure(config)
    meter(state).ema, meter(state).measurements = ema(decay, updates), updates
    return state


def test_the_path_is_next_to_megatrons_checkpoint(tmp_path):
    assert sidecar_path(tmp_path, 3) == tmp_path / "iter_0000003" / SIDECAR


def test_a_saved_sidecar_holds_each_features_state_and_continues_the_emas(tmp_path):
    saved = measuring(updates=3)
    saved.after_save(str(tmp_path), 3)
    path = sidecar_path(tmp_path, 3)
    assert not path.with_name(path.name + ".partial").exists()
    state = {"ema": meter(saved).ema.state_dict(), "measurements": 3}
    assert json.loads(path.read_text()) == {
        "version": 3,
        "iteration": 3,
        "features": {"noise_scale": {"version": 1, "state": state}},
    }
    resumed = measuring()
    resumed.after_load(str(tmp_path), 3, None, 0)
    assert meter(resumed).measurements == 3
    assert meter(resumed).ema.state_dict() == meter(saved).ema.state_dict()


def test_another_decay_starts_afresh(tmp_path, caplog):
    measuring(decay=0.9, updates=2).after_save(str(tmp_path), 5)
    resumed = measuring(decay=0.5)
    resumed.after_load(str(tmp_path), 5, None, 0)
    assert meter(resumed).measurements == 0 and meter(resumed).ema.updates == 0
    assert (
        "kept with --ga-noise-scale-decay 0.9, this run has 0.5: they start afresh" in caplog.text
    )


def test_no_sidecar_starts_afresh_and_a_bad_one_is_refused(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    resumed = measuring()
    resumed.after_load(str(tmp_path), 7, None, 0)
    assert (
        f"no noise-scale state at {sidecar_path(tmp_path, 7)}" in caplog.text
        and meter(resumed).ema.updates == 0
    )
    write(tmp_path, 7, {"version": 99})
    with pytest.raises(
        NoiseScaleError, match=r"has version 99; this release reads 1, 2, 3: delete it"
    ):
        resumed.after_load(str(tmp_path), 7, None, 0)


def write(tmp_path, iteration: int, state: object):
    path = sidecar_path(tmp_path, iteration)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state))
    return path


EMA = {
    "version": 1,
    "decay": 0.95,
    "trace_sigma_ema": 14.996751701984154,
    "grad_sq_ema": 1.427371326976292,
    "updates": 3,
}
#: A sidecar as the releases before the features loop wrote it (version 2: the EMAs and the warmup's
#: stages).
TODAYS = {
    "version": 2,
    "iteration": 3,
    "ema": EMA,
    "measurements": 3,
    "stages": [[0, 16], [48, 32]],
}


@pytest.mark.parametrize(
    "saved",
    [
        TODAYS,
        {"version": 1, "iteration": 3, "ema": EMA, "measurements": 3},
        {
            "version": 1,
            "iteration": 3,
            "ema": EMA,
            "measurements": 3,
            "stages": [[0, 16], [48, 32]],
        },
    ],
)
def test_every_earlier_sidecar_is_read(tmp_path, saved):
    """Version 1 kept the EMAs only (and, written before the version said so, the stages); version 2
    the stages."""
    path = write(tmp_path, 3, saved)
    assert read_sidecar(path) == {
        "noise_scale": (1, {"ema": EMA, "measurements": 3}),
        "batch_schedule": (1, {"stages": saved.get("stages")}),
    }
    resumed = measuring(decay=0.95)
    resumed.after_load(str(tmp_path), 3, None, 0)
    assert meter(resumed).measurements == 3 and meter(resumed).ema.state_dict() == EMA


def test_the_docs_example_is_read(tmp_path):
    from pathlib import Path

    docs = (Path(__file__).parents[1] / "docs" / "noise-scale.md").read_text()
    example = (
        docs[docs.index("megatron_ga_ext_noise_scale.json`") :]
        .split("```json\n", 1)[1]
        .split("\n```")[0]
    )
    saved = json.loads(example)
    assert saved["version"] == 3
    write(tmp_path, saved["iteration"], saved)
    resumed = measuring(decay=saved["features"]["noise_scale"]["state"]["ema"]["decay"])
    resumed.after_load(str(tmp_path), saved["iteration"], None, 0)
    assert meter(resumed).measurements == saved["features"]["noise_scale"]["state"]["measurements"]


@pytest.mark.parametrize(
    "saved, message",
    [
        (
            {"version": 4, "iteration": 3, "features": {}},
            r"has version 4; this release reads 1, 2, 3",
        ),
        ({"version": "2"}, r"has version '2'; this release reads 1, 2, 3"),
        ([1, 2], r"has version None; this release reads 1, 2, 3"),
        (
            {"version": 2, "iteration": 3, "ema": EMA, "measurements": 3},
            r"is a version-2 sidecar with keys \['ema', 'iteration', 'measurements', "
            r"'version'\], not \['ema', 'iteration', 'measurements', 'stages', "
            r"'version'\]",
        ),
        (
            {"version": 3, "iteration": 3, "features": {"noise_scale": {"state": {}}}},
            r"holds features .*, not \{name: \{version, state\}\}",
        ),
    ],
)
def test_an_unknown_layout_is_refused_naming_the_file(tmp_path, saved, message):
    path = write(tmp_path, 3, saved)
    with pytest.raises(NoiseScaleError, match=rf"^the noise-scale state {path} {message}"):
        measuring().after_load(str(tmp_path), 3, None, 0)


def test_a_features_own_layout_is_checked(tmp_path):
    """A feature reads its own versions: a noise-scale part of a layout this release does not know
    is refused."""
    path = write(
        tmp_path,
        3,
        {"version": 3, "iteration": 3, "features": {"noise_scale": {"version": 2, "state": {}}}},
    )
    with pytest.raises(
        NoiseScaleError, match=rf"^the noise-scale state in {path} has layout 2 \{{\}}, not 1"
    ):
        measuring().after_load(str(tmp_path), 3, None, 0)


# -- non-persistent checkpoints: the sidecar where Megatron-LM put the checkpoint, read where it
# loaded it from --


def installation(monkeypatch, tmp_path, **megatron):
    """An Installation with the meter (and the warmup), under Megatron's args ``megatron``."""
    import argparse

    from megatron_ga_ext import GAConfig
    from megatron_ga_ext.integration import megatron_lm
    from megatron_ga_ext.integration.installation import Installation

    args = argparse.Namespace(
        save=str(tmp_path / "save"),
        load=str(tmp_path / "save"),
        consumed_train_samples=0,
        **megatron,
    )
    monkeypatch.setattr(megatron_lm.MEGATRON_LM, "parsed_args", lambda: args)
    config = GAConfig(noise_scale=1)
    state = Installation(config=config, version="test")
    state.configure(config)
    return state


def save(state, iteration: int, non_persistent: bool) -> None:
    """Megatron-LM's save_checkpoint(iteration, ...) of nothing, through the extension's wrapper
    (the save row)."""
    from megatron_ga_ext.integration import megatron_lm

    megatron_lm.saving_sidecar(lambda *args, **kwargs: None, state)(
        iteration, [], None, None, 0, non_persistent_ckpt=non_persistent
    )


def load(state, iteration: int) -> None:
    """Megatron-LM's load_checkpoint(model, optimizer, scheduler) returning ``iteration``, through
    the wrapper."""
    from megatron_ga_ext.integration import megatron_lm

    megatron_lm.loading_sidecar(lambda *args, **kwargs: (iteration, 0), state)([], None, None)


def tracker(directory, iteration: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "latest_checkpointed_iteration.txt").write_text(str(iteration))


@pytest.mark.parametrize("explicit", [False, True])
def test_a_non_persistent_global_checkpoint_gets_its_sidecar_and_a_resume_reads_it(
    monkeypatch, tmp_path, explicit
):
    non_persistent = tmp_path / "np" if explicit else tmp_path / "save" / "non_persistent"
    extra = {"non_persistent_global_ckpt_dir": str(non_persistent)} if explicit else {}
    saving = installation(monkeypatch, tmp_path, non_persistent_ckpt_type="global", **extra)
    meter(saving).ema = ema(decay=0.95, updates=4)
    meter(saving).measurements = 4
    save(saving, 6, non_persistent=True)
    assert (
        sidecar_path(non_persistent, 6).is_file()
        and not sidecar_path(tmp_path / "save", 6).exists()
    )
    tracker(non_persistent, 6)
    tracker(
        tmp_path / "save", 4
    )  # an older persistent checkpoint: Megatron loads the non-persistent one
    resumed = installation(monkeypatch, tmp_path, non_persistent_ckpt_type="global", **extra)
    load(resumed, 6)
    assert meter(resumed).measurements == 4
    assert meter(resumed).ema.state_dict() == meter(saving).ema.state_dict()


def test_a_persistent_checkpoint_beside_non_persistent_ones_is_read_from_load(
    monkeypatch, tmp_path
):
    saving = installation(monkeypatch, tmp_path, non_persistent_ckpt_type="global")
    meter(saving).ema = ema(decay=0.95, updates=2)
    save(saving, 8, non_persistent=False)
    tracker(
        tmp_path / "save" / "non_persistent", 6
    )  # older: Megatron loads the persistent iteration 8
    tracker(tmp_path / "save", 8)
    resumed = installation(monkeypatch, tmp_path, non_persistent_ckpt_type="global")
    load(resumed, 8)
    assert meter(resumed).ema.updates == 2


def test_a_local_non_persistent_checkpoint_gets_none(monkeypatch, tmp_path):
    saving = installation(
        monkeypatch,
        tmp_path,
        non_persistent_ckpt_type="local",
        non_persistent_local_ckpt_dir=str(tmp_path / "local"),
    )
    save(saving, 6, non_persistent=True)
    assert not list(tmp_path.rglob(SIDECAR))


def test_a_resumed_warmup_reads_todays_sidecar(tmp_path, monkeypatch):
    """--ga-batch-size-warmup auto resumed from a version-2 sidecar (the format every release before
    the features loop wrote): its stages are live, at the loaded consumed samples, before the loop
    reads the batch."""
    from megatron.core import num_microbatches_calculator as calculators

    from megatron_ga_ext.core.schedule.step_schedule import StepSchedule
    from megatron_ga_ext.integration.calculator import StepScheduleCalculator

    live = StepScheduleCalculator(
        StepSchedule.constant(16), 1, 2
    )  # MBS 1 x DP 2, --global-batch-size 16
    monkeypatch.setattr(calculators, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", live)
    config = GAConfig(
        noise_scale=1, noise_scale_decay=0.95, batch_size_warmup="auto", batch_size_warmup_max=64
    )
    state = Installation(config=config, version="test")
    state.configure(config)
    write(tmp_path, 3, {**TODAYS, "stages": [[0, 16], [48, 32]]})
    state.after_load(str(tmp_path), 3, None, 64)
    assert (
        list(live.step_schedule.stages) == [(0, 16), (48, 32)]
        and live.get_current_global_batch_size() == 32
    )
    assert meter(state).measurements == 3 and meter(state).ema.state_dict() == EMA
