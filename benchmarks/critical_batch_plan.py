"""The runs issue 51 added (items 1, 3 and 4), planned from the 2026-12-03 sweep and costed, without
training: ``python benchmarks/critical_batch.py --plan`` prints them. Pure Python. The benchmark's
``--phase large``, ``edges``, ``branch`` and ``arms`` train them (critical_batch_phases.py).

* ``large``: GBS 64 and 128 on the long horizon (LONG_SAMPLES, the horizon of the runs that enter
  the fit) at k = LARGE_GRID, so two LRs below the old grid's lowest (k = 0); seed 1, the k already
  run long skipped; then the best k at the further seeds (costed at one k per size). The edge rule,
  ``extends``: a best k within one seed-sd of the grid's edge, in the fitted quantity (log steps to
  a target), adds the k past that edge.
* ``branch``: a constant GBS 8 trunk to BRANCH_SAMPLES past the last branch point, branched at
  BRANCH_AT samples to each larger size of BRANCH_SIZES (LR scaled by sqrt(GBS / 8), the warmup's
  ``--ga-lr-scaling sqrt``) for BRANCH_SAMPLES more, at BRANCH_SEEDS; the trunk after a point is its
  GBS 8 branch.
* ``arms``: constant GBS 8, ``--ga-batch-size-warmup auto`` (trust 1), and a fixed step schedule at
  the adaptive runs' median doubling points (read from their traces), at ARM_SEEDS seeds, each with
  a decay over the last DECAY_SHARE of the samples.

The cost: each run's samples times the sweep's measured wall seconds per sample at its GBS (median
over its grid, seed and long runs, the launch included) times RANKS processes (DP 2: two CPU
processes a run).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence

LARGE_SIZES = (64, 128)
LARGE_GRID = (-2, -1, 0, 1, 2)
LONG_SAMPLES = 24576
BRANCH_AT = (1024, 2048, 4096)
BRANCH_SIZES = (8, 16, 32, 64, 128, 256)  # 128 and 256: where 64 left the knee open
BRANCH_SAMPLES = 2048
BRANCH_SEEDS = (1, 2)
ARM_SEEDS = tuple(range(1, 11))
DECAY_SHARE = 0.2
RANKS = 2


def lr(plan: dict, gbs: int, k: int) -> float:
    """benchmarks/critical_batch.py's Plan.lr."""
    return float(f"{plan['lr16'] * (gbs / 16) ** plan['lr_power'] * 2.0**k:.4g}")


def seconds_per_sample(result: dict) -> dict[int, float]:
    """Per GBS: the median wall seconds per sample of its grid, seed and long runs."""
    by: dict[int, list[float]] = {}
    for r in result["runs"]:
        if r.get("phase") in ("grid", "seeds", "long") and r["steps"]:
            by.setdefault(r["gbs"], []).append(r["seconds"] / (r["steps"] * r["gbs"]))
    return {gbs: statistics.median(v) for gbs, v in by.items()}


def doubling_points(result: dict, prefix: str = "warmup-auto-trust1-seed") -> list[tuple[int, int]]:
    """(samples, GBS) of the adaptive runs' median doubling points: per run, the consumed samples of
    the first trace row at each new batch size (the batch of a step: the samples between two rows
    over their iterations)."""
    per_size: dict[int, list[float]] = {}
    for r in result["runs"]:
        if not r["name"].startswith(prefix):
            continue
        rows, current = r["trace"], r["gbs"]
        for a, b in itertools.pairwise(rows):
            steps = b["iteration"] - a["iteration"]
            size = (b["consumed_samples"] - a["consumed_samples"]) // steps if steps else current
            if size > current and size & (size - 1) == 0:
                per_size.setdefault(size, []).append(a["consumed_samples"])
                current = size
    return [(int(statistics.median(v)), size) for size, v in sorted(per_size.items())]


