"""What ``megatron-ga verify`` launches: per world size one launch of gloo (or NCCL) ranks, every
layout of that size on each rank, then one for the auxiliary losses' coefficients (aux.py) of that
size; with ``--fuzz``, the draws (fuzz.py), a few per launch."""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable, Sequence

from megatron_ga_ext.testing.distributed import LaunchConfig, run_on_ranks
from megatron_ga_ext.testing.shims import cpu_shims
from megatron_ga_ext.verify.aux import AUX_LAYOUTS, AuxCoefficient, measure_aux_coefficients
from megatron_ga_ext.verify.fuzz import Draw, DrawResult, run_draws
from megatron_ga_ext.verify.harness import LayoutResult, run_rank
from megatron_ga_ext.verify.layouts import DEFAULT_LENGTHS, Layout
from megatron_ga_ext.verify.run_config import VerifyConfig


def launch_all(
    layouts: Sequence[Layout],
    *,
    device: str,
    timeout_s: float,
    aux_layouts: Sequence[Layout] = AUX_LAYOUTS,
    upstream: bool = False,
) -> tuple[dict[int, list[list[LayoutResult]]], list[AuxCoefficient]]:
    """({world size: per-rank lists of LayoutResult}, rank 0's auxiliary coefficients): per world
    size one launch of its layouts, then one of its ``aux_layouts``. Each layout builds megatron's
    process groups anew and gloo keeps every group's threads (some 60 a layout): riding on the
    layouts' launch, the coefficients ran at some 1,500 threads a rank, 4 ranks on 2 cores spent
    most of their time in the kernel, and the launch took 150 s to over 900 s. ``upstream``:
    megatron-core alone (VerifyConfig.upstream)."""
    by_world, aux_by_world = _by_world(layouts), _by_world(aux_layouts)
    launch = LaunchConfig(backend="gloo" if device == "cpu" else "nccl", timeout_s=timeout_s)
    results, coefficients = {}, []
    for world_size in sorted(by_world.keys() | aux_by_world.keys()):
        for of_world, aux in ((by_world[world_size], ()), ((), aux_by_world[world_size])):
            if not of_world and not aux:
                continue
            names = ", ".join(lay.name for lay in of_world or aux)
            what = names if of_world else f"the auxiliary coefficients of {names}"
            print(f"launching {world_size} rank(s): {what}", file=sys.stderr, flush=True)
            cfg = VerifyConfig(
                layouts=tuple(of_world), lengths=DEFAULT_LENGTHS, device=device, upstream=upstream
            )
            per_rank = run_on_ranks(_rank_work, world_size, (cfg, tuple(aux)), launch)
            if of_world:
                results[world_size] = [layouts_done for layouts_done, _ in per_rank]
            coefficients += per_rank[0][1]
    return results, coefficients


def _by_world(
    items: Sequence, layout_of: Callable = lambda layout: layout
) -> defaultdict[int, list]:
    """``items`` (layouts, or draws with ``layout_of``) by their layout's world size, in order."""
    grouped: defaultdict[int, list] = defaultdict(list)
    for item in items:
        grouped[layout_of(item).world_size].append(item)
    return grouped


def _rank_work(
    cfg: VerifyConfig, aux_layouts: tuple[Layout, ...]
) -> tuple[list[LayoutResult], list[AuxCoefficient]]:
    """One rank: every layout of ``cfg``, then the coefficients of ``aux_layouts``."""
    results = run_rank(cfg) if cfg.layouts else []
    if not aux_layouts:
        return results, []
    if cfg.device != "cpu":
        return results, measure_aux_coefficients(cfg, aux_layouts)
    with cpu_shims():
        return results, measure_aux_coefficients(cfg, aux_layouts)


#: Each draw builds megatron's process groups anew, and gloo keeps the threads of every group it
#: made: a few draws per launch keep a rank's threads in the tens.
DRAWS_PER_LAUNCH = 4


def launch_draws(
    draws: Sequence[Draw],
    *,
    device: str,
    timeout_s: float,
) -> list[tuple[Draw, tuple[DrawResult, ...] | None, str | None]]:
    """(draw, every rank's verdict, None) for each draw, or (draw, None, why) where its launch
    failed; the draws of one world size at most :data:`DRAWS_PER_LAUNCH` to a launch."""
    launch = LaunchConfig(backend="gloo" if device == "cpu" else "nccl", timeout_s=timeout_s)
    out: list[tuple[Draw, tuple[DrawResult, ...] | None, str | None]] = []
    for world_size, of_world in sorted(_by_world(draws, lambda draw: draw.layout).items()):
        for i in range(0, len(of_world), DRAWS_PER_LAUNCH):
            batch = tuple(of_world[i : i + DRAWS_PER_LAUNCH])
            print(
                f"launching {world_size} rank(s): draw(s) {', '.join(str(d.index) for d in batch)}",
                file=sys.stderr,
                flush=True,
            )
            try:
                per_rank = run_on_ranks(run_draws, world_size, (batch, device), launch)
            except Exception as exc:
                out += [
                    (draw, None, f"launch failed: {type(exc).__name__}: {exc}") for draw in batch
                ]
                continue
            out += [(verdicts[0].draw, verdicts, None) for verdicts in zip(*per_rank)]
    return out
