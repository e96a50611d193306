"""``megatron-ga verify``: every layout in both modes, through install(), against unpartitioned
references.

One launch per world size (1, 2, 4 ranks on the default layouts); each rank runs all layouts of its
world size in sequence, re-initialising megatron's parallel state in between. Each launch also
measures the auxiliary losses' gradient (the MoE router at DP 2, with global_aux_loss, under TP 2
and CP 2; MTP) against the token-mode target, before (upstream alone) and after install()
(verify/aux.py). Exit status: 0 when every ``token`` row is within ``--tolerance`` of the token
reference, with every rank dividing by N = the non-padding tokens of the global batch, every
``microbatch`` row within it of its own mean-of-means reference, and every auxiliary gradient with
the extension within it of the target; 1 otherwise; 2 when a launch fails (a VerifyError, printed by
the CLI's one error path). Layouts a release cannot run are listed as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from megatron_ga_ext.cli.hints import install_hint
from megatron_ga_ext.cli.render import print_table
from megatron_ga_ext.cli.verify_layouts import runnable, runnable_draws, supported
from megatron_ga_ext.errors import VerifyError

if TYPE_CHECKING:
    from megatron_ga_ext.verify.fuzz import Draw, DrawResult
    from megatron_ga_ext.verify.harness import LayoutResult

__all__ = ["configure_parser", "run", "rows_from_results"]

TOLERANCE = 1e-5


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add verify's options to ``parser``."""
    parser.add_argument(
        "--json",
        action="store_true",
        help="print a JSON list of rows (layout, mode, rel_err_token, "
        "rel_err_mean_of_means, num_tokens, ok) instead of a table",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo ranks with CPU shims (default); cuda: nccl, one GPU per rank",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=TOLERANCE,
        help=f"largest relative gradient error that passes (default {TOLERANCE:g}, fp32)",
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds allowed for each launch (default 900)"
    )
    parser.add_argument(
        "--fuzz",
        type=int,
        metavar="N",
        help="instead of the default layouts, N layouts drawn at random (TP, PP, VPP, CP, EP, DP, "
        "MBS, GA, MoE balancing types, MTP, overlap, distributed optimizer, torch FSDP2, "
        "Megatron-FSDP; "
        "uneven loss tokens), each against the unpartitioned reference (verify/fuzz.py)",
    )
    parser.add_argument(
        "--upstream",
        action="store_true",
        help="megatron-core alone, install() not called, on whatever megatron-core is importable "
        "(a tree patched "
        "with patches/upstream first on PYTHONPATH): its token rows pass where upstream is fixed "
        "(docs/upstream.md)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="--fuzz: the seed of the draws (default 0)"
    )
    parser.add_argument(
        "--draw", type=int, metavar="K", help="--fuzz: run draw K of the seed alone"
    )


def run(args: argparse.Namespace) -> int:
    """Run verify as configured by :func:`configure_parser`; return the exit status (0 pass, 1 a row
    fails).

    Raises VerifyError when it cannot run (no CUDA device, a launch failed): ``megatron-ga`` prints
    it.
    """
    start = time.perf_counter()
    _quiet_upstream()
    versions = _import_upstream()
    if args.fuzz is not None:
        if args.upstream:
            raise VerifyError(
                "--upstream runs verify's default layouts; --fuzz's draws run through install()"
            )
        return _fuzz(args, versions, start)
    from megatron_ga_ext.verify.launches import launch_all  # imports torch and megatron-core
    from megatron_ga_ext.verify.layouts import DEFAULT_LAYOUTS, DEFAULT_LENGTHS

    layouts, skipped = supported(runnable(DEFAULT_LAYOUTS, args.device))
    print(f"megatron-ga verify: {versions}, device {args.device}", file=sys.stderr)
    if not layouts:
        raise VerifyError(
            "--device cuda: no CUDA device is visible; run on a GPU machine or use --device cpu."
        )
    from megatron_ga_ext.verify.aux import AFTER, AUX_LAYOUTS, DATA_PARALLEL_LAYOUTS, UPSTREAM

    if args.upstream:
        import megatron.core

        print(
            f"  --upstream: install() not called; megatron-core from {megatron.core.__file__}",
            file=sys.stderr,
        )

    # token mode only: 0.16's MTP runs there
    aux_layouts = runnable((*AUX_LAYOUTS, *supported(list(DATA_PARALLEL_LAYOUTS))[0]), args.device)
    try:
        results, coefficients = launch_all(
            layouts,
            device=args.device,
            timeout_s=args.timeout,
            aux_layouts=aux_layouts,
            upstream=args.upstream,
        )
    except Exception as exc:
        raise VerifyError(f"verify launch failed: {type(exc).__name__}: {exc}") from exc
    expected_num_tokens = {lay.name: sum(lay.lengths or DEFAULT_LENGTHS) for lay in layouts}
    # upstream's finalize does not report its N: its rows are judged by the gradients alone
    rows = rows_from_results(
        results, args.tolerance, None if args.upstream else expected_num_tokens
    )
    aux_rows = [
        {"layout": c.layout, "variant": c.variant, "coefficient": c.coefficient, "error": c.error}
        for c in coefficients
    ]
    judged = UPSTREAM if args.upstream else AFTER
    aux_ok = all(r["error"] <= args.tolerance for r in aux_rows if r["variant"] == judged)
    _report(rows, aux_rows, skipped, args, expected_num_tokens, time.perf_counter() - start)
    return 0 if all(row["ok"] for row in rows) and aux_ok else 1


