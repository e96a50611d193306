"""The noise-scale meter's checkpoint sidecar: a resumed run continues the EMAs and --ga-batch-size-warmup auto's
stages.

    <checkpoint directory>/iter_<iteration:07d>/megatron_ga_ext_noise_scale.json
        {"version": 2, "iteration": I, "ema": <NoiseScaleEMA.state_dict()>, "measurements": M,
         "stages": [[threshold_samples, GBS], ...] or null}

Version 1 had no ``stages`` (the EMAs only); it is read as a sidecar without stages. The checkpoint directory is
where the host loop put that checkpoint (its adapter says: megatron_lm.saved_directory, bridge_loop.saved_directory).

Written after Megatron's ``save_checkpoint`` on the last rank, by ``Installation.after_save`` (every rank folds the
same all-reduced vector, so every rank holds the same EMAs), read by every rank after ``load_checkpoint``. The EMAs
are kept only under one ``--ga-noise-scale-decay``: the bias correction 1 - decay^n holds for one decay throughout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megatron_ga_ext.core.noise_scale import NoiseScaleEMA
from megatron_ga_ext.errors import NoiseScaleError
from megatron_ga_ext.integration.noise_scale import NoiseScaleMeter
from megatron_ga_ext.integration.noise_scale_report import last_rank
from megatron_ga_ext.logs import get_logger

__all__ = [
    "SIDECAR",
    "SIDECAR_VERSION",
    "load_sidecar",
    "save_sidecar",
    "sidecar_path",
]

logger = get_logger(__name__)

#: The sidecar's name in Megatron's ``iter_NNNNNNN`` checkpoint directory.
SIDECAR = "megatron_ga_ext_noise_scale.json"
#: The version of the sidecar's layout this release writes.
SIDECAR_VERSION = 2
_BASE_KEYS = frozenset({"version", "iteration", "ema", "measurements"})
#: The key sets each version it reads may have: 1 kept the EMAs only (and, written by releases that added
#: ``stages`` before the version said so, the stages too), 2 the EMAs and the warmup's ``stages``.
SIDECAR_KEYS = {1: (_BASE_KEYS, _BASE_KEYS | {"stages"}), 2: (_BASE_KEYS | {"stages"},)}


def sidecar_path(directory: str | os.PathLike, iteration: int) -> Path:
    """``<directory>/iter_<iteration:07d>/megatron_ga_ext_noise_scale.json``: next to Megatron's checkpoint."""
    return Path(directory) / f"iter_{iteration:07d}" / SIDECAR


def save_sidecar(
    meter: NoiseScaleMeter, directory: str | os.PathLike, iteration: int, stages: list[list[int]] | None = None
) -> Path | None:
    """Write the meter's EMAs and measurement count next to Megatron's checkpoint of ``iteration``, on the last rank
    (the one that reports; every rank holds the same EMAs, since they are folded from one all-reduced vector), and
    ``stages``, the step schedule --ga-batch-size-warmup auto has written so far. Returns the path written, or None
    on the other ranks."""
    if not last_rank():
        return None
    path = sidecar_path(directory, iteration)
    path.parent.mkdir(parents=True, exist_ok=True)  # an async save may not have made it yet
    state = {
        "version": SIDECAR_VERSION,
        "iteration": iteration,
        "ema": meter.ema.state_dict(),
        "measurements": meter.measurements,
        "stages": stages,
    }
    partial = path.with_name(path.name + ".partial")  # a crash mid-write leaves no half file under the real name
    partial.write_text(json.dumps(state) + "\n")
    partial.replace(path)
    return path


def load_sidecar(meter: NoiseScaleMeter, directory: str | os.PathLike, iteration: int) -> dict[str, Any] | None:
    """Continue the EMAs saved with Megatron's checkpoint of ``iteration`` (every rank reads it); the sidecar read, or
    None with a log line where there is none (a checkpoint saved without ``--ga-noise-scale``). Kept under another
    ``--ga-noise-scale-decay``, the EMAs start afresh (its ``stages`` still hold). A sidecar that cannot be read
    raises NoiseScaleError."""
    path = sidecar_path(directory, iteration)
    if not path.is_file():
        logger.info("megatron-ga-ext: no noise-scale state at %s: the noise-scale EMAs start afresh", path)
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise NoiseScaleError(
            f"the noise-scale state {path} cannot be read ({error}); delete it to start the EMAs afresh."
        ) from error
    state = _versioned(state, path)
    measurements = state["measurements"]
    if isinstance(measurements, bool) or not isinstance(measurements, int) or measurements < 0:
        raise NoiseScaleError(
            f"the noise-scale state {path} has measurements {measurements!r}, not a whole "
            "number >= 0; delete it to start the EMAs afresh."
        )
    ema = NoiseScaleEMA.from_state_dict(state["ema"])
    if ema.decay != meter.ema.decay:
        # The bias correction 1 - decay^n holds for one decay throughout: mixing two would misweigh the saved part.
        logger.warning(
            "megatron-ga-ext: the noise-scale EMAs in %s were kept with --ga-noise-scale-decay %s, this "
            "run has %s: they start afresh",
            path,
            ema.decay,
            meter.ema.decay,
        )
        return state
    meter.ema = ema
    meter.measurements = measurements
    logger.info("megatron-ga-ext: noise-scale EMAs continued from %s (%d measurements)", path, ema.updates)
    return state


def _versioned(state: object, path: Path) -> dict[str, Any]:
    """``state`` as the latest version: a version-1 sidecar gets ``stages`` None (it kept none). Raises
    NoiseScaleError for another version, or keys that are not its version's, naming the file and what it reads."""
    versions = " and ".join(str(v) for v in SIDECAR_KEYS)
    version = state.get("version") if isinstance(state, dict) else None
    if isinstance(version, bool) or not isinstance(version, int) or version not in SIDECAR_KEYS:
        raise NoiseScaleError(
            f"the noise-scale state {path} has version {version!r}; this release reads versions "
            f"{versions}. Delete it to start the EMAs afresh, or resume with the release that "
            "wrote it."
        )
    allowed = SIDECAR_KEYS[version]
    if set(state) not in allowed:
        raise NoiseScaleError(
            f"the noise-scale state {path} is a version-{version} sidecar with keys "
            f"{sorted(state)}, not {sorted(allowed[-1])}; delete it to start the EMAs afresh."
        )
    return {"stages": None, **state}
