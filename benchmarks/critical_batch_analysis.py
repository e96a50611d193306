"""The critical-batch benchmark's analysis, from its result JSON (benchmarks/critical_batch.py
--collect). Pure Python (megatron_ga_ext.core only): ``make docs`` renders its tables from the
committed JSON (critical_batch_report.py).

* **A size's horizon**: its long runs (phase ``long``) where it ran long, else its grid and seed
  runs; its **seeded** runs: those at a k that ran at every seed of the plan.
* **Targets**: TARGETS losses evenly spaced from just below the highest loss any seeded run has at
  the end of its LR warmup (so every run crosses every target after its warmup) down to the lowest
  loss that runs at MIN_SIZES batch sizes all reach (every seed).
* **The LR per batch size, by the fitted quantity**: the k whose runs on the horizon have the
  lowest log steps, averaged over the targets any of the size's seed-1 runs reaches (a target a
  run misses counts infinite) and over the seeds that ran at that k; the edge rule
  (critical_batch_plan.extends) says where the grid would extend. Beside it the old criterion,
  the mean validation loss after the LR warmup, and per target the k with the fewest steps.
* **The fit** per target: the chosen k's runs on the horizon at every batch size and seed,
  ``fit_target`` (dominated batch sizes left out, the profile interval); per seed the same on that
  seed's runs (the seed spread).
* **Interpolation error** at a crossing: the step from linear interpolation between the two
  evaluations around it against a quadratic through three (log S); **seed noise**: the sd of log S
  over the seeds of one batch size.
* **B_simple at matched progress**: per fit run and target, science/core/noise_window.py's centred
  window of WINDOW_SAMPLES on each side of the crossing (ratio of sums), and the EMA at the first row
  at or after it; the EMA's **lag**: how many samples before the crossing the window's value last
  equalled the EMA's reading at it; the ratio of sums' own **bias** (``window_bias``).
* **The warmup against its baselines**: steps and samples to each target and the final validation
  loss, mean and sd over seeds.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence

from benchmarks.critical_batch_plan import extends
from megatron_ga_ext.science.core.critical_batch import RunPoint
from megatron_ga_ext.science.core.critical_batch_targets import fit_target
from megatron_ga_ext.science.core.noise_window import (
    centred_window,
    step_parts,
    window_b_simple,
)

TARGETS = 4
MIN_SIZES = 4
WINDOW_SAMPLES = 256
_GRID = re.compile(r"gbs(\d+)-k([+-]\d+)-seed(\d+)(-long)?")


def lr_of(plan: dict, gbs: int, k: int) -> float:
    """benchmarks/critical_batch.py's Plan.lr."""
    return float(f"{plan['lr16'] * (gbs / 16) ** plan['lr_power'] * 2.0**k:.4g}")


def grid_runs(result: dict) -> list[dict]:
    """The grid's, seeds' and long runs (named by GBS, k and seed)."""
    return [r for r in result["runs"] if _GRID.fullmatch(r["name"])]


def k_of(run: dict) -> int:
    match = _GRID.fullmatch(run["name"])
    return int(match.group(2)) if match else 0


def score(run: dict, warmup_samples: int) -> float:
    """The mean validation loss after the LR warmup (inf where one is not finite): the old LR
    criterion, shown beside the fitted quantity."""
    losses = [loss for _, samples, loss in run["curve"] if samples >= warmup_samples]
    return sum(losses) / len(losses) if losses and all(map(math.isfinite, losses)) else math.inf


def horizon(result: dict, gbs: int) -> list[dict]:
    """The size's runs on its fit horizon (module docstring)."""
    runs = [r for r in grid_runs(result) if r["gbs"] == gbs]
    long = [r for r in runs if r.get("phase") == "long"]
    return long or runs


def seeded(result: dict) -> list[dict]:
    """Every size's horizon runs at a k that ran at every seed of the plan."""
    seeds, out = set(result["plan"]["seeds"]), []
    for gbs in result["plan"]["sizes"]:
        runs = horizon(result, gbs)
        done = {k_of(r) for r in runs if {q["seed"] for q in runs if k_of(q) == k_of(r)} >= seeds}
        out += [r for r in runs if k_of(r) in done]
    return out


