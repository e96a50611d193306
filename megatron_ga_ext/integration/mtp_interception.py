"""process_mtp_loss's module while one call runs: its ``roll_tensor`` and ``MTPLossAutoScaler``
stood in for by an object that keeps what each roll returns (the last roll before an attachment is
the loss mask's) and decides what each attachment does. The MTP correction (aux_losses.py) and the
first-step probe of upstream's MTP arithmetic (mtp_ratio_check.py) are two such objects."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["MTPInterception"]


class MTPInterception:
    """Subclasses give ``apply(hidden_states, mtp_loss)``, called where upstream attaches depth k's
    MTP loss."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.roll_tensor, self.autoscaler = module.roll_tensor, module.MTPLossAutoScaler
        self.rolled: Any = None
        self.rolled_num_tokens: Any = None

    @contextlib.contextmanager
    def in_module(self) -> Iterator[None]:
        self.module.roll_tensor, self.module.MTPLossAutoScaler = self.roll, self
        try:
            yield
        finally:
            self.module.roll_tensor, self.module.MTPLossAutoScaler = (
                self.roll_tensor,
                self.autoscaler,
            )

    def roll(self, *args: Any, **kwargs: Any) -> Any:
        self.rolled, self.rolled_num_tokens = self.roll_tensor(*args, **kwargs)
        return self.rolled, self.rolled_num_tokens

    def apply(self, hidden_states: Any, mtp_loss: Any) -> Any:
        raise NotImplementedError
