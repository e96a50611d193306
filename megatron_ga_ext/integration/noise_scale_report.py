"""Where the noise-scale meter reports a measurement: a line after the iteration's (printed by the last rank, as
Megatron prints), TensorBoard and W&B through the loop's writers, and the trace file (``--ga-noise-scale-trace``).

The measurement is read in the optimizer step, before the loop prints the iteration's line: where the loop's
``training_log`` is wired to print a held line after its own (megatron_lm.printing_after_training_log, Bridge's
likewise), the line waits for it; else it is printed at once.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_ga_ext.core.noise_trace import SCALARS, json_line, log_line, scalar_tag
from megatron_ga_ext.integration.compat import bridge_step_state, megatron_args

__all__ = ["Reporter", "last_rank"]


class Reporter:
    """Writes the meter's trace rows where Megatron users look, and holds the printed line for the loop's log."""

    def __init__(self, trace_path: str | None) -> None:
        self.trace_path = trace_path
        self.held_line: str | None = None
        """The log line waiting for Megatron's ``training_log`` to return (megatron_lm.printing_after_training_log)."""

    def write(self, row: dict[str, Any]) -> None:
        """On the last rank: the row's line (it gives the consumed samples after the step, so ``--suggest`` reads a
        log whatever K and --log-interval), its scalars to the loop's TensorBoard and W&B writers, and the row to the
        trace file."""
        if not last_rank():
            return
        self._say(log_line(row))
        tensorboard, wandb = _writers()
        scalars = {scalar_tag(name): row[name] for name in SCALARS if row[name] is not None}
        if tensorboard is not None:
            for name, value in scalars.items():
                tensorboard.add_scalar(name, value, row["iteration"])
        if wandb is not None:
            wandb.log(scalars, row["iteration"])
        if self.trace_path:
            with open(self.trace_path, "a") as handle:
                handle.write(json_line(row))

    def _say(self, line: str) -> None:
        """Print ``line``, or hold it for :meth:`say_held` (the report runs in the optimizer step, before Megatron
        prints the iteration's line)."""
        self.say_held()  # a line still held (no training_log since) is printed, not lost
        if _training_log_prints_after():
            self.held_line = line
        else:
            print(line, flush=True)

    def say_held(self) -> None:
        """Print the held log line, if any."""
        line, self.held_line = self.held_line, None
        if line is not None:
            print(line, flush=True)


def last_rank() -> bool:
    """This rank is the one that reports: the last, where Megatron prints and keeps its writers."""
    if not torch.distributed.is_initialized():
        return True
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


def _writers() -> tuple[Any, Any]:
    """The loop's TensorBoard and W&B writers (each made on the last rank only): Megatron-LM's global ones, where
    its training package is loaded, else those of the Megatron-Bridge step in progress (its GlobalState's)."""
    import sys

    global_vars = sys.modules.get("megatron.training.global_vars")
    if global_vars is not None and megatron_args() is not None:
        return global_vars.get_tensorboard_writer(), global_vars.get_wandb_writer()
    bridge = bridge_step_state()
    if bridge is None:
        return None, None
    return bridge.tensorboard_logger, bridge.wandb_logger


def _training_log_prints_after() -> bool:
    """Whether the loop's ``training_log`` is wired to print a held line and runs after this step: Megatron-LM's,
    or in a Megatron-Bridge step Bridge's (which it skips under ``logger.skip_train_metrics_log``). The meter is
    made after the wiring, so it asks at each report; functools.wraps carries the mark through wrappers on top."""
    import sys

    bridge = bridge_step_state()
    if bridge is not None:
        if bridge.cfg.logger.skip_train_metrics_log:
            return False
        module = "megatron.bridge.training.train"
    else:
        module = "megatron.training.training"
    training_log = getattr(sys.modules.get(module), "training_log", None)
    return bool(getattr(training_log, "megatron_ga_ext_prints_after", False))
