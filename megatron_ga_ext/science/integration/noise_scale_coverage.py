"""What the noise-scale meter's norms count on this rank: each bucket's plan (the counted
parameters' ranges of its ``grad_data``), why a parameter is left out, and the share of the rank's
parameter elements that is counted.

A parameter counts where its gradient before the data-parallel reduction is this replica's whole
gradient of it, counted once. Left out: expert parameters (reduced over the expert data-parallel
group), a tied embedding split across pipeline stages, everything upstream's finalize reduces again
after the data-parallel reduction (summed or averaged over TP, synced across pipeline stages), a
``main_grad`` held outside its bucket, and the tensor-parallel duplicates of TP ranks other than 0.
The meter (science/integration/noise_scale.py) reads the planned ranges.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "EXPERTS",
    "HELD_APART",
    "NOT_BUFFERED",
    "PP_SYNCED",
    "QK_LAYERNORM",
    "SEQUENCE_PARALLEL",
    "TIED_EMBEDDING",
    "TP_AVERAGED",
    "TP_DUPLICATE",
    "UNNAMED",
    "BucketPlan",
    "CountedElements",
    "Coverage",
]


@dataclass(frozen=True)
class BucketPlan:
    """Which elements of a bucket's ``grad_data`` the norms read: the counted parameters' ranges,
    merged."""

    bucket: weakref.ref
    ranges: tuple[tuple[int, int], ...]


class CountedElements:
    """The elements this rank's norms count: one plan per bucket, built from the parameter names of
    the model chunks known so far (upstream's finalize sums the q/k layernorm gradients over TP by
    name)."""

    def __init__(self) -> None:
        self._plans: dict[int, BucketPlan] = {}
        self._chunks: list[weakref.ref] = []
        self._names = _NO_NAMES

    def plan(self, bucket: Any) -> BucketPlan:
        """The bucket's plan, built at its first read since the last new chunk."""
        plan = self._plans.get(id(bucket))
        if plan is None or plan.bucket() is not bucket:
            ranges = _counted_ranges(bucket, _Layout.here(self._names))
            plan = self._plans[id(bucket)] = BucketPlan(weakref.ref(bucket), ranges)
        return plan

    def owned(self, bucket: Any, group: Any) -> list[tuple[int, int]]:
        """The bucket's counted ranges whose reduced values this rank holds and counts
        (:func:`_owned`)."""
        return _owned(self.plan(bucket).ranges, bucket, group)

    def learn_chunks(self, chunks: Sequence[torch.nn.Module]) -> None:
        """Model chunks whose parameter names the counted set may need (upstream's finalize sums the
        q/k layernorm gradients over TP by name). Called between steps only: a new chunk rebuilds
        the plans from the next bucket read, so one step's two norms always read the same
        elements."""
        alive = [ref for ref in self._chunks if ref() is not None]
        new = [
            chunk
            for chunk in chunks
            if chunk is not None and all(ref() is not chunk for ref in alive)
        ]
        if not new and len(alive) == len(self._chunks):
            return
        self._chunks = alive + [weakref.ref(chunk) for chunk in new]
        self._names = _Names.of([chunk for ref in self._chunks if (chunk := ref()) is not None])
        self._plans.clear()

    def coverage(self, model: Sequence[torch.nn.Module]) -> Coverage:
        """This rank's parameter elements (those that take a gradient) and which of them the norms
        count, by why the others are left out."""
        layout = _Layout.here(self._names)
        buckets: dict[int, Any] = {}
        for chunk in model:
            for group in (
                *getattr(chunk, "bucket_groups", ()),
                *getattr(chunk, "expert_parallel_bucket_groups", ()),
            ):
                for bucket in group.buckets:
                    buckets.update((id(param), bucket) for param in bucket.params_list)
        left_out: dict[str, int] = {}
        total = 0
        for chunk in model:
            for param in chunk.parameters():
                if not param.requires_grad:
                    continue
                total += param.numel()
                bucket = buckets.get(id(param))
                why = NOT_BUFFERED if bucket is None else _why_left_out(param, bucket, layout)
                if why is not None:
                    left_out[why] = left_out.get(why, 0) + param.numel()
        return Coverage(elements=total, left_out=left_out)


@dataclass(frozen=True, kw_only=True)
class Coverage:
    """The parameter elements of one rank, and the parts the meter leaves out of both norms, by
    class."""

    elements: int
    left_out: dict[str, int]

    @property
    def counted(self) -> int:
        return self.elements - sum(self.left_out.values())

    def line(self) -> str:
        share = 100.0 * self.counted / self.elements if self.elements else 0.0
        out = ", ".join(
            f"{why} ({count:,})"
            for why, count in sorted(self.left_out.items(), key=lambda kv: -kv[1])
        )
        return (
            f"megatron-ga-ext: the noise scale covers {share:.1f}% of this rank's "
            f"{self.elements:,} parameter elements ({self.counted:,}); left out: "
            f"{out or 'none'}"
        )


EXPERTS = "experts (reduced over the expert data-parallel group)"
TIED_EMBEDDING = "the tied embedding (summed across pipeline stages)"
SEQUENCE_PARALLEL = "sequence-parallel (summed over TP in finalize)"
QK_LAYERNORM = "q/k layernorm (summed over TP in finalize)"
TP_AVERAGED = "TP-averaged (averaged over TP in finalize)"
PP_SYNCED = "pipeline-synced (summed across pipeline stages in finalize)"
TP_DUPLICATE = "tensor-parallel duplicates (counted on TP rank 0)"
UNNAMED = "TP duplicates of a chunk not seen yet (counted from the next step)"
HELD_APART = "main_grad held outside the bucket"
NOT_BUFFERED = "not in a gradient buffer"


