"""Where the noise-scale meter reports a measurement: a line after the iteration's (printed by the
last rank, as Megatron prints), TensorBoard and W&B through the loop's writers, and the trace file
(``--ga-noise-scale-trace``).

The measurement is read in the optimizer step, before the loop prints the iteration's line: where
the loop's ``training_log`` is wired to print a held line after its own
(megatron_lm.printing_after_training_log, Bridge's likewise), the line waits for it; else it is
printed at once.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_ga_ext.integration.host import Host, current_host
from megatron_ga_ext.science.core.noise_trace import SCALARS, json_line, log_line, scalar_tag

__all__ = ["Reporter", "last_rank"]


class Reporter:
    """Writes the meter's trace rows where Megatron users look, and holds the printed line for the
    loop's log."""

    def __init__(self, trace_path: str | None) -> None:
        self.trace_path = trace_path
        self.held_line: str | None = None
        """The log line waiting for Megatron's ``training_log`` to return
        (megatron_lm.printing_after_training_log)."""

    def write(self, row: dict[str, Any]) -> None:
        """On the last rank: the row's line (it gives the consumed samples after the step, so
        ``--suggest`` reads a log whatever K and --log-interval), its scalars to the loop's
        TensorBoard and W&B writers, and the row to the trace file."""
        if not last_rank():
            return
        host = current_host()
        self._say(log_line(row), host)
        scalars = {scalar_tag(name): row[name] for name in SCALARS if row[name] is not None}
        host.record_metrics(scalars, row["iteration"])
        if self.trace_path:
            with open(self.trace_path, "a") as handle:
                handle.write(json_line(row))

    def _say(self, line: str, host: Host) -> None:
        """Print ``line``, or hold it for :meth:`say_held` where the host's ``training_log`` prints
        it after its own (the report runs in the optimizer step, before the loop prints the
        iteration's line)."""
        self.say_held()  # a line still held (no training_log since) is printed, not lost
        if host.prints_after_log():
            self.held_line = line
        else:
            host.print_line(line)

    def say_held(self) -> None:
        """Print the held log line, if any."""
        line, self.held_line = self.held_line, None
        if line is not None:
            current_host().print_line(line)


def last_rank() -> bool:
    """This rank is the one that reports: the last, where Megatron prints and keeps its writers."""
    if not torch.distributed.is_initialized():
        return True
    return bool(torch.distributed.get_rank() == torch.distributed.get_world_size() - 1)
