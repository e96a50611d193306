"""What each choice of a launch costs: memory per GPU (what the micro-batch moves and what it does
not), compute per step, and the same global batch laid out other ways, before the allocation. Pure
Python.

The layout (world, TP, PP, CP, VPP, MBS, GBS) is check's; the model, precision and recompute flags
are read from the same words (launch/model_flags.py). An alternative keeps the world size, the
global batch and the model, and trades MBS against GA or DP against TP, PP or CP; it is shown only
where check's whole rule pass (``check_launch`` on the edited line) and the model's rules find
nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from megatron_ga_ext.core.flops import step_flops
from megatron_ga_ext.core.memory import Memory, Parallel, Precision, Recompute, memory
from megatron_ga_ext.core.model_shape import ModelShape, padded_vocab
from megatron_ga_ext.launch.line import Launch
from megatron_ga_ext.launch.model_flags import (
    line_words,
    model_problems,
    model_shape,
    precision_of,
    read_model_args,
    recompute_of,
)
from megatron_ga_ext.launch.report import Edit, Problem, Report

__all__ = ["Costs", "Layout", "Row", "launch_costs"]

#: Alternatives listed beside the launch's own row; nearest layouts offered when the launch does not
#: fit.
LISTED = 5
FITTING = 3
_VPP_FLAGS = ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank")


@dataclass(frozen=True)
class Layout:
    """One way to lay out the launch's global batch on its world."""

    tp: int
    pp: int
    cp: int
    mbs: int
    vpp: int | None = None

    def edit(self, own: Layout) -> Edit:
        """The edit of the launch line that gives this layout (VPP flags go where PP changes)."""
        flags = (
            ("--tensor-model-parallel-size", self.tp, own.tp),
            ("--pipeline-model-parallel-size", self.pp, own.pp),
            ("--context-parallel-size", self.cp, own.cp),
            ("--micro-batch-size", self.mbs, own.mbs),
        )
        give = tuple((flag, (str(new),)) for flag, new, old in flags if new != old)
        drop = _VPP_FLAGS if self.pp != own.pp and own.vpp is not None else ()
        return Edit(give=give, drop=drop)

    def distance(self, own: Layout) -> float:
        """How far from the launch: each doubling or halving of a size counts 1."""
        pairs = ((self.tp, own.tp), (self.pp, own.pp), (self.cp, own.cp), (self.mbs, own.mbs))
        return sum(abs(math.log2(a / b)) for a, b in pairs)


@dataclass(frozen=True)
class Row:
    layout: Layout
    dp: int
    ga: int
    memory: Memory
    dp_syncs: int
    bubble: float
    flops_per_gpu: float
    own: bool = False


@dataclass(frozen=True)
class Costs:
    """The costs section of check: None fields where the line does not give what they need."""

    model: ModelShape | None = None
    precision: Precision | None = None
    recompute: Recompute | None = None
    own: Row | None = None
    flops_per_step: float | None = None
    rows: tuple[Row, ...] = ()
    budget: float | None = None
    budget_name: str | None = None
    fitting: tuple[Row, ...] = ()
    assumed: tuple[str, ...] = ()
    problems: tuple[Problem, ...] = ()
    why_none: str | None = None

    @property
    def fits(self) -> bool | None:
        if self.budget is None or self.own is None:
            return None
        return self.own.memory.total <= self.budget


@dataclass
class _Context:
    model: ModelShape
    args: dict[str, object]
    world: int
    gbs: int
    precision: Precision
    recompute: Recompute
    sp: bool
    ep: int
    etp: int | None
    vocab: int
    divisible: int
    rows: dict[Layout, Row] = field(default_factory=dict)
    models: dict[int, ModelShape] = field(default_factory=dict)
    flops: dict[int, float] = field(default_factory=dict)
    candidates: list[Layout] = field(default_factory=list)