def best_k(result: dict, targets: Sequence[float]) -> dict[int, dict]:
    """Per batch size (module docstring): by k, the mean log steps over the reached targets and the
    seeds, and the old criterion (seed 1); the best k, whether it is interior, and the k the edge
    rule adds (None where it adds none)."""
    warmup = result["plan"]["warmup_samples"]
    out = {}
    for gbs in result["plan"]["sizes"]:
        runs = horizon(result, gbs)
        ones = {k_of(r): r for r in runs if r["seed"] == 1}
        hits = {k: [reached(r["curve"], t) for t in targets] for k, r in ones.items()}
        reach = [i for i in range(len(targets)) if any(h[i] for h in hits.values())]
        if not reach:
            continue
        aimed = [targets[i] for i in reach]
        by_seed: dict[int, list[float]] = {}
        for r in runs:
            by_seed.setdefault(k_of(r), []).append(_mean_log_steps(r, aimed))
        steps = {k: statistics.fmean(v) for k, v in by_seed.items()}
        k = min(steps, key=steps.__getitem__)
        out[gbs] = {
            "log_steps": steps,
            "loss": {k: score(r, warmup) for k, r in ones.items()},
            "best": k,
            "interior": min(steps) < k < max(steps),
            "extends": extends(by_seed) if math.isfinite(steps[k]) else None,
        }
    return out


def _mean_log_steps(run: dict, targets: Sequence[float]) -> float:
    hits = [reached(run["curve"], t) for t in targets]
    return statistics.fmean(math.log(h[0]) if h else math.inf for h in hits)


def fit_runs(result: dict, best: dict[int, dict]) -> list[dict]:
    """Per batch size, its chosen k's runs on its horizon, at every seed that ran."""
    return [r for gbs, v in best.items() for r in horizon(result, gbs) if k_of(r) == v["best"]]


