"""Per-step overhead of install() against upstream, side by side in one run.

Two gloo ranks (DP 2) train the tiny megatron-core GPT of ``megatron-ga verify`` with megatron's own
schedule and finalize, ``calculate_per_token_loss=True``, for GA micro-batches per step:

* upstream:  megatron's ``finalize_model_grads`` and the pretrain_gpt-style loss (``masked_loss``);
* extension: the same after ``install()`` (loss contract, micro-batch guards, checked int64 finalize).

Variants alternate step by step (upstream, extension, upstream, ...) so that both see the same machine
load; the report gives the median step time of each and their ratio.

    python benchmarks/overhead.py [--steps 40] [--num-microbatches 4 16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

from megatron_ga_ext.verify.launch import LaunchConfig, run_on_ranks

DP = 2


def rank_main(steps: int, num_microbatches: int) -> dict[str, float]:
    from megatron_ga_ext.verify.shims import cpu_shims

    with cpu_shims():
        return _timings(steps, num_microbatches)


def _timings(steps: int, num_microbatches: int) -> dict[str, float]:
    import megatron_ga_ext
    from megatron.core.distributed import finalize_model_grads as upstream_finalize

    from megatron_ga_ext.reduction import masked_loss
    from megatron_ga_ext.verify.harness import VerifyConfig, build_ddp, init_model_parallel, train_step
    from megatron_ga_ext.verify.layouts import Layout, make_global_batch

    cfg = VerifyConfig()
    layout = Layout(data_parallel_size=DP, num_microbatches=num_microbatches)
    batch = make_global_batch(tuple(1 + (7 * i) % cfg.model.seq_length for i in range(layout.global_batch_size)),
                              cfg.model.seq_length, cfg.model.vocab_size)
    init_model_parallel()
    ddp, _, config = build_ddp(layout, cfg, calculate_per_token_loss=True)
    loss = partial(masked_loss, mode="token")
    times: dict[str, list[float]] = {"upstream": [], "extension": []}
    for step in range(2 * steps + 4):
        variant = "upstream" if step % 2 == 0 else "extension"
        finalize = upstream_finalize
        if variant == "extension":
            finalize = megatron_ga_ext.install(megatron_ga_ext.GAConfig()).finalize
        start = time.perf_counter()
        train_step(ddp, config, layout, cfg, batch, finalize=finalize, loss_func=loss)
        elapsed = time.perf_counter() - start
        megatron_ga_ext.uninstall()
        if step >= 4:  # warm-up
            times[variant].append(elapsed)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per variant")
    parser.add_argument("--num-microbatches", type=int, nargs="+", default=[4, 16])
    args = parser.parse_args()
    print("| DP x GA | upstream step (ms) | extension step (ms) | ratio | extra ms per micro-batch |")
    print("|---|---|---|---|---|")
    for m in args.num_microbatches:
        median = run_on_ranks(rank_main, DP, (args.steps, m), LaunchConfig(timeout_s=600))[0]
        ratio = median["extension"] / median["upstream"]
        extra = 1e3 * (median["extension"] - median["upstream"]) / m
        print(f"| {DP} x {m} | {1e3 * median['upstream']:.2f} | {1e3 * median['extension']:.2f} | {ratio:.3f} "
              f"| {extra:.3f} |", flush=True)


if __name__ == "__main__":
    main()
