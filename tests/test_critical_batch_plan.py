"""benchmarks/critical_batch_plan.py: the runs issue 51 added (items 1, 3, 4), planned from
the committed sweep and costed; nothing trains."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from benchmarks import critical_batch, critical_batch_analysis, critical_batch_plan

RESULT = (
    Path(__file__).resolve().parents[1]
    / "benchmarks"
    / "results"
    / "critical-batch-2026-12-03.json"
)


def test_the_plan_has_the_three_arms_and_their_cost():
    result = json.loads(RESULT.read_text())
    runs = critical_batch_plan.plan(result)
    by_arm = {arm: [r for r in runs if r["arm"] == arm] for arm in ("large", "branch", "arms")}
    assert {arm: len(v) for arm, v in by_arm.items()} == {"large": 12, "branch": 32, "arms": 30}
    old_lowest = {
        64: 0.003249,
        128: 0.004141,
    }  # k = 0, the lowest LR the sweep ran at GBS 64 and 128
    for gbs, lowest in old_lowest.items():
        below = [
            r["lr"] for r in by_arm["large"] if r["gbs"] == gbs and r["lr"] and r["lr"] < lowest
        ]
        assert len(below) == 2
    assert all(r["samples"] == 24576 for r in by_arm["large"])
    gbs32 = next(r for r in by_arm["branch"] if r["name"] == "branch2048-gbs32-seed1")
    assert math.isclose(gbs32["lr"], 0.003138 * 2, rel_tol=1e-3)  # sqrt(32 / 8) x GBS 8's LR
    assert sorted({r["seed"] for r in by_arm["arms"]}) == list(range(1, 11))
    assert critical_batch_plan.doubling_points(result) == [(2304, 16), (4320, 32)]
    cost = critical_batch_plan.cpu_minutes(runs, critical_batch_plan.seconds_per_sample(result))
    assert 100 < cost["all"] < 200 and math.isclose(
        cost["all"], sum(v for k, v in cost.items() if k != "all")
    )


def test_the_edge_rule_extends_past_an_edge_within_one_seed_sd():
    flat = {-2: [5.00, 5.10], -1: [5.02, 5.12], 0: [5.30, 5.40]}  # best -2, at the edge
    assert critical_batch_plan.extends(flat) == -3
    near = {
        -1: [5.05, 5.15],
        0: [5.00, 5.10],
        1: [5.40, 5.50],
    }  # best 0, edge -1 within one sd (0.07)
    assert critical_batch_plan.extends(near) == -2
    clear = {-1: [5.50, 5.52], 0: [5.00, 5.02], 1: [5.60, 5.62]}
    assert critical_batch_plan.extends(clear) is None
    missed = {-1: [5.00, 5.02], 0: [math.inf, 5.3], 1: [math.inf]}  # a miss is worse, not noise
    assert critical_batch_plan.extends(missed) == -2


def test_plan_prints_without_training(capsys, monkeypatch):
    monkeypatch.setattr(critical_batch, "launch", None)  # a training launch would fail
    assert critical_batch.main(["--plan"]) == 0
    out = capsys.readouterr().out
    assert "74 runs, about" in out and "CPU-minutes" in out and "0:8 2304:16 4320:32" in out


def test_the_large_phase_judges_lrs_by_steps_to_the_target_and_runs_the_plan(tmp_path, monkeypatch):
    """--phase large trains the plan's seed-1 grid at GBS 64 and 128 (the committed k = +2 long
    runs count as run), picks the k with the fewest steps to a target its long runs reach,
    runs it at seeds 2 and 3, and leaves the committed runs in the cache for --collect."""
    committed = json.loads(RESULT.read_text())
    target = min(t["target"] for t in critical_batch_analysis.analyse(committed)["targets"])
    sweep = object.__new__(critical_batch.Sweep)
    sweep.plan, sweep.out = critical_batch.FULL, tmp_path
    trained = []

    def train(name, gbs, lr, seed, phase, extra=(), long=False):
        assert phase == "long" and long and lr == critical_batch.FULL.lr(gbs, k_of(name))
        trained.append(name)
        steps = 100 * (1 + abs(k_of(name) + 1))  # k = -1 takes the fewest steps
        curve = [[0, 0, target + 1.0], [steps, steps * gbs, target - 0.01]]
        return {"name": name, "gbs": gbs, "seed": seed, "curve": curve}

    def k_of(name):
        return int(re.search(r"-k([+-]\d+)-", name)[1])

    monkeypatch.setattr(sweep, "train", train)
    assert sweep.large() == {64: -1, 128: -1}
    planned = [
        r["name"]
        for r in critical_batch_plan.plan(committed)
        if r["arm"] == "large" and r["seed"] == 1
    ]
    assert trained[:4] + trained[6:10] == planned
    assert trained[4:6] == ["gbs64-k-1-seed2-long", "gbs64-k-1-seed3-long"]
    assert trained[10:] == ["gbs128-k-1-seed2-long", "gbs128-k-1-seed3-long"]
    assert len(list(tmp_path.glob("*.json"))) == len(committed["runs"])
