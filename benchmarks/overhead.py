"""Per-step cost of install() against upstream, side by side in one run, with host reads and
collectives counted.

Two gloo ranks (DP 2) train with megatron's own schedule and finalize,
``calculate_per_token_loss=True``, GA micro-batches per step, in three variants:

* upstream:         megatron's ``finalize_model_grads`` and the pretrain_gpt-style loss (``masked_loss``);
* extension:        the same after ``install()`` (loss contract, guards, checked int64 finalize, ``--ga-checks sync``);
* extension_async:  the same with ``--ga-checks async`` (no host read in finalize; the verdict read after the step).

Two models: verify's tiny GPT, and a near-empty position-wise model on which a step is mostly
Megatron's schedule, so the host time the extension adds shows with little around it. Variants take
turns step by step: a round is one installation of each variant, in an order drawn at random for
each round, and upstream a second time (the control: upstream against itself says how far two
identical runs differ in that round); each installation's first step runs the once-per-installation
start-up checks and is not timed; the garbage collector is held off while steps are timed. Per model
and GA: the median step time of each variant; the ratio to upstream in each round, over rounds
(median, a distribution-free 95% interval of that median, min, max); the time added per micro-batch
(the median over rounds of the paired difference / GA); the control's ratio; and, from one more step
of each, the host reads (``Tensor.item/tolist/cpu/__bool__/__int__/__float__``) and
``torch.distributed`` collectives per step. Step times on a shared machine vary by up to 2x from
second to second, far more than the effect, so ``own_us`` also times the extension's own work alone,
on one rank (no other rank to wait for), in alternating repeats over several seconds: upstream's
``forward_step_calc_loss`` as install() wraps it against upstream's own, per micro-batch, and the
extension's finalize against upstream's, per step; as the difference of the two minima (a fast
moment of each) and, in ``paired``, as the median of the differences within a repeat (typical
moments, slow ones included). Those run hot, the same call again and again; ``in_step`` times whole
training steps on that rank, installed against every wrapper passing through to upstream, and
``ratio_in_step`` is their ratio; ``in_step_regions`` splits such steps into the time in
``forward_step_calc_loss``, in finalize and in the rest.

    python benchmarks/overhead.py --quick     # GA 16 (< 2 min): one JSON object on the last line
    python benchmarks/overhead.py --write     # GA 4, 16, 64: benchmarks/results/*.json, docs/performance.md
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from megatron_ga_ext.testing.distributed import LaunchConfig, run_on_ranks

DP = 2
VARIANTS = ("upstream", "extension", "extension_async")
CONTROL = "upstream_control"  # upstream again in each round: the noise floor of a ratio
ROTATION = (*VARIANTS, CONTROL)
ROOT = Path(__file__).resolve().parent.parent
#: The models measured: verify's tiny GPT, and a near-empty position-wise model where a step is
#: mostly Megatron's schedule and the extension's host work, so what the extension adds per
#: micro-batch shows with little else around it.
MODELS = {"gpt": "tiny GPT", "positionwise": "position-wise (host-bound)"}
#: Timed steps per installation and round (after the untimed first; install() and uninstall() take
#: about 12 ms).
STEPS_PER_INSTALL = {"gpt": 1, "positionwise": 4}
#: The own-cost timings, hot and in whole steps, each repeat for OWN_SECONDS (5 s with --quick; the
#: machine's slow phases last seconds: a minimum over a few of them is one of its fast moments), at
#: least OWN_REPEATS times; OWN_CALLS calls per repeat of the per-micro-batch one.
OWN_SECONDS, OWN_REPEATS, OWN_CALLS = 8.0, 20, 50
HOST_READS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__")
COLLECTIVES = (
    "broadcast",
    "all_reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


def rank_main(rounds: int, num_microbatches: int, model: str = "gpt") -> dict:
    from megatron_ga_ext.testing.shims import cpu_shims

    with cpu_shims():
        return _measure(rounds, num_microbatches, model)


def own_main(num_microbatches: int, model: str = "gpt", seconds: float = OWN_SECONDS) -> dict:
    """The own-cost timings on one rank: no other rank to wait for, so what is timed is this
    process's work."""
    from megatron_ga_ext.testing.shims import cpu_shims

    with cpu_shims():
        return _own_cost(*_setup(num_microbatches, model, data_parallel_size=1), seconds)


