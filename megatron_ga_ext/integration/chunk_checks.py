"""The checks finalize makes on the model chunks before it divides by the token count: the
per-token flag of their model config, and the pre-reduction gradient factor each data-parallel
wrapper fixed in ``__init__`` (it must sum over DP x CP, never average). Once per list of chunks and
mode; finalize.py keeps the :class:`CheckedChunks` that passed.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_ga_ext.config.launch_rules import check_loss_mode
from megatron_ga_ext.errors import LossContractError

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["CheckedChunks", "check_ddp_chunks", "check_per_token_flag"]


def check_per_token_flag(config: TransformerConfig, mode: str) -> None:
    """options.check_loss_mode on a model config (its calculate_per_token_loss, as the step reads
    it)."""
    check_loss_mode(mode, bool(getattr(config, "calculate_per_token_loss", False)))


def check_ddp_chunks(
    model: Sequence[torch.nn.Module], config: TransformerConfig | None = None
) -> None:
    """Every data-parallel wrapper must sum gradients over DP x CP, not average them.

    Megatron's DDP and Megatron-FSDP fix their pre-reduction gradient factor in ``__init__``: 1 (or
    none) with per-token loss, 1/(DP x CP) without. A chunk built before
    ``calculate_per_token_loss`` was set keeps 1/(DP x CP) and the finalize divides by the token
    count as well: gradients DP x CP times too small, silently. torch FSDP2 (``--use-torch-fsdp2``)
    has no such factor: its units are set to sum each step (features/torch_fsdp2.py). Plain modules
    (no wrapper) have no factor and pass. With ``config`` (the model's TransformerConfig) the
    per-token flag is checked as well.
    """
    if config is not None:
        check_per_token_flag(config, "token")
    for index, chunk in enumerate(model):
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None:  # not a Megatron data-parallel wrapper
            continue
        if getattr(ddp_config, "average_in_collective", False):
            raise LossContractError(
                f"model chunk {index} was wrapped with DistributedDataParallelConfig("
                "average_in_collective=True); per-token loss needs a summing collective. Build DDP "
                f"with average_in_collective=False (--no-average-in-collective is the default)."
            )
        for factor in _gradient_scaling_factors(chunk):
            if factor is not None and factor != 1.0:
                raise LossContractError(
                    f"model chunk {index} was wrapped in {type(chunk).__name__} with "
                    "gradient_scaling_factor "
                    f"{factor:g} (= 1/{round(1 / factor)}), i.e. before calculate_per_token_loss "
                    "was set; its "
                    f"gradients would end up {round(1 / factor)} times too small. Set "
                    "config.calculate_per_token_loss=True before wrapping the model."
                )


def _gradient_scaling_factors(chunk: torch.nn.Module) -> list[float | None]:
    """The pre-reduction factors of a wrapper's gradient buffers: Megatron DDP keeps lists of
    buffers (``buffers``, ``expert_parallel_buffers``; ``nn.Module.buffers`` is a method, not such a
    list), Megatron-FSDP one ``param_and_grad_buffer`` with a dense and an expert factor."""
    buffers = [
        b
        for attr in ("buffers", "expert_parallel_buffers")
        if isinstance(getattr(chunk, attr, None), (list, tuple))
        for b in getattr(chunk, attr)
    ]
    factors = [getattr(b, "gradient_scaling_factor", None) for b in buffers]
    fsdp_buffer = getattr(chunk, "param_and_grad_buffer", None)
    if fsdp_buffer is not None and not buffers:
        factors += [
            getattr(fsdp_buffer, "gradient_scaling_factor", None),
            getattr(fsdp_buffer, "expert_gradient_scaling_factor", None),
        ]
    return factors


@dataclass(frozen=True)
class CheckedChunks:
    """Model chunks that passed :func:`check_ddp_chunks` in ``mode``, their model config and their
    device."""

    chunks: list[weakref.ref[torch.nn.Module]]
    mode: str
    model_config: TransformerConfig
    device: torch.device | None
    """The chunks' device in token mode (where the step's vector is made); None in microbatch
    mode."""

    def are(self, model: list[torch.nn.Module], mode: str) -> bool:
        """The same chunks, checked in the same mode (``list ==`` compares identity first)."""
        return self.mode == mode and [ref() for ref in self.chunks] == model
