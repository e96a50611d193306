"""benchmarks/critical_batch.py's reading of its runs and benchmarks/critical_batch_report.py's tables, on made-up
results (the benchmark itself: make critical-batch; its pipeline in CI: make critical-batch-quick)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import critical_batch_report as report

LOG = """\
 [t] iteration        1/      64 | consumed samples:            8 | global batch size:     8 | lm loss: 5.5 |
 [t] iteration        2/      64 | consumed samples:           16 | global batch size:     8 | lm loss: 5.0 |
 validation loss at iteration 2 | lm loss value: 4.000000E+00 | lm loss PPL: 5.4E+01 |
 [t] iteration        3/      64 | consumed samples:           32 | global batch size:    16 | lm loss: 4.0 |
 [t] iteration        4/      64 | consumed samples:           48 | global batch size:    16 | lm loss: 3.5 |
 validation loss at iteration 4 | lm loss value: 3.000000E+00 | lm loss PPL: 2.0E+01 |
 validation loss at iteration 4 on validation set | lm loss value: 3.100000E+00 | lm loss PPL: 2.2E+01 |
"""


def test_a_run_whose_batch_grows_is_read_and_its_crossing_interpolated(tmp_path):
    pytest.importorskip("megatron.core")
    from benchmarks import critical_batch

    log = tmp_path / "warmup.log"
    log.write_text(LOG)
    assert critical_batch._validation(log) == [(2, 16, 4.0), (4, 48, 3.0), (4, 48, 3.1)]
    assert critical_batch._reached(log, 3.5) == (3.0, 32.0)  # halfway from (2, 16, 4.0) to (4, 48, 3.0)
    assert critical_batch._reached(log, 4.5) == (2.0, 16.0)  # the first validation is already below
    assert critical_batch._reached(log, 2.0) is None
    assert critical_batch._final_loss(log) == 3.1  # the validation after training
    record = {
        "log": str(log),
        "trace": [{"consumed_samples": 16, "b_simple_samples": 1.0}, {"consumed_samples": 40, "b_simple_samples": 2.0}],
    }
    assert critical_batch._b_simple_at(record, 3.5) == 2.0  # the first measurement at or after 32 samples


def _fit(target: float, b_crit: float | None, low: float | None = 0.0, high: float | None = 0.0) -> dict:
    if b_crit is None:
        return {"targets": [{"target": target, "fittable": False, "reason": "2 run(s) at 2 batch size(s) reached it"}]}
    return {
        "targets": [
            {
                "target": target,
                "fittable": True,
                "s_min": 100.0,
                "e_min": 100.0 * b_crit,
                "b_crit": b_crit,
                "b_crit_interval": {"low": low, "high": high},
                "points": [],
            }
        ]
    }


def _result(seed: int, fits: list[dict]) -> dict:
    return {
        "date": "2026-12-02",
        "seed": seed,
        "source": "megatron-lm-core_v0.19.0",
        "seconds": 2900.0,
        "fits": fits,
        "runs": [],
        "merrill": {
            "gbs8-lr1": {"steps_to": {"3.5": 200.0, "3": None}, "final_validation_loss": 3.2},
            "warmup-auto-trust1": {"steps_to": {"3.5": 120.5, "3": 300.0}, "final_validation_loss": 2.9},
        },
    }


def test_the_tables_give_b_crit_b_simple_their_ratio_and_the_other_seed(tmp_path):
    first = [
        {
            "target": 3.5,
            "runs": ["a", "b", "c"],
            "fit": _fit(3.5, 40.0, 20.0, 80.0),
            "b_simple": {"a": 2.0, "b": 8.0, "c": None},
        },
        {"target": 3.0, "runs": ["a", "b"], "fit": _fit(3.0, None), "b_simple": {"a": 4.0, "b": None}},
        {"target": 2.5, "runs": ["a", "b", "c"], "fit": _fit(2.5, 40.0, None, 80.0), "b_simple": {"a": 4.0}},
    ]
    second = [
        {"target": 3.5, "runs": ["a", "b", "c"], "fit": _fit(3.5, 90.0, 50.0, 120.0), "b_simple": {}},
        {"target": 2.5, "runs": ["a", "b", "c"], "fit": _fit(2.5, 10.0, 5.0, None), "b_simple": {}},
    ]
    (tmp_path / "critical-batch-2026-12-02.json").write_text(json.dumps(_result(1234, first)))
    (tmp_path / "critical-batch-2026-12-03-seed7.json").write_text(
        json.dumps({**_result(7, second), "like": "critical-batch-2026-12-02.json"})
    )
    (tmp_path / "critical-batch-2026-12-01-seed9.json").write_text(  # like an older first seed: not read
        json.dumps({**_result(9, second), "like": "critical-batch-2026-11-30.json"})
    )
    third = [{"target": 2.5, "runs": ["a", "b"], "fit": _fit(2.5, None), "b_simple": {}}]
    (tmp_path / "critical-batch-2026-12-03-seed11.json").write_text(
        json.dumps({**_result(11, third), "like": "critical-batch-2026-12-02.json"})
    )
    (tmp_path / "critical-batch-2026-11-30.json").write_text(json.dumps(_result(1234, [])))  # an older date: not read
    assert [r["seed"] for r in report.results(tmp_path)] == [1234, 7, 11]
    tables = report.tables(tmp_path)
    rows = tables["critical-batch"].splitlines()
    assert rows[0] == "2026-12-02, megatron-lm-core_v0.19.0, 2900 s for seed 1234."
    mean = math.sqrt(2.0 * 8.0)  # 4: the geometric mean of the runs' B_simple
    assert rows[4] == (
        f"| 3.5 | 3 | 100 | 4,000 | 40 [20, 80] | {mean:.3g} [2, 8] | 0.1 [0.05, 0.2] | "
        f"seed 7: 90 (outside); seed 11: - |"
    )
    assert rows[5].startswith("| 3 | 2 | not fittable: 2 run(s) at 2 batch size(s) reached it |")
    # an end the bootstrap does not bound (null) is open: B_crit in (0, 80], so 10 lies inside
    assert rows[6] == (
        "| 2.5 | 3 | 100 | 4,000 | 40 (0, 80] | 4 [4, 4] | 0.1 [0.05, inf) | "
        "seed 7: 10 (inside); seed 11: not fittable (2 run(s) at 2 batch size(s) reached it) |"
    )
    warmup = tables["warmup-test"].splitlines()
    assert warmup[0] == "| run | steps to 3.5 | steps to 3 | steps to 2.5 | final validation loss |"
    assert warmup[2:] == ["| gbs8-lr1 | 200.0 | - | - | 3.2 |", "| warmup-auto-trust1 | 120.5 | 300.0 | - | 2.9 |"]


def test_without_a_result_the_tables_say_how_to_make_one(tmp_path):
    assert set(report.tables(tmp_path).values()) == {
        "No result committed yet: run `make critical-batch`, then `make docs`."
    }


def test_a_second_seed_trains_each_batch_size_at_the_lr_the_first_chose_most():
    pytest.importorskip("megatron.core")
    from benchmarks import critical_batch

    first = {
        "fits": [
            {"runs": ["gbs8-lr0.5", "gbs16-lr1"]},
            {"runs": ["gbs8-lr1", "gbs16-lr1"]},
            {"runs": ["gbs8-lr1", "gbs16-lr0.5"]},
        ]
    }
    assert critical_batch._chosen_factors(first) == {8: (1.0,), 16: (1.0,)}


def test_a_refit_fits_the_targets_again_from_the_cached_logs(tmp_path):
    pytest.importorskip("megatron.core")
    from benchmarks import critical_batch
    from tests.test_cli_critical_batch import megatron_log

    cache = tmp_path / "cache"
    (cache / "seed5").mkdir(parents=True)
    names = [f"gbs{b}-lr1" for b in (8, 32, 128)]
    for name, batch in zip(names, (8, 32, 128)):
        (cache / "seed5" / f"{name}.log").write_text(megatron_log(batch, steps=1500))
    stale = {"targets": [{"target": 3.5, "fittable": True, "b_crit": 1.0, "b_crit_interval": {"low": 0.03}}]}
    result = {
        "seed": 5,
        "quick": False,
        "plan": critical_batch.QUICK.__dict__,
        "seconds": 12.0,
        "merrill": {"m": 1},
        "runs": [{"name": n, "gbs": b, "lr": 1e-3} for n, b in zip(names, (8, 32, 128))],
        "fits": [{"target": 3.5, "runs": names, "fit": stale, "b_simple": {}}],
    }
    path = tmp_path / "critical-batch-2026-12-02-seed5.json"
    path.write_text(json.dumps(result))
    assert critical_batch.refit(path, cache) == 0
    again = json.loads(path.read_text())
    fit = again["fits"][0]["fit"]["targets"][0]
    assert fit["fittable"] and 20 < fit["b_crit"] < 50 and fit["b_crit_interval"]["below"] == 0  # B_CRIT 32
    assert again["fits"][0]["b_simple"] == dict.fromkeys(names)  # no trace in the cache: none measured
    assert (again["seconds"], again["merrill"], again["refit"]) == (12.0, {"m": 1}, again["refit"])
    (cache / "seed5" / f"{names[0]}.log").unlink()
    with pytest.raises(SystemExit, match=r"--refit needs the runs' logs in the cache; missing: .*gbs8-lr1\.log"):
        critical_batch.refit(path, cache)
