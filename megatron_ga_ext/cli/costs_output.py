"""check's costs section: memory per GPU split by what MBS moves, compute per step, and the same
global batch laid out other ways (launch/costs.py), in a few lines; and its JSON."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from megatron_ga_ext.cli.render import print_table
from megatron_ga_ext.errors import UsageError
from megatron_ga_ext.launch.check import check_launch
from megatron_ga_ext.launch.costs import Costs, Row, launch_costs
from megatron_ga_ext.launch.gpu_budget import gpu_memory
from megatron_ga_ext.launch.line import Launch
from megatron_ga_ext.launch.model_flag_table import NEEDS
from megatron_ga_ext.launch.report import Problem, Report

__all__ = [
    "budget_problem",
    "costs_json",
    "ledger_section",
    "print_costs",
    "with_costs",
]

GiB = 1024**3


def _gib(value: float) -> str:
    return f"{value / GiB:.1f}"


def _flops(value: float) -> str:
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.3g} FLOP"


def _precision(costs: Costs) -> tuple[str, str, str]:
    p = costs.precision
    if p is None:
        return "", "", ""
    param = "fp8" if p.fp8_param_gather else p.params_dtype
    grad = f"{p.grad_bytes * 8}-bit"
    sharded = {part: p.sharded(part) for part in ("params", "grads", "optimizer")}
    how = "/DP" if p.fsdp_sharding is None else f"/DP, FSDP {p.fsdp_sharding}"
    return (
        f"{param}{' ' + how if sharded['params'] else ''}",
        f"{grad}{' ' + how if sharded['grads'] else ''}",
        f"{p.optimizer_bytes} B/param{' ' + how if sharded['optimizer'] else ''}",
    )


def print_costs(costs: Costs) -> None:
    """Memory (the launch's), compute, the budget, and the alternatives' table."""
    if costs.own is None:
        if costs.why_none and costs.model is not None:
            print(f"memory per GPU: not estimated: {costs.why_none}.")
        return
    mem, own = costs.own.memory, costs.own
    params, grads, optim = _precision(costs)
    assumed = "".join(f"; {words}" for words in costs.assumed)
    print(
        f"memory per GPU, first pipeline stage ({mem.total_parameters / 1e9:.2f}B parameters, "
        f"{mem.params_on_rank / 1e9:.3g}B on it{assumed}):"
    )
    print(
        f"  MBS moves nothing of: parameters {_gib(mem.parameters)} GiB ({params}) + gradients "
        f"{_gib(mem.gradients)} ({grads}) + optimizer {_gib(mem.optimizer)} ({optim}) = "
        f"{_gib(mem.weights_and_optimizer)} GiB"
    )
    print(
        f"  MBS {own.layout.mbs} moves: activations {_gib(mem.activations_one_microbatch)} GiB "
        f"per micro-batch, {mem.in_flight:.3g} in flight = {_gib(mem.activations_peak)} "
        "GiB at the peak"
    )
    compute = ""
    if costs.flops_per_step is not None:
        compute = (
            f"; compute {_flops(costs.flops_per_step)} per step, {_flops(own.flops_per_gpu)} per "
            "GPU (model FLOPs)"
        )
    print(f"  total {_gib(mem.total)} GiB{_budget_words(costs)}{compute}")
    if costs.why_none:
        print(f"  alternatives: none listed: {costs.why_none}.")
    if len(costs.rows) > 1:
        print()
        _table(
            f"the same GBS {own.dp * own.ga * own.layout.mbs:,}, other layouts (* the launch)",
            costs.rows,
        )
    if costs.fitting:
        print()
        _table(f"the nearest valid layouts that fit {costs.budget_name}", costs.fitting)


def _budget_words(costs: Costs) -> str:
    if costs.fits is None or costs.budget is None or costs.own is None:
        return ""
    spare = costs.budget - costs.own.memory.total
    if spare >= 0:
        return f"; fits {costs.budget_name} with {_gib(spare)} GiB to spare"
    return f"; does NOT fit {costs.budget_name}: {_gib(-spare)} GiB over"


def _table(title: str, rows: tuple[Row, ...]) -> None:
    cells = [
        (
            "*" if r.own else "",
            f"TP{r.layout.tp} PP{r.layout.pp}{f'x{r.layout.vpp}' if r.layout.vpp else ''} "
            f"CP{r.layout.cp} DP{r.dp}",
            r.layout.mbs,
            r.ga,
            _gib(r.memory.total),
            _gib(r.memory.activations_peak),
            r.dp_syncs,
            f"{r.bubble:.1%}",
            _flops(r.flops_per_gpu / (1 - r.bubble)),
        )
        for r in rows
    ]
    header = (
        "",
        "layout",
        "MBS",
        "GA",
        "GiB/GPU",
        "act GiB",
        "DP syncs",
        "bubble",
        "FLOP/GPU + bubble",
    )
    print_table(title, header, cells)


def budget_problem(costs: Costs) -> Problem | None:
    """The launch does not fit the memory given: a problem, with the nearest layouts that do."""
    if costs.fits is not False or costs.own is None or costs.budget is None:
        return None
    over = _gib(costs.own.memory.total - costs.budget)
    near = "; or ".join(_words(r) for r in costs.fitting)
    fix = (
        f"Use {near}."
        if near
        else "No layout of this world and global batch fits: add GPUs or recompute."
    )
    return Problem(
        message=f"--gpu-memory: the launch needs {_gib(costs.own.memory.total)} GiB per GPU, "
        f"{over} GiB "
        f"over {costs.budget_name}. {fix}",
        rule="memory-budget",
        flag="--gpu-memory",
        fix=fix,
    )


def _words(row: Row) -> str:
    lay = row.layout
    return f"TP {lay.tp}, PP {lay.pp}, CP {lay.cp}, MBS {lay.mbs} ({_gib(row.memory.total)} GiB)"


def costs_json(costs: Costs) -> dict[str, Any] | None:
    if costs.own is None:
        return None if costs.model is None else {"estimated": False, "why": costs.why_none}

    def row(r: Row) -> dict[str, Any]:
        m = r.memory
        return {
            "launch": r.own,
            "tensor_model_parallel_size": r.layout.tp,
            "pipeline_model_parallel_size": r.layout.pp,
            "virtual_pipeline_model_parallel_size": r.layout.vpp,
            "context_parallel_size": r.layout.cp,
            "data_parallel_size": r.dp,
            "micro_batch_size": r.layout.mbs,
            "num_microbatches": r.ga,
            "parameters_bytes": m.parameters,
            "gradients_bytes": m.gradients,
            "optimizer_bytes": m.optimizer,
            "activations_one_microbatch_bytes": m.activations_one_microbatch,
            "activations_peak_bytes": m.activations_peak,
            "in_flight_microbatches": m.in_flight,
            "total_bytes": m.total,
            "dp_syncs_per_step": r.dp_syncs,
            "pipeline_bubble_fraction": r.bubble,
            "flops_per_gpu_per_step": r.flops_per_gpu,
        }

    return {
        "estimated": True,
        "launch": row(costs.own),
        "flops_per_step": costs.flops_per_step,
        "total_parameters": costs.own.memory.total_parameters,
        "budget_bytes": costs.budget,
        "fits": costs.fits,
        "alternatives": [row(r) for r in costs.rows],
        "fitting": [row(r) for r in costs.fitting],
        "assumed": list(costs.assumed),
    }


def with_costs(
    tokens: Sequence[str],
    launch: Launch | None,
    report: Report,
    world_size: int | None,
    budget_text: str | None,
) -> tuple[Report, dict[str, Any] | None, Callable[[], None] | None]:
    """(the report with the model's problems and the budget's added, the costs as JSON, the section
    printer) of ``launch`` (None: a Megatron-Bridge launch, whose model the recipe holds)."""
    budget = gpu_memory(budget_text) if budget_text is not None else None
    if launch is None:
        if budget is not None:
            raise UsageError(
                "--gpu-memory reads the model from a launch line's flags; a Bridge recipe has none."
            )
        return report, None, None
    costs = launch_costs(
        tokens, launch, report, lambda line: check_launch(line, world_size), budget
    )
    if budget is not None and costs.model is None and (costs.why_none or "").startswith("give"):
        raise UsageError(f"--gpu-memory needs the model: {NEEDS}.")
    over = budget_problem(costs)
    # A model rule check's own pass already reports (its registry holds some of them) is not said
    # twice.
    flags = {p.flag for p in report.problems}
    mine = tuple(p for p in costs.problems if p.flag not in flags)
    problems = (*report.problems, *mine, *((over,) if over is not None else ()))
    report = replace(report, problems=problems)

    def section() -> None:
        if costs.own is not None or (costs.why_none and costs.model is not None):
            print()
            print_costs(costs)

    return report, costs_json(costs), section


# -- ledger ------------------------------------------------------------------------------------


def ledger_section(words: list[str], launch: Launch, budget_text: str | None) -> None:
    """ledger with a model's flags (``words``): the costs section after the ledger, then its
    problems."""
    before = check_launch(launch)
    after, _, section = with_costs(words, launch, before, None, budget_text)
    if section is not None:
        section()
    for problem in after.problems[len(before.problems) :]:
        print(f"problem: {problem.message}")