def _setup(num_microbatches: int, model: str, data_parallel_size: int) -> tuple:
    """(DDP model, its config, layout, VerifyConfig, global batch, loss) of verify's harness,
    per-token loss."""
    from megatron_ga_ext.integration.loss_contract import masked_loss
    from megatron_ga_ext.verify.harness import build_ddp
    from megatron_ga_ext.verify.layouts import Layout, make_global_batch
    from megatron_ga_ext.verify.models import init_model_parallel
    from megatron_ga_ext.verify.run_config import VerifyConfig

    cfg = VerifyConfig()
    layout = Layout(
        data_parallel_size=data_parallel_size, num_microbatches=num_microbatches, model=model
    )
    batch = make_global_batch(
        tuple(1 + (7 * i) % cfg.model.seq_length for i in range(layout.global_batch_size)),
        cfg.model.seq_length,
        cfg.model.vocab_size,
    )
    init_model_parallel()
    ddp, _, config = build_ddp(layout, cfg, calculate_per_token_loss=True)
    return ddp, config, layout, cfg, batch, partial(masked_loss, mode="token")


def installed_step(variant: str, harness: tuple) -> Callable[[], None]:
    """A fresh installation of ``variant`` and its training step on ``harness`` (what :func:`_setup`
    returns): the extension with sync or async checks, or upstream (any other variant) after the
    same install() and uninstall(), so that every variant's steps follow the same scan of every
    loaded module. Under async the step ends with the verdict read, where install() reads it (after
    the step). The caller uninstalls."""
    from megatron.core.distributed import finalize_model_grads as upstream_finalize

    import megatron_ga_ext
    from megatron_ga_ext.verify.step import train_step

    ddp, config, layout, cfg, batch, loss = harness
    checks = {"extension": "sync", "extension_async": "async", "extension_noise_scale": "sync"}.get(
        variant
    )
    noise_scale = (
        1 if variant == "extension_noise_scale" else 0
    )  # every step measured: K = 1, the most it costs
    state = megatron_ga_ext.install(
        megatron_ga_ext.GAConfig(checks=checks or "sync", noise_scale=noise_scale)
    )
    if checks is None:
        megatron_ga_ext.uninstall()
        state = None
    # --ga-noise-scale: the NoiseScale feature's meter
    meter = (
        next((f.meter for f in state.features if f.name == "noise_scale"), None) if state else None
    )

    def one_step() -> None:
        train_step(
            ddp,
            config,
            layout,
            cfg,
            batch,
            finalize=state.finalize if state else upstream_finalize,
            loss_func=loss,
        )
        if state is not None:
            state.finalize.poll(wait=True)
            if meter is not None:
                meter.read()  # where Megatron's optimizer step reads it: one host read

    return one_step


def _measure(rounds: int, num_microbatches: int, model: str) -> dict:
    import megatron_ga_ext

    harness = _setup(num_microbatches, model, DP)

    def steps(variant: str, timed_steps: int, count: bool = False) -> tuple[list[float], dict]:
        """A fresh installation's steps after its first (which runs the once-per-installation
        start-up checks, as a job's first step does): their times, with the garbage collector held
        off, and the counts of the last."""
        one_step = installed_step(variant, harness)
        one_step()
        gc.collect()
        gc.disable()
        elapsed = []
        for index in range(timed_steps):
            with _counting(enabled=count and index == timed_steps - 1) as counted:
                start = time.perf_counter()
                one_step()
                elapsed.append(time.perf_counter() - start)
        gc.enable()
        megatron_ga_ext.uninstall()
        return elapsed, counted

    for variant in VARIANTS:  # warm-up
        steps(variant, 1)
    times = {variant: [] for variant in ROTATION}
    order = random.Random(num_microbatches)  # the same orders on both ranks (they step together)
    for _ in range(rounds):
        for variant in order.sample(ROTATION, len(ROTATION)):
            times[variant].append(statistics.median(steps(variant, STEPS_PER_INSTALL[model])[0]))
    counts = {variant: steps(variant, 1, count=True)[1] for variant in VARIANTS}
    return {"times": times, "counts": counts}


