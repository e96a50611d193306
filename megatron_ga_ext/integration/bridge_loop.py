"""Megatron-Bridge's training loop (``megatron.bridge.training``) as a host loop: its functions the
hook table wraps, each onto an Installation phase (hooks.py's rows with ``host="megatron-bridge"``),
as megatron_lm.py does for Megatron-LM's. Wired once Bridge's modules are loaded (``from
megatron.bridge.training.pretrain import pretrain`` loads them); importing this module imports
nothing of Bridge's.

* ``train_step(..., global_state, ...)`` (train.py's global, which ``train()`` reads at its start):
  Bridge's ``GlobalState`` is the run state during the step, where Megatron-LM keeps its parsed args
  and global writers:
  :class:`Bridge`, the host (host.py) of the step, reads the iteration (``train_state.step`` + 1), the consumed
  samples, the settings and the TensorBoard/W&B writers there;
* ``gpt_step.get_batch`` (gpt_step.py's global): in token mode its loss mask is kept for the model
  call that follows, which Bridge's GPT step makes without it (Bridge #6103), for the MoE and MTP
  rules;
* ``training_log`` (bound by name in train.py): the noise-scale line printed after Bridge's;
* ``save_checkpoint(state, ...)`` / ``load_checkpoint(state, ...)`` (checkpointing.py's globals,
  which Bridge's checkpoint manager calls): the sidecar beside the checkpoint Bridge saved, read
  from the one it loaded (with the GlobalState set, so restored warmup stages replan
  ``train.train_iters``);
* ``data.loaders.get_train_valid_test_num_samples(cfg)``: a training dataset that holds every sample
  the planned steps consume.

Each is only wrapped around the call.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_ga_ext.config.megatron_args import MegatronArgs
from megatron_ga_ext.integration.host import NON_PERSISTENT_SUBDIR, Host, hosting

if TYPE_CHECKING:
    from megatron_ga_ext.integration.installation import Installation

__all__ = [
    "CHECKPOINTING",
    "Bridge",
    "GPT_STEP",
    "LOADERS",
    "TRAIN",
    "loaded_directory",
    "loading_sidecar",
    "planned_num_samples",
    "saved_directory",
    "saving_sidecar",
    "stepping",
]

TRAIN = "megatron.bridge.training.train"
GPT_STEP = "megatron.bridge.training.gpt_step"
CHECKPOINTING = "megatron.bridge.training.checkpointing"
LOADERS = "megatron.bridge.data.loaders"


class Bridge(Host):
    """Megatron-Bridge's loop during one call that hands it its ``GlobalState`` (a training step, a
    checkpoint load): the run state Bridge keeps where Megatron-LM keeps its parsed args and global
    writers."""

    name = "Megatron-Bridge"

    def __init__(self, global_state: Any) -> None:
        self.state = global_state

    def settings(self) -> MegatronArgs:
        """The container's ``train``, ``scheduler`` and ``model`` fields, which have Megatron-LM's
        names."""
        values: dict[str, Any] = {}
        for section in (self.state.cfg.train, self.state.cfg.scheduler, self.state.cfg.model):
            for field in dataclasses.fields(section):
                values.setdefault(field.name, getattr(section, field.name))
        return MegatronArgs(values)

    def iteration(self) -> int | None:
        return int(self.state.train_state.step) + 1

    def consumed_samples(self) -> int | None:
        return int(self.state.train_state.consumed_train_samples)

    def set_train_iters(self, iterations: int) -> None:
        self.state.cfg.train.train_iters = iterations

    def writers(self) -> tuple[Any, Any]:
        return self.state.tensorboard_logger, self.state.wandb_logger

    def prints_after_log(self) -> bool:
        """Bridge's ``training_log`` is wired to print after its own, and runs
        (``logger.skip_train_metrics_log`` skips it)."""
        if self.state.cfg.logger.skip_train_metrics_log:
            return False
        training_log = getattr(sys.modules.get(TRAIN), "training_log", None)
        return bool(getattr(training_log, "megatron_ga_ext_prints_after", False))


def stepping(original: Callable, state: Installation) -> Callable:
    """``train_step(forward_step_func, data_iterator, model, optimizer, scheduler, global_state,
    ...)``: the step runs with ``global_state`` as the run state the step's hooks read."""

    @functools.wraps(original)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        with hosting(Bridge(_argument(args, kwargs, "global_state", 5))):
            return original(*args, **kwargs)

    return train_step


