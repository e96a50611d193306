"""Run-time invariants of the batch arithmetic: pipeline parallelism never multiplies the global
batch.

Two counts are checked every step, both plain Python integers (no device-to-host sync):

* micro-batches per forward/backward call: every model chunk runs exactly
  num_microbatches = GBS / (MBS x DP) forward steps, whatever PP and VPP are;
* consumed samples: they advance by exactly the running GBS = DP x MBS x num_microbatches per step.

Under Megatron's sequence-packing scheduler (``--sequence-packing-scheduler dp_balanced``, which
``--use-varlen-dataset`` selects) a step's GBS samples, num_microbatches = GBS / (MBS x DP) of them
fetched per rank, are repacked into the scheduler's own number of micro-batches
(``wrap_data_iterator``), and the schedule is called with that number. The micro-batch guard then
follows the scheduler: the call must run exactly the count the scheduler produced for it
(:meth:`MicrobatchCounter.schedule`), while consumed samples still advance by the GBS (Megatron
counts DP x MBS x get_num_microbatches() per step, and the scheduler packs every fetched sample).

A count that is a PP multiple of the right one gets the message "pipeline parallelism never
multiplies the global batch size", with the numbers.
"""

from __future__ import annotations

import sys
from typing import Any

from megatron_ga_ext.core.rules import require_count
from megatron_ga_ext.errors import GuardError
from megatron_ga_ext.integration.compat import Calculator

__all__ = [
    "MicrobatchCounter",
    "GuardedCalculator",
    "check_microbatch_counts",
    "check_consumed_advance",
    "check_scheduled_count",
    "check_split_step_count",
]

PP_RULE = "pipeline parallelism never multiplies the global batch size"
SCHEDULER = "the sequence-packing scheduler (--sequence-packing-scheduler)"


def _pp_note(got: int, expected: int, pipeline_model_parallel_size: int) -> str:
    pp = pipeline_model_parallel_size
    if pp > 1 and expected > 0 and got == expected * pp:
        return f"{got} = {expected} x PP {pp}: {PP_RULE} (GBS = MBS x DP x num_microbatches). "
    return ""


def _split_note(got: int, expected: int) -> str:
    if 0 < got < expected:
        return (
            "Where a step is split over several forward_backward_func calls, only its last call "
            "may run finalize_model_grads (config.finalize_model_grads_func None on the "
            "others; each finalize reduces and divides the gradients accumulated so "
            "far), and the calls' counts add up to "
            f"{expected}. "
        )
    return ""


def check_microbatch_counts(
    counts: dict[object, int],
    num_microbatches: int,
    expected: int | None,
    pipeline_model_parallel_size: int | None = 1,
    *,
    scheduled: bool = False,
) -> None:
    """Raise :class:`GuardError` unless every chunk ran ``num_microbatches`` forward steps and that
    equals ``expected`` = GBS / (MBS x DP) from the calculator (None: not known, not checked), or
    with ``scheduled`` the count the sequence-packing scheduler produced for this call. PP only goes
    into the message; None reads it from megatron's parallel state then (the step's check reads
    nothing more)."""
    if (expected is None or num_microbatches == expected) and set(counts.values()) == {
        num_microbatches
    }:
        return
    pp = (
        current_pipeline_size()
        if pipeline_model_parallel_size is None
        else pipeline_model_parallel_size
    )
    if expected is not None and num_microbatches != expected:
        if scheduled:
            check_scheduled_count(num_microbatches, expected)
        raise GuardError(
            f"forward_backward_func was called with num_microbatches={num_microbatches}, but the "
            "calculator's "
            f"num_microbatches = GBS / (MBS x DP) is {expected}. "
            f"{_pp_note(num_microbatches, expected, pp)}{_split_note(num_microbatches, expected)}Pass "
            "num_microbatches=get_num_microbatches()."
        )
    wrong = {chunk: n for chunk, n in counts.items() if n != num_microbatches}
    if wrong or not counts:
        ran = ", ".join(f"chunk {i}: {n}" for i, n in enumerate(counts.values())) or "none"
        got = next(iter(wrong.values()), 0)
        raise GuardError(
            f"the schedule ran forward steps per model chunk ({ran}) instead of "
            f"num_microbatches={num_microbatches} for each chunk. "
            f"{_pp_note(got, num_microbatches, pp)}Each model chunk must see every "
            "micro-batch of the step exactly once."
        )


def check_scheduled_count(num_microbatches: int, scheduled: int) -> None:
    """Raise :class:`GuardError` unless a schedule call runs the ``scheduled`` micro-batches the
    sequence-packing scheduler packed its step into: fewer leave packed samples untrained while
    consumed samples count them, more read past the packed iterator."""
    if num_microbatches == scheduled:
        return
    pp = current_pipeline_size() if "megatron.core.parallel_state" in sys.modules else 1
    raise GuardError(
        f"forward_backward_func was called with num_microbatches={num_microbatches}, but "
        f"{SCHEDULER} packed this step's samples into {scheduled} micro-batches "
        f"(wrap_data_iterator returned {scheduled}), and its data iterator holds exactly "
        f"those. {_pp_note(num_microbatches, scheduled, pp)}Pass the "
        "count wrap_data_iterator "
        f"returns, as Megatron's train_step does."
    )


