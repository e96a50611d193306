"""The real-text sweep (benchmarks/results/critical-batch-2026-12-05.json) refitted by a second
fitter written here with numpy/scipy, not importing the package's fitter
(science/core/critical_batch.py, profile_interval.py, noise_window.py) nor the benchmark's analysis,
against ``megatron-ga critical-batch`` run as a user runs it (its main, in this process): on
Megatron-LM logs of the same validation curves (iteration and validation lines), ``--targets ...
--interpolate --json``. They must agree to 3 significant digits on B_crit, its 95 % profile interval
and S_min; B_simple / B_crit (which the command does not give) against
benchmarks/critical_batch_analysis's ratio, the one the docs' tables render, imported by that test
only, as the other side.

The second fitter, from the definitions in docs/critical-batch.md and
benchmarks/critical_batch_analysis.py's docstring (the selection of runs and targets), by other
means:

* horizon: per batch size its long runs where it ran long (GBS 64, 128), else its grid and seed
  runs; the seeded runs: those at a k that ran at every seed of the plan.
* targets: 4, evenly from 0.995 x the lowest loss any seeded run has at its first evaluation after
  the LR warmup down to the 4th lowest of the batch sizes' "loss every seed reaches".
* runs: per batch size the k with the fewest log steps, averaged over the targets any of its seed-1
  runs reaches (a miss is infinite) and over the k's seeds; its runs at every seed.
* S, E at a target: linear in the loss between the last evaluation above it and the first at or
  below it.
* dominated: a batch size whose geometric-mean S and E are both >= another's (one strictly) is left
  out.
* fit: min over log B_crit of sum (log S_i - log S_min - log(1 + B_crit / B_i))^2, log S_min in
  closed form; a dense grid and scipy's bounded Brent; profile interval: RSS(B_crit) <= RSS_min (1 +
  t^2 / (n - 2)), scipy's t quantile, its ends by brentq.
* B_simple: per run, the ratio of the sums of tr(Sigma) / tokens and |G|^2 over the trace rows
  centred on the first row at or after the crossing's samples, 256 samples each side; geometric mean
  over the runs the fit used.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from scipy import optimize, stats

from megatron_ga_ext.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "critical-batch-2026-12-05.json"
GRID_NAME = re.compile(r"gbs(\d+)-k([+-]\d+)-seed(\d+)")


def load() -> dict:
    return json.loads(RESULT.read_text())


def curve_of(run: dict) -> np.ndarray:
    """(step, samples, loss) rows, the repeated evaluation after training dropped (the first at a
    step kept)."""
    rows = np.asarray(run["curve"], dtype=float)
    keep = np.concatenate([[True], np.diff(rows[:, 0]) > 0])
    return rows[keep]


def named(data: dict) -> list[dict]:
    """The grid's, seeds' and long runs, each with its k."""
    return [
        {**r, "k": int(m.group(2))}
        for r in data["runs"]
        if (m := GRID_NAME.fullmatch(r["name"].removesuffix("-long")))
    ]


def horizons(data: dict) -> dict[int, list[dict]]:
    """Per batch size its long runs where it has any, else its grid and seed runs."""
    out: dict[int, list[dict]] = {}
    for r in named(data):
        out.setdefault(r["gbs"], []).append(r)
    return {gbs: [r for r in runs if r["phase"] == "long"] or runs for gbs, runs in out.items()}


def seeded_runs(data: dict) -> list[dict]:
    """Every size's horizon runs at the k's that ran at every seed of the plan."""
    seeds, out = set(data["plan"]["seeds"]), []
    for runs in horizons(data).values():
        full = {
            k for k in {r["k"] for r in runs} if {r["seed"] for r in runs if r["k"] == k} >= seeds
        }
        out += [r for r in runs if r["k"] in full]
    return out


def fit_runs(data: dict) -> list[dict]:
    """Per size the k with the fewest log steps, averaged over the targets any seed-1 run of the
    size reaches (a miss is infinite) and the k's seeds; its runs."""
    aims = targets_of(seeded_runs(data), data["plan"]["warmup_samples"])
    chosen = []
    for runs in horizons(data).values():
        reachable = [t for t in aims if any(crossing(r, t) for r in runs if r["seed"] == 1)]
        if not reachable:
            continue
        cost = {}
        for k in {r["k"] for r in runs}:
            logs = [
                np.mean([math.log(h[0]) if (h := crossing(r, t)) else np.inf for t in reachable])
                for r in runs
                if r["k"] == k
            ]
            cost[k] = float(np.mean(logs))
        best = min(cost, key=cost.__getitem__)
        chosen += [r for r in runs if r["k"] == best]
    return chosen


