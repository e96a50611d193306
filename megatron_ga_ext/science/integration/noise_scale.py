"""``--ga-noise-scale K``: the gradient noise scale measured in the run, every K-th iteration.

Per measured step (the estimator and its derivation: science/core/noise_scale.py), with replica r's
b_r loss tokens and its summed gradient S_r = sum of its tokens' loss gradients, before the
data-parallel reduction, and S = sum_r S_r after:

    |g_r|^2 = |S_r|^2 / b_r^2        taken where each bucket group's grad sync starts (the gradients are complete
                                     and not reduced yet, with or without --overlap-grad-reduce)
    |g|^2   = |S|^2 / N^2            taken in finalize, after upstream's reduction, before the division by N

Each rank adds its shard's part: a tensor-parallel duplicate counts on TP rank 0 only, a pipeline
stage holds its own layers, and with the distributed optimizer each rank reads only the shard of S
its reduce-scatter wrote. One all-reduce over the world, of six float64 numbers, then gives

    [sum_r |g_r|^2, |g|^2, sum_r 1/b_r, N, K, replicas with b_r = 0]

(the last four counted on one rank per replica: TP rank 0 of the last pipeline stage). The vector
stays on the device until :meth:`NoiseScaleMeter.read` (after Megatron's optimizer step, once per
measured iteration): no host read on the other steps, nothing per micro-batch.

Measured over the dense parameters a replica owns whole: expert parameters (reduced over the expert
data-parallel group), a tied embedding split across pipeline stages (its stages' parts are summed
only after the reduction), and every parameter upstream's finalize reduces again after the
data-parallel reduction (sequence-parallel parameters and, at TP > 1, the q/k layernorms under
``qk_layernorm`` and those marked ``average_gradients_across_tp_domain``, summed or averaged over
TP; at PP > 1, routers and conditional embedders synced across stages) are left out of both norms:
each rank's local value of those is a partial one. The first measured step logs the share of this
rank's parameter elements the norms cover, and the classes left out
(:meth:`NoiseScaleMeter.coverage`).

Each squared norm is accumulated in float64, :data:`NORM_CHUNK` elements converted at a time
(bounded extra memory). The local read waits for a local CUDA graph's backward replay as upstream's
grad sync does, and the loss scale the gradients hold is kept before the optimizer step (its dynamic
scaler may change it in the step).

Where it cannot measure (config/noise_scale_layout.check_noise_scale_layout) is refused at install() from
Megatron-LM's args; a megatron-core loop without them is refused at its first forward/backward call,
from what megatron-core holds (:func:`check_core_layout`).

What the norms count is science/integration/noise_scale_coverage.py; where a measurement is
reported, noise_scale_report.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megatron_ga_ext.config.noise_scale_layout import check_noise_scale_layout
from megatron_ga_ext.errors import OptionError
from megatron_ga_ext.integration.host import current_host
from megatron_ga_ext.logs import get_logger
from megatron_ga_ext.science.core.noise_scale import (
    NoiseEstimate,
    NoiseScaleEMA,
    replica_estimate_from_sums,
)
from megatron_ga_ext.science.core.noise_trace import trace_row
from megatron_ga_ext.science.integration.noise_scale_coverage import CountedElements, Coverage
from megatron_ga_ext.science.integration.noise_scale_report import Reporter

if TYPE_CHECKING:
    from megatron_ga_ext.config.ga_config import GAConfig

__all__ = ["NORM_CHUNK", "Measurement", "NoiseScaleMeter", "check_core_layout", "squared_norm"]

logger = get_logger(__name__)

NORM_CHUNK = 1 << 24
"""Elements converted to float64 at a time by :func:`squared_norm`: at most 128 MiB of extra memory
per norm."""


def squared_norm(values: torch.Tensor) -> torch.Tensor:
    """|values|^2 accumulated in float64, as a 0-d float64 tensor on the values' device.

    The elements are converted to float64 :data:`NORM_CHUNK` at a time (the estimate subtracts two
    close sums, so the accumulation stays in float64): the extra memory is 8 x NORM_CHUNK bytes
    whatever the bucket's size, where one conversion of the whole range would take 8 bytes per
    element (a whole model's gradient without bucketing)."""
    total = torch.zeros((), dtype=torch.float64, device=values.device)
    for start in range(0, values.numel(), NORM_CHUNK):
        total += torch.linalg.vector_norm(
            values[start : start + NORM_CHUNK], dtype=torch.float64
        ).square()
    return total


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One measured iteration, as read on the host."""

    iteration: int | None
    estimate: NoiseEstimate
    replicas: int


class NoiseScaleMeter:
    """The in-run measurement; see the module docstring. Made by install() where
    ``--ga-noise-scale`` > 0.

    Attributes: ema: the EMAs of tr(Sigma) and |G|^2 (kept next to the loop's checkpoints:
        sidecar.py). last: the last measured iteration, or None. measurements: how many iterations
        were measured since the start (a resume continues the count). counted: the gradient elements
        the norms count (noise_scale_coverage.py). reporter: where a measurement goes: the printed
        line, the writers, the trace (noise_scale_report.py).
    """

    def __init__(self, config: GAConfig) -> None:
        self.interval = config.noise_scale
        self.ema = NoiseScaleEMA(decay=config.noise_scale_decay)
        self.last: Measurement | None = None
        self.last_row: dict[str, Any] | None = None
        """The last measurement's trace row (what --ga-batch-size-warmup auto decides from)."""
        self.measurements = 0
        self.steps = 0
        """finalize calls seen: the step count where Megatron's iteration is not known."""
        self._local: torch.Tensor | None = None
        self._pending: tuple[torch.Tensor, int | None] | None = None
        self.counted = CountedElements()
        self.coverage_logged = False
        self._loss_scale: torch.Tensor | float | None = None
        """The loss scale of the pending measurement's gradients, kept before the optimizer step."""
        self.reporter = Reporter(config.noise_scale_trace)

    # -- which steps ------------------------------------------------------------------------------

    def measuring(self) -> bool:
        """Whether the step in progress is measured: Megatron's iteration (as its log numbers it) is
        a multiple of K; without Megatron's args, the finalize count."""
        iteration = current_host().iteration()
        step = iteration if iteration is not None else self.steps + 1
        return step % self.interval == 0

    # -- before the reduction: where each bucket group's grad sync starts ------------------------

    def before_grad_sync(self, bucket_group: Any, chunks: Sequence[torch.nn.Module] = ()) -> None:
        """Add this bucket group's part of |S_r|^2 (its gradients are complete and not reduced yet).
        ``chunks``: the step's model chunks known here (the schedule's first), for the names of
        their parameters."""
        if not self.measuring():
            return
        self.learn_chunks(chunks)
        _wait_for_graph_replays(bucket_group)
        part = self._local
        for bucket in bucket_group.buckets:
            for start, end in self.counted.plan(bucket).ranges:
                norm = squared_norm(bucket.grad_data[start:end])
                part = norm if part is None else part + norm
        if part is not None:
            self._local = part

    # -- after the reduction: in finalize ---------------------------------------------------------

    def after_reduction(
        self, model: Sequence[torch.nn.Module], local_tokens: torch.Tensor, is_last_stage: bool
    ) -> None:
        """In finalize (the NoiseScale feature's part), after the reductions and before the division
        by N: this rank's parts of the vector, summed over the world (the measured step's one
        collective). ``local_tokens`` is b_r (the replica's count, broadcast from its last stage);
        TP rank 0 of the last stage counts the replica."""
        from megatron.core import parallel_state

        counts_replica = is_last_stage and parallel_state.get_tensor_model_parallel_rank() == 0
        measuring = self.measuring()
        self.steps += 1
        if not measuring:
            self.learn_chunks(model)
            return
        if not self.coverage_logged:
            self.coverage_logged = True
            logger.info("%s", self.coverage(model).line())
        device = local_tokens.device
        reduced = torch.zeros((), dtype=torch.float64, device=device)
        for chunk in model:
            for group in getattr(chunk, "bucket_groups", ()):
                for bucket in group.buckets:
                    for start, end in self.counted.owned(bucket, group):
                        reduced += squared_norm(bucket.grad_data[start:end])
        b = local_tokens.to(torch.float64)
        safe = torch.clamp(b, min=1)
        local = (
            self._local
            if self._local is not None
            else torch.zeros((), dtype=torch.float64, device=device)
        )
        self._local = None
        once = 1.0 if counts_replica else 0.0
        vector = torch.stack(
            [
                local / safe.square(),
                reduced,
                once / safe,
                once * b,
                torch.full((), once, dtype=torch.float64, device=device),
                once * (b == 0).to(torch.float64),
            ]
        )
        torch.distributed.all_reduce(vector)
        iteration = current_host().iteration()
        self._pending = (vector, iteration if iteration is not None else self.steps)
        self.learn_chunks(model)  # the next step's plans know every chunk's names

    # -- on the host
    # --------------------------------------------------------------------------------

    def read(self, loss_scale: float = 1.0) -> Measurement | None:
        """The pending measurement, read (one device-to-host copy) and folded into the EMAs; None
        where there is none or it has no estimate (a replica without loss tokens, a non-finite
        gradient: an fp16 overflow)."""
        if self._pending is None:
            return None
        vector, iteration = self._pending
        self._pending = None
        local, reduced, inverse_counts, tokens, replicas, empty = vector.tolist()
        scale = float(loss_scale) ** 2
        total = round(tokens)
        if (
            empty
            or replicas < 2
            or not all(math.isfinite(x) for x in (local, reduced, scale))
            or scale <= 0
        ):
            logger.info(
                "megatron-ga-ext: noise scale not measured at iteration %s (%s)",
                iteration,
                "a replica without loss tokens" if empty else "a non-finite gradient",
            )
            return None
        estimate = replica_estimate_from_sums(
            mean_local_sq_norm=local / scale / replicas,
            global_sq_norm=reduced / scale / total**2,
            mean_inverse_tokens=inverse_counts / replicas,
            tokens=total,
            replicas=round(replicas),
        )
        self.ema.update(estimate)
        self.measurements += 1
        self.last = Measurement(iteration=iteration, estimate=estimate, replicas=round(replicas))
        return self.last

    def before_optimizer_step(self, optimizer: Any) -> None:
        """Before Megatron's optimizer step, on a measured step: keep the loss scale the measured
        gradients hold. The step's dynamic scaler may grow it (or shrink it, on an overflow); kept
        as given, a device tensor is not read here (:meth:`after_optimizer_step` reads it)."""
        if self._pending is None:
            return
        scale = _loss_scale(optimizer)
        self._loss_scale = scale.detach().clone() if isinstance(scale, torch.Tensor) else scale

    def after_optimizer_step(self, optimizer: Any) -> Measurement | None:
        """Megatron's optimizer step is done (its grad-norm read has synced the stream): read a
        pending measurement, unscaled by the loss scale kept before the step
        (:meth:`before_optimizer_step`; the optimizer's own where none was kept), and report it
        (:meth:`report`). Nothing on the other steps."""
        scale, self._loss_scale = self._loss_scale, None
        if self._pending is None:
            return None
        measurement = self.read(float(_loss_scale(optimizer) if scale is None else scale))
        if measurement is not None:
            self.report(measurement)
        return measurement

    def report(self, measurement: Measurement) -> dict[str, Any]:
        """Where Megatron users look: a line after the iteration's (printed by the last rank, as
        Megatron prints; it gives the consumed samples after the step, so ``--suggest`` reads a log
        whatever K and --log-interval), TensorBoard and W&B through Megatron's writers, and the
        trace file (``--ga-noise-scale-trace``). The row is the trace's (what ``megatron-ga schedule
        --suggest`` reads)."""
        row = self.last_row = self.trace_row(measurement)
        self.reporter.write(row)
        return row

    def say_held(self) -> None:
        """Print the held log line, if any (:meth:`Reporter.say_held`)."""
        self.reporter.say_held()

    def trace_row(self, measurement: Measurement) -> dict[str, Any]:
        """The row ``megatron-ga schedule --suggest`` reads (science/core/suggest.py), and the parts
        behind it: B_simple from the EMAs, in tokens and in samples (at this step's loss tokens per
        sample, N / GBS)."""
        estimate = measurement.estimate
        consumed, tokens_per_sample = current_host().consumed_samples(), None
        if consumed is not None:
            from megatron.core.num_microbatches_calculator import get_current_global_batch_size

            batch = get_current_global_batch_size()
            consumed += batch  # the loop adds the step's batch after the step
            tokens_per_sample = estimate.tokens / batch
        return trace_row(
            iteration=measurement.iteration,
            consumed_samples=consumed,
            b_simple_tokens=self.ema.b_simple(),
            b_simple_samples=self.ema.b_simple(tokens_per_sample) if tokens_per_sample else None,
            tokens_per_sample=tokens_per_sample,
            grad_sq=estimate.grad_sq,
            trace_sigma=estimate.trace_sigma,
            grad_sq_ema=self.ema.grad_sq,
            trace_sigma_ema=self.ema.trace_sigma,
            step_b_simple_tokens=estimate.b_simple_tokens,
            tokens=estimate.tokens,
            replicas=measurement.replicas,
        )

    # -- the counted elements
    # -----------------------------------------------------------------------

    def learn_chunks(self, chunks: Sequence[torch.nn.Module]) -> None:
        """Model chunks whose parameter names the counted set may need
        (:meth:`CountedElements.learn_chunks`)."""
        self.counted.learn_chunks(chunks)

    def coverage(self, model: Sequence[torch.nn.Module]) -> Coverage:
        """This rank's parameter elements and which of them the norms count
        (:meth:`CountedElements.coverage`)."""
        return self.counted.coverage(model)


def _loss_scale(optimizer: Any) -> torch.Tensor | float:
    """The optimizer's loss scale (fp16's grad scaler; 1 for an optimizer without one), as it gives
    it."""
    get_loss_scale = getattr(optimizer, "get_loss_scale", None)
    return 1.0 if get_loss_scale is None else get_loss_scale()


def _wait_for_graph_replays(bucket_group: Any) -> None:
    """Local CUDA graphs: a backward graph's replay is asynchronous to the hooks, and upstream's
    start_grad_sync waits for each parameter's ``_cudagraph_wgrad_ready_event`` before it reads the
    bucket. The meter reads first, so it waits first (each event once; upstream's own wait after it
    is then a no-op)."""
    waited: set[int] = set()
    for bucket in bucket_group.buckets:
        for param in bucket.params_list:
            event = getattr(param, "_cudagraph_wgrad_ready_event", None)
            if event is not None and id(event) not in waited:
                torch.cuda.current_stream().wait_event(event)
                waited.add(id(event))


def check_core_layout(interval: int, model: Any) -> None:
    """A megatron-core loop (no Megatron-LM args): check_noise_scale_layout on the settings
    Megatron-LM's flags would have set, as megatron-core holds them: the DP, CP and TP sizes from
    parallel_state, the rest from the first model chunk's DDP config and TransformerConfig (fields
    an older release lacks count as off). Raises OptionError."""
    from megatron.core import parallel_state

    chunk = model[0] if isinstance(model, (list, tuple)) else model
    ddp, config = getattr(chunk, "ddp_config", None), getattr(chunk, "config", None)
    settings = {
        "context_parallel_size": parallel_state.get_context_parallel_world_size(),
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "hybrid_context_parallel": getattr(config, "hybrid_context_parallel", False),
        "tensor_parallel_num_weight_shards": getattr(
            config, "tensor_parallel_num_weight_shards", None
        ),
        "num_distributed_optimizer_instances": getattr(
            ddp, "num_distributed_optimizer_instances", 1
        ),
        "use_megatron_fsdp": (
            getattr(ddp, "use_megatron_fsdp", False)
            or type(chunk).__name__ == "FullyShardedDataParallel"
        ),
        "use_torch_fsdp2": type(chunk).__name__ == "TorchFullyShardedDataParallel",
        "ddp_param_name_patterns_for_fp32_local_accumulation": getattr(
            ddp, "param_name_patterns_for_fp32_local_accumulation", ()
        ),
    }
    try:
        check_noise_scale_layout(
            interval,
            data_parallel_size=parallel_state.get_data_parallel_world_size(),
            settings=settings,
        )
    except OptionError as error:
        raise OptionError(
            f"{error} (A megatron-core loop: the setting as parallel_state and the model's DDP "
            "and Transformer configs hold it, which that Megatron-LM flag sets.)"
        ) from None
