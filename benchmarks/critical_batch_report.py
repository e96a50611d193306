"""The critical-batch benchmark's tables and plots, from its JSON under benchmarks/results (benchmarks/critical_batch.py
writes it). Pure Python but the plots (matplotlib, the ``plot`` extra).

``make docs`` renders the tables into docs/noise-scale.md (tools/docs.py: from the committed JSON alone, so
``make docs-check`` holds them); the benchmark draws the plots beside its JSON.

* ``critical-batch``: per target (validation loss), the runs that reached it, S_min, E_min, B_crit with its bootstrap
  interval (an end the data do not bound written open: (0, high] or [low, inf)), B_simple where those runs reached
  it (geometric mean over the batch sizes, and its range), the ratio
  B_simple / B_crit (its range from B_crit's interval), and B_crit of each other seed, with whether it lies inside
  the first seed's interval;
* ``warmup-test``: Merrill's runs at the same sample budget: steps to each target and the final validation loss.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FIRST_SEED = 1234
_NAME = re.compile(r"critical-batch-(\d{4}-\d{2}-\d{2})(?:-seed(\d+))?\.json")


def results(directory: Path = RESULTS) -> list[dict]:
    """The newest first-seed result, then the other seeds' results run ``--like`` it, by seed (empty where there is
    none)."""
    found = {
        p.name: (m.group(1), int(m.group(2) or FIRST_SEED))
        for p in directory.glob("critical-batch-*.json")
        if (m := _NAME.fullmatch(p.name))
    }
    firsts = [name for name, (_, seed) in found.items() if seed == FIRST_SEED]
    if not firsts:
        return []
    first = max(firsts, key=lambda name: found[name][0])
    others = [
        json.loads((directory / name).read_text())
        for name in sorted(found, key=lambda n: found[n][1])
        if found[name][1] != FIRST_SEED
    ]
    return [json.loads((directory / first).read_text()), *(r for r in others if r.get("like") == first)]


def geometric_mean(values) -> float | None:
    """Of the positive values (None and 0 left out); None where there is none."""
    positive = [v for v in values if v is not None and v > 0]
    return math.exp(sum(map(math.log, positive)) / len(positive)) if positive else None


def _b_crit(fit: dict) -> dict | None:
    targets = fit.get("targets") or []
    return targets[0] if targets and targets[0].get("fittable") else None


def _ends(interval: dict) -> tuple[float, float]:
    """An interval's ends, an end the data do not bound (null: ``megatron-ga critical-batch``) as 0 or inf."""
    return (
        0.0 if interval["low"] is None else interval["low"],
        math.inf if interval["high"] is None else interval["high"],
    )


def _span(low: float, high: float) -> str:
    """[low, high], an open end at 0 or inf written as such: (0, high] or [low, inf)."""
    return f"{'(0' if low == 0 else f'[{_g(low)}'}, {'inf)' if math.isinf(high) else f'{_g(high)}]'}"


def _g(value: float | None, digits: int = 3) -> str:
    """``digits`` significant digits; a whole number at and above 10 ** digits."""
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.0f}" if abs(value) >= 10**digits else f"{value:.{digits}g}"


