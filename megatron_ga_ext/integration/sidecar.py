"""The checkpoint sidecar: each feature's state (features/) beside the host loop's checkpoint, so a
resumed run continues where the saved one stood.

    <checkpoint directory>/iter_<iteration:07d>/megatron_ga_ext_noise_scale.json {"version": 3,
        "iteration": I, "features": {<feature name>: {"version": V, "state": {...}}, ...}}

Each feature's state carries its own layout version, read by the feature
(``Feature.load_state_dict``). The file keeps the name of the releases where only the noise scale
had state, and every sidecar they wrote is read:

* version 1: ``{"version": 1, "iteration", "ema", "measurements"}`` (and ``stages``, from releases
  that added the warmup's stages before the version said so);
* version 2: ``{"version": 2, "iteration", "ema", "measurements", "stages"}``;

as version 3 with the noise scale's ``{"ema", "measurements"}`` and the batch schedule's
``{"stages"}`` (each at its layout 1). The checkpoint directory is where the host loop put that
checkpoint (its adapter says: megatron_lm.saved_directory, bridge_loop.saved_directory).

Written after the loop's ``save_checkpoint`` on the last rank (every feature's state is the same on
every rank: the noise scale folds one all-reduced vector, the warmup decides from it), read by every
rank after ``load_checkpoint``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from megatron_ga_ext.errors import NoiseScaleError

__all__ = ["SIDECAR", "SIDECAR_VERSION", "read_sidecar", "sidecar_path", "write_sidecar"]

#: The sidecar's name in the loop's ``iter_NNNNNNN`` checkpoint directory.
SIDECAR = "megatron_ga_ext_noise_scale.json"
#: The version of the sidecar's layout this release writes.
SIDECAR_VERSION = 3
_BASE_KEYS = frozenset({"version", "iteration", "ema", "measurements"})
#: The key sets each version it reads may have.
SIDECAR_KEYS = {
    1: (_BASE_KEYS, _BASE_KEYS | {"stages"}),
    2: (_BASE_KEYS | {"stages"},),
    3: (frozenset({"version", "iteration", "features"}),),
}
#: Whom to ask about a sidecar that cannot be read.
_FIX = (
    "delete it to start the noise-scale EMAs (and the batch-size warmup) afresh, or resume with "
    "the release that wrote it"
)


def sidecar_path(directory: str | os.PathLike, iteration: int) -> Path:
    """``<directory>/iter_<iteration:07d>/megatron_ga_ext_noise_scale.json``: next to the loop's
    checkpoint."""
    return Path(directory) / f"iter_{iteration:07d}" / SIDECAR


def write_sidecar(
    directory: str | os.PathLike, iteration: int, features: dict[str, tuple[int, Any]]
) -> Path | None:
    """Write ``features`` ({name: (version, state)}) next to the checkpoint of ``iteration``, on the
    last rank (the one that reports). Returns the path written, or None on the other ranks."""
    if not _last_rank():
        return None
    path = sidecar_path(directory, iteration)
    path.parent.mkdir(parents=True, exist_ok=True)  # an async save may not have made it yet
    parts = {
        name: {"version": version, "state": state} for name, (version, state) in features.items()
    }
    saved = {"version": SIDECAR_VERSION, "iteration": iteration, "features": parts}
    partial = path.with_name(
        path.name + ".partial"
    )  # a crash mid-write leaves no half file under the real name
    partial.write_text(json.dumps(saved) + "\n")
    partial.replace(path)
    return path


def read_sidecar(path: Path) -> dict[str, tuple[int, Any]] | None:
    """Each feature's part of the sidecar at ``path`` ({name: (version, state)}), or None where
    there is none. One that cannot be read raises NoiseScaleError naming the file and what this
    release reads."""
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise NoiseScaleError(
            f"the noise-scale state {path} cannot be read ({error}); {_FIX}."
        ) from error
    version = saved.get("version") if isinstance(saved, dict) else None
    if isinstance(version, bool) or not isinstance(version, int) or version not in SIDECAR_KEYS:
        versions = ", ".join(str(v) for v in SIDECAR_KEYS)
        raise NoiseScaleError(
            f"the noise-scale state {path} has version {version!r}; this release reads "
            f"{versions}: {_FIX}."
        )
    allowed = SIDECAR_KEYS[version]
    if set(saved) not in allowed:
        raise NoiseScaleError(
            f"the noise-scale state {path} is a version-{version} sidecar with keys "
            f"{sorted(saved)}, not {sorted(allowed[-1])}: {_FIX}."
        )
    if version < 3:  # the noise scale's and the warmup's state, each at its layout 1
        return {
            "noise_scale": (1, {"ema": saved["ema"], "measurements": saved["measurements"]}),
            "batch_schedule": (1, {"stages": saved.get("stages")}),
        }
    parts = saved["features"]
    if not isinstance(parts, dict) or not all(_is_part(part) for part in parts.values()):
        raise NoiseScaleError(
            f"the noise-scale state {path} holds features {parts!r}, not {{name: {{version, "
            f"state}}}}: {_FIX}."
        )
    return {name: (part["version"], part["state"]) for name, part in parts.items()}


def _is_part(part: object) -> bool:
    return (
        isinstance(part, dict)
        and set(part) == {"version", "state"}
        and type(part["version"]) is int
    )


def _last_rank() -> bool:
    """This rank writes the sidecar: the last, where Megatron prints and keeps its writers (as the
    noise scale reports)."""
    if not torch.distributed.is_initialized():
        return True
    return bool(torch.distributed.get_rank() == torch.distributed.get_world_size() - 1)
