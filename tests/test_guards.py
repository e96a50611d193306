"""The run-time guards: micro-batch counts per chunk and consumed samples per step."""

import pytest

from megatron_ga_ext.errors import GuardError
from megatron_ga_ext.integration.guards import (
    GuardedCalculator,
    MicrobatchCounter,
    check_consumed_advance,
    check_microbatch_counts,
    check_split_step_count,
)


def counts(*per_chunk: int) -> dict:
    counter = MicrobatchCounter()
    for n in per_chunk:
        chunk = object()
        for _ in range(n):
            counter.count(chunk)
    return counter.counts


def test_right_counts_pass():
    check_microbatch_counts(
        counts(8, 8), num_microbatches=8, expected=8, pipeline_model_parallel_size=4
    )
    check_microbatch_counts(counts(3), num_microbatches=3, expected=None)


def test_pp_multiplied_num_microbatches_is_named():
    with pytest.raises(
        GuardError,
        match=r"num_microbatches=32, but the calculator's num_microbatches = GBS / "
        r"\(MBS x DP\) is 8\. 32 = 8 x PP 4: pipeline parallelism never multiplies the global "
        r"batch size",
    ):
        check_microbatch_counts(
            counts(32), num_microbatches=32, expected=8, pipeline_model_parallel_size=4
        )


def test_a_chunk_that_ran_too_many_steps_is_named():
    with pytest.raises(
        GuardError, match=r"\(chunk 0: 4, chunk 1: 8\) instead of num_microbatches=4.*8 = 4 x PP 2"
    ):
        check_microbatch_counts(
            counts(4, 8), num_microbatches=4, expected=4, pipeline_model_parallel_size=2
        )
    with pytest.raises(GuardError, match=r"\(none\) instead of num_microbatches=4"):
        check_microbatch_counts({}, num_microbatches=4, expected=4)


class _Calculator:
    def get(self) -> int:
        return 4


def test_a_step_split_over_calls_runs_the_calculators_count_in_all():
    counter = MicrobatchCounter()
    counter.counts = counts(2)
    counter.check(2, _Calculator(), earlier=2)  # 2 + 2 = 4
    check_split_step_count(1, 3, 4)
    counter.counts = counts(1)
    with pytest.raises(
        GuardError,
        match=r"^this step's forward_backward_func calls ran 2 \+ 1 = 3 micro-batches "
        r"\(a step split over several calls, finalize on the last\), but the calculator's "
        r"num_microbatches = GBS / \(MBS x DP\) is 4\.",
    ):
        counter.check(1, _Calculator(), earlier=2)
    counter.counts = counts(3)
    with pytest.raises(GuardError, match=r"\(chunk 0: 3\) instead of num_microbatches=2"):
        counter.check(2, _Calculator(), earlier=2)  # each call's own count still holds per chunk


def test_fewer_micro_batches_than_the_calculators_say_how_a_step_is_split():
    with pytest.raises(
        GuardError,
        match=r"is 4\. Where a step is split over several forward_backward_func calls, only "
        r"its last call may run finalize_model_grads .* add up to 4\. Pass num_microbatches=",
    ):
        check_microbatch_counts(counts(2), num_microbatches=2, expected=4)


def test_consumed_samples_advance():
    check_consumed_advance(100, 100, 64)  # the checked update of the same step
    check_consumed_advance(100, 164, 64)
    check_consumed_advance(1000, 0, 64)  # train-iters simulation resets to 0
    with pytest.raises(
        GuardError,
        match=r"from 0 to 256 \(\+256\).*running global batch size 64.*"
        r"256 = 64 x PP 4: pipeline parallelism never multiplies",
    ):
        check_consumed_advance(0, 256, 64, pipeline_model_parallel_size=4)
    with pytest.raises(GuardError, match=r"\(\+65\)"):
        check_consumed_advance(0, 65, 64)


def test_guarded_calculator_around_upstream_constant_calculator():
    calculators = pytest.importorskip("megatron.core.num_microbatches_calculator")
    inner = calculators.ConstantNumMicroBatchesCalculator(64, 4, 4, False, 0)
    guarded = GuardedCalculator(inner, pipeline_model_parallel_size=2)
    assert (
        guarded.get(),
        guarded.get_current_global_batch_size(),
        guarded.get_micro_batch_size(),
    ) == (4, 64, 4)
    guarded.update(0, True)  # checkpoint load / start
    for step in range(1, 4):  # the training loop: unchecked then checked, +GBS per step
        guarded.update(64 * step, False)
        guarded.update(64 * step, True)
    with pytest.raises(GuardError, match=r"\+128\).*128 = 64 x PP 2"):
        guarded.update(64 * 3 + 128, False)
    assert guarded.num_micro_batches == 4  # other attributes reach the inner calculator