def _own_cost(ddp, config, layout, cfg, batch, loss, seconds: float) -> dict:
    """The extension's own work, in microseconds, from alternating repeats for ``seconds`` (on one
    rank: with two, a finalize's time is mostly waiting for the other in its collectives), minimum
    against minimum and, in ``paired``, the median of the differences within a repeat:
    ``microbatch``: upstream's forward_step_calc_loss as install() wraps it (forward-step count,
    loss contract) minus upstream's own, on the same output and loss; ``step``: the extension's
    finalize (the step's checks, its vector's broadcast and all-reduce, the read, the scaling) minus
    upstream's with the count, both after the same micro-batches. Those two run hot (the same call
    again and again); ``in_step`` times whole training steps, where the extension's code runs
    between the model's, everything install() adds to a step included (resolved to microseconds on
    the position-wise model at GA 4, whose step takes 3 ms; not resolved on the tiny GPT, whose runs
    ranged -3% to +10% of a step)."""
    import inspect

    from megatron.core.distributed import finalize_model_grads as upstream_finalize

    import megatron_ga_ext
    from megatron_ga_ext.integration.compat import SCHEDULES
    from megatron_ga_ext.verify.step import forward_step, microbatches, train_step

    # The first micro-batch's forward, as train_step runs it: its output and the loss function bound
    # to its mask.
    output, loss_func = forward_step(
        iter(microbatches(layout, batch, cfg.device)),
        ddp,
        loss_func=loss,
        with_loss_mask=layout.model != "positionwise",
    )
    output = output.detach()
    upstream_calc = sys.modules[SCHEDULES].forward_step_calc_loss
    available = {
        "model": ddp,
        "output_tensor": output,
        "loss_func": loss_func,
        "config": config,
        "vp_stage": None,
        "collect_non_loss_data": False,
        "num_microbatches": layout.num_microbatches,
        "cp_group_size": 1,
        "is_last_stage": True,
    }
    names = list(inspect.signature(upstream_calc).parameters)

    def microbatch_calls(calc, contract) -> float:
        args = [
            {**available, "forward_data_store": []}[name] for name in names
        ]  # by position, as Megatron calls it
        start = time.perf_counter()
        for _ in range(OWN_CALLS):
            calc(*args)
        elapsed = (time.perf_counter() - start) / OWN_CALLS
        if contract is not None:
            contract.reset()
        return elapsed

    outputs = loss_func(output)

    def one_finalize(finalize, contract) -> float:
        # the same (zero) gradients each time: repeated scaling never reaches denormals
        ddp.zero_grad_buffer()
        if contract is not None:
            for _ in range(layout.num_microbatches):
                contract.check(outputs)
        start = time.perf_counter()
        finalize([ddp], outputs[1].reshape(1) * layout.num_microbatches)
        return time.perf_counter() - start

    def whole_step(active: bool, finalizes: tuple | None = None) -> float:
        """A whole training step, megatron's schedule and all: installed (``active``) or with every
        wrapper passing straight through to upstream (what uninstall() sets, without its 12 ms of
        restoring) and upstream's finalize (``finalizes``: the two, upstream's first, if not
        these)."""
        state.active = active
        start = time.perf_counter()
        train_step(
            ddp,
            config,
            layout,
            cfg,
            batch,
            finalize=(finalizes or (upstream_finalize, state.finalize))[active],
            loss_func=loss,
        )
        elapsed = time.perf_counter() - start
        state.active = True
        return elapsed

    # Installed, upstream's originals (bound before install()) stay callable beside the wrappers:
    # the two take turns, in alternating order, so both see the same moments of a noisy machine.
    state = megatron_ga_ext.install(megatron_ga_ext.GAConfig())
    state.configure_from_megatron_args()
    hot = {
        "microbatch": (
            partial(microbatch_calls, upstream_calc, None),
            partial(
                microbatch_calls, sys.modules[SCHEDULES].forward_step_calc_loss, state.contract
            ),
        ),
        "step": (
            partial(one_finalize, upstream_finalize, None),
            partial(one_finalize, state.finalize, state.contract),
        ),
    }
    whole_step(True)
    own = _alternating(hot, seconds)
    own["in_step"] = _alternating(
        {"step": (partial(whole_step, False), partial(whole_step, True))}, seconds
    )
    own["in_step_regions"] = _regions(whole_step, (upstream_finalize, state.finalize), seconds)
    megatron_ga_ext.uninstall()
    return own


