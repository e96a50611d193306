"""A model config's ``finalize_model_grads_func`` made the extension's finalize, and put back at
uninstall().

A config may hold upstream's finalize set before install(), directly or in a ``functools.partial``.
At each forward/backward call the schedule's model config is adopted (``Installation.begin_step``):
where it holds upstream's finalize, or the wrapper of an installation replaced since (install() with
another config), it gets this installation's, bound the same way. uninstall() puts back what the
config held, where it still holds ours.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_ga_ext.integration.finalize import FinalizeModelGrads

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["AdoptedFinalize", "adopt_finalize"]


@dataclass(frozen=True)
class AdoptedFinalize:
    """A model config whose finalize_model_grads_func install() replaced: what it held, and what it
    holds since."""

    config: weakref.ref[TransformerConfig]
    original: Callable
    replacement: Callable

    def restore(self) -> None:
        """What the config held, back where it still holds the replacement."""
        config = self.config()
        if config is not None and config.finalize_model_grads_func is self.replacement:
            config.finalize_model_grads_func = self.original


def adopt_finalize(
    finalize: FinalizeModelGrads, config: TransformerConfig
) -> AdoptedFinalize | None:
    """Give ``config`` the extension's ``finalize`` where it holds upstream's (set before install())
    or an earlier installation's (set before install() with another config), directly or in a
    ``functools.partial``; None where it holds neither."""
    current = getattr(config, "finalize_model_grads_func", None)
    partial = current if isinstance(current, functools.partial) else None
    function = partial.func if partial is not None else current
    if current is None or function is finalize or not _is_upstream_finalize(finalize, function):
        return None
    replacement = (
        functools.partial(finalize, *partial.args, **partial.keywords)
        if partial is not None
        else finalize
    )
    config.finalize_model_grads_func = replacement
    return AdoptedFinalize(weakref.ref(config), current, replacement)


def _is_upstream_finalize(finalize: FinalizeModelGrads, function: object) -> bool:
    """Upstream's finalize (the one ``finalize`` wraps), or an uninstalled installation's wrapper of
    it."""
    return function is finalize.original or (
        isinstance(function, FinalizeModelGrads)
        and not function.active
        and function.original is finalize.original
    )
