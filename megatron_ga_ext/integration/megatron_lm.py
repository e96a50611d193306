"""Megatron-LM's training loop (``megatron.training``) as a host loop: its functions the hook table
wraps, each onto an Installation phase (hooks.py's rows with ``host="megatron-lm"``; another host
loop gets a module like this one).

* ``parse_args``: the ``--ga-*`` flags, and token mode's ``--calculate-per-token-loss`` (below);
* ``update_train_iters`` / ``get_train_valid_test_num_samples``: the run length under a step
  schedule;
* ``training_log``: the noise-scale line printed after Megatron's;
* ``save_checkpoint`` / ``load_checkpoint``: the ``--ga-noise-scale`` EMAs kept next to the
  checkpoint (the sidecar), and warmup stages restored before the loop reads them.

Its run state (the parsed args, the global writers) is read here only: :class:`MegatronLM` is its
host (host.py), current wherever the args are parsed.

Each is only wrapped around the call (the bodies of the last three are not fingerprinted targets).

The parser makes the whole drop-in ``megatron_ga_ext.install()`` at the top of an unmodified
training script.

Megatron parses its command line in ``megatron.training.arguments.parse_args(extra_args_provider,
ignore_unknown_args)`` on every tested source: ``parse_and_validate_args`` (0.18 and later) looks it
up as a module global and ``initialize_megatron`` (0.16, 0.17) binds it by name, so replacing it
wherever it is bound reaches both. The replacement runs the script's own ``extra_args_provider``
first, then adds the flags the parser lacks (``config/args.py``); a script that passes
``megatron_ga_ext.args_provider(...)`` itself keeps working.

Token mode is what installing the extension asks for, and it needs Megatron's per-token loss
(``docs/reduction.md``): without ``--calculate-per-token-loss`` Megatron divides each micro-batch by
its own token count and DDP pre-divides by DP x CP. So a token-mode launch without the flag gets it
set on the parsed args, before Megatron validates them or builds anything from them, and the
start-up log says so once. ``--ga-loss-reduction microbatch`` keeps upstream's mean of means.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from megatron_ga_ext.config.args import args_provider
from megatron_ga_ext.config.flags import LOSS_REDUCTION
from megatron_ga_ext.config.megatron_args import MegatronArgs
from megatron_ga_ext.integration.calculator import live_step_calculator
from megatron_ga_ext.integration.host import NON_PERSISTENT_SUBDIR, Host, register
from megatron_ga_ext.logs import get_logger

if TYPE_CHECKING:
    from megatron_ga_ext.integration.installation import Installation

__all__ = [
    "ARGUMENTS",
    "MegatronLM",
    "loaded_directory",
    "loading_sidecar",
    "parser_module",
    "planned_num_samples",
    "planned_train_iters",
    "printing_after_training_log",
    "saved_directory",
    "saving_sidecar",
    "with_ga_flags",
]

logger = get_logger(__name__)

ARGUMENTS = "megatron.training.arguments"
TRAINING = "megatron.training.training"

ParseArgs = Callable[..., argparse.Namespace]
GLOBAL_VARS = "megatron.training.global_vars"
#: Megatron-LM's tracker file in a checkpoint directory: the last iteration saved there.
TRACKER = "latest_checkpointed_iteration.txt"


class MegatronLM(Host):
    """Megatron-LM's ``pretrain()``: its parsed args (``get_args()``) and global writers."""

    name = "Megatron-LM"

    def __init__(self) -> None:
        self._view: tuple[argparse.Namespace | None, MegatronArgs] = (None, MegatronArgs({}))
        """The last args :meth:`settings` was asked for and their view (the step's hooks read it
        often; the view reads the Namespace's values as they change)."""

    def parsed_args(self) -> argparse.Namespace | None:
        """The parsed args, or None before parsing (megatron.training is not imported for this)."""
        return getattr(sys.modules.get(GLOBAL_VARS), "_GLOBAL_ARGS", None)

    def settings(self) -> MegatronArgs:
        args = self.parsed_args()
        if self._view[0] is not args:
            self._view = (args, MegatronArgs.of(args))
        return self._view[1]

    def iteration(self) -> int | None:
        current = self.settings().curr_iteration
        return None if current is None else current + 1

    def consumed_samples(self) -> int | None:
        settings = self.settings()
        return settings.consumed_train_samples if settings.has("consumed_train_samples") else None

    def set_train_iters(self, iterations: int) -> None:
        args = self.parsed_args()
        if args is not None:
            args.train_iters = iterations

    def writers(self) -> tuple[Any, Any]:
        global_vars = sys.modules[GLOBAL_VARS]
        return global_vars.get_tensorboard_writer(), global_vars.get_wandb_writer()

    def prints_after_log(self) -> bool:
        return _prints_after(getattr(sys.modules.get(TRAINING), "training_log", None))