def _regions(whole_step, finalizes: tuple, seconds: float) -> dict:
    """Whole steps as ``in_step`` times them, with the time spent in ``forward_step_calc_loss`` (the
    step's every micro-batch, the extension's wrapper included) and in finalize added up per step:
    per region, and for the rest of the step, the difference of the minima (extension less upstream)
    and the median of the paired differences, in us."""
    from megatron_ga_ext.integration.compat import SCHEDULES

    module = sys.modules[SCHEDULES]
    installed = module.forward_step_calc_loss
    spent = {"forward_step_calc_loss": 0.0, "finalize": 0.0}

    def timed(call, key):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start

        return run

    timed_finalizes = tuple(timed(f, "finalize") for f in finalizes)
    samples = {side: [] for side in (0, 1)}
    module.forward_step_calc_loss = timed(installed, "forward_step_calc_loss")
    gc.collect()
    gc.disable()
    try:
        start, repeat = time.perf_counter(), 0
        while repeat < OWN_REPEATS or time.perf_counter() - start < seconds:
            repeat += 1
            for side in (0, 1) if repeat % 2 else (1, 0):
                spent.update(dict.fromkeys(spent, 0.0))
                step = whole_step(bool(side), timed_finalizes)
                samples[side].append({**spent, "rest": step - sum(spent.values())})
    finally:
        gc.enable()
        module.forward_step_calc_loss = installed
    regions = {}
    for key in (*spent, "rest"):
        upstream, extension = ([row[key] for row in samples[side]] for side in (0, 1))
        regions[key] = {
            "minima": round(1e6 * (min(extension) - min(upstream)), 2),
            "paired": round(1e6 * statistics.median(e - u for u, e in zip(upstream, extension)), 2),
        }
    return {**regions, "repeats": repeat}


def _alternating(pairs: dict, seconds: float) -> dict:
    """``pairs`` {key: (upstream call, extension call)}, each call timing itself, in alternating
    order for ``seconds`` (at least OWN_REPEATS times): per key, the difference of the minima and
    the median of the differences within a repeat (``paired``), in us, and upstream's minimum."""
    samples = {(key, side): [] for key in pairs for side in (0, 1)}
    gc.collect()
    gc.disable()
    start, repeat = time.perf_counter(), 0
    while repeat < OWN_REPEATS or time.perf_counter() - start < seconds:
        repeat += 1
        for key, calls in pairs.items():
            for side in (0, 1) if repeat % 2 else (1, 0):
                samples[key, side].append(calls[side]())
    gc.enable()
    best = {k: min(v) for k, v in samples.items()}
    own = {key: round(1e6 * (best[key, 1] - best[key, 0]), 2) for key in pairs}
    paired = {
        key: round(
            1e6 * statistics.median(e - u for u, e in zip(samples[key, 0], samples[key, 1])), 2
        )
        for key in pairs
    }
    return {
        **own,
        "paired": paired,
        **{f"upstream_{key}": round(1e6 * best[key, 0], 2) for key in pairs},
        "repeats": repeat,
    }


@contextmanager
def _counting(enabled: bool = True):
    """Count host reads (wrapped Tensor methods) and torch.distributed collectives while the block
    runs; a call made inside a counted one (a torch function mode calling the method again) is not
    counted twice."""
    import torch
    import torch.distributed as dist

    counted = {"host_reads": 0, "collectives": 0}
    originals = [(torch.Tensor, name, getattr(torch.Tensor, name)) for name in HOST_READS]
    originals += [(dist, name, getattr(dist, name)) for name in COLLECTIVES if hasattr(dist, name)]
    depth = [0]

    def counter(original, key):
        def counted_call(*args, **kwargs):
            counted[key] += depth[0] == 0
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted_call

    if enabled:
        for owner, name, original in originals:
            setattr(
                owner,
                name,
                counter(original, "host_reads" if owner is torch.Tensor else "collectives"),
            )
    try:
        yield counted
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def median_ci95(values: list[float]) -> tuple[float, float]:
    """A distribution-free 95% interval of the median: the order statistics k and n + 1 - k, k the
    largest rank with P(Binomial(n, 1/2) < k) <= 2.5% (the whole range where n is too small for
    one)."""
    ordered, n = sorted(values), len(values)
    k, below = 0, 0.0
    while k < n and below + math.comb(n, k) / 2**n <= 0.025:
        below += math.comb(n, k) / 2**n
        k += 1
    return (ordered[0], ordered[-1]) if k == 0 else (ordered[k - 1], ordered[n - k])