def _fuzz(args: argparse.Namespace, versions: str, start: float) -> int:
    """``--fuzz N``: the draws of ``--seed`` (or draw ``--draw`` alone), one launch per world size;
    0 when every draw that ran passes, 1 otherwise."""
    if args.fuzz < 1 or (args.draw is not None and not 0 <= args.draw < args.fuzz):
        raise VerifyError(
            f"--fuzz {args.fuzz} --draw {args.draw}: --fuzz takes N >= 1 draws, and --draw K one "
            "of them (0 <= K < N)."
        )
    from megatron_ga_ext.verify.fuzz import draw_layouts
    from megatron_ga_ext.verify.launches import launch_draws

    draws = draw_layouts(args.fuzz, args.seed)
    draws = [draws[args.draw]] if args.draw is not None else draws
    print(
        f"megatron-ga verify --fuzz {args.fuzz} --seed {args.seed}: {versions}, device "
        f"{args.device}",
        file=sys.stderr,
    )
    rows = [
        _draw_row(draw, verdicts, failure, args)
        for draw, verdicts, failure in launch_draws(
            runnable_draws(draws, args.device), device=args.device, timeout_s=args.timeout
        )
    ]
    _report_fuzz(rows, args, time.perf_counter() - start)
    return 0 if all(row["verdict"] in ("ok", "limited") for row in rows) else 1


def _draw_row(
    draw: Draw, verdicts: Sequence[DrawResult] | None, failure: str | None, args: argparse.Namespace
) -> dict[str, Any]:
    """One draw's row: the worst errors over ranks of its two modes, and its verdict."""
    row = {
        "draw": draw.index,
        "layout": draw.layout.name,
        "micro_batch_size": draw.layout.micro_batch_size,
        "lengths": list(draw.lengths),
        "rel_err_token": None,
        "rel_err_mean_of_means": None,
        "num_tokens": None,
        "verdict": "FAIL",
        "reason": failure,
        "row": draw.row,
        "rerun": f"megatron-ga verify --fuzz {args.fuzz} --seed {args.seed} --draw {draw.index}",
    }
    if verdicts is None:
        return row
    limited = {v.limited for v in verdicts if v.limited is not None}
    errors = {v.error for v in verdicts if v.error is not None}
    if limited:
        return row | {"verdict": "limited", "reason": limited.pop()}
    if errors:
        return row | {"reason": sorted(errors)[0]}
    results = {0: [list(v.results) for v in verdicts]}
    mode_rows = {
        r["mode"]: r for r in rows_from_results(results, args.tolerance, sum(draw.lengths))
    }
    return row | {
        "rel_err_token": mode_rows["token"]["rel_err_token"],
        "rel_err_mean_of_means": mode_rows["microbatch"]["rel_err_mean_of_means"],
        "num_tokens": mode_rows["token"]["num_tokens"],
        "verdict": "ok" if all(r["ok"] for r in mode_rows.values()) else "FAIL",
    }


def _report_fuzz(rows: list[dict[str, Any]], args: argparse.Namespace, seconds: float) -> None:
    if args.json:
        print(json.dumps({"seed": args.seed, "draws": rows}, indent=2))
        return
    table = [
        [
            str(r["draw"]),
            r["layout"],
            str(r["micro_batch_size"]),
            str(sum(r["lengths"])),
            "-" if r["rel_err_token"] is None else f"{r['rel_err_token']:.2e}",
            "-" if r["rel_err_mean_of_means"] is None else f"{r['rel_err_mean_of_means']:.2e}",
            r["verdict"],
        ]
        for r in rows
    ]
    print_table(
        f"Drawn layouts (seed {args.seed}) against unpartitioned references",
        ["draw", "layout", "MBS", "N", "token vs token ref", "microbatch vs its ref", "verdict"],
        table,
    )
    for r in rows:
        if r["verdict"] != "ok":
            print(
                f"draw {r['draw']} {r['verdict']}: "
                f"{r['reason'] or 'a mode misses its reference'}\n  row: {r['row']}\n  "
                f"rerun: {r['rerun']}"
            )
    passed = sum(r["verdict"] == "ok" for r in rows)
    limited = sum(r["verdict"] == "limited" for r in rows)
    print(
        f"{passed} of {len(rows)} draws pass, {limited} limited (tolerance {args.tolerance:g}); "
        f"{seconds:.1f} s"
    )


