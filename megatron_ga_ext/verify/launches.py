"""What ``megatron-ga verify`` launches: one launch of gloo (or NCCL) ranks per world size, every layout of that
size on each rank, and the router's auxiliary-loss coefficients on the 2-rank launch."""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Sequence

from megatron_ga_ext.testing.distributed import LaunchConfig, run_on_ranks
from megatron_ga_ext.testing.shims import cpu_shims
from megatron_ga_ext.verify.aux import RouterCoefficient, measure_router_coefficients
from megatron_ga_ext.verify.harness import LayoutResult, VerifyConfig, run_rank
from megatron_ga_ext.verify.layouts import DEFAULT_LENGTHS, Layout


def launch_all(layouts: Sequence[Layout], *, device: str, timeout_s: float,
               ) -> tuple[dict[int, list[list[LayoutResult]]], list[RouterCoefficient]]:
    """({world size: per-rank lists of LayoutResult}, rank 0's router coefficients), one launch per world
    size; the router measurement rides on the 2-rank launch (CPU only: it is a DP 2 layout)."""
    by_world: dict[int, list[Layout]] = defaultdict(list)
    for layout in layouts:
        by_world[layout.world_size].append(layout)
    launch = LaunchConfig(backend="gloo" if device == "cpu" else "nccl", timeout_s=timeout_s)
    results, router = {}, []
    for world_size in sorted(by_world):
        names = ", ".join(lay.name for lay in by_world[world_size])
        print(f"launching {world_size} rank(s): {names}", file=sys.stderr, flush=True)
        cfg = VerifyConfig(layouts=tuple(by_world[world_size]), lengths=DEFAULT_LENGTHS,
                           device=device)
        per_rank = run_on_ranks(_rank_work, world_size, (cfg, world_size == 2), launch)
        results[world_size] = [layouts_done for layouts_done, _ in per_rank]
        router = per_rank[0][1] or router
    return results, router


def _rank_work(cfg: VerifyConfig, router: bool) -> tuple[list[LayoutResult], list[RouterCoefficient]]:
    """One rank: every layout of ``cfg``, then (``router``) the router coefficients."""
    results = run_rank(cfg)
    if not router:
        return results, []
    if cfg.device != "cpu":
        return results, measure_router_coefficients(cfg)
    with cpu_shims():
        return results, measure_router_coefficients(cfg)
