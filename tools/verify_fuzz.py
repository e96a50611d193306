"""`make verify-fuzz`: `megatron-ga verify --fuzz` on several seeds, with install()'s corrections
and with each reverted, recorded for docs/reduction.md's fuzz table (tools/results.py, then `make
docs`).

    python -m tools.verify_fuzz [--draws 200] [--seeds 0 1 2026] [--reverted 4]

With every correction, each seed's N draws run as a user runs them. Reverted (install() without the
hook that applies the correction, as an audit would revert it), only the draws the correction
concerns run, the first ``--reverted`` of each seed: MoE under TP or CP, or global_aux_loss over DP
(the router's count, Megatron-LM #7452 finding 10), MTP over more than one unit (MTP's local count,
finding 3), and torch FSDP2 (its units left averaging over DP x CP and no one dividing by N,
upstream's per-token step: integration/features/torch_fsdp2.py). A row says how many of them fail: a
correction that no draw needs is a correction no run checks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from megatron_ga_ext.verify.fuzz import Draw, draw_layouts

from .results import record


def _without_hook(name: str) -> str:
    return f"from tests.support.faults import without_row; without_row({name!r})"


#: The FSDP2 fix taken out for the rest of the process, as tests/test_fsdp.py takes it out (the
#: context kept in a global: a context manager no one holds is collected, and its exit puts the fix
#: back).
FSDP2_AVERAGING = (
    "from tests.support.faults import fsdp2_sum_reverted; reverted = fsdp2_sum_reverted(); "
    "reverted.__enter__()"
)

#: Each reverted variant: the statement that takes its correction out of install(), and the draws it
#: concerns.
REVERTED = {
    "router count reverted": (
        _without_hook("get_tokens_per_expert_and_token_count"),
        lambda layout: (
            "moe" in layout.model
            and (
                layout.tensor_model_parallel_size * layout.context_parallel_size > 1
                or ("global" in layout.model and layout.data_parallel_size > 1)
            )
        ),
    ),
    "MTP count reverted": (
        _without_hook("process_mtp_loss"),
        lambda layout: (
            "mtp" in layout.model and layout.data_parallel_size * layout.num_microbatches > 1
        ),
    ),
    "FSDP2 sum reverted": (FSDP2_AVERAGING, lambda layout: layout.data_parallel == "torch_fsdp2"),
}

REVERTING = """
import sys
exec(sys.argv.pop(1))
from megatron_ga_ext.cli.main import main
sys.exit(main(["verify", *sys.argv[1:]]))
"""


def run_verify(args: list[str], revert: str | None = None) -> dict:
    """``megatron-ga verify --json ARGS`` in a fresh process (after the statement ``revert``): its
    JSON."""
    command = (
        [sys.executable, "-c", REVERTING, revert]
        if revert
        else [sys.executable, "-m", "megatron_ga_ext.cli", "verify"]
    )
    proc = subprocess.run([*command, *args, "--json"], capture_output=True, text=True, timeout=7200)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"verify {' '.join(args)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def fuzz_row(
    version: str, seed: int, corrections: str, rows: list[dict], seconds: float
) -> dict[str, object]:
    passed = sum(r["verdict"] == "ok" for r in rows)
    limited = sum(r["verdict"] == "limited" for r in rows)
    errors = [
        e for r in rows for e in (r["rel_err_token"], r["rel_err_mean_of_means"]) if e is not None
    ]
    verdict = f"{passed} pass, {limited} limited, {len(rows) - passed - limited} fail"
    return {
        "megatron-core": version,
        "Seed": seed,
        "Corrections": corrections,
        "Draws": len(rows),
        "Verdict": verdict,
        "Worst relative error": f"{max(errors):.1e}" if errors else "-",
        "Time (s)": round(seconds),
    }


def concerned(draws: list[Draw], wants, count: int) -> list[Draw]:
    return [draw for draw in draws if wants(draw.layout)][:count]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2026])
    parser.add_argument(
        "--reverted", type=int, default=4, help="draws per seed and reverted correction"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="each launch's limit (s)")
    args = parser.parse_args(argv)
    import megatron.core
    from megatron.core.transformer import multi_token_prediction

    from megatron_ga_ext.verify.data_parallel import torch_fsdp2_runs

    version, status = megatron.core.__version__.split("+")[0], 0
    skipped = {
        "MTP count reverted": not hasattr(
            multi_token_prediction, "process_mtp_loss"
        ),  # 0.16 attaches MTP's sum
        "FSDP2 sum reverted": not torch_fsdp2_runs(),  # upstream's FSDP2 stops before 0.19
    }
    reverted = {name: variant for name, variant in REVERTED.items() if not skipped.get(name)}
    for seed in args.seeds:
        start = time.perf_counter()
        out = run_verify(
            ["--fuzz", str(args.draws), "--seed", str(seed), "--timeout", str(args.timeout)]
        )
        row = fuzz_row(version, seed, "all", out["draws"], time.perf_counter() - start)
        status |= any(r["verdict"] == "FAIL" for r in out["draws"])
        record("verify-fuzz", [row])
        print(row, flush=True)
        draws = draw_layouts(args.draws, seed)
        for corrections, (revert, wants) in reverted.items():
            start, rows = time.perf_counter(), []
            for draw in concerned(draws, wants, args.reverted):
                rows += run_verify(
                    [
                        "--fuzz",
                        str(args.draws),
                        "--seed",
                        str(seed),
                        "--draw",
                        str(draw.index),
                        "--timeout",
                        str(args.timeout),
                    ],
                    revert=revert,
                )["draws"]
            row = fuzz_row(version, seed, corrections, rows, time.perf_counter() - start)
            status |= not rows or all(
                r["verdict"] != "FAIL" for r in rows
            )  # a reverted run must fail
            record("verify-fuzz", [row])
            print(row, flush=True)
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
