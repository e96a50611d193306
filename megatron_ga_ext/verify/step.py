"""One training step of a verify layout: this rank's micro-batches through megatron's own schedule.

Each rank cuts its micro-batches from the global batch (``layout.sample``: micro-batch m, DP rank
r, row j), cuts those to its context-parallel shard with megatron-core's own
``get_batch_on_this_cp_rank``, and runs ``get_forward_backward_func()`` over them with a forward
step as pretrain_gpt's; the finalize hook (``finalize_model_grads``) reduces the gradients.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from megatron_ga_ext.verify import upstream
from megatron_ga_ext.verify.data_parallel import wire_sync
from megatron_ga_ext.verify.layouts import GlobalBatch, Layout

if TYPE_CHECKING:
    from megatron_ga_ext.verify.run_config import VerifyConfig

__all__ = ["cp_shard", "forward_step", "microbatches", "train_step"]


def train_step(
    model: Any,
    config: Any,
    layout: Layout,
    cfg: VerifyConfig,
    batch: GlobalBatch,
    *,
    finalize: Any,
    loss_func: Any,
    forward_step_func: Callable | None = None,
    sample_ids: bool = False,
) -> None:
    """One forward/backward over this rank's micro-batches with megatron's own schedule.

    ``model`` is a DDP chunk or the list of a rank's chunks (interleaved PP: each chunk reads the
    same micro-batches from an iterator of its own). ``loss_func(output_tensor, loss_mask)`` is what
    the loss function of each micro-batch returns; ``finalize`` becomes
    ``config.finalize_model_grads_func``. ``forward_step_func(data_iterator, model, *, loss_func)``
    replaces the default forward step; ``sample_ids`` adds each micro-batch's sample indices (see
    :func:`microbatches`).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks = model if isinstance(model, list) else [model]
    config.finalize_model_grads_func = finalize
    wire_sync(config, chunks)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    data = microbatches(layout, batch, cfg.device, sample_ids=sample_ids)
    step = forward_step_func or partial(forward_step, with_loss_mask=layout.model != "positionwise")
    get_forward_backward_func()(
        forward_step_func=partial(step, loss_func=loss_func),
        data_iterator=[iter(data) for _ in chunks] if len(chunks) > 1 else iter(data),
        model=chunks,
        num_microbatches=layout.num_microbatches,
        seq_length=cfg.model.seq_length // layout.context_parallel_size,
        micro_batch_size=layout.micro_batch_size,
        forward_only=False,
    )


def microbatches(
    layout: Layout, batch: GlobalBatch, device: str, *, sample_ids: bool = False
) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches, in order, already cut to its CP shard.

    With ``sample_ids``, each also holds ``sample_ids`` [MBS]: the samples' indices in the global
    batch.
    """
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    out = []
    for m in range(layout.num_microbatches):
        rows = [layout.sample(m, dp_rank, j) for j in range(layout.micro_batch_size)]
        micro = {
            "tokens": batch.tokens[rows],
            "labels": batch.labels[rows],
            "loss_mask": batch.loss_mask[rows],
            "position_ids": batch.position_ids[rows],
        }
        micro = cp_shard(micro) if layout.context_parallel_size > 1 else micro
        if sample_ids:  # after the CP cut: it shards the sequence dimension, which sample_ids lacks
            micro["sample_ids"] = torch.tensor(rows)
        out.append({k: v.to(device) for k, v in micro.items()})
    return out


def cp_shard(micro: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """megatron-core's own ``get_batch_on_this_cp_rank``.

    Its signature differs by release, and from 0.19 on a missing ``cp_group`` means the *world*
    group (``get_world_size(None)``), so the group is always passed explicitly.
    """
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    cp_group = parallel_state.get_context_parallel_group()
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        shard: dict[str, Any] = get_batch_on_this_cp_rank(
            dict(micro), is_hybrid_cp=False, cp_group=cp_group
        )
    else:
        shard = get_batch_on_this_cp_rank(dict(micro), cp_group=cp_group)
    return shard


def forward_step(
    data_iterator: Any,
    model: torch.nn.Module,
    *,
    loss_func: Any,
    with_loss_mask: bool = True,
    mode: str | None = None,
    return_schedule_plan: bool = False,
) -> tuple[Any, Any]:
    """As pretrain_gpt's: the GPT gets the loss mask too (its MTP block uses it; install() derives
    MoE's padding mask from it in token mode). Given ``mode`` (verify --upstream), MoE's padding
    mask as a patched pretrain_gpt.py passes it (verify/upstream.py)."""
    micro = next(data_iterator)
    kwargs = {"loss_mask": micro["loss_mask"]} if with_loss_mask else {}
    if mode is not None and with_loss_mask:
        kwargs.update(upstream.forward_kwargs(model, micro, mode))
    # combined 1F1B asks for the model's schedule plan instead of its output (pretrain_gpt.py)
    call = model.build_schedule_plan if return_schedule_plan else model
    losses = call(micro["tokens"], micro["position_ids"], None, labels=micro["labels"], **kwargs)
    return losses, partial(_call_loss, loss_func, micro["loss_mask"])


def _call_loss(loss_func: Any, loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> Any:
    return loss_func(output_tensor, loss_mask)