def fits_table(runs: list[dict]) -> str:
    first, others = runs[0], runs[1:]
    lines = [
        "| target (validation loss) | runs | S_min | E_min (samples) | B_crit [95%] | B_simple at the target: "
        "geometric mean [min, max] | B_simple / B_crit | other seeds' B_crit |",
        "|" + "---|" * 8,
    ]
    for entry in first["fits"]:
        fit = _b_crit(entry["fit"])
        simple = [v for v in entry["b_simple"].values() if v is not None and v > 0]
        mean = geometric_mean(simple)
        spread = f"[{_g(min(simple))}, {_g(max(simple))}]" if simple else ""
        if fit is None:
            reason = (entry["fit"].get("targets") or [{}])[0].get("reason") or entry["fit"].get("error", "")
            lines.append(
                f"| {entry['target']:.4g} | {len(entry['runs'])} | not fittable: {reason} | | | "
                f"{_g(mean)} {spread} | | |"
            )
            continue
        low, high = _ends(fit["b_crit_interval"])
        ratio = (
            "-"
            if mean is None
            else (f"{_g(mean / fit['b_crit'])} {_span(mean / high, mean / low if low else math.inf)}")
        )
        seeds = []
        for other in others:
            match = next((e for e in other["fits"] if abs(e["target"] - entry["target"]) < 1e-9), None)
            theirs = None if match is None else _b_crit(match["fit"])
            if theirs is not None:
                inside = "inside" if low <= theirs["b_crit"] <= high else "outside"
                seeds.append(f"seed {other['seed']}: {_g(theirs['b_crit'])} ({inside})")
            else:  # the reason's first clause: "every run is above the knee", "2 run(s) at 2 batch size(s) ..."
                reason = "" if match is None else ((match["fit"].get("targets") or [{}])[0].get("reason") or "")
                seeds.append(f"seed {other['seed']}: " + (f"not fittable ({reason.split(':')[0]})" if reason else "-"))
        lines.append(
            f"| {entry['target']:.4g} | {len(entry['runs'])} | {_g(fit['s_min'])} | {_g(fit['e_min'])} | "
            f"{_g(fit['b_crit'])} {_span(low, high)} | {_g(mean)} {spread} | {ratio} | "
            f"{'; '.join(seeds) or '-'} |"
        )
    return "\n".join(lines)


def warmup_table(result: dict) -> str:
    targets = [f"{e['target']:.4g}" for e in result["fits"]]
    lines = [
        "| run | " + " | ".join(f"steps to {t}" for t in targets) + " | final validation loss |",
        "|" + "---|" * (len(targets) + 2),
    ]
    for name, row in result["merrill"].items():
        steps = [row["steps_to"].get(f"{e['target']:.6g}") for e in result["fits"]]
        lines.append(
            f"| {name} | "
            + " | ".join("-" if s is None else str(s) for s in steps)
            + f" | {_g(row['final_validation_loss'], 4)} |"
        )
    return "\n".join(lines)


def tables(directory: Path = RESULTS) -> dict[str, str]:
    """The two tables by block name; a one-line placeholder each where no result is committed."""
    runs = results(directory)
    if not runs:
        none = "No result committed yet: run `make critical-batch`, then `make docs`."
        return {"critical-batch": none, "warmup-test": none}
    head = f"{runs[0]['date']}, {runs[0]['source']}, {runs[0]['seconds']:.0f} s for seed {runs[0]['seed']}.\n\n"
    return {"critical-batch": head + fits_table(runs), "warmup-test": warmup_table(runs[0])}


def plot(result: dict, prefix: Path) -> list[Path]:
    """``<prefix>-fit.png`` (per target the S-E points and the fitted hyperbola) and ``<prefix>-b-simple.png``
    (each sweep run's B_simple EMA against its consumed samples)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4.5))
    for entry in result["fits"]:
        fit = _b_crit(entry["fit"])
        points = (entry["fit"].get("targets") or [{}])[0].get("points", [])
        label = f"loss {entry['target']:.3g}" + ("" if fit is None else f": B_crit {fit['b_crit']:.3g}")
        line = axes.loglog([p["steps"] for p in points], [p["samples"] for p in points], "o", label=label)
        if fit is not None:
            s = [fit["s_min"] * (1 + 10 ** (k / 20 - 2)) for k in range(0, 81)]
            axes.loglog(s, [fit["e_min"] * (1 + 1 / (x / fit["s_min"] - 1)) for x in s], "-", color=line[0].get_color())
    axes.set_xlabel("optimizer steps S")
    axes.set_ylabel("samples E")
    axes.set_title("(S / S_min - 1)(E / E_min - 1) = 1 per target")
    axes.legend(fontsize=8)
    written = [prefix.with_name(prefix.name + "-fit.png"), prefix.with_name(prefix.name + "-b-simple.png")]
    figure.savefig(written[0], dpi=100, bbox_inches="tight")
    plt.close(figure)
    figure, axes = plt.subplots(figsize=(6, 4.5))
    for run in result["runs"]:
        series = run.get("b_simple", [])
        if series:
            axes.semilogy([s for s, _ in series], [b for _, b in series], label=run["name"], linewidth=1)
    axes.set_xlabel("consumed samples")
    axes.set_ylabel("B_simple EMA (samples)")
    axes.legend(fontsize=7)
    figure.savefig(written[1], dpi=100, bbox_inches="tight")
    plt.close(figure)
    return written
