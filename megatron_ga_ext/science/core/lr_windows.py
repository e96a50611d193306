"""The learning-rate windows where the batch size must not change: the LR warmup and a WSD
schedule's final decay. Pure Python.

    warmup         [0, W)            W = --lr-warmup-samples, else --lr-warmup-fraction x the decay's end
    final decay    [max(D - F, 0), the run's end)    D = the decay's end, F = --lr-wsd-decay-samples

A doubling of the batch (``schedule --suggest``, ``--ga-batch-size-warmup auto``) never starts a
stage inside one: a switch in the warmup changes the noise the warmup was sized for, and one in the
final anneal changes the rate's effect while it is shrinking to its end.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Frozen", "lr_windows", "warmup_samples"]

#: The labels the run's log gives a window ({samples}: where it starts or ends).
WARMUP_LABEL = "the LR warmup (to {samples:,} samples)"
FINAL_DECAY_LABEL = "the WSD final decay (from {samples:,} samples)"


@dataclass(frozen=True, kw_only=True)
class Frozen:
    """Consumed samples [start, end) where the batch size must not change (end None: to the run's
    end)."""

    label: str
    start: int
    end: int | None

    def holds(self, consumed_samples: int) -> bool:
        return self.start <= consumed_samples and (self.end is None or consumed_samples < self.end)


def warmup_samples(
    lr_warmup_samples: int | None, lr_warmup_fraction: float | None, decay_end: int | None
) -> int:
    """Megatron's warmup length in samples: ``--lr-warmup-samples``, else
    int(``--lr-warmup-fraction`` x the decay's end) where both are given, else 0."""
    warmup = lr_warmup_samples or 0
    if not warmup and lr_warmup_fraction and decay_end:
        warmup = int(lr_warmup_fraction * decay_end)
    return warmup


def lr_windows(
    *,
    warmup: int,
    decay_end: int | None = None,
    final_decay: int | None = None,
    warmup_label: str = WARMUP_LABEL,
    final_decay_label: str = FINAL_DECAY_LABEL,
) -> tuple[Frozen, ...]:
    """The windows of the module docstring: [0, ``warmup``) where it is > 0, and [max(``decay_end``
    - ``final_decay``, 0), end) where both are given and > 0 (a WSD schedule). The labels are
    formatted with ``samples``: the warmup's end, the final decay's start."""
    frozen = []
    if warmup:
        frozen.append(Frozen(label=warmup_label.format(samples=warmup), start=0, end=warmup))
    if final_decay and decay_end:
        start = max(decay_end - final_decay, 0)
        frozen.append(Frozen(label=final_decay_label.format(samples=start), start=start, end=None))
    return tuple(frozen)
