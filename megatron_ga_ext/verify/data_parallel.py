"""The data-parallel wrapper of a verify layout, and the sync hooks Megatron-LM's training wires for
it.

A layout's ``data_parallel`` picks what ``pretrain()`` builds (``training/training.py``,
``get_model``):

    ddp             megatron.core.distributed.DistributedDataParallel (the default)
    torch_fsdp2     TorchFullyShardedDataParallel (--use-torch-fsdp2: an untied GPT, transformer_impl local)
    megatron_fsdp   Megatron-FSDP's FullyShardedDataParallel (--use-megatron-fsdp, with the distributed optimizer
                    it implies, in the layout's --data-parallel-sharding-strategy)

Megatron-LM sets ``config.no_sync_func`` only with ``--overlap-grad-reduce``, and only for its DDP
and Megatron-FSDP (``training.py``, where it sets up the training config): without it a schedule
reduces nothing per micro-batch and the wrapper's ``finish_grad_sync`` does the one reduction.
:func:`wire_sync` does the same, so a wrapper's path verify proves is the one a run takes
(Megatron-FSDP no_shard with a ``no_sync`` a run never sets reduces twice).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from megatron_ga_ext.verify.layouts import Layout

__all__ = [
    "TORCH_FSDP2_BEFORE_0_19",
    "ddp_config_of",
    "megatron_fsdp_limited",
    "torch_fsdp2_runs",
    "wire_sync",
    "wrap_chunk",
]

#: Megatron-FSDP (strategy, overlapped reduce) whose step is off, upstream's own step as well, by
#: megatron-core minor release (measured over gloo: token-mode relative error 0.79 for no_shard
#: without the overlap on 0.16.1 and 0.17.1, 0.97 for optim with it on 0.16.1; exact on 0.18.2 and
#: 0.19.2). Not traced to its cause.
MEGATRON_FSDP_OFF = {"0.16": {("no_shard", False), ("optim", True)}, "0.17": {("no_shard", False)}}

#: Why a release before 0.19 cannot run a torch FSDP2 layout (:func:`torch_fsdp2_runs`).
TORCH_FSDP2_BEFORE_0_19 = (
    "megatron-core 0.16-0.18's finalize_model_grads calls "
    "finish_grad_sync(force_all_reduce=...), which their torch FSDP2 wrapper does not "
    "take (the base class's has no arguments): upstream's --use-torch-fsdp2 stops at the "
    "first step with a TypeError, in either mode; the FSDP2 rows need 0.19 or later"
)


def ddp_config_of(layout: Layout) -> Any:
    """The DistributedDataParallelConfig ``pretrain()`` builds for the layout's flags (on gloo,
    Megatron-FSDP divides by DP after its reduce-scatter, ``--no-gradient-reduce-div-fusion``: gloo
    has no PREMUL_SUM).

    The position-wise models have no transformer layer, Megatron-FSDP's unit: optim_grads_params
    sizes its communication by the mean unit (``total_param_elements // total_fsdp_module``, a
    division by zero there), so they pass ``--suggested-communication-unit-size`` as a launch would:
    1e9 elements, the least upstream's sizing gives."""
    from megatron.core.distributed import DistributedDataParallelConfig

    if layout.data_parallel == "megatron_fsdp":
        return DistributedDataParallelConfig(
            overlap_grad_reduce=layout.overlap_grad_reduce,
            use_distributed_optimizer=True,
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy=layout.sharding_strategy,
            gradient_reduce_div_fusion=torch.distributed.get_backend()
            != "gloo",  # PREMUL_SUM is NCCL's alone
            suggested_communication_unit_size=1_000_000_000
            if "positionwise" in layout.model
            else None,
        )
    return DistributedDataParallelConfig(
        overlap_grad_reduce=layout.overlap_grad_reduce,
        use_distributed_optimizer=layout.distributed_optimizer,
    )


def megatron_fsdp_limited(layout: Layout) -> str | None:
    """Why this megatron-core's Megatron-FSDP cannot prove ``layout`` (:data:`MEGATRON_FSDP_OFF`; TP
    where the wrapper needs Transformer Engine), or None."""
    from megatron_ga_ext.integration.compat import megatron_core_version

    release = ".".join(megatron_core_version().split(".")[:2])
    if (
        layout.data_parallel == "megatron_fsdp"
        and layout.tensor_model_parallel_size > 1
        and _tp_needs_te()
    ):
        return (
            f"megatron-core {release}'s Megatron-FSDP under TP tells a TP-split weight by "
            "isinstance(module, TELinear) (mcore_fsdp_adapter._fix_tensor_parallel_attributes), "
            "a TypeError without Transformer Engine: "
            f"the TP draws need Transformer Engine or 0.18"
        )
    off = MEGATRON_FSDP_OFF.get(release, set())
    if (
        layout.data_parallel != "megatron_fsdp"
        or (layout.sharding_strategy, layout.overlap_grad_reduce) not in off
    ):
        return None
    overlap = "with" if layout.overlap_grad_reduce else "without"
    return (
        f"megatron-core {release}'s Megatron-FSDP {layout.sharding_strategy} {overlap} "
        "--overlap-grad-reduce: upstream's own step misses both references here too (without the "
        "extension); the row needs 0.18"
    )


@functools.cache
def _tp_needs_te() -> bool:
    """megatron-core's Megatron-FSDP wrapper checks TP weights against TELinear (0.16, 0.17; 0.18 on
    compare the module's type name), which without Transformer Engine is a stand-in, not a class."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    checks_the_class = "isinstance(direct_module, (TELinear,))" in inspect.getsource(
        mcore_fsdp_adapter
    )
    return checks_the_class and not isinstance(mcore_fsdp_adapter.TELinear, type)


def torch_fsdp2_runs() -> bool:
    """megatron-core's torch FSDP2 wrapper takes the ``finish_grad_sync(force_all_reduce=...)`` its
    finalize passes (0.19 and later)."""
    from megatron.core.distributed.torch_fully_sharded_data_parallel import (
        TorchFullyShardedDataParallel,
    )

    return (
        "force_all_reduce"
        in inspect.signature(TorchFullyShardedDataParallel.finish_grad_sync).parameters
    )


def wrap_chunk(
    layout: Layout,
    config: Any,
    module: torch.nn.Module,
    ddp_config: Any,
    *,
    disable_bucketing: bool,
    device: str,
) -> torch.nn.Module:
    """``module`` wrapped in the layout's data-parallel wrapper, as ``get_model`` wraps a model
    chunk."""
    if layout.data_parallel == "torch_fsdp2":
        from megatron.core.distributed.torch_fully_sharded_data_parallel import (
            TorchFullyShardedDataParallel,
        )

        return TorchFullyShardedDataParallel(
            config, ddp_config, module, disable_bucketing=disable_bucketing
        )
    if layout.data_parallel == "megatron_fsdp":
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        return FullyShardedDataParallel(
            config,
            ddp_config,
            module,
            disable_bucketing=disable_bucketing,
            device=torch.device(device),
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