def summarize(num_microbatches: int, model: str, measured: dict) -> dict:
    """One GA's result (a round's time is the median of its timed steps): median step times, ratios
    to upstream paired by round, the time added per micro-batch (median over rounds of the paired
    difference / GA), the control's ratio (upstream against itself), host reads and collectives per
    step, the own-cost timings."""
    wall = measured["times"]
    counts = measured["counts"]
    ratios = {
        v: [t / u for t, u in zip(wall[v], wall["upstream"])] for v in (*VARIANTS[1:], CONTROL)
    }
    added = {
        v: [(t - u) / num_microbatches for t, u in zip(wall[v], wall["upstream"])]
        for v in VARIANTS[1:]
    }
    own = measured["own_us"]
    return {
        "model": model,
        "num_microbatches": num_microbatches,
        "rounds": len(wall["upstream"]),
        "steps": len(wall["upstream"]) * STEPS_PER_INSTALL[model],
        "step_ms": {v: round(1e3 * statistics.median(wall[v]), 3) for v in VARIANTS},
        "ratio_median": {v: round(statistics.median(ratios[v]), 4) for v in VARIANTS[1:]},
        "ratio_ci95": {v: [round(x, 4) for x in median_ci95(ratios[v])] for v in VARIANTS[1:]},
        "ratio_min": {v: round(min(ratios[v]), 4) for v in VARIANTS[1:]},
        "ratio_max": {v: round(max(ratios[v]), 4) for v in VARIANTS[1:]},
        "extra_us_per_microbatch": {
            v: round(1e6 * statistics.median(added[v]), 1) for v in VARIANTS[1:]
        },
        "control": {
            "ratio_median": round(statistics.median(ratios[CONTROL]), 4),
            "ratio_ci95": [round(x, 4) for x in median_ci95(ratios[CONTROL])],
        },
        "own_us": {
            **own,
            "per_microbatch_at_this_ga": _per_microbatch(own, num_microbatches),
            "paired": {
                **own["paired"],
                "per_microbatch_at_this_ga": _per_microbatch(own["paired"], num_microbatches),
            },
            "in_step": {
                **own["in_step"],
                "per_microbatch_at_this_ga": {
                    "step": round(own["in_step"]["step"] / num_microbatches, 2),
                    "paired": round(own["in_step"]["paired"]["step"] / num_microbatches, 2),
                },
            },
        },
        # 1 + the extension's own work per step / upstream's median step: the ratio without the
        # machine's noise
        "ratio_from_own_work": round(
            1
            + (own["microbatch"] * num_microbatches + own["step"])
            * 1e-6
            / statistics.median(wall["upstream"]),
            4,
        ),
        # whole steps on one rank, side by side: 1 + what the extension adds / upstream's fastest
        # step
        "ratio_in_step": {
            key: round(1 + value / own["in_step"]["upstream_step"], 4)
            for key, value in (
                ("minima", own["in_step"]["step"]),
                ("paired", own["in_step"]["paired"]["step"]),
            )
        },
        "host_reads_per_step": {v: counts[v]["host_reads"] for v in VARIANTS},
        "collectives_per_step": {v: counts[v]["collectives"] for v in VARIANTS},
    }


def _per_microbatch(own: dict, num_microbatches: int) -> float:
    """What the own work adds per micro-batch at this GA: check + finalize / GA."""
    return round(own["microbatch"] + own["step"] / num_microbatches, 2)


def run(
    num_microbatches: int, rounds: int, model: str = "gpt", own_seconds: float = OWN_SECONDS
) -> dict:
    # Rank 0's clock: both ranks step in lock-step (every step ends in the same collectives).
    launch = LaunchConfig(timeout_s=900)
    measured = run_on_ranks(rank_main, DP, (rounds, num_microbatches, model), launch)[0]
    measured["own_us"] = run_on_ranks(own_main, 1, (num_microbatches, model, own_seconds), launch)[
        0
    ]
    return summarize(num_microbatches, model, measured)


def environment() -> dict:
    from importlib import metadata

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.machine(),
            "cpus": os.cpu_count(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": metadata.version("torch"),
            "megatron-core": metadata.version("megatron-core"),
            "megatron-ga-ext": metadata.version("megatron-ga-ext"),
        },
        "layout": f"DP {DP} over gloo on the CPU, verify's tiny GPT (2 layers, hidden 32, seq "
        "16), MBS 1",
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| model | GA | upstream step (ms) | extension: ratio, median [95% interval] | us per "
        "micro-batch | async: ratio, median [95% interval] | us per micro-batch | "
        "upstream against itself | own work, us per micro-batch: check + finalize / GA, "
        "hot; from paired medians; in whole steps (minima, paired) | whole steps on one "
        "rank, ratio (minima / paired) | host reads per step (up / ext / async) | "
        "collectives per step (up / ext / async) |",
        "|" + "---|" * 13,
    ]
    for r in rows:
        cells = [MODELS[r["model"]], str(r["num_microbatches"]), f"{r['step_ms']['upstream']:.2f}"]
        for v in VARIANTS[1:]:
            low, high = r["ratio_ci95"][v]
            cells += [
                f"{r['ratio_median'][v]:.3f} [{low:.3f}, {high:.3f}]",
                f"{r['extra_us_per_microbatch'][v]:.1f}",
            ]
        low, high = r["control"]["ratio_ci95"]
        cells.append(f"{r['control']['ratio_median']:.3f} [{low:.3f}, {high:.3f}]")
        own, paired = r["own_us"], r["own_us"]["paired"]
        in_step = own["in_step"]["per_microbatch_at_this_ga"]
        cells.append(
            f"{own['per_microbatch_at_this_ga']:.1f} ({own['microbatch']:.1f} + "
            f"{own['step']:.0f} / {r['num_microbatches']}); "
            f"{paired['per_microbatch_at_this_ga']:.1f}; {in_step['step']:.1f}, "
            f"{in_step['paired']:.1f}"
        )
        cells.append(" / ".join(f"{r['ratio_in_step'][key]:.3f}" for key in ("minima", "paired")))
        cells += [
            " / ".join(str(r[key][v]) for v in VARIANTS)
            for key in ("host_reads_per_step", "collectives_per_step")
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(rows: list[dict], env: dict) -> None:
    """benchmarks/results/overhead-<date>.json, the plot, and the table of docs/performance.md."""
    _plot(rows, ROOT / "docs" / "performance-overhead.png")
    stamp = (
        f"\nRun on {env['date'][:10]}: Python {env['versions']['python']}, torch "
        f"{env['versions']['torch']}, megatron-core {env['versions']['megatron-core']}, "
        f"{env['machine']['cpus']} CPUs; {env['layout']}; rounds per row as its JSON "
        f"says ({rows[0]['rounds']} at GA {rows[0]['num_microbatches']}).\n\n"
    )
    record("overhead", rows, env, stamp + table(rows) + "\n")


def record(name: str, rows: list[dict], env: dict, body: str) -> None:
    """benchmarks/results/<name>-<date>.json, and ``body`` as docs/performance.md's table ``name``
    (between its ``<!-- table:name -->`` markers)."""
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}-{env['date'][:10]}.json").write_text(
        json.dumps({**env, "rows": rows}, indent=2) + "\n"
    )
    doc = ROOT / "docs" / "performance.md"
    begin, end = f"<!-- table:{name} -->", f"<!-- /table:{name} -->"
    head, rest = doc.read_text().split(begin, 1)
    doc.write_text(head + begin + body + end + rest.split(end, 1)[1])


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4), dpi=100)
    gpt = [r for r in rows if r["model"] == "gpt"]
    ga = [r["num_microbatches"] for r in gpt]
    for variant, marker in zip(VARIANTS, "osd"):
        axes.plot(ga, [r["step_ms"][variant] for r in gpt], marker=marker, label=variant)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xticks(ga, [str(g) for g in ga])
    axes.set_xlabel("micro-batches per step (GA), DP 2")
    axes.set_ylabel("median step time (ms)")
    axes.set_title("install() against upstream, tiny GPT on the CPU")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="GA 16 only, 8 rounds, own work over 5 s hot and 5 s in whole steps; one JSON "
        "object on the last line",
    )
    parser.add_argument(
        "--write",
        action="store_true",
        help="write benchmarks/results/*.json and docs/performance.md",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds per model and GA (default 8 quick; 24, 12 at GA 64); a round times 1 step "
        "of each "
        "variant and the control on the tiny GPT, 4 on the position-wise model",
    )
    parser.add_argument(
        "--num-microbatches", type=int, nargs="+", default=None, help="GA values (default 4 16 64)"
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(MODELS),
        default=list(MODELS),
        help="models (default both)",
    )
    args = parser.parse_args(argv)
    import megatron.core.pipeline_parallel.schedules  # noqa: F401  (once here: every launch forks with it loaded)

    ga_values = args.num_microbatches or ([16] if args.quick else [4, 16, 64])
    rows = []
    for model in args.models:
        for num_microbatches in ga_values:
            rounds = args.rounds or (8 if args.quick else 24 if num_microbatches < 64 else 12)
            rows.append(run(num_microbatches, rounds, model, 5.0 if args.quick else OWN_SECONDS))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    env = environment()
    if args.write:
        write(rows, env)
    print(table(rows))
    print(json.dumps({**rows[0], "host_bound": rows[-1]} if args.quick else {**env, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
