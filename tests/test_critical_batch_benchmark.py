"""benchmarks/critical_batch.py's reading of its runs and its LR grid,
benchmarks/critical_batch_analysis.py and critical_batch_report.py on a made-up result whose runs
follow a known hyperbola (the benchmark itself: make critical-batch; its pipeline in CI: make
critical-batch-quick)."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from benchmarks import critical_batch_analysis as analysis
from benchmarks import critical_batch_report as report

B_CRIT = 20.0
SIZES = (4, 8, 16, 32, 64, 128)
PLAN = {
    "sizes": list(SIZES),
    "seeds": [1, 2, 3],
    "warmup_samples": 512,
    "lr16": 2e-3,
    "lr_power": 0.35,
}


def loss_at(step: float, gbs: int, k: int, noise: float) -> float:
    """2 + 3 exp(-x), x = step / (20 (1 + B_crit / B) slow(k) exp(noise)): the best LR is k = 0."""
    return 2.0 + 3.0 * math.exp(
        -step / (20.0 * (1 + B_CRIT / gbs) * (1 + 0.3 * k * k) * math.exp(noise))
    )


def b_true(samples: float) -> float:
    return 2.0 + samples / 100.0


def run(
    gbs: int, k: int, seed: int, noise: float, name: str | None = None, phase: str = "grid"
) -> dict:
    steps = 8192 // gbs
    every = max(1, 128 // gbs)
    curve = [[s, s * gbs, loss_at(s, gbs, k, noise)] for s in range(every, steps + 1, every)]
    trace, sigma, grad = [], 0.0, 0.0
    for samples in range(32, 8193, max(32, gbs)):
        sigma, grad = 0.95 * sigma + 0.05 * b_true(samples) * 64, 0.95 * grad + 0.05
        trace.append(
            {
                "iteration": samples // gbs,
                "consumed_samples": samples,
                "grad_sq": 1.0,
                "trace_sigma": b_true(samples) * 64,
                "tokens_per_sample": 64.0,
                "b_simple_samples": sigma / grad / 64,
            }
        )
    return {
        "name": name or f"gbs{gbs}-k{k:+d}-seed{seed}",
        "phase": phase,
        "gbs": gbs,
        "lr": 0.0,
        "seed": seed,
        "seconds": 1.0,
        "steps": steps,
        "curve": curve,
        "trace": trace,
    }


def result() -> dict:
    rng = random.Random(3)
    runs = [run(gbs, k, 1, rng.gauss(0, 0.05)) for gbs in SIZES for k in (-1, 0, 1)]
    runs += [run(gbs, 0, seed, rng.gauss(0, 0.05)) for gbs in SIZES for seed in (2, 3)]
    runs += [run(8, 0, seed, 0.0, f"constant-gbs8-seed{seed}", "warmup") for seed in (1, 2)]
    return {"date": "2026-12-03", "source": "megatron-lm-core_v0.19.0", "plan": PLAN, "runs": runs}


def test_the_analysis_recovers_the_known_b_crit_lr_and_b_simple():
    data = result()
    out = analysis.analyse(data)
    assert all(v["best"] == 0 and v["interior"] for v in out["lr"].values())
    targets = out["targets"]
    assert len(targets) == analysis.TARGETS
    after_warmup = max(
        loss_at(512 / 4, 4, 0, 0.2), 0
    )  # the smallest batch is lowest at the end of its warmup
    assert all(t["target"] < after_warmup for t in targets)
    for t in targets:
        assert t["b_crit"] is not None, t["reason"]
        assert t["low"] <= B_CRIT <= t["high"], t
        assert set(t["per_seed"]) == {1, 2, 3} and all(
            b is not None for b in t["per_seed"].values()
        )
        assert len(t["runs_used"]) + len(t["dominated"]) >= 12
        noise = t["interpolation"]
        assert noise["interpolation_log_s"] < noise["seed_sd_log_s"]
        for name, value in t["b_simple"].items():
            if value is None or value["window"] is None:
                continue
            crossing = analysis.reached(
                next(r for r in data["runs"] if r["name"] == name)["curve"], t["target"]
            )
            assert value["window"] == pytest.approx(b_true(crossing[1]), rel=0.1)
            assert (
                value["ema"] < value["window"] and value["lag_samples"] > 0
            )  # the EMA lags a rising B_simple
    warmup = out["warmup"]["constant-gbs8"]
    assert warmup["seeds"] == [1, 2] and len(warmup["steps"][0]) == len(targets)


def test_a_size_that_ran_long_enters_the_fit_by_its_long_runs_only():
    data = result()
    data["runs"] += [
        {**run(128, 0, seed, 0.0), "name": f"gbs128-k+0-seed{seed}-long", "phase": "long"}
        for seed in (1, 2)
    ]
    targets = analysis.choose_targets(analysis.seeded(data), PLAN["warmup_samples"])
    chosen = analysis.fit_runs(data, analysis.best_k(data, targets))
    assert sorted(r["name"] for r in chosen if r["gbs"] == 128) == [
        "gbs128-k+0-seed1-long",
        "gbs128-k+0-seed2-long",
    ]
    assert len([r for r in chosen if r["gbs"] == 64]) == 3


def test_the_tables_render_from_the_newest_result(tmp_path):
    (tmp_path / "critical-batch-2026-12-03.json").write_text(json.dumps(result()))
    (tmp_path / "critical-batch-2026-12-01.json").write_text("{}")  # older: not read
    tables = report.tables(tmp_path)
    assert set(tables) == set(report.BLOCKS)
    rows = tables["critical-batch"].splitlines()
    assert rows[0] == "2026-12-03, megatron-lm-core_v0.19.0, 32 runs, 32 s of training."
    assert len(rows) == 2 + 2 + analysis.TARGETS and " of 3 | 18 | none |" in rows[4]
    assert tables["lr-grid"].splitlines()[2].startswith("| 4 | 0.000616: ")
    assert "| yes |" in tables["lr-grid"]
    assert tables["warmup-test"].splitlines()[2].startswith("| constant-gbs8 | 2 | ")
    assert len(tables["b-simple"].splitlines()) == 2 + analysis.TARGETS


def test_without_a_result_the_tables_say_how_to_make_one(tmp_path):
    assert set(report.tables(tmp_path).values()) == {
        "No result committed yet: run `make critical-batch`, then `make docs`."
    }


def test_the_quadratic_check_of_the_interpolation():
    curve = [
        [s, 16 * s, 5.0 - 0.01 * s * s] for s in (10, 20, 30)
    ]  # a parabola: the quadratic is exact
    hit = analysis.reached(curve, 2.0)  # linear between 10 (4.0) and 20 (1.0)
    assert hit is not None and hit[0] == pytest.approx(10.0 + 10.0 * 2.0 / 3.0)
    assert analysis.quadratic_steps(curve, 2.0, hit[2]) == pytest.approx(math.sqrt(300.0))
    assert analysis.reached(curve, 6.0) is None  # already below at the first evaluation


def test_a_run_is_read_from_its_log_also_where_the_validation_set_is_named():
    pytest.importorskip("megatron.core")
    from benchmarks import critical_batch

    log = """\
 [t] iteration        1/      64 | consumed samples:            8 | global batch size:     8 | lm loss: 5.5 |
 [t] iteration        2/      64 | consumed samples:           16 | global batch size:     8 | lm loss: 5.0 |
 validation-0 loss at iteration 2 | lm loss value: 4.000000E+00 | lm loss PPL: 5.4E+01 |
 [t] iteration        3/      64 | consumed samples:           32 | global batch size:    16 | lm loss: 4.0 |
 validation loss at iteration 3 on validation set | lm loss value: 3.100000E+00 | lm loss PPL: 2.2E+01 |