def _quiet_upstream() -> None:
    """megatron-core warns about Apex, Transformer Engine and deprecations on import and build."""
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for name in ("megatron", "torch.utils.cpp_extension", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _import_upstream() -> str:
    """Import megatron-core once in the parent: forked ranks inherit it instead of paying 5-12 s."""
    try:
        import megatron.core
        import torch
    except ImportError as exc:
        raise VerifyError(
            "megatron-ga verify trains real megatron-core models and needs torch and "
            f"megatron-core ({exc}); install them with {install_hint('megatron')}. ledger, check "
            "and schedule need neither."
        ) from exc

    return f"megatron-core {megatron.core.__version__}, torch {torch.__version__}"


def rows_from_results(
    results: dict[int, list[list[LayoutResult]]],
    tolerance: float,
    expected_num_tokens: int | dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    """One row per (layout, mode): the largest error over ranks, the token count, and the verdict.

    ``token`` passes when within ``tolerance`` of the token reference and, given
    ``expected_num_tokens`` (one count, or one per layout name), every rank's finalize divided by N
    = that count (the non-padding tokens of the global batch); ``microbatch`` passes when within
    ``tolerance`` of its own (mean-of-means) reference. ``num_tokens`` is N when every rank reports
    the same, else None.
    """
    per_row: dict[tuple[str, str], list[LayoutResult]] = defaultdict(list)
    for per_rank in results.values():
        for rank_results in per_rank:
            for res in rank_results:
                per_row[(res.layout, res.mode)].append(res)
    rows = []
    for (layout, mode), ranks in per_row.items():
        err_token = _worst(res.rel_err_token for res in ranks)
        err_mom = _worst(res.rel_err_mean_of_means for res in ranks)
        own = err_token if mode == "token" else err_mom
        counts = {res.num_tokens for res in ranks}
        num_tokens = counts.pop() if len(counts) == 1 else None
        expected = (
            expected_num_tokens.get(layout)
            if isinstance(expected_num_tokens, dict)
            else expected_num_tokens
        )
        count_ok = mode != "token" or expected is None or num_tokens == expected
        rows.append(
            {
                "layout": layout,
                "mode": mode,
                "rel_err_token": err_token,
                "rel_err_mean_of_means": err_mom,
                "num_tokens": num_tokens,
                "ok": not math.isnan(own) and own <= tolerance and count_ok,
            }
        )
    return rows


def _worst(errors: Iterable[float]) -> float:
    """The largest error, or NaN if any is NaN (Python's ``max`` drops a NaN that is not first)."""
    errors = list(errors)
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def _report(
    rows: list[dict[str, Any]],
    aux: list[dict[str, Any]],
    skipped: list[dict[str, str]],
    args: argparse.Namespace,
    expected_num_tokens: dict[str, int],
    seconds: float,
) -> None:
    if args.json:
        print(json.dumps({"rows": rows, "aux_coefficients": aux, "skipped": skipped}, indent=2))
        return
    table = [
        [
            r["layout"],
            r["mode"],
            f"{r['rel_err_token']:.2e}",
            f"{r['rel_err_mean_of_means']:.2e}",
            "-" if r["mode"] != "token" else str(r["num_tokens"]),
            _verdict(r),
        ]
        for r in rows
    ]
    print_table(
        "Gradients against unpartitioned references (max relative error over ranks)",
        ["layout", "mode", "vs token ref", "vs mean-of-means ref", "N", "verdict"],
        table,
    )
    if aux:
        print_table(
            "Gradient against the token-mode target, upstream beside the extension (MoE: the "
            "router weights and the auxiliary losses alone; MTP: all, the auxiliary "
            "losses alone; torch FSDP2: all, the whole loss)",
            ["layout", "step", "coefficient", "max relative error"],
            [
                [r["layout"], r["variant"], f"{r['coefficient']:.4f}", f"{r['error']:.2e}"]
                for r in aux
            ],
        )
    for skip in skipped:
        print(f"skipped {skip['layout']}: {skip['reason']}")
    failed = sum(not r["ok"] for r in rows)
    summary = "all rows pass" if not failed else f"{failed} row(s) FAIL"
    counts = " or ".join(str(n) for n in sorted(set(expected_num_tokens.values()), reverse=True))
    print(
        f"{summary} (tolerance {args.tolerance:g}; token rows must divide by N, their batch's "
        "loss tokens: "
        f"{counts}); {seconds:.1f} s"
    )


def _verdict(row: dict[str, Any]) -> str:
    if not row["ok"]:
        return "FAIL"
    return "ok: token mean" if row["mode"] == "token" else "ok: mean of means"
