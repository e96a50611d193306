"""This rank's reduced gradients, whole, by global name: what verify compares with the references.

Each data-parallel wrapper keeps its reduced gradient in its own place:

* Megatron's DDP: ``main_grad`` of each parameter; with the distributed optimizer each rank holds
  its shard of each bucket only, so the shards are all-gathered first (:func:`_gather_shards`).
* torch FSDP2 (``TorchFullyShardedDataParallel``): ``param.grad``, a DTensor sharded over DP x CP
  (``full_tensor``).
* Megatron-FSDP: its main-gradient buffer, as ``update_main_grads`` reads it for the optimizer after
  ``finish_grad_sync``: a rank's slice of each parameter in a sharded strategy (it may be empty:
  ``param.grad`` is then None), the whole parameter under ``no_shard``.

A tensor-parallel parameter's gradient is then gathered over its TP group (:func:`_whole`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["gradients"]


def gradients(model: Any, names: dict[str, str]) -> dict[str, torch.Tensor]:
    """This rank's reduced gradient of every parameter of its chunk(s), by global name, whole, on
    the CPU."""
    chunks = model if isinstance(model, list) else [model]
    out = {}
    for chunk in chunks:
        kind = type(chunk).__name__
        module = (
            chunk.module.module if kind == "FullyShardedDataParallel" else chunk.module
        )  # the model itself
        if kind == "TorchFullyShardedDataParallel":
            local = {n: p.grad.full_tensor() for n, p in module.named_parameters()}
        elif kind == "FullyShardedDataParallel":
            local = _megatron_fsdp_grads(chunk)
        else:
            if getattr(chunk.ddp_config, "use_distributed_optimizer", False):
                _gather_shards(chunk)
            local = {n: p.main_grad for n, p in module.named_parameters()}
        params = dict(module.named_parameters())
        out.update(
            {
                names[n]: _whole(params[n], grad.detach().clone()).cpu()
                for n, grad in local.items()
                if not _unused_output_weight(module, n)
            }
        )
    return out


def _megatron_fsdp_grads(chunk: Any) -> dict[str, torch.Tensor]:
    """Megatron-FSDP's reduced gradients, whole on every rank: what ``update_main_grads`` hands the
    optimizer (the rank's slice of each parameter, in a sharded strategy; the whole of it under
    ``no_shard``), each slice put in place in a zero tensor and summed over the buffer's DP group
    (the slices are disjoint and cover the parameter)."""
    buffer = chunk.param_and_grad_buffer
    sharded = chunk.ddp_config.data_parallel_sharding_strategy != "no_shard"
    out = {}
    for name, param in buffer.optimizer_named_parameters:
        orig = param.orig_param
        grads = buffer.parameter_groups[buffer.param_to_param_group[orig]].main_grad_buffer
        item = grads.param_idx[orig]
        if not sharded:
            out[name] = grads.get_item(item).detach().clone().view(orig.shape)
            continue
        start, end = grads._get_item_slice_in_shard(item)
        whole = torch.zeros(orig.numel(), dtype=grads.data.dtype, device=grads.data.device)
        whole[start:end] = grads.get_item(item, only_shard=True)
        torch.distributed.all_reduce(whole, group=grads.data_parallel_group)
        out[name] = whole.view(orig.shape)
    return out


def _unused_output_weight(module: torch.nn.Module, name: str) -> bool:
    """A last stage that holds the embedding too (MTP's) keeps an output layer weight it never
    reads: the output layer is given the tied embedding weight
    (``shared_embedding_or_output_weight``)."""
    return (
        name == "output_layer.weight"
        and hasattr(module, "embedding")
        and module.share_embeddings_and_output_weights
    )


def _whole(param: torch.nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of the whole parameter: a TP shard's gathered along its ``partition_dim`` over
    the TP group (the expert TP group for an expert's), in rank order, as init_by_name split it."""
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return grad
    expert = not getattr(param, "allreduce", True)
    group = (
        parallel_state.get_expert_tensor_parallel_group()
        if expert
        else parallel_state.get_tensor_model_parallel_group()
    )
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return grad
    parts = [torch.empty_like(grad) for _ in range(size)]
    torch.distributed.all_gather(parts, grad.contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def _gather_shards(chunk: Any) -> None:
    """The distributed optimizer reduce-scatters each bucket: rank r holds chunk r of
    ``bucket.grad_data`` (equal chunks, the buffer padded to DP). All-gather the chunks so every
    ``main_grad`` view is whole."""
    for buffer in [*chunk.buffers, *getattr(chunk, "expert_parallel_buffers", [])]:
        group = buffer.data_parallel_group
        size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        for bucket in buffer.buckets:
            shards = list(bucket.grad_data.chunk(size))
            torch.distributed.all_gather(shards, shards[rank].clone(), group=group)