MEGATRON_LM = MegatronLM()
register(lambda: MEGATRON_LM if MEGATRON_LM.parsed_args() is not None else None)


def _prints_after(training_log: Callable | None) -> bool:
    """``training_log`` is wired to print a held line after its own (functools.wraps carries the
    mark through wrappers on top)."""
    return bool(getattr(training_log, "megatron_ga_ext_prints_after", False))


def parser_module(state: Installation) -> ModuleType | bool:
    """Megatron-LM's ``megatron.training.arguments``, whose ``parse_args`` the hook table replaces
    where it is bound; False (nothing to do) with megatron-core alone.

    Importing ``megatron.training`` configures the root logger and loads Megatron-LM's whole
    training loop, so it is imported here only for an install() that waits for Megatron's args (the
    training script imports it next anyway); an install() given its config patches the parser only
    where the script has loaded it already."""
    if ARGUMENTS not in sys.modules:
        if not state.waiting_for_args:
            # a config given outright (a megatron-core loop, verify): no Megatron-LM parse to join
            return False
        try:
            return importlib.import_module(ARGUMENTS)
        except ModuleNotFoundError as error:
            if error.name not in ("megatron.training", ARGUMENTS):
                raise  # Megatron-LM's training code is there, but something it imports is not
            return False  # megatron-core alone: Megatron-LM's parser is not there
    return sys.modules[ARGUMENTS]


def with_ga_flags(original: ParseArgs, state: Installation) -> ParseArgs:
    """``parse_args`` with the ``--ga-*`` flags, and ``--calculate-per-token-loss`` on in token
    mode."""
    announced = False

    @functools.wraps(original)
    def parse_args(
        extra_args_provider: Callable | None = None, ignore_unknown_args: bool = False
    ) -> argparse.Namespace:
        nonlocal announced
        if not state.active:
            return original(extra_args_provider, ignore_unknown_args)
        args = original(args_provider(extra_args_provider), ignore_unknown_args)
        mode = (
            MegatronArgs.of(args).get(LOSS_REDUCTION.dest)
            if state.waiting_for_args
            else state.config.loss_reduction
        )
        if mode == "token" and not args.calculate_per_token_loss:
            args.calculate_per_token_loss = True
            if not announced:
                announced = True
                logger.info(
                    "megatron-ga-ext: %s token turns on --calculate-per-token-loss: every "
                    "non-padding token of the global batch weighs the same (%s "
                    "microbatch keeps upstream's mean of means)",
                    LOSS_REDUCTION.flag,
                    LOSS_REDUCTION.flag,
                )
        return args

    return parse_args


def planned_train_iters(original: Callable, state: Installation) -> Callable:
    """``--train-samples`` under a step schedule: train_iters = the steps the schedule plans, while
    consumed < train_samples (upstream divides by a constant GBS on 0.16/0.17 and with a rampup). A
    calculator built where no hook saw it is adopted first (calculator_adoption.py): the run length
    is planned from the calculator that runs it."""

    @functools.wraps(original)
    def update_train_iters(args: argparse.Namespace) -> None:
        if state.active:
            state.adopt_live_calculator("Megatron-LM's update_train_iters")
        calculator = live_step_calculator()
        if not state.active or calculator is None or args.train_iters or not args.train_samples:
            original(args)
            return
        iterations, samples = calculator.plan(args.train_samples)
        args.train_iters = iterations
        logger.info(
            "step batch-size schedule: --train-samples %d takes %d iterations (%d samples)",
            args.train_samples,
            iterations,
            samples,
        )

    return update_train_iters