def _flops(context: _Context, model: ModelShape) -> float:
    if model.padded_vocab_size not in context.flops:
        context.flops[model.padded_vocab_size] = step_flops(model, context.gbs)
    return context.flops[model.padded_vocab_size]


def launch_costs(
    tokens: Sequence[str],
    launch: Launch,
    report: Report,
    check: Callable[[Launch], Report],
    budget: tuple[float, str] | None = None,
) -> Costs:
    """The costs of the launch ``report`` is check's report of; ``check`` runs check's whole pass on
    an edited line; ``budget``: (bytes per GPU, how it was given)."""
    args, spelled = read_model_args(line_words(tokens))
    ledger = report.ledger
    tp = ledger.get("tensor_model_parallel_size")
    problems = tuple(model_problems(args, spelled, tp if isinstance(tp, int) and tp > 0 else 1))
    layout = report.layout
    if layout is None:
        return Costs(problems=problems, why_none="the layout breaks a rule (see the problems)")
    model, assumed = model_shape(args, layout.tensor_model_parallel_size, layout.seq_length)
    if model is None:
        return Costs(
            problems=problems, why_none="give --num-layers, --hidden-size, --num-attention-heads"
        )
    if args.get("hybrid_layer_pattern"):
        why = (
            "hybrid Mamba models are not estimated, as upstream's formula does not (docs/memory.md)"
        )
        return Costs(model=model, problems=problems, why_none=why)
    if problems:
        return Costs(model=model, problems=problems, why_none="the model's flags break a rule")
    vocab = args.get("vocab_size")
    context = _Context(
        model=model,
        args=args,
        world=layout.world_size,
        gbs=layout.samples_per_step,
        precision=precision_of(args),
        recompute=recompute_of(args),
        sp=bool(args.get("sequence_parallel")),
        ep=layout.expert_model_parallel_size,
        etp=layout.expert_tensor_parallel_size,
        vocab=vocab if isinstance(vocab, int) else 50257,
        divisible=int(args.get("make_vocab_size_divisible_by") or 128),
    )
    own_layout = Layout(
        layout.tensor_model_parallel_size,
        layout.pipeline_model_parallel_size,
        layout.context_parallel_size,
        layout.micro_batch_size,
        layout.virtual_pipeline_model_parallel_size,
    )
    own = replace(_row(context, own_layout), own=True)
    costs = Costs(
        model=model,
        precision=context.precision,
        recompute=context.recompute,
        own=own,
        flops_per_step=step_flops(model, context.gbs),
        budget=budget[0] if budget else None,
        budget_name=budget[1] if budget else None,
        assumed=tuple(assumed),
    )
    if report.stages is not None:
        return replace(costs, why_none="a batch schedule: alternatives are for a constant batch")
    valid = _validator(launch, own_layout, check, context, report)
    rows = _alternatives(context, own_layout, valid)
    fitting: tuple[Row, ...] = ()
    if costs.fits is False and costs.budget is not None:
        fitting = _fitting(context, own_layout, valid, costs.budget)
    return replace(costs, rows=(own, *rows), fitting=fitting)


def _row(context: _Context, layout: Layout) -> Row:
    """Memory, syncs, bubble and compute of ``layout`` (each computed once)."""
    if layout not in context.rows:
        context.rows[layout] = _new_row(context, layout)
    return context.rows[layout]


def _model_at(context: _Context, tp: int) -> ModelShape:
    """The model at TP ``tp``: Megatron pads the vocabulary to a multiple of
    make_vocab_size_divisible_by x TP."""
    if tp not in context.models:
        vocab = padded_vocab(context.vocab, context.divisible, tp)
        context.models[tp] = replace(context.model, padded_vocab_size=vocab)
    return context.models[tp]


