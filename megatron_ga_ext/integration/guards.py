"""Run-time invariants of the batch arithmetic: pipeline parallelism never multiplies the global batch.

Two counts are checked every step, both plain Python integers (no device-to-host sync):

* micro-batches per forward/backward call: every model chunk runs exactly
  num_microbatches = GBS / (MBS x DP) forward steps, whatever PP and VPP are;
* consumed samples: they advance by exactly the running GBS = DP x MBS x num_microbatches per step.

A count that is a PP multiple of the right one gets the message "pipeline parallelism never multiplies
the global batch size", with the numbers.
"""

from __future__ import annotations

from typing import Any

from megatron_ga_ext.core.rules import require_count
from megatron_ga_ext.errors import GuardError
from megatron_ga_ext.integration.compat import Calculator

__all__ = ["MicrobatchCounter", "GuardedCalculator", "check_microbatch_counts", "check_consumed_advance"]

PP_RULE = "pipeline parallelism never multiplies the global batch size"


def _pp_note(got: int, expected: int, pipeline_model_parallel_size: int) -> str:
    pp = pipeline_model_parallel_size
    if pp > 1 and expected > 0 and got == expected * pp:
        return f"{got} = {expected} x PP {pp}: {PP_RULE} (GBS = MBS x DP x num_microbatches). "
    return ""


def check_microbatch_counts(
    counts: dict[object, int], num_microbatches: int, expected: int | None, pipeline_model_parallel_size: int | None = 1
) -> None:
    """Raise :class:`GuardError` unless every chunk ran ``num_microbatches`` forward steps and that
    equals ``expected`` = GBS / (MBS x DP) from the calculator (None: not known, not checked). PP only goes into
    the message; None reads it from megatron's parallel state then (the step's check reads nothing more)."""
    if (expected is None or num_microbatches == expected) and set(counts.values()) == {num_microbatches}:
        return
    pp = current_pipeline_size() if pipeline_model_parallel_size is None else pipeline_model_parallel_size
    if expected is not None and num_microbatches != expected:
        raise GuardError(
            f"forward_backward_func was called with num_microbatches={num_microbatches}, but the calculator's "
            f"num_microbatches = GBS / (MBS x DP) is {expected}. {_pp_note(num_microbatches, expected, pp)}"
            f"Pass num_microbatches=get_num_microbatches()."
        )
    wrong = {chunk: n for chunk, n in counts.items() if n != num_microbatches}
    if wrong or not counts:
        ran = ", ".join(f"chunk {i}: {n}" for i, n in enumerate(counts.values())) or "none"
        got = next(iter(wrong.values()), 0)
        raise GuardError(
            f"the schedule ran forward steps per model chunk ({ran}) instead of num_microbatches="
            f"{num_microbatches} for each chunk. {_pp_note(got, num_microbatches, pp)}"
            f"Each model chunk must see every micro-batch of the step exactly once."
        )


def check_consumed_advance(
    previous: int,
    current: int,
    running_global_batch_size: int,
    pipeline_model_parallel_size: int = 1,
    global_batch_size: int | None = None,
) -> None:
    """Raise unless consumed samples advanced by 0 (same step) or by exactly one step's batch: the
    running GBS (what the training loop adds) or the nominal GBS (what the train-iters simulation adds)."""
    delta = current - previous
    if delta <= 0 or delta in (running_global_batch_size, global_batch_size):
        return
    raise GuardError(
        f"consumed samples advanced from {previous} to {current} (+{delta}) in one step, but one step consumes "
        f"exactly the running global batch size {running_global_batch_size} = DP x MBS x num_microbatches. "
        f"{_pp_note(delta, running_global_batch_size, pipeline_model_parallel_size)}"
        f"Count consumed samples as DP x MBS x get_num_microbatches()."
    )


def current_pipeline_size() -> int:
    """PP from megatron's parallel state; 1 before it is initialized."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_pipeline_model_parallel_world_size()


class MicrobatchCounter:
    """Forward steps per model chunk during one forward/backward call (host integers only), keyed by the chunk
    itself (``id()`` raises an audit event per call, which costs microseconds where a hook is installed)."""

    def __init__(self) -> None:
        self.counts: dict[object, int] = {}

    def reset(self) -> None:
        self.counts.clear()

    def count(self, model_chunk: object) -> None:
        self.counts[model_chunk] = self.counts.get(model_chunk, 0) + 1


class GuardedCalculator:
    """Megatron's num-microbatches calculator interface around another calculator, checking that
    consumed samples advance by exactly the running GBS between training steps.

    Megatron's loop calls ``update(consumed, consistency_check=False)`` once per step before the
    checked call, so the advance is checked on unchecked calls; a step backwards (the train-iters
    simulation resetting to 0) or a checked call (checkpoint load) only moves the baseline."""

    def __init__(self, inner: Calculator, pipeline_model_parallel_size: int | None = None) -> None:
        self.inner = inner
        self._pipeline_model_parallel_size = pipeline_model_parallel_size
        self._consumed: int | None = None
        self._batch: tuple[int, int] | None = None

    @property
    def pipeline_model_parallel_size(self) -> int:
        """PP as given, else from megatron's parallel state (not yet initialized when Megatron builds
        the calculator, so it is read when a check needs it)."""
        return self._pipeline_model_parallel_size or current_pipeline_size()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get(self) -> int:
        return self.inner.get()

    def get_current_global_batch_size(self) -> int:
        return self.inner.get_current_global_batch_size()

    def get_micro_batch_size(self) -> int:
        return self.inner.get_micro_batch_size()

    def get_current_running_global_batch_size(self) -> int:
        return self.inner.get_current_running_global_batch_size()

    def update(self, consumed_samples: int, consistency_check: bool, verbose: bool = False) -> None:
        require_count("consumed_samples", consumed_samples)  # upstream's calculators do not check it
        if not consistency_check and self._consumed is not None and self._batch is not None:
            running, nominal = self._batch
            check_consumed_advance(
                self._consumed, consumed_samples, running, self.pipeline_model_parallel_size, nominal
            )
        self.inner.update(consumed_samples, consistency_check, verbose)
        self._consumed = consumed_samples
        self._batch = (
            self.inner.get_current_running_global_batch_size(),
            self.inner.get_current_global_batch_size(),
        )