def plan(result: dict) -> list[dict]:
    """Every run of the three arms (module docstring): name, arm, GBS, LR, seed and samples."""
    p, runs = result["plan"], []
    done = {r["name"] for r in result["runs"]}
    for gbs in LARGE_SIZES:
        for k in LARGE_GRID:
            name = f"gbs{gbs}-k{k:+d}-seed1-long"
            if name not in done:
                runs.append(_run(name, "large", gbs, lr(p, gbs, k), 1, LONG_SAMPLES))
        for seed in p["seeds"][1:]:
            runs.append(
                _run(f"gbs{gbs}-best-seed{seed}-long", "large", gbs, None, seed, LONG_SAMPLES)
            )
    start = p["warmup_start"]
    base = next(
        r["lr"] for r in result["runs"] if r["name"] == f"constant-gbs{start}-seed1"
    )  # its best LR
    end = max(BRANCH_AT) + BRANCH_SAMPLES
    for seed in BRANCH_SEEDS:
        runs.append(_run(f"trunk-gbs{start}-seed{seed}", "branch", start, base, seed, end))
        for at in BRANCH_AT:
            for gbs in BRANCH_SIZES[1:]:  # the trunk after a point is its start-size branch
                scaled = float(f"{base * math.sqrt(gbs / start):.4g}")
                runs.append(
                    _run(
                        f"branch{at}-gbs{gbs}-seed{seed}",
                        "branch",
                        gbs,
                        scaled,
                        seed,
                        BRANCH_SAMPLES,
                    )
                )
    for seed in ARM_SEEDS:
        for arm in ("constant", "adaptive", "fixed"):
            runs.append(
                _run(f"{arm}-gbs{start}-decay-seed{seed}", "arms", start, base, seed, p["samples"])
            )
    return runs


def _run(name: str, arm: str, gbs: int, rate: float | None, seed: int, samples: int) -> dict:
    return {"name": name, "arm": arm, "gbs": gbs, "lr": rate, "seed": seed, "samples": samples}


def cpu_minutes(runs: Sequence[dict], rates: dict[int, float]) -> dict[str, float]:
    """Per arm and in all: samples x seconds per sample at the run's GBS (the nearest measured) x
    RANKS / 60."""
    out: dict[str, float] = {}
    for r in runs:
        rate = rates[min(rates, key=lambda g: abs(math.log(g / r["gbs"])))]
        out[r["arm"]] = out.get(r["arm"], 0.0) + r["samples"] * rate * RANKS / 60
    out["all"] = sum(out.values())
    return out


def extends(log_steps: dict[int, list[float]]) -> int | None:
    """The edge rule: per k, the log steps to a target over seeds (inf where a run misses it); the k
    past an edge to add where the mean at the grid's lowest (or highest) k is within one seed-sd
    (the median over the k's whose seeds all reach it) of the best (lowest) mean, else None."""
    means = {k: statistics.fmean(v) for k, v in log_steps.items()}
    sds = [
        statistics.stdev(v) for v in log_steps.values() if len(v) > 1 and all(map(math.isfinite, v))
    ]
    sd = statistics.median(sds) if sds else 0.0
    best, low, high = min(means, key=means.__getitem__), min(means), max(means)
    if means[low] - means[best] <= sd:
        return low - 1
    if means[high] - means[best] <= sd:
        return high + 1
    return None


def render(result: dict) -> str:
    runs, rates = plan(result), seconds_per_sample(result)
    lines = []
    for r in runs:
        rate = "best" if r["lr"] is None else f"{r['lr']:.4g}"
        lines.append(
            f"{r['arm']:7s} {r['name']:32s} GBS {r['gbs']:4d}  LR {rate:<8} {r['samples']:6d} "
            "samples"
        )
    points = " ".join(f"{s}:{g}" for s, g in doubling_points(result))
    lines.append(
        f"fixed schedule (samples:GBS, the adaptive runs' median doubling points): 0:8 {points}"
    )
    cost = cpu_minutes(runs, rates)
    lines.append(
        f"{len(runs)} runs, about {cost['all']:.0f} CPU-minutes ("
        + ", ".join(f"{arm} {m:.0f}" for arm, m in cost.items() if arm != "all")
        + f"; {RANKS} processes a run, the sweep's measured seconds per sample)"
    )
    return "\n".join(lines)
