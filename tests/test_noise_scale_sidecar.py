"""integration/noise_scale_sidecar.py: the meter's EMAs and the warmup's stages survive a checkpoint."""

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
from megatron_ga_ext.core.noise_scale import NoiseEstimate, NoiseScaleEMA
from megatron_ga_ext.errors import NoiseScaleError
from megatron_ga_ext.integration.noise_scale_sidecar import (
    SIDECAR,
    load_sidecar,
    save_sidecar,
    sidecar_path,
)


def meter(decay: float = 0.9, updates: int = 0) -> SimpleNamespace:
    """What the sidecar reads and writes of a NoiseScaleMeter: its EMAs and its measurement count."""
    ema = NoiseScaleEMA(decay=decay)
    for step in range(updates):
        ema.update(NoiseEstimate(grad_sq=1.0 + step, trace_sigma=10.0, tokens=64))
    return SimpleNamespace(ema=ema, measurements=updates)


def test_the_path_is_next_to_megatrons_checkpoint(tmp_path):
    assert sidecar_path(tmp_path, 3) == tmp_path / "iter_0000003" / SIDECAR


def test_a_saved_sidecar_continues_the_emas(tmp_path):
    saved = meter(updates=3)
    path = save_sidecar(saved, tmp_path, 3, stages=[[0, 16], [80, 32]])
    assert path == sidecar_path(tmp_path, 3) and not path.with_name(path.name + ".partial").exists()
    resumed = meter()
    state = load_sidecar(resumed, tmp_path, 3)
    assert state["stages"] == [[0, 16], [80, 32]] and resumed.measurements == 3
    assert resumed.ema.state_dict() == saved.ema.state_dict()


def test_another_decay_starts_afresh_and_keeps_the_stages(tmp_path):
    save_sidecar(meter(decay=0.9, updates=2), tmp_path, 5, stages=[[0, 16]])
    resumed = meter(decay=0.5)
    assert load_sidecar(resumed, tmp_path, 5)["stages"] == [[0, 16]]
    assert resumed.measurements == 0 and resumed.ema.updates == 0


def test_no_sidecar_and_a_bad_one(tmp_path):
    assert load_sidecar(meter(), tmp_path, 7) is None
    path = sidecar_path(tmp_path, 7)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": 99}))
    with pytest.raises(NoiseScaleError, match=r"has version 99; this release reads versions 1 and 2"):
        load_sidecar(meter(), tmp_path, 7)


def write(tmp_path, iteration: int, state: dict):
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


def test_the_sidecar_is_version_2_with_stages(tmp_path):
    path = save_sidecar(meter(updates=1), tmp_path, 2, stages=[[0, 16]])
    assert json.loads(path.read_text())["version"] == 2


@pytest.mark.parametrize("extra", [{}, {"stages": [[0, 16], [48, 32]]}])
def test_a_version_1_sidecar_is_read(tmp_path, extra):
    """Version 1 kept the EMAs only (and, written before the version said so, the stages)."""
    write(tmp_path, 3, {"version": 1, "iteration": 3, "ema": EMA, "measurements": 3, **extra})
    resumed = meter(decay=0.95)
    state = load_sidecar(resumed, tmp_path, 3)
    assert state["stages"] == extra.get("stages") and resumed.measurements == 3 and resumed.ema.updates == 3


def test_the_docs_example_is_read(tmp_path):
    from pathlib import Path

    docs = (Path(__file__).parents[1] / "docs" / "noise-scale.md").read_text()
    example = docs[docs.index("megatron_ga_ext_noise_scale.json`") :].split("```json\n", 1)[1].split("\n```")[0]
    state = json.loads(example)
    write(tmp_path, state["iteration"], state)
    resumed = meter(decay=state["ema"]["decay"])
    assert load_sidecar(resumed, tmp_path, state["iteration"])["version"] == 2
    assert resumed.measurements == state["measurements"]


@pytest.mark.parametrize(
    "state, message",
    [
        (
            {"version": 3, "iteration": 3, "ema": EMA, "measurements": 3, "stages": None},
            r"has version 3; this release reads versions 1 and 2",
        ),
        ({"version": "2"}, r"has version '2'; this release reads versions 1 and 2"),
        ([1, 2], r"has version None; this release reads versions 1 and 2"),
        (
            {"version": 2, "iteration": 3, "ema": EMA, "measurements": 3},
            r"is a version-2 sidecar with keys \['ema', 'iteration', 'measurements', 'version'\], not "
            r"\['ema', 'iteration', 'measurements', 'stages', 'version'\]",
        ),
    ],
)
def test_an_unknown_version_is_refused_naming_the_file(tmp_path, state, message):
    path = write(tmp_path, 3, state)
    with pytest.raises(NoiseScaleError, match=rf"^the noise-scale state {path} {message}"):
        load_sidecar(meter(), tmp_path, 3)


