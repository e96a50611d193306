"""The host port: what the extension asks of the training loop that runs it, and nothing else.

A host loop keeps the run's state its own way: Megatron-LM's ``pretrain()`` in its parsed args and
global writers (megatron_lm.py), Megatron-Bridge's in a ``GlobalState`` handed to each step
(bridge_loop.py), a user's own loop over megatron-core (the pattern RL frameworks use) wherever it
likes (core_loop.py). The features ask a :class:`Host`; only those three adapters read a host's
state (tests/test_architecture.py holds every other module to that).

    current_host()   the host of the call in progress: one that announced itself for it (:func:`hosting`: Bridge's
                     step and checkpoint load), else one whose state exists (:func:`register`:
                     Megatron-LM's parsed args), else the megatron-core loop (:func:`use_core_loop`;
                     by default one that knows nothing)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from megatron_ga_ext.config.megatron_args import MegatronArgs

__all__ = ["NON_PERSISTENT_SUBDIR", "Host", "current_host", "hosting", "register", "use_core_loop"]

#: The subdirectory of the save (and load) directory both loops keep global non-persistent
#: checkpoints in (``_NON_PERSISTENT_CKPT_SUBDIR`` in Megatron-LM's and in Megatron-Bridge's
#: checkpointing.py).
NON_PERSISTENT_SUBDIR = "non_persistent"


class Host:
    """A training loop as the features see it. This base knows nothing of the loop: every answer is
    "not known" (None, empty), every request does nothing, and a line is printed. An adapter
    overrides what its loop keeps."""

    name = "megatron-core loop"

    def parsed_args(self) -> argparse.Namespace | None:
        """Megatron-LM's parsed args (the source of the ``--ga-*`` configuration), or None."""
        return None

    def settings(self) -> MegatronArgs:
        """The run's settings under Megatron-LM's argument names (what a loop does not keep is
        absent)."""
        return MegatronArgs({})

    def iteration(self) -> int | None:
        """The iteration being trained, numbered as Megatron's log numbers it (the first is 1)."""
        return None

    def consumed_samples(self) -> int | None:
        """The samples consumed before the step in progress (the loop adds the step's batch after
        it)."""
        return None

    def set_train_iters(self, iterations: int) -> None:
        """The loop's run length, which it reads at every iteration."""

    def writers(self) -> tuple[Any, Any]:
        """The loop's TensorBoard and W&B writers (each made on the last rank only), or None."""
        return None, None

    def prints_after_log(self) -> bool:
        """Whether the loop's ``training_log`` is wired to print a held line after its own and runs
        after this step (so a line the step reports waits for it)."""
        return False

    def record_metrics(self, scalars: dict[str, float], iteration: int) -> None:
        """``scalars`` to the loop's TensorBoard and W&B writers, at ``iteration``."""
        tensorboard, wandb = self.writers()
        if tensorboard is not None:
            for name, value in scalars.items():
                tensorboard.add_scalar(name, value, iteration)
        if wandb is not None:
            wandb.log(scalars, iteration)

    def print_line(self, line: str) -> None:
        """A line where the loop prints its own (standard output, as Megatron prints)."""
        print(line, flush=True)


#: Hosts that announced themselves for a call in progress (innermost last), the finders of hosts
#: whose state exists, and the megatron-core loop.
_announced: list[Host] = []
_finders: list[Callable[[], Host | None]] = []
_core_loop: list[Host] = [Host()]


@contextmanager
def hosting(host: Host) -> Iterator[None]:
    """``host`` is the current host while the block runs (a loop that hands its state to each
    call)."""
    _announced.append(host)
    try:
        yield
    finally:
        _announced.remove(host)


def register(finder: Callable[[], Host | None]) -> None:
    """A host loop whose state outlives its calls (Megatron-LM's parsed args): ``finder`` answers it
    where that state exists, else None."""
    if finder not in _finders:
        _finders.append(finder)


def use_core_loop(host: Host) -> None:
    """The host where no other is current: a user's own megatron-core loop (core_loop.py)."""
    _core_loop[0] = host


def current_host() -> Host:
    """The host of the call in progress (see the module's docstring)."""
    if _announced:
        return _announced[-1]
    for finder in _finders:
        host = finder()
        if host is not None:
            return host
    return _core_loop[0]
