"""A user's own training loop over megatron-core as a host (host.py): the pattern RL frameworks use
(a trainer that calls megatron-core's schedules and optimizer itself, with no Megatron-LM args and
no Bridge state).

Such a loop keeps its iteration, samples and writers where it likes, so it says where::

    megatron_ga_ext.install(config, host=CoreLoop(iteration=lambda: trainer.step + 1,
                                                  consumed_samples=lambda: trainer.samples_seen))

What it does not give is not known, as for :class:`~megatron_ga_ext.integration.host.Host`: the
noise scale then numbers its measurements by the optimizer steps it saw, the warmup cannot replan a
run length, and so on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_ga_ext.integration.host import Host

__all__ = ["CoreLoop"]


class CoreLoop(Host):
    """A megatron-core loop that answers each question it can with a callable."""

    name = "megatron-core loop"

    def __init__(
        self,
        *,
        iteration: Callable[[], int | None] | None = None,
        consumed_samples: Callable[[], int | None] | None = None,
        set_train_iters: Callable[[int], None] | None = None,
        writers: Callable[[], tuple[Any, Any]] | None = None,
        print_line: Callable[[str], None] | None = None,
    ) -> None:
        self._iteration = iteration
        self._consumed_samples = consumed_samples
        self._set_train_iters = set_train_iters
        self._writers = writers
        self._print_line = print_line

    def iteration(self) -> int | None:
        return None if self._iteration is None else self._iteration()

    def consumed_samples(self) -> int | None:
        return None if self._consumed_samples is None else self._consumed_samples()

    def set_train_iters(self, iterations: int) -> None:
        if self._set_train_iters is not None:
            self._set_train_iters(iterations)

    def writers(self) -> tuple[Any, Any]:
        return (None, None) if self._writers is None else self._writers()

    def print_line(self, line: str) -> None:
        if self._print_line is None:
            super().print_line(line)
        else:
            self._print_line(line)