def planned_num_samples(original: Callable, state: Installation) -> Callable:
    """The training dataset holds every sample the planned steps consume (the last step may pass
    --train-samples)."""

    @functools.wraps(original)
    def get_train_valid_test_num_samples(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        train_samples = MEGATRON_LM.settings().train_samples
        planned = state.planned_samples(train_samples)
        if planned is None or result[0] != train_samples:
            return result
        return (max(result[0], planned), *result[1:])

    return get_train_valid_test_num_samples


def printing_after_training_log(original: Callable, state: Installation) -> Callable:
    """``training_log``: the noise-scale line of the iteration printed after it, so it follows
    Megatron's iteration line (the measurement is read in the optimizer step, before). Wiring it
    makes the meter hold its lines."""

    @functools.wraps(original)
    def training_log(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if state.active:
            state.after_log()
        return result

    # read by the host (MegatronLM.prints_after_log); gone with the patch
    training_log.megatron_ga_ext_prints_after = True  # type: ignore[attr-defined]
    return training_log


def saving_sidecar(original: Callable, state: Installation) -> Callable:
    """``save_checkpoint(iteration, ...)``: the sidecar after it, where Megatron put the
    checkpoint."""

    @functools.wraps(original)
    def save_checkpoint(iteration: int, *args: Any, **kwargs: Any) -> Any:
        result = original(iteration, *args, **kwargs)
        if state.active:
            state.after_save(
                saved_directory(
                    MEGATRON_LM.settings(), bool(kwargs.get("non_persistent_ckpt", False))
                ),
                iteration,
            )
        return result

    return save_checkpoint


def loading_sidecar(original: Callable, state: Installation) -> Callable:
    """``load_checkpoint(model, optimizer, opt_param_scheduler, load_arg='load', ...)``, which
    returns (iteration, flops): the sidecar of that iteration read after it, from where Megatron
    loaded it."""

    @functools.wraps(original)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        view = MEGATRON_LM.settings()
        iteration = result[0] if isinstance(result, tuple) and result else view.iteration
        if state.active and isinstance(iteration, int) and iteration > 0:
            load_arg = kwargs.get("load_arg", args[3] if len(args) > 3 else "load")
            state.after_load(
                loaded_directory(view, load_arg, iteration),
                iteration,
                kwargs.get("opt_param_scheduler", args[2] if len(args) > 2 else None),
                view.consumed_train_samples,
            )
        return result

    return load_checkpoint


def saved_directory(args: MegatronArgs, non_persistent: bool) -> str | None:
    """Where ``save_checkpoint`` put its checkpoint: ``--save``, or for a non-persistent global one
    ``--non-persistent-global-ckpt-dir`` (default ``<--save>/non_persistent``). None where there is
    no such directory: no ``--save``, or a local non-persistent checkpoint (per-rank files in
    Megatron's local checkpoint manager, no ``iter_NNNNNNN`` directory; --ga-batch-size-warmup auto
    refuses it at start-up)."""
    save = args.directory("save")
    if not non_persistent:
        return save
    if args.get("non_persistent_ckpt_type") != "global":
        return None
    return args.get("non_persistent_global_ckpt_dir") or (
        None if save is None else os.path.join(save, NON_PERSISTENT_SUBDIR)
    )


def loaded_directory(args: MegatronArgs, load_arg: str, iteration: int) -> str | None:
    """Where ``load_checkpoint`` read ``iteration`` from: its non-persistent global directory
    (``--non-persistent-global-ckpt-dir``, or ``<args.load_arg>/non_persistent``) where that
    directory's tracker names ``iteration`` (upstream's ``_load_base_checkpoint`` prefers it when it
    is not older than the persistent one), else ``args.<load_arg>``."""
    load = args.directory(load_arg)
    if args.get("non_persistent_ckpt_type") == "global":
        explicit = args.get("non_persistent_global_ckpt_dir")
        candidate = (
            explicit if explicit or load is None else os.path.join(load, NON_PERSISTENT_SUBDIR)
        )
        if candidate and _tracked_iteration(Path(candidate) / TRACKER) == iteration:
            return candidate
    return load


def _tracked_iteration(tracker: Path) -> int | None:
    """The iteration a Megatron tracker file names; None where there is none (or it says
    ``release``)."""
    try:
        return int(tracker.read_text().strip())
    except (OSError, ValueError):
        return None
