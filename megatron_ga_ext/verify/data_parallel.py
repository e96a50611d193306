"""The data-parallel wrapper of a verify layout, and the sync hooks Megatron-LM's training wires for it.

A layout's ``data_parallel`` picks what ``pretrain()`` builds (``training/training.py``, ``get_model``):

    ddp             megatron.core.distributed.DistributedDataParallel (the default)
    torch_fsdp2     TorchFullyShardedDataParallel (--use-torch-fsdp2: an untied GPT, transformer_impl local)
    megatron_fsdp   Megatron-FSDP's FullyShardedDataParallel (--use-megatron-fsdp, with the distributed optimizer
                    it implies, in the layout's --data-parallel-sharding-strategy)

Megatron-LM sets ``config.no_sync_func`` only with ``--overlap-grad-reduce``, and only for its DDP and Megatron-FSDP
(``training.py``, where it sets up the training config): without it a schedule reduces nothing per micro-batch and
the wrapper's ``finish_grad_sync`` does the one reduction. :func:`wire_sync` does the same, so a wrapper's path
verify proves is the one a run takes (Megatron-FSDP no_shard with a ``no_sync`` a run never sets reduces twice).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_ga_ext.verify.layouts import Layout

__all__ = ["ddp_config_of", "wire_sync", "wrap_chunk"]


def ddp_config_of(layout: Layout) -> Any:
    """The DistributedDataParallelConfig ``pretrain()`` builds for the layout's flags (on gloo, Megatron-FSDP
    divides by DP after its reduce-scatter, ``--no-gradient-reduce-div-fusion``: gloo has no PREMUL_SUM)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    if layout.data_parallel == "megatron_fsdp":
        return DistributedDataParallelConfig(
            overlap_grad_reduce=layout.overlap_grad_reduce,
            use_distributed_optimizer=True,
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy=layout.sharding_strategy,
            gradient_reduce_div_fusion=torch.distributed.get_backend() != "gloo",  # PREMUL_SUM is NCCL's alone
        )
    return DistributedDataParallelConfig(
        overlap_grad_reduce=layout.overlap_grad_reduce, use_distributed_optimizer=layout.distributed_optimizer
    )


def wrap_chunk(
    layout: Layout, config: Any, module: torch.nn.Module, ddp_config: Any, *, disable_bucketing: bool, device: str
) -> torch.nn.Module:
    """``module`` wrapped in the layout's data-parallel wrapper, as ``get_model`` wraps a model chunk."""
    if layout.data_parallel == "torch_fsdp2":
        from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel

        return TorchFullyShardedDataParallel(config, ddp_config, module, disable_bucketing=disable_bucketing)
    if layout.data_parallel == "megatron_fsdp":
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        return FullyShardedDataParallel(
            config, ddp_config, module, disable_bucketing=disable_bucketing, device=torch.device(device)
        )
    from megatron.core.distributed import DistributedDataParallel

    return DistributedDataParallel(
        config=config, module=module, ddp_config=ddp_config, disable_bucketing=disable_bucketing
    )


def wire_sync(config: Any, chunks: list[torch.nn.Module]) -> None:
    """``config.no_sync_func`` as Megatron-LM's training sets it: each chunk's ``no_sync`` with
    ``--overlap-grad-reduce`` on Megatron's DDP or Megatron-FSDP, else None."""
    overlapped = all(
        type(chunk).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel")
        and getattr(chunk.ddp_config, "overlap_grad_reduce", False)
        for chunk in chunks
    )
    if not overlapped:
        config.no_sync_func = None
        return
    no_sync = [chunk.no_sync for chunk in chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
