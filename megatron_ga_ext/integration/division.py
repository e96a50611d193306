"""The division by N at the end of finalize: ``grad = grad * (1 / max(N, 1))`` on every model chunk.

Megatron's DDP and Megatron-FSDP scale their own buffers (``scale_gradients``). megatron-core's
torch FSDP2 wrapper keeps the base class's ``scale_gradients``, a no-op (``data_parallel_base.py``,
every release from 0.16 on): there each parameter's local gradient shard, which holds the reduced
sum, is scaled instead (the TorchFSDP2 feature, features/torch_fsdp2.py, makes its units sum). An
upstream that implements it scales, and the shards are not scaled again.
"""

from __future__ import annotations

import torch

__all__ = ["is_torch_fsdp2", "scale_gradients", "upstream_scales"]


def is_torch_fsdp2(chunk: torch.nn.Module) -> bool:
    """megatron-core's torch FSDP2 wrapper (matched by name: its module imports FSDP2 where torch
    has it)."""
    return type(chunk).__name__ == "TorchFullyShardedDataParallel"


def upstream_scales(chunk: torch.nn.Module) -> bool:
    """The wrapper's own ``scale_gradients`` does something: it is not the base class's no-op."""
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel

    return getattr(type(chunk), "scale_gradients", None) is not _BaseDataParallel.scale_gradients


def scale_gradients(chunk: torch.nn.Module, scaling: torch.Tensor | float) -> None:
    """``chunk.scale_gradients(scaling)``; on torch FSDP2 whose ``scale_gradients`` is still
    upstream's no-op, each parameter's local gradient shard times ``scaling`` instead (the reduced,
    summed gradient is held there)."""
    if not is_torch_fsdp2(chunk) or upstream_scales(chunk):
        chunk.scale_gradients(scaling)
        return
    with torch.no_grad():
        for param in chunk.module.parameters():
            if param.grad is not None:
                _local(param.grad).mul_(scaling)


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor FSDP2 reduced into), or the tensor itself."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad
