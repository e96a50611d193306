"""The critical-batch benchmark's tables, from its newest result JSON under benchmarks/results
(benchmarks/critical_batch.py --collect writes it; benchmarks/critical_batch_analysis.py reads it).
Pure Python.

``make docs`` renders them into docs/noise-scale.md (tools/docs.py: from the committed JSON alone,
so ``make docs-check`` holds them):

* ``critical-batch``: per target, B_crit with its 95 % profile interval, each seed's own B_crit and
  whether it lies inside, the runs used and those left out as dominated, the fit's rms log residual,
  and the interpolation error against the seed noise (log S);
* ``b-simple``: per target, B_simple from the centred window and from the EMA where the fit's runs
  cross it, the EMA's reading over the window's, its lag, and B_simple (window, over the runs the
  fit used) / B_crit with an interval that carries both uncertainties
  (critical_batch_analysis.ratio);
* ``lr-grid``: per batch size, the mean validation loss after the LR warmup at each LR, the best,
  and per target the LR with the fewest steps;
* ``warmup-test``: the adaptive warmup and its baselines: steps and samples to each target, the
  final loss;
* ``local-critical-batch``: per branch point, the local B_crit per target from the branched runs
  (critical_batch_local.py) against the trunk's B_simple there;
* ``warmup-arms``: the three arms with a decay (critical_batch_arms.py): steps and samples to each
  target, the final loss, and the paired differences with their 95 % t intervals.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from benchmarks import critical_batch_local as local
from benchmarks.critical_batch_analysis import analyse, geometric, mean_sd
from benchmarks.critical_batch_analysis import ratio as ratio_of
from benchmarks.critical_batch_arms import ARMS, analyse_arms

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
_NAME = re.compile(r"critical-batch-(\d{4}-\d{2}-\d{2})\.json")
BLOCKS = (
    "critical-batch",
    "b-simple",
    "lr-grid",
    "warmup-test",
    "local-critical-batch",
    "warmup-arms",
)


def newest(directory: Path = RESULTS) -> dict | None:
    found = sorted(
        (m.group(1), p)
        for p in directory.glob("critical-batch-*.json")
        if (m := _NAME.fullmatch(p.name))
    )
    return json.loads(found[-1][1].read_text()) if found else None


def _g(value: float | None, digits: int = 3) -> str:
    """``digits`` significant digits; a whole number at and above 10 ** digits; '-' for None."""
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.0f}" if abs(value) >= 10**digits else f"{value:.{digits}g}"


def _span(low: float | None, high: float | None) -> str:
    """[low, high], an end the data do not bound written open: (0, high] or [low, inf)."""
    return f"{'(0' if low is None else f'[{_g(low)}'}, {'inf)' if high is None else f'{_g(high)}]'}"


def critical_table(result: dict, analysis: dict) -> str:
    lines = [
        "| target (validation loss) | B_crit | 95% profile interval | per seed | seeds inside | "
        "runs used | left out as dominated | rms log residual | interpolation error / "
        "seed sd (log S) |",
        "|" + "---|" * 9,
    ]
    for t in analysis["targets"]:
        seeds = {s: b for s, b in t["per_seed"].items()}
        inside = [
            b is not None and (t.get("low") or 0) <= b <= (t.get("high") or math.inf)
            for b in seeds.values()
        ]
        noise = t["interpolation"]
        error = f"{_g(noise['interpolation_log_s'], 2)} / {_g(noise['seed_sd_log_s'], 2)}"
        dominated = ", ".join(t["dominated"]) or "none"
        if t.get("b_crit") is None:
            lines.append(
                f"| {t['target']:.4g} | not fittable: {t['reason']} | | | | "
                f"{len(t['runs_used'])} | {dominated} | | {error} |"
            )
            continue
        per_seed = ", ".join(f"{s}: {_g(b)}" for s, b in seeds.items())
        lines.append(
            f"| {t['target']:.4g} | {_g(t['b_crit'])} | {_span(t.get('low'), t.get('high'))} | "
            f"{per_seed} | {sum(inside)} of {len(inside)} | {len(t['runs_used'])} | "
            f"{dominated} | {_g(t['rms_log_residual'], 2)} | {error} |"
        )
    return "\n".join(lines)


def b_simple_table(analysis: dict) -> str:
    lines = [
        "| target | B_simple, centred window: geometric mean [min, max] | B_simple, EMA: "
        "geometric mean | EMA / window (median over runs) | EMA lag (median, samples) | "
        "window's ratio-of-sums bias (delta method, median) | "
        "B_simple (window, the fit's runs) / B_crit [~95%] |",
        "|" + "---|" * 7,
    ]
    for t in analysis["targets"]:
        rows = [v for v in t["b_simple"].values() if v is not None]
        window = [v["window"] for v in rows if v["window"] is not None and v["window"] > 0]
        ema = [v["ema"] for v in rows]
        ratios = sorted(
            v["ema"] / v["window"] for v in rows if v["window"] and v["ema"] and v["window"] > 0
        )
        lags = sorted(v["lag_samples"] for v in rows if v["lag_samples"] is not None)
        mean = geometric(window)
        spread = f"[{_g(min(window))}, {_g(max(window))}]" if window else ""
        found = ratio_of(t)
        ratio = (
            "-"
            if found is None
            else f"{_g(found['ratio'])} {_span(found['low'], found['high'])} ({found['runs']} runs)"
        )
        biases = sorted(v["bias"] for v in rows if v.get("bias") is not None)
        lines.append(
            f"| {t['target']:.4g} | {_g(mean)} {spread} | {_g(geometric(ema))} | "
            f"{_g(ratios[len(ratios) // 2] if ratios else None)} | "
            f"{_g(lags[len(lags) // 2] if lags else None)} | "
            f"{_g(biases[len(biases) // 2] if biases else None)} | {ratio} |"
        )
    return "\n".join(lines)


def lr_table(analysis: dict) -> str:
    lines = [
        "| GBS | LR: steps to the targets, geometric mean (seed 1) | chosen LR | interior | "
        "edge rule | mean validation loss after the LR warmup (the old criterion) | "
        "fewest-steps LR per target |",
        "|" + "---|" * 7,
    ]
    for gbs, v in analysis["lr"].items():
        ks = sorted(v["log_steps"], key=int)
        steps = ", ".join(f"{_g(v['lr'][k])}: {_g(math.exp(v['log_steps'][k]))}" for k in ks)
        loss = ", ".join(f"{_g(v['lr'][k])}: {_g(v['loss'][k], 4)}" for k in ks)
        fewest = [t["fewest_steps_k"].get(gbs) for t in analysis["targets"]]
        fewest_lr = ", ".join("-" if k is None else _g(v["lr"][k]) for k in fewest)
        edge = "holds" if v["extends"] is None else f"add k = {v['extends']:+d}"
        lines.append(
            f"| {gbs} | {steps} | {_g(v['lr'][v['best']])} | {'yes' if v['interior'] else 'no'} "
            f"| {edge} | {loss} | {fewest_lr} |"
        )
    return "\n".join(lines)


def _stat(values: list[float | None], digits: int = 3) -> str:
    mean, sd, count = mean_sd(values)
    if mean is None:
        return "-"
    missing = len(values) - count
    return f"{_g(mean, digits)} ± {_g(sd, 2)}" + (f" ({missing} not)" if missing else "")


def warmup_table(analysis: dict) -> str:
    targets = [t["target"] for t in analysis["targets"]]
    lines = [
        "| run | seeds | "
        + " | ".join(f"steps to {t:.4g}" for t in targets)
        + f" | samples to {targets[-1]:.4g} | final validation loss | steps run |"
        if targets
        else "| run | seeds | final validation loss | steps run |",
        "|" + "---|" * (len(targets) + (5 if targets else 4)),
    ]
    for name, row in analysis["warmup"].items():
        steps = [_stat([s[i] for s in row["steps"]]) for i in range(len(targets))]
        samples = [_stat([s[-1] for s in row["samples"]])] if targets else []
        lines.append(
            f"| {name} | {len(row['seeds'])} | "
            + " | ".join([*steps, *samples])
            + f"{' | ' if targets else ''}{_stat(row['final'], 4)} | {_stat(row['steps_run'])} |"
        )
    return "\n".join(lines)


def local_table(result: dict) -> str:
    points = local.local(result)
    if not points:
        return "No branched runs in this result (`python benchmarks/critical_batch.py --phase branch`)."
    lines = [
        "| branch point (samples) | trunk's validation loss | seeds | GBS | target: local B_crit "
        "[95% profile] | local B_crit (geometric mean) | trunk's B_simple (window) | B_simple / "
        "local B_crit |",
        "|" + "---|" * 8,
    ]
    for point in points:
        fits = "; ".join(
            f"{f['target']:.4g}: "
            + (
                f"{_g(f['b_crit'])} {_span(f.get('low'), f.get('high'))}"
                if f.get("b_crit")
                else f"not fittable ({f['reason']})"
            )
            for f in point["fits"]
        )
        sizes = ", ".join(map(str, point["sizes"]))
        lines.append(
            f"| {point['at']:,} | {point['loss']:.4g} | {len(point['seeds'])} | {sizes} | {fits} | "
            f"{_g(local.summary(point))} | {_g(point['b_simple'])} | {_g(local.ratio(point))} |"
        )
    return "\n".join(lines)


def _paired(found: dict | None, digits: int = 3) -> str:
    if found is None:
        return "-"
    return f"{_g(found['mean'], digits)} [{_g(found['low'], digits)}, {_g(found['high'], digits)}]"


def arms_table(result: dict) -> str:
    out = analyse_arms(result)
    if not out["arms"]:
        return "No warmup arms in this result (`python benchmarks/critical_batch.py --phase arms`)."
    aims = out["targets"]
    head = " | ".join(f"steps to {t:.4g}" for t in aims)
    lines = [
        f"| arm | seeds | {head} | samples to {aims[-1]:.4g} | final validation loss | steps run |",
        "|" + "---|" * (len(aims) + 5),
    ]
    for arm in ARMS:
        rows = list(out["arms"].get(arm, {}).values())
        if not rows:
            continue
        steps = [_stat([r["steps"][i] for r in rows]) for i in range(len(aims))]
        lines.append(
            f"| {arm} | {len(rows)} | "
            + " | ".join(steps)
            + f" | {_stat([r['samples'][-1] for r in rows])} | {_stat([r['final'] for r in rows], 4)}"
            + f" | {_stat([r['steps_run'] for r in rows])} |"
        )
    lines += [
        "",
        f"| paired difference (mean [95% t]) | {head} | samples to {aims[-1]:.4g} | final "
        "validation loss |",
        "|" + "---|" * (len(aims) + 3),
    ]
    for pair, found in out["pairs"].items():
        steps = " | ".join(_paired(p) for p in found["steps"])
        lines.append(
            f"| {pair} | {steps} | {_paired(found['samples'][-1])} | {_paired(found['final'], 2)} |"
        )
    return "\n".join(lines)


def tables(directory: Path = RESULTS) -> dict[str, str]:
    """The tables by block name; a one-line placeholder each where no result is committed."""
    result = newest(directory)
    if result is None:
        none = "No result committed yet: run `make critical-batch`, then `make docs`."
        return dict.fromkeys(BLOCKS, none)
    analysis = analyse(result)
    seconds = sum(r["seconds"] for r in result["runs"])
    head = (
        f"{result['date']}, {result['source']}, {len(result['runs'])} runs, {seconds:,.0f} s "
        "of training.\n\n"
    )
    return {
        "critical-batch": head + critical_table(result, analysis),
        "b-simple": b_simple_table(analysis),
        "lr-grid": lr_table(analysis),
        "warmup-test": warmup_table(analysis),
        "local-critical-batch": local_table(result),
        "warmup-arms": arms_table(result),
    }
