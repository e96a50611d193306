"""The e2e run's record: with ``MEGATRON_GA_RECORD`` set, rank R appends JSON lines to
``<record>.rank<R>.jsonl``:

* ``{"event": "start", "megatron": <path of the megatron package>, "version": ...}``;
* per logged iteration (``training_log``): iteration, consumed samples, the calculator's GBS and
  num_microbatches, learning rate (Megatron's: what its scheduler wrote after the step),
  ``trained_lr`` (the first param group's rate when torch's optimizer stepped in this iteration,
  read by a global step pre-hook; None where no step ran: a skipped step), ``optimizer_state``
  ([parameters holding state, parameters] of that torch optimizer on this rank after the step:
  torch's Adam keeps no state for a parameter whose gradient was None), losses, grad norm, skipped,
  whether this rank is a last pipeline stage, ``mask_tokens`` (the sum of the loss masks this rank's
  loss functions saw since the last iteration, read from pretrain_gpt's ``loss_func`` partial; not
  read while a CUDA graph is being captured, where a host read would end the capture, nor run where
  a captured graph replays), and from megatron-ga-ext when installed: ``num_tokens`` (the global N
  of the step) and ``forward_steps`` (the guard's count of forward steps per model chunk);
* ``{"event": "end", "train_iters": ..., "error": <type: message> or null}``.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from tests.support.faults import current_iteration, faulty_loss, reinstall
from tests.support.step_values import add_step_values, last_num_tokens

__all__ = ["Recorder"]


class Recorder:
    """Appends one JSON object per event to this rank's file."""

    def __init__(self, prefix: str, faults: dict[str, int | None] | None = None) -> None:
        rank = os.environ.get("RANK", "0")
        self.path = f"{prefix}.rank{rank}.jsonl"
        self.mask_tokens = 0
        self.zeroed_tokens = 0
        self.faults = faults or {}
        """This rank's faults (faults.py's ``rank_faults``) that act on the forward step or the loss
        function."""
        self.microbatches: Counter = Counter()
        """Forward steps per iteration, so a fault can pick the first micro-batch of one."""
        self.trained_lr: float | None = None
        self.optimizer_state: list[int] | None = None

    def watch_optimizer_steps(self) -> None:
        """Keep the rate each of torch's optimizer steps trains with, and how many of its parameters
        hold state after it (the first step since the last logged row)."""
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            if self.trained_lr is None:
                self.trained_lr = float(optimizer.param_groups[0]["lr"])

        def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            if self.optimizer_state is None:
                params = [p for group in optimizer.param_groups for p in group["params"]]
                self.optimizer_state = [
                    sum(1 for p in params if optimizer.state.get(p)),
                    len(params),
                ]

        register_optimizer_step_pre_hook(before_step)
        register_optimizer_step_post_hook(after_step)
        # N of each step as finalize hands it on: a feature of the test's own (step_values.py)
        add_step_values()

    def write(self, row: dict) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(row) + "\n")

    def training_log(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def training_log(
            loss_dict: dict,
            total_loss_dict: dict,
            learning_rate: Any,
            iteration: int,
            loss_scale: Any,
            report_memory_flag: Any,
            skipped_iter: Any,
            grad_norm: Any,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            self.write(
                self._iteration_row(loss_dict, learning_rate, iteration, skipped_iter, grad_norm)
            )
            if self._at("reinstall-at", int(iteration)):
                reinstall()
            return original(
                loss_dict,
                total_loss_dict,
                learning_rate,
                iteration,
                loss_scale,
                report_memory_flag,
                skipped_iter,
                grad_norm,
                *args,
                **kwargs,
            )

        return training_log

    def _iteration_row(
        self, loss_dict: dict, learning_rate: Any, iteration: int, skipped_iter: Any, grad_norm: Any
    ) -> dict:
        from megatron.core import num_microbatches_calculator as calculators
        from megatron.core import parallel_state
        from megatron.training.global_vars import get_args

        from megatron_ga_ext.integration.features.guards import Guards
        from megatron_ga_ext.integration.lifecycle import installed

        state = installed()
        guards = None if state is None else state.feature(Guards)
        counter = None if guards is None else guards.counter
        row = {
            "event": "iteration",
            "iteration": int(iteration),
            "consumed_samples": int(get_args().consumed_train_samples),
            "global_batch_size": int(calculators.get_current_global_batch_size()),
            "num_microbatches": int(calculators.get_num_microbatches()),
            "learning_rate": None if learning_rate is None else float(learning_rate),
            "trained_lr": self.trained_lr,
            "optimizer_state": self.optimizer_state,
            "loss": {key: float(value) for key, value in loss_dict.items()},
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "skipped": int(skipped_iter),
            "last_stage": parallel_state.is_pipeline_last_stage(ignore_virtual=True),
            "mask_tokens": self.mask_tokens,
            "zeroed_tokens": self.zeroed_tokens,
            "num_tokens": None if state is None else last_num_tokens(state),
            "forward_steps": None if counter is None else sorted(counter.counts.values()),
            # when Megatron logged the iteration (its log interval is 1 here)
            "time": time.perf_counter(),
        }
        self.mask_tokens = self.zeroed_tokens = 0
        self.trained_lr = self.optimizer_state = None
        return row

    def pretrain(self, original: Callable) -> Callable:
        """``pretrain`` whose forward step reports each micro-batch's loss-mask sum."""

        signature = inspect.signature(original)  # 0.18 puts a config container first

        @functools.wraps(original)
        def pretrain(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.arguments["forward_step_func"] = self._counting(
                bound.arguments["forward_step_func"]
            )
            return original(*bound.args, **bound.kwargs)

        return pretrain

    def _counting(self, forward_step_func: Callable) -> Callable:
        from megatron_ga_ext.integration.hooks import stream_capturing

        @functools.wraps(forward_step_func)
        def forward_step(*args: Any, **kwargs: Any) -> Any:
            result = forward_step_func(*args, **kwargs)
            loss_func = result[1] if isinstance(result, tuple) and len(result) == 2 else None
            mask = (
                loss_func.args[0]
                if isinstance(loss_func, functools.partial) and loss_func.args
                else None
            )
            iteration = current_iteration()
            first = self.microbatches[iteration] == 0
            self.microbatches[iteration] += 1
            if hasattr(mask, "sum") and not stream_capturing():
                if self._at("zero-tokens-at", iteration) or (
                    first and self._at("empty-microbatch-at", iteration)
                ):
                    self.zeroed_tokens += int(mask.sum())
                    mask.zero_()
                self.mask_tokens += int(mask.sum())
            if loss_func is not None:
                nan = first and self._at("nan-loss-at", iteration)
                if nan or "two-tuple-loss" in self.faults:
                    result = (result[0], faulty_loss(loss_func, nan=nan))
            return result

        return forward_step

    def _at(self, fault: str, iteration: int) -> bool:
        return fault in self.faults and self.faults[fault] == iteration