@dataclass(frozen=True)
class _Names:
    """What the known model chunks' names and configs decide, by parameter id: the q/k layernorms
    upstream's finalize sums over TP (``config.qk_layernorm`` and "q_layernorm" or "k_layernorm" in
    the name, as its ``_allreduce_non_tensor_model_parallel_grads`` reads them) and the conditional
    embedders it sums across stages (``config.has_cond_embedder`` and the parameter's
    ``pipeline_parallel``)."""

    known: frozenset[int]
    qk_layernorm: frozenset[int]
    cond_embedder: frozenset[int] = frozenset()

    @classmethod
    def of(cls, chunks: Sequence[torch.nn.Module]) -> _Names:
        from megatron.core.utils import get_model_config

        known, qk, cond = set(), set(), set()
        for chunk in chunks:
            config = get_model_config(chunk)
            summed = bool(getattr(config, "qk_layernorm", False))
            conditional = bool(getattr(config, "has_cond_embedder", False))
            for name, param in chunk.named_parameters():
                known.add(id(param))
                if summed and ("q_layernorm" in name or "k_layernorm" in name):
                    qk.add(id(param))
                if conditional and getattr(param, "pipeline_parallel", False):
                    cond.add(id(param))
        return cls(frozenset(known), frozenset(qk), frozenset(cond))


_NO_NAMES = _Names(frozenset(), frozenset())


@dataclass(frozen=True)
class _Layout:
    """This rank's place in the model-parallel groups, and the names known, as the counted set needs
    them."""

    tp_rank: int
    tp_size: int
    pp_size: int
    names: _Names

    @classmethod
    def here(cls, names: _Names) -> _Layout:
        from megatron.core import parallel_state

        return cls(
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            names,
        )


def _counted_ranges(bucket: Any, layout: _Layout) -> tuple[tuple[int, int], ...]:
    """The bucket-local ranges of the parameters a replica's gradient norm counts on this rank,
    merged. Each is where the parameter's ``main_grad`` view lies in ``grad_data``:
    ``param_to_index`` leaves out the padding between parameters on 0.16 and 0.17."""
    spans = sorted(
        span
        for param in bucket.params_list
        if _why_left_out(param, bucket, layout) is None
        and (span := _span(param, bucket)) is not None
    )
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and merged[-1][1] == start:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    return tuple((start, end) for start, end in merged)


def _span(param: torch.nn.Parameter, bucket: Any) -> tuple[int, int] | None:
    """Where the parameter's ``main_grad`` lies in the bucket's ``grad_data``; None where it is held
    apart (0.19's extra main grads, fp32 local accumulation)."""
    grad, data = getattr(param, "main_grad", None), bucket.grad_data
    if grad is None:
        return None
    start = (grad.data_ptr() - data.data_ptr()) // data.element_size()
    return (
        (start, start + grad.numel())
        if start >= 0 and start + grad.numel() <= data.numel()
        else None
    )


def _why_left_out(param: torch.nn.Parameter, bucket: Any, layout: _Layout) -> str | None:
    """Why the norms leave a parameter out on this rank; None where its gradient before the
    reduction is this replica's whole gradient of it, counted once. Left out is everything
    upstream's finalize reduces again after the data-parallel reduction (summed over TP or across
    pipeline stages: the local value is a partial sum)."""
    if not getattr(
        param, "allreduce", True
    ):  # an expert's: reduced over the expert data-parallel group
        return EXPERTS
    if getattr(
        param, "shared_embedding", False
    ):  # tied across pipeline stages: summed after the reduction
        return TIED_EMBEDDING
    if getattr(
        param, "sequence_parallel", False
    ):  # a partial sum over TP until finalize all-reduces it
        return SEQUENCE_PARALLEL
    if layout.tp_size > 1 and getattr(param, "average_gradients_across_tp_domain", False):
        return TP_AVERAGED
    if layout.tp_size > 1 and id(param) in layout.names.qk_layernorm:
        return QK_LAYERNORM
    if layout.pp_size > 1 and (
        getattr(param, "flextron_router_pp_sync", False) or id(param) in layout.names.cond_embedder
    ):
        # routers and conditional embedders replicated per stage, summed across them in finalize
        return PP_SYNCED
    if _span(param, bucket) is None:
        return HELD_APART
    if getattr(param, "tensor_model_parallel", False):
        return None
    if layout.tp_rank != 0:
        return TP_DUPLICATE
    if layout.tp_size > 1 and id(param) not in layout.names.known:
        # its name may make it a q/k layernorm: left out of both norms until it is known
        return UNNAMED
    return None


def _owned(ranges: Sequence[tuple[int, int]], bucket: Any, group: Any) -> list[tuple[int, int]]:
    """The part of ``ranges`` whose reduced values this rank holds and counts: with the distributed
    optimizer the shard its reduce-scatter wrote, else everything on data-parallel rank 0 (every
    rank holds all of S)."""
    if group.ddp_config.use_distributed_optimizer:
        size = group.intra_distributed_optimizer_instance_size
        shard = bucket.grad_data.numel() // size
        low = group.intra_distributed_optimizer_instance_rank * shard
        high = low + shard
    elif group.data_parallel_group.rank() == 0:
        return list(ranges)
    else:
        return []
    return [
        (max(start, low), min(end, high)) for start, end in ranges if start < high and end > low
    ]