"""
    assert critical_batch.validation_curve(log) == [[2, 16, 4.0], [3, 32, 3.1]]
    # thresholds in tokens (x --seq-length 64): 8 -> 64 at 0, 1,024, 2,048 and 3,072 samples
    assert critical_batch.hand_schedule(8, 64, 8192) == "0:8 65536:16 131072:32 196608:64"


def test_the_grid_extends_past_an_edge_best_until_it_is_interior():
    """Scores falling toward k = +2 at GBS 4: the grid (-1, 0, 1) extends to +2 and then +3 (where
    the score rises again), never past the plan's two extensions; GBS 8's best is interior at
    once."""
    pytest.importorskip("megatron.core")
    from benchmarks import critical_batch

    sweep = object.__new__(critical_batch.Sweep)
    sweep.plan = critical_batch.Plan(
        **{**critical_batch.FULL.__dict__, "sizes": (4, 8), "grid": (-1, 0, 1)}
    )
    ran = []

    def grid_run(gbs: int, k: int, seed: int, phase: str) -> dict:
        ran.append((gbs, k))
        loss = (k - 2) ** 2 if gbs == 4 else k * k
        return {"curve": [[1, 1024, 3.0 + loss]]}

    sweep.grid_run = grid_run
    assert sweep.grid() == {4: 2, 8: 0}
    assert ran == [(4, -1), (4, 0), (4, 1), (4, 2), (4, 3), (8, -1), (8, 0), (8, 1)]


def test_the_lr_is_chosen_by_steps_to_the_targets_and_the_edge_rule_flags_a_near_edge():
    """GBS 16's k = +1 follows k = 0 1 % later in steps until the lowest target, then falls to 1.9
    (the old criterion, mean loss after the LR warmup, prefers it); the fitted quantity chooses
    k = 0, and k = +1 lies within one seed-sd of it, so the edge rule adds k = +2."""
    data = result()
    for r in data["runs"]:
        if r["gbs"] == 16 and k_of_name(r["name"]) == 1:
            r["curve"] = [[s, e, late(s, 512)] for s, e, _ in r["curve"]]
    out = analysis.analyse(data)
    gbs16 = out["lr"][16]
    assert min(gbs16["loss"], key=gbs16["loss"].__getitem__) == 1
    assert gbs16["best"] == 0 and gbs16["extends"] == 2
    assert all(v["extends"] is None for g, v in out["lr"].items() if g != 16)


def late(step: float, steps: int) -> float:
    """GBS 16 at k = 0 (no noise) 1 % later, then linear from 2.001 down to 1.9 at ``steps``."""
    loss = loss_at(step / 1.01, 16, 0, 0.0)
    turn = 1.01 * 45 * math.log(3 / 0.001)  # where it reaches 2.001
    return loss if step <= turn else 2.001 - 0.101 * (step - turn) / (steps - turn)


def k_of_name(name: str) -> int:
    return analysis.k_of({"name": name})


def test_the_edges_phase_adds_the_k_the_rule_names_then_seeds_the_chosen_k(monkeypatch):
    pytest.importorskip("megatron.core")
    from benchmarks import critical_batch

    sweep = object.__new__(critical_batch.Sweep)
    sweep.plan = critical_batch.Plan(
        **{**critical_batch.FULL.__dict__, "sizes": SIZES, "seeds": (1, 2, 3), "long_sizes": ()}
    )
    runs = result()["runs"]
    for r in runs:  # GBS 16: k = +1 within a seed-sd of k = 0, so the rule adds +2, which wins
        if r["gbs"] == 16 and k_of_name(r["name"]) == 1:
            r["curve"] = [[s, e, late(s, 512)] for s, e, _ in r["curve"]]
    trained = []

    def grid_run(gbs: int, k: int, seed: int, phase: str) -> dict:
        name = f"gbs{gbs}-k{k:+d}-seed{seed}"
        if (found := next((r for r in runs if r["name"] == name), None)) is not None:
            return found
        trained.append((name, phase))
        made = run(gbs, 0, seed, -0.05, name, phase)  # the added k: faster than k = 0
        runs.append(made)
        return made

    monkeypatch.setattr(sweep, "grid_run", grid_run)
    monkeypatch.setattr(sweep, "runs", lambda: runs)
    best = sweep.edges()
    assert trained[0] == ("gbs16-k+2-seed1", "grid")
    assert best[16] == 2 and trained[-2:] == [
        ("gbs16-k+2-seed2", "seeds"),
        ("gbs16-k+2-seed3", "seeds"),
    ]


def test_the_window_bias_is_the_ratio_of_sums_own_bias():
    """Windows of 17 rows with |G|^2 ~ N(1, 0.4) and tr(Sigma) per sample ~ N(10, 2): the
    delta method's factor (median over windows) matches the simulated E[sum X / sum Y] / 10 to
    1 %, and it is above 1 (the ratio of sums reads high)."""
    rng = random.Random(7)
    factors, ratios = [], []
    for _ in range(4000):
        rows = [
            {
                "consumed_samples": 32 * i,
                "grad_sq": rng.gauss(1, 0.4),
                "trace_sigma": rng.gauss(10, 2) * 64,
                "tokens_per_sample": 64.0,
            }
            for i in range(17)
        ]
        factors.append(analysis.window_bias(rows, 256, 8))
        ratios.append(sum(r["trace_sigma"] / 64 for r in rows) / sum(r["grad_sq"] for r in rows))
    simulated = statistics.fmean(ratios) / 10
    assert simulated > 1.005 and statistics.median(factors) == pytest.approx(simulated, abs=0.01)