def reached(curve: Sequence[Sequence[float]], target: float) -> tuple[float, float, int] | None:
    """(steps, samples, index of the first evaluation at or below) where the curve first reaches
    ``target``, linear in the loss between that evaluation and the one before it; None where it
    never does or starts below."""
    for i, (step, samples, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return None
            s0, e0, l0 = curve[i - 1]
            share = (l0 - target) / (l0 - loss)
            return s0 + share * (step - s0), e0 + share * (samples - e0), i
    return None


def quadratic_steps(curve: Sequence[Sequence[float]], target: float, i: int) -> float | None:
    """The step where the quadratic through the evaluations i-1, i and its outer neighbour (i+1, or
    i-2 at the end) in (step, loss) reaches ``target`` between evaluations i-1 and i; None where it
    does not."""
    j = i + 1 if i + 1 < len(curve) else i - 2
    if j < 0:
        return None
    xs, ys = zip(*[(curve[m][0], curve[m][2]) for m in (i - 1, i, j)])

    def value(x: float) -> float:
        return sum(
            ys[a] * math.prod((x - xs[b]) / (xs[a] - xs[b]) for b in range(3) if b != a)
            for a in range(3)
        )

    low, high = xs[0], xs[1]
    if (value(low) - target) * (value(high) - target) > 0:
        return None
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if value(middle) > target else (low, middle)
    return (low + high) / 2


def choose_targets(runs: list[dict], warmup_samples: int) -> list[float]:
    """Module docstring: below every run's loss at the end of its LR warmup, above what MIN_SIZES
    sizes reach."""
    after = [
        next(loss for _, samples, loss in r["curve"] if samples >= warmup_samples) for r in runs
    ]
    lowest: dict[int, float] = {}
    for r in runs:
        low = min(loss for _, _, loss in r["curve"])
        lowest[r["gbs"]] = max(
            lowest.get(r["gbs"], -math.inf), low
        )  # every seed of the size reaches it
    if len(lowest) < MIN_SIZES:
        return []
    high, low = min(after) * 0.995, sorted(lowest.values())[MIN_SIZES - 1]
    if not low < high:
        return []
    return [high - (high - low) * k / (TARGETS - 1) for k in range(TARGETS)]


def fit(target: float, runs: list[dict]) -> dict:
    """``fit_target`` on the runs that reach ``target`` (dominated batch sizes out, profile
    interval)."""
    points = []
    for r in runs:
        hit = reached(r["curve"], target)
        if hit is not None:
            points.append(
                RunPoint(label=r["name"], batch_size=r["gbs"], steps=hit[0], samples=hit[1])
            )
    found = fit_target(target, points)
    out = {
        "runs_used": [p.label for p in found.points],
        "dominated": [p.label for p in found.dominated],
        "reason": found.reason,
    }
    if found.fit is not None and found.interval is not None:
        out.update(
            b_crit=found.fit.b_crit,
            s_min=found.fit.s_min,
            e_min=found.fit.e_min,
            low=found.interval.low,
            high=found.interval.high,
            rms_log_residual=found.fit.rms_log_residual,
        )
    return out


def b_simple(run: dict, target: float, gbs: int) -> dict | None:
    """The window's and the EMA's B_simple where ``run`` crosses ``target``, and the EMA's lag
    (module docstring)."""
    hit = reached(run["curve"], target)
    rows = run["trace"]
    if hit is None or not rows:
        return None
    half = window_half(rows, gbs)
    window, count = window_b_simple(rows, hit[1], half)
    after = [r for r in rows if r["consumed_samples"] >= hit[1]]
    ema = after[0]["b_simple_samples"] if after else None
    lag = None
    if ema is not None:
        for r in reversed([r for r in rows if r["consumed_samples"] < hit[1]]):
            value, _ = window_b_simple(rows, r["consumed_samples"], half)
            if value is not None and value <= ema:
                lag = hit[1] - r["consumed_samples"]
                break
    return {
        "window": window,
        "rows": count,
        "ema": ema,
        "lag_samples": lag,
        "bias": window_bias(rows, hit[1], half),
    }


def window_half(rows: Sequence[dict], gbs: int) -> int:
    """The rows on each side of a window of WINDOW_SAMPLES samples, at the trace's interval (``gbs``
    where it has one row)."""
    every = rows[1]["consumed_samples"] - rows[0]["consumed_samples"] if len(rows) > 1 else gbs
    return max(1, WINDOW_SAMPLES // max(1, every))


def window_bias(rows: Sequence[dict], at_samples: float, half: int) -> float | None:
    """The ratio of sums' own bias at a window, E[X / Y] / (E X / E Y) to second order (the delta
    method) from the window's rows: 1 + var(mean Y) / (mean Y)^2 - cov(mean X, mean Y) / (mean X
    mean Y), X the per-sample tr(Sigma) and Y the |G|^2 of a row; None below 3 rows or where a mean
    is not positive."""
    parts = [step_parts(r) for r in centred_window(rows, at_samples, half)]
    if len(parts) < 3 or any(p is None for p in parts):
        return None
    xs, ys = zip(*parts)
    mx, my, n = statistics.fmean(xs), statistics.fmean(ys), len(parts)
    if mx <= 0 or my <= 0:
        return None
    cov = sum((x - mx) * (y - my) for x, y in parts) / (n - 1)
    return 1 + statistics.variance(ys) / n / my**2 - cov / n / (mx * my)


def distinct(curve: Sequence[Sequence[float]]) -> list[Sequence[float]]:
    """The curve without the evaluation after training where it repeats the last one's iteration."""
    out: list[Sequence[float]] = []
    for point in curve:
        if not out or point[0] > out[-1][0]:
            out.append(point)
    return out


def ratio(target: dict) -> dict | None:
    """B_simple (the window's, geometric mean over the runs the fit used) / B_crit, with an
    approximate 95 % interval: B_crit's profile interval and the normal interval of the mean log
    B_simple (1.96 standard errors) combined in quadrature in log space, each side apart. None where
    the target is not fitted or fewer than 2 runs measure."""
    logs = [
        math.log(v["window"])
        for name, v in target["b_simple"].items()
        if name in target["runs_used"]
        and v is not None
        and v["window"] is not None
        and v["window"] > 0
    ]
    if not target.get("b_crit") or len(logs) < 2:
        return None
    mean, error = statistics.fmean(logs), 1.96 * statistics.stdev(logs) / math.sqrt(len(logs))
    centre = mean - math.log(target["b_crit"])
    low = (
        None
        if target.get("high") is None
        else math.hypot(error, math.log(target["high"] / target["b_crit"]))
    )
    high = (
        None
        if not target.get("low")
        else math.hypot(error, math.log(target["b_crit"] / target["low"]))
    )
    return {
        "b_simple": math.exp(mean),
        "runs": len(logs),
        "ratio": math.exp(centre),
        "low": None if low is None else math.exp(centre - low),
        "high": None if high is None else math.exp(centre + high),
    }


def geometric(values: Sequence[float | None]) -> float | None:
    positive = [v for v in values if v is not None and v > 0]
    return math.exp(sum(map(math.log, positive)) / len(positive)) if positive else None


def analyse(result: dict) -> dict:
    """Every table of the module docstring, as numbers."""
    result = {**result, "runs": [{**r, "curve": distinct(r["curve"])} for r in result["runs"]]}
    plan = result["plan"]
    targets = choose_targets(seeded(result), plan["warmup_samples"])
    best = best_k(result, targets)
    runs = fit_runs(result, best)
    seeds = sorted({r["seed"] for r in runs})
    table = []
    for target in targets:
        entry = {"target": target, **fit(target, runs)}
        entry["per_seed"] = {
            s: fit(target, [r for r in runs if r["seed"] == s]).get("b_crit") for s in seeds
        }
        entry["fewest_steps_k"] = _fewest_steps_k(result, target)
        entry["b_simple"] = {r["name"]: b_simple(r, target, r["gbs"]) for r in runs}
        entry["interpolation"] = _interpolation(runs, target)
        table.append(entry)
    return {
        "lr": {
            gbs: {**v, "lr": {k: lr_of(plan, gbs, k) for k in v["log_steps"]}}
            for gbs, v in best.items()
        },
        "targets": table,
        "warmup": _warmup(result, targets),
    }


def _fewest_steps_k(result: dict, target: float) -> dict[int, int | None]:
    out: dict[int, int | None] = {}
    for gbs in result["plan"]["sizes"]:
        steps = {
            k_of(r): hit[0]
            for r in horizon(result, gbs)
            if r["seed"] == 1 and (hit := reached(r["curve"], target)) is not None
        }
        out[gbs] = min(steps, key=steps.__getitem__) if steps else None
    return out


def _interpolation(runs: list[dict], target: float) -> dict:
    """Median |log S| error of the linear interpolation (against the quadratic) and median seed sd
    of log S."""
    errors, by_size = [], {}
    for r in runs:
        hit = reached(r["curve"], target)
        if hit is None:
            continue
        by_size.setdefault(r["gbs"], []).append(math.log(hit[0]))
        other = quadratic_steps(r["curve"], target, hit[2])
        if other is not None and other > 0:
            errors.append(abs(math.log(hit[0]) - math.log(other)))
    sds = [statistics.stdev(v) for v in by_size.values() if len(v) > 1]
    return {
        "interpolation_log_s": statistics.median(errors) if errors else None,
        "seed_sd_log_s": statistics.median(sds) if sds else None,
    }


def _warmup(result: dict, targets: list[float]) -> dict:
    """Per configuration (the name without its seed): steps and samples to each target and the final
    loss, by seed."""
    out: dict[str, dict] = {}
    for r in result["runs"]:
        if r.get("phase") != "warmup":
            continue
        config = re.sub(r"-seed\d+$", "", r["name"])
        row = out.setdefault(
            config, {"seeds": [], "steps": [], "samples": [], "final": [], "steps_run": []}
        )
        hits = [reached(r["curve"], t) for t in targets]
        row["seeds"].append(r["seed"])
        row["steps"].append([None if h is None else h[0] for h in hits])
        row["samples"].append([None if h is None else h[1] for h in hits])
        row["final"].append(r["curve"][-1][2] if r["curve"] else None)
        row["steps_run"].append(r["steps"])
    return out


def measured_trust(analysis: dict) -> float | None:
    """The trust the measurement supports: the geometric mean over the fitted targets of B_crit /
    B_simple (the window's geometric mean over the runs the fit used, dominated ones out: the scope
    of :func:`ratio` and of the ratio the help texts quote), to 3 digits; None where no target gives
    both."""
    ratios = []
    for t in analysis["targets"]:
        used = set(t["runs_used"])
        window = geometric(
            [v["window"] for n, v in t["b_simple"].items() if v is not None and n in used]
        )
        if t.get("b_crit") and window:
            ratios.append(t["b_crit"] / window)
    mean = geometric(ratios)
    return None if mean is None else float(f"{mean:.3g}")


def mean_sd(values: Sequence[float | None]) -> tuple[float | None, float | None, int]:
    """(mean, sd, count) of the values that are not None; sd None below two."""
    given = [v for v in values if v is not None]
    if not given:
        return None, None, 0
    return (
        statistics.fmean(given),
        (statistics.stdev(given) if len(given) > 1 else None),
        len(given),
    )