def targets_of(runs: list[dict], warmup: int) -> np.ndarray:
    after = min(curve_of(r)[curve_of(r)[:, 1] >= warmup][0, 2] for r in runs)
    reach: dict[int, float] = {}
    for r in runs:
        reach[r["gbs"]] = max(reach.get(r["gbs"], -np.inf), curve_of(r)[:, 2].min())
    return np.linspace(0.995 * after, sorted(reach.values())[3], 4)


def crossing(run: dict, target: float) -> tuple[float, float] | None:
    rows = curve_of(run)
    below = np.nonzero(rows[:, 2] <= target)[0]
    if not below.size or below[0] == 0:
        return None
    (s0, e0, l0), (s1, e1, l1) = rows[below[0] - 1], rows[below[0]]
    w = (l0 - target) / (l0 - l1)
    return s0 + w * (s1 - s0), e0 + w * (e1 - e0)


def undominated(points: list[tuple[str, int, float, float]]) -> list[tuple[str, int, float, float]]:
    sizes = sorted({p[1] for p in points})
    means = {
        b: np.exp(np.mean([[math.log(p[2]), math.log(p[3])] for p in points if p[1] == b], axis=0))
        for b in sizes
    }
    out = set()
    for b in sizes:
        s, e = means[b]
        if any(
            means[o][0] <= s and means[o][1] <= e and (means[o][0] < s or means[o][1] < e)
            for o in sizes
            if o != b
        ):
            out.add(b)
    return [p for p in points if p[1] not in out]


def refit(points: list[tuple[str, int, float, float]], keep_dominated: bool = False) -> dict:
    used = points if keep_dominated else undominated(points)
    b = np.array([p[1] for p in used], dtype=float)
    log_s = np.log([p[2] for p in used])

    def rss(u: float) -> float:
        r = log_s - np.log1p(math.exp(u) / b)
        return float(np.sum((r - r.mean()) ** 2))

    lo, hi = math.log(b.min() / 1000), math.log(b.max() * 1000)
    grid = np.linspace(lo, hi, 4001)
    values = np.array([rss(u) for u in grid])
    i = int(values.argmin())
    best = optimize.minimize_scalar(
        rss,
        bounds=(grid[max(i - 1, 0)], grid[min(i + 1, 4000)]),
        method="bounded",
        options={"xatol": 1e-10},
    )
    u = float(best.x)
    b_crit = math.exp(u)
    s_min = math.exp(float(np.mean(log_s - np.log1p(b_crit / b))))
    n = len(used)
    level = rss(u) * (1 + stats.t.ppf(0.975, n - 2) ** 2 / (n - 2))
    ends = []
    for side in (grid[grid < u][::-1], grid[grid > u]):
        outside = [x for x in side if rss(x) > level]
        ends.append(
            math.exp(optimize.brentq(lambda x: rss(x) - level, u, outside[0], xtol=1e-12))
            if outside
            else None
        )
    fitted = b.min() <= b_crit <= b.max()
    return {
        "used": [p[0] for p in used],
        "b_crit": b_crit if fitted else None,
        "raw_b_crit": b_crit,
        "s_min": s_min,
        "fewest_steps": min(p[2] for p in used),
        "interval": ends,
    }


