"""Megatron's parsed args, read through one typed view. Pure Python.

Megatron hands its settings around as an ``argparse.Namespace`` whose attributes depend on the
release and on how far ``validate_args`` got. :class:`MegatronArgs` wraps one (or a dict by argparse
destination, as ``megatron-ga check`` reads a launch line) and answers each flag
``core/megatron_flags.py`` declares with its type; a flag the args lack reads as Megatron's default
there. Nothing else in the package reads ``args`` by name.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_ga_ext.config.flags import BY_DEST

__all__ = ["MegatronArgs"]

#: ``get``'s default: the declared default of the flag.
_DECLARED = object()


@dataclass(frozen=True)
class MegatronArgs:
    """A read-only view of Megatron's args by argparse destination (``args.micro_batch_size``
    ...)."""

    values: Mapping[str, Any] = field(default_factory=dict)
    """Every value the args hold, by destination; absent ones read as their declared default."""

    @classmethod
    def of(cls, args: argparse.Namespace | Mapping[str, Any] | MegatronArgs | None) -> MegatronArgs:
        """From a Namespace, a dict by destination, another view, or None (a loop without Megatron's
        args)."""
        if isinstance(args, MegatronArgs):
            return args
        if args is None:
            return cls({})
        return cls(
            args if isinstance(args, Mapping) else vars(args)
        )  # a view: a Namespace's values as they change

    def has(self, dest: str) -> bool:
        """The args hold ``dest`` (a release or parser without the flag does not)."""
        return dest in self.values

    def get(self, dest: str, default: Any = _DECLARED) -> Any:
        """The value of ``dest``; where absent, ``default`` if given, else its flag's declared
        default (or None)."""
        if dest in self.values:
            return self.values[dest]
        if default is not _DECLARED:
            return default
        return BY_DEST[dest].default if dest in BY_DEST else None

    def _int(self, dest: str) -> int | None:
        value = self.get(dest)
        return None if value is None else int(value)

    def _on(self, dest: str) -> bool:
        return bool(self.get(dest))

    # -- the batch arithmetic ------------------------------------------------------------------

    @property
    def micro_batch_size(self) -> int | None:
        return self._int("micro_batch_size")

    @property
    def global_batch_size(self) -> int | None:
        return self._int("global_batch_size")

    @property
    def rampup_batch_size(self) -> list[Any] | None:
        """``--rampup-batch-size START INCREMENT SAMPLES`` as given (read exactly by
        core/schedule/rampup.py)."""
        value = self.get("rampup_batch_size")
        return list(value) if value else None

    @property
    def step_batch_size_schedule(self) -> str | None:
        value = self.get("step_batch_size_schedule")
        return None if value is None else str(value)

    @property
    def decrease_batch_size_if_needed(self) -> bool:
        return self._on("decrease_batch_size_if_needed")

    @property
    def seq_length(self) -> int | None:
        return self._int("seq_length")

    @property
    def train_iters(self) -> int | None:
        return self._int("train_iters")

    @property
    def train_samples(self) -> int | None:
        return self._int("train_samples")

    # -- the layout ------------------------------------------------------------------------------

    @property
    def world_size(self) -> int | None:
        return self._int("world_size")

    @property
    def tensor_model_parallel_size(self) -> int:
        return self._int("tensor_model_parallel_size") or 1

    @property
    def pipeline_model_parallel_size(self) -> int:
        return self._int("pipeline_model_parallel_size") or 1

    @property
    def context_parallel_size(self) -> int:
        return self._int("context_parallel_size") or 1

    @property
    def virtual_pipeline_model_parallel_size(self) -> int | None:
        """VPP as Megatron derives it (``validate_args`` sets it from the flags that give it)."""
        return self._int("virtual_pipeline_model_parallel_size")

    @property
    def microbatch_group_size_per_vp_stage(self) -> int | None:
        return self._int("microbatch_group_size_per_vp_stage")

    @property
    def num_distributed_optimizer_instances(self) -> int:
        return self._int("num_distributed_optimizer_instances") or 1

    @property
    def data_parallel_size(self) -> int | None:
        """DP = world / (TP x PP x CP), as Megatron derives it (``validate_args`` sets it; before
        that, from the world size and the other sizes); None where neither is known."""
        given = self._int("data_parallel_size")
        if given:
            return given
        world = self.world_size
        if world is None:
            return None
        return world // (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )

    # -- the loss and the schedules that run another number of forward passes -------------------

    @property
    def calculate_per_token_loss(self) -> bool | None:
        """``--calculate-per-token-loss``; None where the args do not hold it (a loop without
        Megatron's parser)."""
        return (
            bool(self.values["calculate_per_token_loss"])
            if self.has("calculate_per_token_loss")
            else None
        )

    @property
    def hybrid_context_parallel(self) -> bool:
        return self._on("hybrid_context_parallel")

    @property
    def rl_sequence_packing(self) -> bool:
        """``--perform-rl-step`` with ``--rl-use-sequence-packing``: packed RL batches count bins,
        not samples."""
        return self._on("perform_rl_step") and self._on("rl_use_sequence_packing")

    @property
    def use_megatron_fsdp(self) -> bool:
        return self._on("use_megatron_fsdp")

    # -- the run in progress, set by Megatron-LM's loop -------------------------------------------

    @property
    def consumed_train_samples(self) -> int:
        return self._int("consumed_train_samples") or 0

    @property
    def iteration(self) -> int:
        """The last completed (or loaded) iteration."""
        return self._int("iteration") or 0

    @property
    def curr_iteration(self) -> int | None:
        """The iteration in progress, counted from 0 (Megatron's log numbers it + 1)."""
        return self._int("curr_iteration")

    def directory(self, dest: str) -> str | None:
        """A checkpoint directory flag's value (``save``, ``load``, ``pretrained_checkpoint``); None
        where unset."""
        value = self.get(dest, None)
        return str(value) if value else None

    @property
    def rerun_mode(self) -> str:
        """``disabled`` where the args do not hold it (a loop without Megatron-LM's rerun
        machine)."""
        return str(self.get("rerun_mode", "disabled"))

    @property
    def check_for_nan_in_loss_and_grad(self) -> bool:
        """Off where the args do not hold it (a loop without Megatron-LM's rerun machine)."""
        return bool(self.get("check_for_nan_in_loss_and_grad", False))

    # -- the learning-rate schedule (in samples) ---------------------------------------------------

    @property
    def lr_decay_samples(self) -> int | None:
        return self._int("lr_decay_samples")

    @property
    def lr_warmup_samples(self) -> int | None:
        return self._int("lr_warmup_samples")

    @property
    def lr_warmup_fraction(self) -> float | None:
        value = self.get("lr_warmup_fraction", None)
        return None if value is None else float(value)

    @property
    def lr_decay_style(self) -> str | None:
        value = self.get("lr_decay_style", None)
        return None if value is None else str(value)

    @property
    def lr_wsd_decay_samples(self) -> int | None:
        return self._int("lr_wsd_decay_samples")
