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
    with pytest.raises(NoiseScaleError, match=r"is not a version-1 sidecar"):
        load_sidecar(meter(), tmp_path, 7)
