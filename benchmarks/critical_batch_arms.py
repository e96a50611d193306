"""The warmup against a fixed schedule and a constant batch (issue 51, item 4), from the arms of
benchmarks/critical_batch_phases.py: every arm at every seed ends with the same linear decay, so
its final loss is an end of training. Pure Python.

* **Targets**: ARM_TARGETS losses evenly spaced from 0.995 x the highest loss any arm run has at the
  end of its LR warmup down to the highest final loss of any arm run (every run reaches each).
* Per arm and seed: the steps and samples to each target (linear between evaluations), the final
  validation loss (the evaluation after training) and the steps run.
* **Paired**, per pair of arms over the seeds both ran (same seed: same initial weights and data
  order): the mean difference and its 95 % t interval, mean +- t(0.975, n - 1) x sd / sqrt(n).
"""

from __future__ import annotations

import math
import re
import statistics

from benchmarks.critical_batch_analysis import distinct, reached
from megatron_ga_ext.science.core.profile_interval import t_quantile

ARMS = ("constant", "adaptive", "fixed")
PAIRS = (("adaptive", "constant"), ("fixed", "constant"), ("adaptive", "fixed"))
ARM_TARGETS = 4
_ARM = re.compile(r"(constant|adaptive|fixed)-gbs\d+-decay-seed(\d+)")


def arm_runs(result: dict) -> dict[str, dict[int, dict]]:
    """{arm: {seed: run}}, each curve without its repeated last evaluation but the final loss kept
    as ``final``."""
    out: dict[str, dict[int, dict]] = {}
    for r in result["runs"]:
        if (m := _ARM.fullmatch(r["name"])) is not None:
            run = {**r, "curve": distinct(r["curve"]), "final": r["curve"][-1][2]}
            out.setdefault(m[1], {})[int(m[2])] = run
    return out


def targets(arms: dict[str, dict[int, dict]], warmup_samples: int) -> list[float]:
    runs = [r for by_seed in arms.values() for r in by_seed.values()]
    if not runs:
        return []
    after = [next(p[2] for p in r["curve"] if p[1] >= warmup_samples) for r in runs]
    high, low = 0.995 * max(after), max(min(p[2] for p in r["curve"]) for r in runs)
    return [high - (high - low) * j / (ARM_TARGETS - 1) for j in range(ARM_TARGETS)]


def measures(run: dict, aims: list[float]) -> dict:
    hits = [reached(run["curve"], t) for t in aims]
    return {
        "steps": [None if h is None else h[0] for h in hits],
        "samples": [None if h is None else h[1] for h in hits],
        "final": run["final"],
        "steps_run": run["steps"],
    }


def paired(a: list[float | None], b: list[float | None]) -> dict | None:
    """Mean of a - b over the seeds where both are given, with its 95 % t interval."""
    diffs = [x - y for x, y in zip(a, b, strict=True) if x is not None and y is not None]
    if len(diffs) < 2:
        return None
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    half = t_quantile(0.95, len(diffs) - 1) * sd / math.sqrt(len(diffs))
    return {"mean": mean, "low": mean - half, "high": mean + half, "seeds": len(diffs)}


def analyse_arms(result: dict) -> dict:
    """Per arm its measures by seed; per pair the paired differences (module docstring)."""
    arms = arm_runs(result)
    aims = targets(arms, result["plan"]["warmup_samples"])
    per = {
        arm: {seed: measures(r, aims) for seed, r in sorted(by_seed.items())}
        for arm, by_seed in arms.items()
    }
    pairs = {}
    for one, other in PAIRS:
        seeds = sorted(set(per.get(one, {})) & set(per.get(other, {})))
        if not seeds:
            continue
        a, b = [per[one][s] for s in seeds], [per[other][s] for s in seeds]
        pairs[f"{one} - {other}"] = {
            key: [paired([x[key][i] for x in a], [y[key][i] for y in b]) for i in range(len(aims))]
            for key in ("steps", "samples")
        }
        pairs[f"{one} - {other}"]["final"] = paired(
            [x["final"] for x in a], [y["final"] for y in b]
        )
    return {"targets": aims, "arms": per, "pairs": pairs}
