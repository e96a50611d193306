"""``megatron-ga verify --fuzz N --seed S``: layouts drawn at random, each against the unpartitioned reference.

verify's default layouts are the ones we chose; the fuzzer draws the rest of the space a user can run, so that the
next bug of the router-count kind (Megatron-LM #7452) is ours to find first. Each draw picks, under the rules
megatron-core itself enforces (and the CPU's: at most 4 ranks, no Transformer Engine):

* a model: dense GPT, MoE (aux_loss, seq_aux_loss or global_aux_loss; the expert bias), MTP, MoE + MTP, and,
  under CP, the position-wise models (attention under CP needs Transformer Engine's ring attention);
* TP (with or without sequence parallelism), PP and VPP, CP, EP, DP, with world = TP x PP x CP x DP <= 4;
* MBS and GA, and per-sample loss-token counts drawn from 1 to the sequence length, so that units, DP ranks, CP
  and TP shards hold uneven counts;
* overlapped grad reduce and the distributed optimizer.

Each draw runs one step in both modes through install(), like every verify row, and checks token mode against the
token reference with N = the batch's loss tokens, and microbatch mode against the mean-of-means reference. Draw k of
seed S is the same on every machine (``random.Random(S)``): ``--fuzz N --seed S --draw k`` reruns it alone, and a
failing draw prints its ``Layout(...)`` and lengths, a row to add to :data:`layouts.DEFAULT_LAYOUTS`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from megatron_ga_ext.verify.layouts import Layout

__all__ = ["Draw", "draw_layouts"]

SEQ_LENGTH = 16
MAX_WORLD = 4
MOE_KINDS = ("moe", "moe_seq", "moe_global", "moe_bias")


@dataclass(frozen=True)
class Draw:
    """One drawn layout and the loss tokens of each sample of its global batch."""

    index: int
    layout: Layout
    lengths: tuple[int, ...]

    @property
    def row(self) -> str:
        """The draw as a verify row: the layout's constructor and the batch's lengths."""
        return f"{self.layout!r}, lengths={self.lengths}"


def draw_layouts(count: int, seed: int) -> list[Draw]:
    """``count`` draws from ``random.Random(seed)``; draw k depends on the seed and k alone."""
    return [_draw(random.Random(f"{seed}:{k}"), k) for k in range(count)]


def _draw(rng: random.Random, index: int) -> Draw:
    cp = rng.choice((1, 1, 2))
    if cp > 1:
        model = rng.choice(("positionwise", "moe_positionwise"))
        tp, pp, vpp = 1, 1, 1
    else:
        model = rng.choice(("gpt", *MOE_KINDS, "mtp", "moe_mtp"))
        tp = rng.choice((1, 2)) if "mtp" not in model else 1  # MTP's norms under sequence parallelism need TE
        pp = rng.choice((1, 2)) if tp == 1 and "mtp" not in model else 1
        vpp = rng.choice((1, 2)) if pp > 1 else 1
    dp = rng.choice([d for d in (1, 2, 4) if tp * pp * cp * d <= MAX_WORLD])
    moe = model in MOE_KINDS or model in ("moe_mtp", "moe_positionwise")
    ep = rng.choice([e for e in (1, 2) if dp % e == 0]) if moe and tp == 1 and cp == 1 else 1
    micro_batch_size = rng.choice((1, 2))
    ga_choices = (1, 2, 4) if pp == 1 else (pp, 2 * pp)  # the interleaved schedule wants GA a multiple of PP
    num_microbatches = rng.choice(ga_choices)
    distributed_optimizer = dp > 1 and rng.random() < 0.3
    layout = Layout(
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1 and rng.random() < 0.7,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp, expert_model_parallel_size=ep, data_parallel_size=dp,
        num_microbatches=num_microbatches, micro_batch_size=micro_batch_size, model=model,
        overlap_grad_reduce=rng.random() < 0.3, distributed_optimizer=distributed_optimizer)
    lengths = tuple(rng.randint(1, SEQ_LENGTH) for _ in range(layout.global_batch_size))
    return Draw(index, layout, lengths)


@dataclass(frozen=True)
class DrawResult:
    """One draw's verdict on one rank: its rows (both modes), or why it did not run."""

    draw: Draw
    results: tuple = ()
    """LayoutResult of each mode (harness.py)."""
    limited: str | None = None
    """A limit the coverage table states for this layout on this release: not run."""
    error: str | None = None
    """The exception the step raised, if any."""


SEQ_AUX_BEFORE_0_19 = "seq_aux_loss with --micro-batch-size > 1 before 0.19: upstream's per-sequence count (1 / MBS)"


def seq_aux_limited(layout: Layout) -> bool:
    """seq_aux_loss at MBS > 1 on a release whose router keeps its per-sequence count (a limit docs/reduction.md
    states)."""
    from megatron_ga_ext.integration.aux_losses import router_scales_by_tp_cp

    return layout.model == "moe_seq" and layout.micro_batch_size > 1 and not router_scales_by_tp_cp()


def known_limit(draw: Draw) -> str | None:
    """A draw whose layout meets a limit the docs state on the installed megatron-core, or None."""
    from megatron.core.transformer import multi_token_prediction

    layout = draw.layout
    if seq_aux_limited(layout):
        return SEQ_AUX_BEFORE_0_19
    if "mtp" in layout.model and not hasattr(multi_token_prediction, "process_mtp_loss") and min(draw.lengths) <= 1:
        return "MTP on 0.16 with a sample of one loss token: upstream divides microbatch mode's MTP mean by 0"
    return None


def run_draws(draws: tuple[Draw, ...], device: str = "cpu") -> list[DrawResult]:
    """This rank's verdict on each draw (every draw of a launch has the launch's world size). An exception of the
    step is kept as the draw's error (every rank raises it alike where megatron-core refuses the layout)."""
    from megatron_ga_ext.verify.harness import VerifyConfig, run_rank

    out = []
    for draw in draws:
        limit = known_limit(draw)
        if limit is not None:
            out.append(DrawResult(draw, limited=limit))
            continue
        cfg = VerifyConfig(layouts=(draw.layout,), lengths=draw.lengths, device=device, progress=False)
        try:
            out.append(DrawResult(draw, results=tuple(run_rank(cfg))))
        except Exception as exc:
            out.append(DrawResult(draw, error=f"{type(exc).__name__}: {exc}"))
    return out
