"""The local critical batch where the warmup decides (issue 51, item 3), from the branched runs of
benchmarks/critical_batch_phases.py: Merrill et al.'s branching design, measured by McCandlish's
hyperbola. Pure Python.

* **A branch** from point ``a`` (samples) of a seed's trunk starts at the trunk's evaluation there
  (loss L0, the same weights); its S and E are its steps and samples since ``a``. The trunk itself
  after ``a`` is the start size's branch.
* **Targets** per point: LOCAL_TARGETS losses evenly spaced below the lowest L0 of the seeds, the
  last the lowest loss that the branches of MIN_SIZES sizes all reach (every seed), as the sweep's
  targets: a size whose branches never fall below L0 (an LR past stable) does not hold them up.
* **The fit** per point and target: ``fit_target`` on every seed's branches together (dominated
  sizes left out, the profile interval).
* **B_simple** at the point: the trunk's centred window (WINDOW_SAMPLES each side, ratio of sums)
  at ``a``, geometric mean over the seeds.
"""

from __future__ import annotations

import math
import re

from benchmarks.critical_batch_analysis import (
    MIN_SIZES,
    distinct,
    geometric,
    reached,
    window_half,
)
from megatron_ga_ext.science.core.critical_batch import RunPoint
from megatron_ga_ext.science.core.critical_batch_targets import fit_target
from megatron_ga_ext.science.core.noise_window import window_b_simple

LOCAL_TARGETS = 3
_TRUNK = re.compile(r"trunk-gbs(\d+)-seed(\d+)")
_BRANCH = re.compile(r"branch(\d+)-gbs(\d+)-seed(\d+)")


def branches(result: dict) -> dict[int, dict[int, dict[int, list]]]:
    """{point: {seed: {GBS: curve since the point, (steps, samples, loss), from (0, 0, L0)}}}."""
    trunks = _trunks(result)
    out: dict[int, dict[int, dict[int, list]]] = {}
    for r in result["runs"]:
        if (m := _BRANCH.fullmatch(r["name"])) is None or int(m[3]) not in trunks:
            continue
        at, gbs, seed = int(m[1]), int(m[2]), int(m[3])
        start, trunk = trunks[seed]
        curve = distinct(trunk["curve"])
        origin = next((p for p in curve if p[1] == at), None)
        if origin is None:
            continue
        size = out.setdefault(at, {}).setdefault(seed, {})
        end = max(p[1] for p in distinct(r["curve"]))  # the branch's last samples
        size[start] = _since(origin, [p for p in curve if at <= p[1] <= end])
        size[gbs] = _since(origin, [origin, *distinct(r["curve"])])
    return out


def _since(origin, curve) -> list[list[float]]:
    return [[p[0] - origin[0], p[1] - origin[1], p[2]] for p in curve]


def local(result: dict) -> list[dict]:
    """Per branch point: its targets' fits and the trunk's B_simple there (module docstring)."""
    trunks = _trunks(result)
    out = []
    for at, seeds in sorted(branches(result).items()):
        high = min(curves[min(curves)][0][2] for curves in seeds.values())
        reach: dict[int, float] = {}  # per size, the lowest loss every seed's branch reaches
        for curves in seeds.values():
            for gbs, curve in curves.items():
                reach[gbs] = max(reach.get(gbs, -math.inf), min(p[2] for p in curve))
        low = sorted(reach.values())[min(MIN_SIZES, len(reach)) - 1]
        targets = [high - (high - low) * j / LOCAL_TARGETS for j in range(1, LOCAL_TARGETS + 1)]
        targets = [t for t in targets if t < high]
        fits = []
        for target in targets:
            points = [
                RunPoint(label=f"gbs{gbs}-seed{seed}", batch_size=gbs, steps=hit[0], samples=hit[1])
                for seed, curves in sorted(seeds.items())
                for gbs, curve in sorted(curves.items())
                if (hit := reached(curve, target)) is not None
            ]
            found = fit_target(target, points)
            entry = {"target": target, "reason": found.reason, "runs": len(points)}
            entry["dominated"] = [p.label for p in found.dominated]
            if found.fit is not None and found.interval is not None:
                entry.update(
                    b_crit=found.fit.b_crit, low=found.interval.low, high=found.interval.high
                )
            fits.append(entry)
        simple = {}
        for seed in seeds:
            start, trunk = trunks[seed]
            half = window_half(trunk["trace"], start)
            simple[seed] = window_b_simple(trunk["trace"], at, half)[0]
        out.append(
            {
                "at": at,
                "loss": high,
                "seeds": sorted(seeds),
                "sizes": sorted({g for curves in seeds.values() for g in curves}),
                "fits": fits,
                "b_simple": geometric(list(simple.values())),
                "b_simple_per_seed": simple,
            }
        )
    return out


def _trunks(result: dict) -> dict[int, tuple[int, dict]]:
    """{seed: (its start GBS, the trunk's run)}."""
    runs = result["runs"]
    return {int(m[2]): (int(m[1]), r) for r in runs if (m := _TRUNK.fullmatch(r["name"]))}


def summary(point: dict) -> float | None:
    """The point's local B_crit: the geometric mean over its fitted targets (None where none is)."""
    values = [f["b_crit"] for f in point["fits"] if f.get("b_crit")]
    return geometric(values) if values else None


def ratio(point: dict) -> float | None:
    """B_simple / the local B_crit at the point."""
    b_crit = summary(point)
    return None if b_crit is None or not point["b_simple"] else point["b_simple"] / b_crit