# -- non-persistent checkpoints: the sidecar where Megatron-LM put the checkpoint, read where it loaded it from --


def installation(monkeypatch, tmp_path, **megatron):
    """An Installation with the meter (and the warmup), under Megatron's args ``megatron``."""
    import argparse

    from megatron_ga_ext import GAConfig
    from megatron_ga_ext.integration import megatron_lm
    from megatron_ga_ext.integration.installation import Installation

    args = argparse.Namespace(
        save=str(tmp_path / "save"), load=str(tmp_path / "save"), consumed_train_samples=0, **megatron
    )
    monkeypatch.setattr(megatron_lm.MEGATRON_LM, "parsed_args", lambda: args)
    config = GAConfig(noise_scale=1)
    state = Installation(config=config, version="test")
    state.configure(config)
    return state


def save(state, iteration: int, non_persistent: bool) -> None:
    """Megatron-LM's save_checkpoint(iteration, ...) of nothing, through the extension's wrapper (the save row)."""
    from megatron_ga_ext.integration import megatron_lm

    megatron_lm.saving_sidecar(lambda *args, **kwargs: None, state)(
        iteration, [], None, None, 0, non_persistent_ckpt=non_persistent
    )


def load(state, iteration: int) -> None:
    """Megatron-LM's load_checkpoint(model, optimizer, scheduler) returning ``iteration``, through the wrapper."""
    from megatron_ga_ext.integration import megatron_lm

    megatron_lm.loading_sidecar(lambda *args, **kwargs: (iteration, 0), state)([], None, None)


def tracker(directory, iteration: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "latest_checkpointed_iteration.txt").write_text(str(iteration))


@pytest.mark.parametrize("explicit", [False, True])
def test_a_non_persistent_global_checkpoint_gets_its_sidecar_and_a_resume_reads_it(monkeypatch, tmp_path, explicit):
    non_persistent = tmp_path / "np" if explicit else tmp_path / "save" / "non_persistent"
    extra = {"non_persistent_global_ckpt_dir": str(non_persistent)} if explicit else {}
    saving = installation(monkeypatch, tmp_path, non_persistent_ckpt_type="global", **extra)
    saving.noise_scale.ema = meter(decay=0.95, updates=4).ema
    saving.noise_scale.measurements = 4
    save(saving, 6, non_persistent=True)
    assert sidecar_path(non_persistent, 6).is_file() and not sidecar_path(tmp_path / "save", 6).exists()
    tracker(non_persistent, 6)
    tracker(tmp_path / "save", 4)  # an older persistent checkpoint: Megatron loads the non-persistent one
    resumed = installation(monkeypatch, tmp_path, non_persistent_ckpt_type="global", **extra)
    load(resumed, 6)
    assert resumed.noise_scale.measurements == 4
    assert resumed.noise_scale.ema.state_dict() == saving.noise_scale.ema.state_dict()


def test_a_persistent_checkpoint_beside_non_persistent_ones_is_read_from_load(monkeypatch, tmp_path):
    saving = installation(monkeypatch, tmp_path, non_persistent_ckpt_type="global")
    saving.noise_scale.ema = meter(decay=0.95, updates=2).ema
    save(saving, 8, non_persistent=False)
    tracker(tmp_path / "save" / "non_persistent", 6)  # older: Megatron loads the persistent iteration 8
    tracker(tmp_path / "save", 8)
    resumed = installation(monkeypatch, tmp_path, non_persistent_ckpt_type="global")
    load(resumed, 8)
    assert resumed.noise_scale.ema.updates == 2


def test_a_local_non_persistent_checkpoint_gets_none(monkeypatch, tmp_path):
    saving = installation(
        monkeypatch, tmp_path, non_persistent_ckpt_type="local", non_persistent_local_ckpt_dir=str(tmp_path / "local")
    )
    save(saving, 6, non_persistent=True)
    assert not list(tmp_path.rglob(SIDECAR))