def check_split_step_count(earlier: int, num_microbatches: int, expected: int) -> None:
    """Raise :class:`GuardError` unless a step split over several forward_backward_func calls
    (``earlier`` micro-batches before the last call's ``num_microbatches``) ran ``expected`` = GBS /
    (MBS x DP) in all."""
    total = earlier + num_microbatches
    if total == expected:
        return
    raise GuardError(
        f"this step's forward_backward_func calls ran {earlier} + {num_microbatches} = {total} "
        "micro-batches (a step split over several calls, finalize on the last), but the "
        "calculator's num_microbatches = GBS / (MBS x DP) "
        f"is {expected}. The calls of one step run get_num_microbatches() micro-batches in all."
    )


def check_consumed_advance(
    previous: int,
    current: int,
    running_global_batch_size: int,
    pipeline_model_parallel_size: int = 1,
    global_batch_size: int | None = None,
) -> None:
    """Raise unless consumed samples advanced by 0 (same step) or by exactly one step's batch: the
    running GBS (what the training loop adds) or the nominal GBS (what the train-iters simulation
    adds)."""
    delta = current - previous
    if delta <= 0 or delta in (running_global_batch_size, global_batch_size):
        return
    raise GuardError(
        f"consumed samples advanced from {previous} to {current} (+{delta}) in one step, but one "
        "step consumes "
        f"exactly the running global batch size {running_global_batch_size} = DP x MBS x "
        "num_microbatches. "
        f"{_pp_note(delta, running_global_batch_size, pipeline_model_parallel_size)}Count "
        "consumed samples as DP x MBS x get_num_microbatches()."
    )


def current_pipeline_size() -> int:
    """PP from megatron's parallel state; 1 before it is initialized."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return int(parallel_state.get_pipeline_model_parallel_world_size())


class MicrobatchCounter:
    """Forward steps per model chunk during one forward/backward call (host integers only), keyed by
    the chunk itself (``id()`` raises an audit event per call, which costs microseconds where a hook
    is installed); and the micro-batch count the sequence-packing scheduler produced for the next
    call, if it ran."""

    def __init__(self) -> None:
        self.counts: dict[object, int] = {}
        self.scheduled: int | None = None
        """``wrap_data_iterator``'s count for the next forward/backward call (taken by
        :meth:`check`)."""

    def reset(self) -> None:
        """Before a forward/backward call: no forward step yet (the scheduled count was given for
        this call)."""
        self.counts.clear()

    def count(self, model_chunk: object) -> None:
        self.counts[model_chunk] = self.counts.get(model_chunk, 0) + 1

    def schedule(self, num_microbatches: object, requested: object = None) -> None:
        """The sequence-packing scheduler packed a step (``requested`` micro-batches per rank,
        fetched) into ``num_microbatches``: the next call must run exactly that many. Raise
        :class:`GuardError` unless it is an integer >= 1."""
        if (
            isinstance(num_microbatches, bool)
            or not isinstance(num_microbatches, int)
            or num_microbatches < 1
        ):
            fetched = (
                f" from {requested} fetched micro-batches per rank" if requested is not None else ""
            )
            raise GuardError(
                f"{SCHEDULER} returned num_microbatches={num_microbatches!r} for a "
                f"step{fetched}; a step runs an "
                "integer number >= 1 of micro-batches, so this step cannot be trained as packed. "
                "Check "
                f"--max-seqlen-per-dp-cp-rank against the samples' lengths, and the data iterator."
            )
        self.scheduled = num_microbatches

    def check_scheduled(self, num_microbatches: int) -> None:
        """Before a forward/backward call: it runs the scheduler's count, if the scheduler ran for
        it."""
        if self.scheduled is not None and num_microbatches != self.scheduled:
            scheduled, self.scheduled = (
                self.scheduled,
                None,
            )  # this call is refused: the count was its
            check_scheduled_count(num_microbatches, scheduled)

    def check(self, num_microbatches: int, calculator: Calculator | None, earlier: int = 0) -> None:
        """After a forward/backward call: every chunk ran ``num_microbatches``, which is the
        scheduler's count for this call where it ran (then consumed), else the calculator's GBS /
        (MBS x DP) (None: an evaluation call, a call that leaves its step open, not known).
        ``earlier``: the micro-batches of this step's earlier calls (a step split over several,
        finalize on the last): the calculator's count is then the calls' sum."""
        scheduled, self.scheduled = self.scheduled, None
        expected = (
            scheduled if scheduled is not None else None if calculator is None else calculator.get()
        )
        if earlier and scheduled is None and expected is not None:
            check_microbatch_counts(self.counts, num_microbatches, None, None)
            check_split_step_count(earlier, num_microbatches, expected)
            return
        check_microbatch_counts(
            self.counts, num_microbatches, expected, None, scheduled=scheduled is not None
        )


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
        """PP as given, else from megatron's parallel state (not yet initialized when Megatron
        builds the calculator, so it is read when a check needs it)."""
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
        require_count(
            "consumed_samples", consumed_samples
        )  # upstream's calculators do not check it
        if not consistency_check and self._consumed is not None and self._batch is not None:
            running, nominal = self._batch
            check_consumed_advance(
                self._consumed,
                consumed_samples,
                running,
                self.pipeline_model_parallel_size,
                nominal,
            )
        self.inner.update(consumed_samples, consistency_check, verbose)
        self._consumed = consumed_samples
        self._batch = (
            self.inner.get_current_running_global_batch_size(),
            self.inner.get_current_global_batch_size(),
        )