def _new_row(context: _Context, layout: Layout) -> Row:
    model = _model_at(context, layout.tp)
    dp = context.world // (layout.tp * layout.pp * layout.cp)
    ga = context.gbs // (layout.mbs * dp)
    par = Parallel(
        world_size=context.world,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp and layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=context.ep,
        expert_tensor_parallel_size=context.etp,
        sequence_parallel=context.sp and layout.tp > 1,
    )
    mem = memory(model, par, context.precision, layout.mbs, ga, context.recompute)
    vpp = layout.vpp or 1
    bubble = (layout.pp - 1) / (vpp * ga + layout.pp - 1)
    return Row(
        layout=layout,
        dp=dp,
        ga=ga,
        memory=mem,
        dp_syncs=0 if dp == 1 else 1,
        bubble=bubble,
        flops_per_gpu=_flops(context, model) / context.world,
    )


def _validator(
    launch: Launch,
    own: Layout,
    check: Callable[[Launch], Report],
    context: _Context,
    report: Report,
) -> Callable[[Layout], bool]:
    """Whether a layout passes check's whole rule pass and the model's rules (each layout checked
    once): it may keep a problem the launch has (a flag the layout does not touch), never add
    one."""
    seen: dict[Layout, bool] = {}
    kept = {(p.rule, p.flag) for p in report.problems}

    def valid(layout: Layout) -> bool:
        if layout not in seen:
            model_ok = not model_problems(context.args, {}, layout.tp)
            after = check(launch.edited(layout.edit(own))).problems
            seen[layout] = model_ok and all((p.rule, p.flag) in kept for p in after)
        return seen[layout]

    return valid


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidates(context: _Context, own: Layout) -> list[Layout]:
    """Every layout that keeps the world and the global batch whole, by the batch arithmetic alone
    (the rule pass decides the rest), nearest the launch first."""
    if not context.candidates:
        context.candidates = _all_candidates(context, own)
    return context.candidates


def _all_candidates(context: _Context, own: Layout) -> list[Layout]:
    found = []
    heads, layers = context.model.num_attention_heads, context.model.num_layers
    for tp in _divisors(context.world):
        if heads % tp or tp > max(8, own.tp):
            continue
        for pp in _divisors(context.world // tp):
            if layers % pp and pp != own.pp:
                continue
            for cp in _divisors(context.world // (tp * pp)):
                if cp > 1 and context.model.seq_length % (2 * cp):
                    continue
                dp = context.world // (tp * pp * cp)
                if context.gbs % dp:
                    continue
                for mbs in _divisors(context.gbs // dp):
                    if mbs > max(16, 4 * own.mbs):
                        break  # more samples per forward only adds memory and bubble
                    found.append(Layout(tp, pp, cp, mbs, own.vpp if pp == own.pp else None))
    found.sort(key=lambda lay: (lay.distance(own), lay.tp, lay.pp, lay.cp, lay.mbs))
    return [lay for lay in found if lay != own]


def _alternatives(context: _Context, own: Layout, valid: Callable[[Layout], bool]) -> list[Row]:
    """MBS up and down at the launch's parallel sizes, then DP traded for TP, PP or CP: the nearest
    valid ones."""
    candidates = _candidates(context, own)
    same = [lay for lay in candidates if (lay.tp, lay.pp, lay.cp) == (own.tp, own.pp, own.cp)]
    traded = [lay for lay in candidates if (lay.tp, lay.pp, lay.cp) != (own.tp, own.pp, own.cp)]
    picked: list[Layout] = []
    for group, limit in ((same, 2), (traded, LISTED)):
        count = 0
        for lay in group:
            if len(picked) >= LISTED or count >= limit:
                break
            if valid(lay):
                picked.append(lay)
                count += 1
    return sorted((_row(context, lay) for lay in picked), key=lambda r: r.memory.total)


def _fitting(
    context: _Context, own: Layout, valid: Callable[[Layout], bool], budget: float
) -> tuple[Row, ...]:
    """The nearest valid layouts whose memory per GPU fits ``budget``."""
    found: list[Row] = []
    for lay in _candidates(context, own):
        row = _row(context, lay)
        if row.memory.total <= budget and valid(lay):
            found.append(row)
            if len(found) >= FITTING:
                break
    return tuple(found)
