"""``schedule --plot``: the stage table drawn (GBS and num_microbatches against tokens or samples);
with ``--suggest`` the measured B_simple against the suggested schedule is science/cli/plots.py.
matplotlib is imported only in :func:`pyplot`, on demand.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

from megatron_ga_ext.cli.hints import install_hint
from megatron_ga_ext.core.schedule.step_schedule import StageRow
from megatron_ga_ext.errors import UsageError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["count_label", "plot_schedule", "pyplot", "save_figure"]


def plot_schedule(
    rows: list[StageRow],
    path: str,
    seq_length: int | None = None,
    train_samples: int | None = None,
    *,
    micro_batch_size: int | None = None,
    data_parallel_size: int | None = None,
) -> None:
    """Draw GBS and num_microbatches (steps) against tokens, or samples without a seq_length, to
    ``path``: the consumed axis in K, M, B, T, each stage labelled with its GBS and first step,
    whole micro-batch ticks, and MBS, DP and the sequence length in the title."""
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    scale = seq_length or 1
    used = [r for r in rows if r.first_sample is not None] or rows[:1]
    xs = [
        (r.first_sample if r.first_sample is not None else r.threshold_samples) * scale
        for r in used
    ]
    last = used[-1]
    end = train_samples or (last.first_sample or last.threshold_samples) * 1.25 or 1
    end_x = max(end * scale, xs[-1] + 1)
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5), dpi=100)
    top.step(
        xs + [end_x],
        [r.global_batch_size for r in used] + [last.global_batch_size],
        where="post",
        color="C0",
    )
    top.set_ylabel("global batch size")
    top.margins(y=0.3)  # room for the stage labels under the title
    for x, row in zip(xs, used):
        top.annotate(
            f"GBS {row.global_batch_size:,}\nstep {row.first_step or 0:,}",
            (x, row.global_batch_size),
            xytext=(3, 3),
            textcoords="offset points",
            fontsize=7,
            va="bottom",
        )
    bottom.step(
        xs + [end_x],
        [r.num_microbatches for r in used] + [last.num_microbatches],
        where="post",
        color="C1",
    )
    bottom.set_ylabel("num_microbatches")
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.xaxis.set_major_formatter(FuncFormatter(lambda value, _: count_label(value)))
    bottom.set_xlabel("tokens consumed" if seq_length else "samples consumed")
    for axis in (top, bottom):
        axis.grid(True, alpha=0.3)
    layout = ", ".join(
        part
        for part in (
            f"MBS {micro_batch_size}" if micro_batch_size else "",
            f"DP {data_parallel_size}" if data_parallel_size else "",
            f"seq {seq_length:,}" if seq_length else "",
        )
        if part
    )
    top.set_title("step batch-size schedule" + (f" ({layout})" if layout else ""))
    figure.tight_layout()
    save_figure(plt, figure, path)


def count_label(value: float) -> str:
    """``2.4B``, ``500M``, ``0``: a count on an axis in the schedule's own suffixes."""
    for suffix, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= size:
            return f"{value / size:g}{suffix}"
    return f"{value:g}"


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend (files only, no display); a UsageError naming the extra
    without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(f"--plot needs matplotlib: {install_hint('plot')}.") from None
    return plt


def save_figure(plt: ModuleType, figure: Figure, path: str) -> None:
    """Write ``figure`` to ``path`` and close it; a UsageError where the file cannot be written."""
    try:
        figure.savefig(path)
    except OSError as error:
        raise UsageError(
            f"--plot {path}: cannot write the figure ({error.strerror or error})."
        ) from None
    finally:
        plt.close(figure)
