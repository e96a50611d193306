"""One row of the hook table (hooks.py): an upstream target, how install() wraps it, and the phase
it serves.

The rows the phases run on are hooks.py's; a feature declares the rows of its own
(``Feature.hooks``), beside its class, so its module and what its wrappers import load only where
its configuration turns it on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Generic, TypeVar

__all__ = ["PHASES", "Hook"]

#: The phases of a run, in order; each row serves one (the Installation method of the same name runs
#: it).
PHASES = ("configure", "step", "micro_batch", "finalize", "optimizer_step", "log", "save", "load")

#: The state a row's wrapper runs: installation.Installation (not imported here: it imports the
#: features, which declare rows).
S = TypeVar("S")


@dataclass(frozen=True)
class Hook(Generic[S]):
    """One upstream target and how install() wraps it."""

    phase: str
    module: str
    name: str
    """A module global, or ``Class.method``."""
    wrap: Callable[[Callable, S], Callable]
    """``wrap(original, state)``: the replacement of ``original``, which runs ``state``."""
    load: str = "import"
    """``import``: imported at install(); ``loaded``: wired once the host loop has loaded the
    module."""
    host: str = "megatron-core"
    """The code the row belongs to: megatron-core, or a host loop (megatron-lm, megatron-bridge)."""
    present: Callable[[ModuleType], bool] | None = None
    """Whether this source has the target (None: where the name resolves)."""
    fingerprinted: bool = False
    does: str = ""
    """What the replacement does, in a few words (the table in docs/design.md)."""
    when: Callable[[S], bool] | None = None
    """Whether an installation needs the row wired (None: always; a feature's own rows: where it
    runs)."""

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.name}"

    def found_in(self, module: ModuleType) -> bool:
        if self.present is not None:
            return self.present(module)
        owner, _, attribute = self.name.rpartition(".")
        holder = getattr(module, owner, None) if owner else module
        return holder is not None and attribute in vars(holder)