def window_b_simple(run: dict, samples: float) -> float:
    rows = run["trace"]
    every = rows[1]["consumed_samples"] - rows[0]["consumed_samples"]
    half = max(1, 256 // every)
    centre = next(i for i, r in enumerate(rows) if r["consumed_samples"] >= samples)
    width = min(half, centre, len(rows) - 1 - centre)
    part = rows[centre - width : centre + width + 1]
    return sum(r["trace_sigma"] / r["tokens_per_sample"] for r in part) / sum(
        r["grad_sq"] for r in part
    )


def independent(data: dict, keep_dominated: bool = False) -> list[dict]:
    runs = fit_runs(data)
    out = []
    for target in targets_of(seeded_runs(data), data["plan"]["warmup_samples"]):
        hits = {r["name"]: (r, crossing(r, target)) for r in runs}
        points = [(name, r["gbs"], h[0], h[1]) for name, (r, h) in hits.items() if h is not None]
        found = {"target": float(target), **refit(points, keep_dominated)}
        if found["b_crit"] is not None:
            windows = [window_b_simple(hits[n][0], hits[n][1][1]) for n in found["used"]]
            found["ratio"] = math.exp(np.mean(np.log(windows))) / found["b_crit"]
        out.append(found)
    return out


def megatron_log(run: dict) -> str:
    """The iteration and validation lines Megatron-LM's training_log and evaluate_and_print_results
    print."""
    lines = ["training ..."]
    for step, samples, loss in curve_of(run):
        lines.append(
            f" [2026-12-03 10:00:00.000000] iteration {int(step):8d}/{run['steps']:8d} | "
            "consumed samples: "
            f"{int(samples):12d} | learning rate: {run['lr']:.6E} | global batch size: "
            f"{run['gbs']:5d} | lm loss: {loss + 0.01:.6E} | loss scale: 1.0 |"
        )
        lines.append(
            f" validation loss at iteration {int(step)} | lm loss value: {float(loss)!r} | lm "
            "loss PPL: 1.0 | "
        )
    return "\n".join(lines) + "\n"


def package(tmp: Path, runs: list[dict], targets: list[float], *extra: str) -> list[dict]:
    """``megatron-ga critical-batch`` on Megatron-LM logs of ``runs``, its --json targets."""
    paths = []
    for r in runs:
        paths.append(tmp / f"{r['name']}.log")
        paths[-1].write_text(megatron_log(r))
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        status = main(
            ["critical-batch", *map(str, paths), "--targets", ",".join(map(repr, targets)), *extra]
        )
    assert status == 0
    return json.loads(buffer.getvalue())["targets"]


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> dict:
    data = load()
    ours = independent(data)
    ours_kept = independent(data, keep_dominated=True)
    targets = [t["target"] for t in ours]
    tmp = tmp_path_factory.mktemp("refit")
    theirs = package(tmp, fit_runs(data), targets, "--interpolate", "--json")
    kept = package(tmp, fit_runs(data), targets, "--interpolate", "--json", "--keep-dominated")
    return {"ours": ours, "theirs": theirs, "ours_kept": ours_kept, "kept": kept}


def three_digits(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return f"{a:.3g}" == f"{b:.3g}" or abs(a - b) <= 5e-4 * abs(b)


def test_the_fits_agree_to_three_digits(both):
    for ours, theirs in zip(both["ours"], both["theirs"], strict=True):
        assert sorted(Path(p["run"]).stem for p in theirs["points"]) == sorted(ours["used"])
        assert theirs["fittable"] is (ours["b_crit"] is not None), theirs["reason"]
        if ours["b_crit"] is None:
            continue
        interval = theirs["b_crit_interval"]
        for a, b in [
            (ours["b_crit"], theirs["b_crit"]),
            (ours["s_min"], theirs["s_min"]),
            (ours["interval"][0], interval["low"]),
            (ours["interval"][1], interval["high"]),
        ]:
            assert three_digits(a, b), (ours["target"], a, b)


def test_the_numbers_the_docs_quote(both):
    """docs/critical-batch.md: B_crit 4.60 [3.23, 6.25], 6.32 [4.92, 7.96], 13.9 [11.7, 16.3], 19.3
    [16.4, 22.6], B_simple / B_crit 2.22, 2.51, 1.92, 1.79, each fit on all 18 runs (GBS 4-128, none
    dominated)."""
    got = [[f"{x:.3g}" for x in (t["b_crit"], *t["interval"], t["ratio"])] for t in both["ours"]]
    assert got == [
        ["4.6", "3.23", "6.25", "2.22"],
        ["6.32", "4.92", "7.96", "2.51"],
        ["13.9", "11.7", "16.3", "1.92"],
        ["19.3", "16.4", "22.6", "1.79"],
    ]
    assert all(len(t["used"]) == 18 for t in both["ours"])


def test_gbs_64_and_128_sit_on_the_hyperbola(both):
    """docs/critical-batch.md: at their LR chosen by the fitted quantity (k = -1) their steps
    (geometric mean over seeds) are 0.92-1.1x the fitted S(B) at every target, and S_min lies within
    9 % of the fewest steps any batch size took."""
    runs = fit_runs(load())
    assert {r["k"] for r in runs if r["gbs"] in (64, 128)} == {-1}
    factors = []
    for t in both["ours"]:
        for gbs in (64, 128):
            steps = [h[0] for r in runs if r["gbs"] == gbs and (h := crossing(r, t["target"]))]
            factors.append(
                math.exp(np.mean(np.log(steps))) / (t["s_min"] * (1 + t["b_crit"] / gbs))
            )
        assert abs(math.log(t["s_min"] / t["fewest_steps"])) < math.log(1.09)
    assert len(factors) == 8 and (round(min(factors), 2), round(max(factors), 1)) == (0.92, 1.1)


def test_b_simple_over_b_crit_agrees_with_the_benchmark_analysis(both):
    """The ratio the docs' table renders (benchmarks/critical_batch_analysis.ratio) is the second
    fitter's."""
    from benchmarks.critical_batch_analysis import analyse, ratio

    analysed = analyse(load())["targets"]
    for ours, target, theirs in zip(both["ours"], analysed, both["theirs"], strict=True):
        assert three_digits(ours["target"], target["target"])
        if ours["b_crit"] is None:
            continue
        quoted = ratio(target)
        assert quoted is not None and three_digits(ours["ratio"], quoted["ratio"])
        assert three_digits(ours["ratio"] * ours["b_crit"] / theirs["b_crit"], quoted["ratio"])


def test_no_batch_size_is_dominated_and_keeping_changes_nothing(both):
    """Issue 51, item 1: at their chosen LR GBS 64 and 128 are on the trade-off curve, so
    --keep-dominated fits the same runs (the 2026-12-03 sweep's k = +2 runs, kept, moved B_crit to
    1.5, 5.5, 14.7)."""
    ours = [t["b_crit"] for t in both["ours_kept"]]
    theirs = [t.get("b_crit") for t in both["kept"]]
    assert all(three_digits(a, b) for a, b in zip(ours, theirs, strict=True))
    assert ours == [t["b_crit"] for t in both["ours"]]


#: Every help text and doc that may quote the ratio (issue 51, item 6: one ratio, one scope).
QUOTING = (
    "megatron_ga_ext/config/flags.py",
    "megatron_ga_ext/cli/schedule.py",
    "docs/guide.md",
    "docs/noise-scale.md",
    "docs/critical-batch.md",
)
QUOTE = re.compile(r"B_crit\s*/\s*B_simple,?\s+(\d\.\d+)")


def quotes() -> list[tuple[str, str, str]]:
    """(file, number, the 600 characters around it, joined across lines and string literals) per
    quote."""
    found = []
    for name in QUOTING:
        text = re.sub(
            r'"\s*\n\s*"', "", (ROOT / name).read_text()
        )  # a help string's pieces, joined
        text = re.sub(r"\s+", " ", text)
        found += [
            (name, m.group(1), text[max(0, m.start() - 600) : m.end() + 600])
            for m in QUOTE.finditer(text)
        ]
    return found


def test_every_quoted_ratio_is_the_refit_of_the_fit_runs(both):
    """The geometric mean over the fitted targets of B_crit / B_simple (18 runs) is the one number
    quoted, with its scope: the runs, the model size, tokens per parameter, the byte-bigram loss;
    the earlier 0.43 and 0.50 are gone."""
    ratios = [1 / t["ratio"] for t in both["ours"] if t["b_crit"] is not None]
    refit_ratio = f"{math.exp(np.mean(np.log(ratios))):.2f}"
    assert refit_ratio == "0.48"
    found = quotes()
    assert {name for name, _, _ in found} >= set(QUOTING[:3])
    for name, number, after in found:
        assert number == refit_ratio, (name, number)
        for scope in (
            "18 runs",
            "(129k|128,768)[ -]parameter",
            "tokens per parameter",
            "byte-bigram",
            "2.64",
        ):
            assert re.search(scope, after), (name, scope, after)
    for name in QUOTING:
        text = (ROOT / name).read_text()
        assert "B_simple 0.43" not in text and "B_simple 0.50" not in text, name


def test_the_repeated_evaluation_differs_by_the_quoted_median():
    """docs/critical-batch.md: the evaluation after training repeats the last one's weights; 102
    runs, median 0.0035."""
    diffs = [
        abs(r["curve"][-1][2] - r["curve"][-2][2])
        for r in load()["runs"]
        if len(r["curve"]) > 1 and r["curve"][-1][0] == r["curve"][-2][0]
    ]
    assert (len(diffs), f"{np.median(diffs):.2g}", f"{max(diffs):.2g}") == (102, "0.0035", "0.0091")


def smoothed_crossing(run: dict, target: float, half: int = 2) -> tuple[float, float] | None:
    """The crossing of a straight line fitted to loss against log step over the ``half`` evaluations
    on each side of the first at or below ``target``: a reading of S that one noisy evaluation moves
    less."""
    rows = curve_of(run)
    below = np.nonzero(rows[:, 2] <= target)[0]
    if not below.size or below[0] == 0:
        return None
    near = rows[max(0, below[0] - half) : below[0] + half + 1]
    slope, intercept = np.polyfit(np.log(near[:, 0]), near[:, 2], 1)
    steps = math.exp((target - intercept) / slope)
    return steps, steps * run["gbs"]


def test_the_first_crossing_rule_moves_b_crit_by_a_few_percent(both):
    """docs/critical-batch.md (*Smaller biases*): with the smoothed crossing B_crit moves by +7.5 %,
    +5.1 %, +2.5 % and -2.0 % at the four targets."""
    runs, moved = fit_runs(load()), []
    for t in both["ours"]:
        hits = [(r["name"], r["gbs"], smoothed_crossing(r, t["target"])) for r in runs]
        again = refit([(name, gbs, *h) for name, gbs, h in hits if h is not None])
        moved.append(f"{again['b_crit'] / t['b_crit'] - 1:+.1%}")
    assert moved == ["+7.5%", "+5.1%", "+2.5%", "-2.0%"]
