"""``schedule --suggest ... --plot``: the measured B_simple against the suggested schedule.
matplotlib is imported only through cli/plots.py's :func:`~megatron_ga_ext.cli.plots.pyplot`, on
demand."""

from __future__ import annotations

from megatron_ga_ext.cli.plots import pyplot, save_figure
from megatron_ga_ext.science.core.noise_trace import TraceRow
from megatron_ga_ext.science.core.suggest import DoublingRule, Suggestion

__all__ = ["plot_suggestion"]


def plot_suggestion(
    trace: list[TraceRow],
    suggestion: Suggestion,
    rule: DoublingRule,
    path: str,
    seq_length: int | None = None,
    train_samples: int | None = None,
) -> None:
    """Draw the measured B_simple (and x trust), the suggested GBS, the 2 x GBS trigger and the
    frozen ranges, against samples (or tokens with a seq_length), on a log scale, to ``path``; to
    ``train_samples`` if given."""
    plt = pyplot()
    scale = seq_length or 1
    measured = [
        (r.consumed_samples * scale, r.b_simple_samples)
        for r in trace
        if r.b_simple_samples is not None
    ]
    last = max([r.consumed_samples for r in trace] + [t for t, _ in suggestion.schedule.stages])
    end = max(train_samples or 0, last + last // 20, 1) * scale  # the last stage gets some width
    xs = [t * scale for t, _ in suggestion.schedule.stages] + [end]
    batches = [b for _, b in suggestion.schedule.stages]
    figure, axis = plt.subplots(figsize=(8, 4.5), dpi=100)
    if measured:
        axis.plot(
            [x for x, _ in measured],
            [b for _, b in measured],
            "o-",
            color="C0",
            ms=3,
            lw=0.6,
            label="B_simple measured",
        )
        if rule.trust != 1:
            axis.plot(
                [x for x, _ in measured],
                [rule.trust * b for _, b in measured],
                "-",
                color="C0",
                lw=0.8,
                alpha=0.6,
                label=f"B_simple x trust {rule.trust:g}",
            )
    axis.step(xs, batches + batches[-1:], where="post", color="C1", lw=2, label="suggested GBS")
    axis.step(
        xs,
        [2 * b for b in batches + batches[-1:]],
        where="post",
        color="C1",
        ls="--",
        lw=0.8,
        label="2 x GBS (doubles when crossed)",
    )
    axis.axhline(rule.max_global_batch_size, color="grey", ls=":", lw=1, label="cap")
    for frozen in rule.frozen:
        axis.axvspan(
            frozen.start * scale,
            (frozen.end if frozen.end is not None else end / scale) * scale,
            color="grey",
            alpha=0.15,
            lw=0,
        )
    axis.set_yscale("log")
    axis.set_xlabel("tokens consumed" if seq_length else "samples consumed")
    axis.set_ylabel("samples")
    axis.set_title("measured critical batch (B_simple) and the suggested schedule; grey: no change")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    save_figure(plt, figure, path)
