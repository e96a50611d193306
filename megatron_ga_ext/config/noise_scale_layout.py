"""Where ``--ga-noise-scale`` can measure: DP >= 2, and none of the Megatron settings under which a
rank's gradient before the data-parallel reduction is not its replica's own. Pure Python.

:func:`check_noise_scale_layout` is one of the rules between flags that config/launch_rules.py runs
(its ``noise-scale-layout`` rule); science/integration/noise_scale.py runs it on a megatron-core
loop. Each refusal's coverage row (config/coverage/) says the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from megatron_ga_ext.config.flags import NOISE_SCALE
from megatron_ga_ext.config.megatron_args import MegatronArgs
from megatron_ga_ext.errors import OptionError

__all__ = ["NOISE_SCALE_REFUSALS", "NoiseScaleRefusal", "check_noise_scale_layout"]


@dataclass(frozen=True)
class NoiseScaleRefusal:
    """A Megatron setting under which ``--ga-noise-scale`` cannot measure
    (:func:`check_noise_scale_layout`)."""

    flag: str
    given: Callable[[MegatronArgs], str | None]
    """The setting's value as the message names it ("" for a switch), or None where the launch does
    not have it."""
    why: str
    fix: str
    """What to do instead of dropping ``--ga-noise-scale``."""


def _not_one(dest: str) -> Callable[[MegatronArgs], str | None]:
    def given(settings: MegatronArgs) -> str | None:
        value = settings.get(dest) or 1
        return None if value == 1 else str(value)

    return given


def _on(dest: str) -> Callable[[MegatronArgs], str | None]:
    return lambda settings: "" if settings.get(dest) else None


def _gtp_shards(settings: MegatronArgs) -> str | None:
    """GTP weight rematerialization: more weight shards than TP ranks (Megatron's
    gtp_weight_remat_size > 1)."""
    shards, tp = (
        settings.get("tensor_parallel_num_weight_shards") or 0,
        settings.get("tensor_model_parallel_size") or 1,
    )
    return f"{shards} (above --tensor-model-parallel-size {tp})" if int(shards) > int(tp) else None


def _patterns(settings: MegatronArgs) -> str | None:
    patterns = settings.get("ddp_param_name_patterns_for_fp32_local_accumulation") or ()
    return " ".join([patterns] if isinstance(patterns, str) else map(str, patterns)) or None


#: Where --ga-noise-scale cannot measure, beyond DP >= 2; the coverage rows of these flags say so.
# fmt: off
NOISE_SCALE_REFUSALS = (
    NoiseScaleRefusal(
        flag="--context-parallel-size", given=_not_one("context_parallel_size"),
        why="the CP shards of one sequence are parts of one sample, not independent replicas, "
            "and a replica's gradient "
        "would need a reduction over CP before the one over DP x CP", fix="--context-parallel-size "
            "1"),
    NoiseScaleRefusal(
        flag="--hybrid-context-parallel", given=_on("hybrid_context_parallel"),
        why="it schedules each step's sub-samples over the DP x CP ranks "
            "(megatron/core/datasets/data_schedule.py, "
        "HybridCPDataLoaderWrapper), so a sequence split over a group of data-parallel ranks is "
            "part of several "
        "ranks' gradients, which are then not independent replicas", fix="drop "
            "--hybrid-context-parallel"),
    NoiseScaleRefusal(
        flag="--tensor-parallel-num-weight-shards", given=_gtp_shards,
        why="GTP spreads the micro-batches over the replicate DP x GTP ranks and reduce-scatters "
            "each weight's "
        "gradient over the GTP axis inside the backward pass, so the gradient the meter reads "
            "before the data-parallel "
        "reduction already sums several ranks' samples", fix="keep it at "
            "--tensor-model-parallel-size (no GTP)"),
    NoiseScaleRefusal(
        flag="--num-distributed-optimizer-instances", given=_not_one("num_distributed_optimizer_instances"),
        why="the reduced gradient is all-reduced across the optimizer instances after the "
            "reduce-scatter",
        fix="--num-distributed-optimizer-instances 1"),
    NoiseScaleRefusal(
        flag="--use-megatron-fsdp", given=_on("use_megatron_fsdp"),
        why="Megatron-FSDP keeps the gradients in its own buffer, not the DDP buckets the meter "
            "reads; with "
        "optim_grads and optim_grads_params it reduce-scatters them into shards, so no rank "
            "holds its replica's "
        "gradient", fix="use Megatron's DDP (with --use-distributed-optimizer if you like)"),
    NoiseScaleRefusal(
        flag="--use-torch-fsdp2", given=_on("use_torch_fsdp2"),
        why="torch FSDP2 reduce-scatters each unit's gradient as each micro-batch's backward "
            "ends (Megatron-LM sets "
        "no no_sync for it), so no rank ever holds its replica's gradient of the step", fix="use "
            "Megatron's DDP"),
    NoiseScaleRefusal(
        flag="--ddp-param-name-patterns-for-fp32-local-accumulation", given=_patterns,
        why="the parameters it names accumulate into an fp32 main_grad outside the gradient "
            "buffer the meter reads "
        "(megatron/core/distributed/param_and_grad_buffer.py), so both norms leave them out, and "
            "the pattern all "
        "leaves out every parameter: each estimate would be 0 / 0",
        fix="drop the patterns (--accumulate-allreduce-grads-in-fp32 keeps every main_grad in "
            "fp32, in the buffer)"),
    NoiseScaleRefusal(
        flag="--optimizer-cuda-graph", given=_on("optimizer_cuda_graph"),
        why="after its capture Megatron's OptimizerCudaGraphWrapper replays the optimizer step "
            "without calling the "
        "extension's step hook, where each measurement is taken and --ga-batch-size-warmup auto "
            "decides, so the "
        "meter and the warmup would stop at the capture without a word", fix="drop "
            "--optimizer-cuda-graph"),
)
# fmt: on


def check_noise_scale_layout(
    interval: int, *, data_parallel_size: int, settings: Mapping[str, Any] | MegatronArgs
) -> None:
    """Where ``--ga-noise-scale`` can measure: DP >= 2 (it compares replicas), and none of
    :data:`NOISE_SCALE_REFUSALS` (CP 1, one distributed-optimizer instance, Megatron's DDP ...). Raises OptionError
    naming the flag; ``settings`` holds Megatron's args by destination."""
    if not interval:
        return
    settings = MegatronArgs.of(settings)
    if data_parallel_size < 2:
        raise OptionError(
            f"{NOISE_SCALE.flag} {interval} with data-parallel size {data_parallel_size}: the "
            "estimate compares each replica's gradient with the reduced one, so it needs DP >= "
            "2. Drop "
            f"{NOISE_SCALE.flag}, or train with more data-parallel replicas."
        )
    for refusal in NOISE_SCALE_REFUSALS:
        given = refusal.given(settings)
        if given is not None:
            setting = f"{refusal.flag} {given}" if given else refusal.flag
            raise OptionError(
                f"{NOISE_SCALE.flag} with {setting}: {refusal.why}. Drop {NOISE_SCALE.flag}, or "
                f"{refusal.fix}."
            )
