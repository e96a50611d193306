"""Which layouts ``megatron-ga verify`` runs: those this megatron-core release and device can.

A release may lack what a layout needs (seq_aux_loss under TP/CP before 0.19, torch FSDP2 before
0.19, a Megatron-FSDP wrapper verify cannot read, MTP before 0.17, the delayed weight gradient of
local layers before 0.17): such layouts are listed as
skipped, with the reason. On CUDA a layout needs one GPU per rank.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_ga_ext.verify.fuzz import Draw
    from megatron_ga_ext.verify.layouts import Layout

__all__ = ["MEGATRON_FSDP_RENAMED", "runnable", "runnable_draws", "supported"]


def supported(layouts: list) -> tuple[list, list[dict[str, str]]]:
    """The layouts this megatron-core can run, and the others with the reason."""
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer import multi_token_prediction

    from megatron_ga_ext.verify.data_parallel import (
        TORCH_FSDP2_BEFORE_0_19,
        megatron_fsdp_limited,
        torch_fsdp2_runs,
    )
    from megatron_ga_ext.verify.fuzz import SEQ_AUX_BEFORE_0_19, seq_aux_limited

    mtp_clamped = hasattr(multi_token_prediction, "process_mtp_loss")
    local_wgrad = hasattr(layers.RowParallelLinear, "backward_dw")
    fsdp2_runs = torch_fsdp2_runs()
    kept, skipped = [], []
    for layout in layouts:
        if seq_aux_limited(layout):
            skipped.append({"layout": layout.name, "reason": SEQ_AUX_BEFORE_0_19})
        elif layout.data_parallel == "torch_fsdp2" and not fsdp2_runs:
            skipped.append({"layout": layout.name, "reason": TORCH_FSDP2_BEFORE_0_19})
        elif megatron_fsdp_limited(layout):
            skipped.append({"layout": layout.name, "reason": megatron_fsdp_limited(layout)})
        elif layout.data_parallel == "megatron_fsdp" and not _megatron_fsdp_readable():
            skipped.append({"layout": layout.name, "reason": MEGATRON_FSDP_RENAMED})
        elif "mtp" in layout.model and not mtp_clamped:
            skipped.append(
                {
                    "layout": layout.name,
                    "reason": (
                        "megatron-core 0.16 divides each micro-batch's MTP loss by its rolled "
                        "token count without a clamp, so a micro-batch with at most one "
                        "loss token per sequence (this batch has one) gives NaN; the MTP "
                        "rows need 0.17 or later"
                    ),
                }
            )
        elif layout.delay_wgrad_compute and not local_wgrad:
            skipped.append({"layout": layout.name, "reason": LOCAL_WGRAD_BEFORE_0_17})
        else:
            kept.append(layout)
    return kept, skipped


LOCAL_WGRAD_BEFORE_0_17 = (
    "megatron-core 0.16's local linear layers have no backward_dw, which --delay-wgrad-compute's "
    "schedule calls (Transformer Engine's have it): the row needs 0.17 or later here"
)


MEGATRON_FSDP_RENAMED = (
    "verify reads Megatron-FSDP's gradients through the wrapper class FullyShardedDataParallel "
    "of 0.16-0.19; this megatron-core's is another class (main: "
    "FullyShardedDataParallelV1 / V2), which verify does not read yet"
)


def _megatron_fsdp_readable() -> bool:
    """Megatron-FSDP's wrapper is the class verify's gradient reader knows (verify/grads.py)."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    wrapper = getattr(mcore_fsdp_adapter, "FullyShardedDataParallel", None)
    return isinstance(wrapper, type) and wrapper.__name__ == "FullyShardedDataParallel"


def runnable(layouts: tuple[Layout, ...], device: str) -> list[Layout]:
    """All layouts on the CPU; on CUDA those with no more ranks than GPUs (nccl needs one each)."""
    if device == "cpu":
        return list(layouts)
    import torch

    gpus = torch.cuda.device_count()
    kept = [lay for lay in layouts if lay.world_size <= gpus]
    for lay in layouts:
        if lay.world_size > gpus:
            print(
                f"  skipped {lay.name}: needs {lay.world_size} GPUs, {gpus} visible",
                file=sys.stderr,
            )
    return kept


def runnable_draws(draws: list[Draw], device: str) -> list[Draw]:
    """The draws whose layout ``device`` can run (``runnable``)."""
    kept = runnable(tuple(draw.layout for draw in draws), device)
    return [draw for draw in draws if draw.layout in kept]