def saving_sidecar(original: Callable, state: Installation) -> Callable:
    """``save_checkpoint(state, model, optimizer, opt_param_scheduler, ...,
    non_persistent_ckpt=False, ...)``: the sidecar after it, in the directory Bridge saved the
    iteration ``state.train_state.step`` to."""

    @functools.wraps(original)
    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if state.active:
            global_state = _argument(args, kwargs, "state", 0)
            non_persistent = bool(_argument(args, kwargs, "non_persistent_ckpt", 8, False))
            state.after_save(
                saved_directory(global_state.cfg.checkpoint, non_persistent),
                global_state.train_state.step,
            )
        return result

    return save_checkpoint


def loading_sidecar(original: Callable, state: Installation) -> Callable:
    """``load_checkpoint(state, model, optimizer, opt_param_scheduler, ...)``, which returns
    (iteration, flops): the sidecar of that iteration read after it, from the directory Bridge
    loaded it from."""

    @functools.wraps(original)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        iteration = result[0]
        if state.active and isinstance(iteration, int) and iteration > 0:
            global_state = _argument(args, kwargs, "state", 0)
            with hosting(
                Bridge(global_state)
            ):  # restored warmup stages replan Bridge's train.train_iters
                state.after_load(
                    loaded_directory(global_state.cfg.checkpoint, iteration),
                    iteration,
                    _argument(args, kwargs, "opt_param_scheduler", 3),
                    global_state.train_state.consumed_train_samples,
                )
        return result

    return load_checkpoint


def _argument(
    args: tuple, kwargs: dict[str, Any], name: str, index: int, default: Any = None
) -> Any:
    """A call's argument ``name``, passed by keyword (as Bridge's checkpoint manager passes them) or
    at ``index``."""
    return kwargs[name] if name in kwargs else args[index] if len(args) > index else default


def planned_num_samples(original: Callable, state: Installation) -> Callable:
    """``get_train_valid_test_num_samples(cfg)``: the training dataset holds every sample the
    planned steps consume (Bridge sizes it at ``train.train_samples``; under --ga-batch-size-warmup
    auto the last step may pass it)."""

    @functools.wraps(original)
    def get_train_valid_test_num_samples(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(cfg, *args, **kwargs)
        planned = state.planned_samples(cfg.train.train_samples)
        if planned is None or result[0] != cfg.train.train_samples:
            return result
        return (max(result[0], planned), *result[1:])

    return get_train_valid_test_num_samples


def saved_directory(checkpoint: Any, non_persistent: bool) -> str | None:
    """Where Bridge's ``save_checkpoint`` put its ``iter_NNNNNNN`` directory: ``checkpoint.save``,
    or for a global non-persistent checkpoint ``checkpoint.non_persistent_global_ckpt_dir`` (default
    ``<save>/non_persistent``); None for a local non-persistent one (per-rank files, no such
    directory)."""
    save: str | None = checkpoint.save
    if not non_persistent:
        return save
    if checkpoint.non_persistent_ckpt_type != "global":
        return None
    explicit: str | None = checkpoint.non_persistent_global_ckpt_dir
    return explicit or os.path.join(checkpoint.save, NON_PERSISTENT_SUBDIR)


def loaded_directory(checkpoint: Any, iteration: int) -> str | None:
    """Where Bridge's ``load_checkpoint`` read ``iteration`` from: the first of its global
    non-persistent directories and ``checkpoint.load`` (Bridge prefers a non-persistent checkpoint
    not older than the persistent one) that holds ``iter_<iteration:07d>``; the parent of a
    ``checkpoint.load`` that names that directory itself. None where none does (a pretrained
    checkpoint: Bridge starts its count at 0 there)."""
    load = checkpoint.load
    candidates = []
    if checkpoint.non_persistent_ckpt_type == "global":
        explicit = checkpoint.non_persistent_global_ckpt_dir
        roots = [] if explicit else [root for root in (checkpoint.save, load) if root]
        candidates += (
            [explicit]
            if explicit
            else [os.path.join(root, NON_PERSISTENT_SUBDIR) for root in roots]
        )
    if load:
        candidates += [load, os.path.dirname(os.path.normpath(load))]
    name = f"iter_{iteration:07d}"
    return next((directory for directory in candidates if (Path(directory) / name).is_dir()), None)
