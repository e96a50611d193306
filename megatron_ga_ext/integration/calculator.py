"""A num-microbatches calculator with Megatron's interface, built on :class:`StepSchedule`.

    global_batch_size = the schedule's GBS at consumed_samples        (O(log stages) per update)
    num_microbatches  = global_batch_size // (micro_batch_size x data_parallel_size)

It is the global calculator on megatron-core 0.16.1 and 0.17 (which have no step schedules), and a
drop-in for upstream's ``StepBatchsizeNumMicroBatchesCalculator`` on 0.18+: same (GBS,
num_microbatches) for every input upstream handles correctly. The difference is when it fails: at
the first ``update`` with ``consistency_check=True`` (start-up, after a checkpoint is loaded) it
validates every remaining stage, so a stage that cannot run fails the launch, not the run days
later. Errors where upstream asserted derive from AssertionError as well as ValueError.

Pure Python: it does not import megatron, so it can be built and tested without it; ``lifecycle.py``
puts an instance behind megatron's ``_GLOBAL_NUM_MICROBATCHES_CALCULATOR``.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_ga_ext.config.launch_rules import decrease_if_needed_error
from megatron_ga_ext.config.resolve import ScheduleInputs, resolve_schedule
from megatron_ga_ext.core.rules import require_positive_int
from megatron_ga_ext.core.schedule.step_schedule import StepSchedule
from megatron_ga_ext.errors import ScheduleError, SizeError
from megatron_ga_ext.integration.compat import live_calculator
from megatron_ga_ext.logs import get_logger

__all__ = ["StepScheduleCalculator"]

logger = get_logger(__name__)


class StepScheduleCalculator:
    """Megatron's calculator interface (``get``, ``update``, ...) over a checked step schedule."""

    def __init__(
        self,
        schedule: StepSchedule,
        micro_batch_size: int | None,
        data_parallel_size: int | None,
        rank: int = 0,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_size: int | None = None,
        *,
        microbatch_group_size_per_vp_stage: int | None = None,
        planned_data_parallel_sizes: Sequence[int] = (),
        strict_future: bool = True,
    ) -> None:
        """Args: schedule: the step schedule (see :meth:`StepSchedule.parse`,
        :meth:`StepSchedule.from_rampup`). micro_batch_size, data_parallel_size: MBS and DP; one
        step consumes MBS x DP x num_microbatches. Each
            is checked here: a size Megatron's call leaves out (None) is refused with a SizeError.
        rank: only rank 0 logs. pipeline_model_parallel_size, virtual_pipeline_size,
        microbatch_group_size_per_vp_stage: checked
            against the interleaved schedule's rule for every stage at the first checked update.
        planned_data_parallel_sizes, strict_future: see :meth:`StepSchedule.validate`.
        """
        self.step_schedule = schedule
        # Upstream asserts micro_batch_times_data_parallel_size > 0: ScheduleError is an
        # AssertionError too.
        self.micro_batch_size = require_positive_int(
            "--micro-batch-size", micro_batch_size, below_one=ScheduleError
        )
        self.data_parallel_size = require_positive_int(
            "--data-parallel-size", data_parallel_size, below_one=ScheduleError
        )
        self.rank = rank
        self.pipeline_model_parallel_size = pipeline_model_parallel_size
        self.virtual_pipeline_size = virtual_pipeline_size
        self.microbatch_group_size_per_vp_stage = microbatch_group_size_per_vp_stage
        self.planned_data_parallel_sizes = tuple(planned_data_parallel_sizes)
        self.strict_future = strict_future
        self.micro_batch_times_data_parallel_size = self.micro_batch_size * self.data_parallel_size
        self.decrease_batch_size_if_needed = (
            False  # a step schedule fixes each batch size (upstream refuses it too)
        )
        # Upstream's public attributes, with the same meaning.
        self.schedule: Sequence[tuple[int, int]] = (
            schedule.stages
        )  # computed when read (a long ramp)
        self.seq_length: int | None = schedule.seq_length
        self.global_batch_size: int = schedule.final_global_batch_size
        self.num_micro_batches: int | None = None
        self.current_global_batch_size: int | None = None
        self.current_running_global_batch_size: int | None = None
        self.validated_from: int | None = None
        """Consumed samples at which every remaining stage was validated (the first checked
        update)."""
        self._checked_from: int | None = None
        self._last_checked: int | None = None
        self._demoted = False
        """Some later stage was only warned about (strict_future=False): each new stage in force is
        checked."""
        if rank == 0:
            logger.info("step batch-size schedule %s (%d stages)", schedule, schedule.num_stages)
        self.update(0, consistency_check=False, verbose=True)

    # -- construction from Megatron's arguments ------------------------------------------------

    @classmethod
    def from_megatron(
        cls,
        micro_batch_size: int,
        data_parallel_size: int,
        decrease_batch_size_if_needed: bool,
        rank: int,
        schedule: str,
        seq_length: int | None = None,
    ) -> StepScheduleCalculator:
        """The constructor signature of upstream's ``StepBatchsizeNumMicroBatchesCalculator``
        (0.18+)."""
        if decrease_batch_size_if_needed:
            raise decrease_if_needed_error()
        return cls(
            StepSchedule.parse(schedule, seq_length), micro_batch_size, data_parallel_size, rank
        )

    @classmethod
    def build(
        cls,
        rank: int,
        rampup_batch_size: Sequence[int | str] | None = None,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        data_parallel_size: int | None = None,
        decrease_batch_size_if_needed: bool = False,
        step_batch_size_schedule: str | None = None,
        seq_length: int | None = None,
        **layout: object,
    ) -> StepScheduleCalculator:
        """The arguments of ``init_num_microbatches_calculator`` (any megatron-core release).

        The schedule is :func:`~megatron_ga_ext.config.resolve.resolve_schedule`'s, with a given
        rampup converted (upstream 0.18+ drops it silently); without either, the constant
        ``global_batch_size``. ``layout`` passes pipeline/interleave/rescale keywords to the
        constructor.
        """
        if decrease_batch_size_if_needed:
            # this calculator runs a step schedule, even a constant one
            raise decrease_if_needed_error()
        schedule = resolve_schedule(
            ScheduleInputs(
                step_batch_size_schedule=step_batch_size_schedule,
                rampup_batch_size=rampup_batch_size,
                global_batch_size=global_batch_size,
                seq_length=seq_length,
                convert_rampup=True,
            )
        )
        if schedule is None:
            schedule = StepSchedule.constant(_need_gbs(global_batch_size))
        return cls(schedule, micro_batch_size, data_parallel_size, rank, **layout)  # type: ignore[arg-type]

    @classmethod
    def for_launch(
        cls, schedule: StepSchedule, inputs: ScheduleInputs, rank: int = 0
    ) -> StepScheduleCalculator:
        """The calculator of a resolved schedule, checked against the same layout as ``megatron-ga
        check`` (MBS, DP, PP, VPP and N of ``inputs``, as ``inputs.layout()`` gives them to
        ``check``)."""
        return cls(
            schedule,
            inputs.micro_batch_size,
            inputs.data_parallel_size,
            rank,
            pipeline_model_parallel_size=inputs.pipeline_model_parallel_size,
            virtual_pipeline_size=inputs.virtual_pipeline_model_parallel_size,
            microbatch_group_size_per_vp_stage=inputs.microbatch_group_size_per_vp_stage,
        )

    # -- Megatron's interface ------------------------------------------------------------------

    def get(self) -> int:
        """Number of micro-batches per step: GBS // (MBS x DP)."""
        return _present(self.num_micro_batches, "num_micro_batches")

    def get_current_global_batch_size(self) -> int:
        """The schedule's GBS at the last update."""
        return _present(self.current_global_batch_size, "current_global_batch_size")

    def get_micro_batch_size(self) -> int:
        """MBS."""
        return self.micro_batch_size

    def get_current_running_global_batch_size(self) -> int:
        """Equal to the current GBS: a step schedule never decreases the batch to fit DP."""
        return _present(self.current_running_global_batch_size, "current_running_global_batch_size")

    def update(self, consumed_samples: int, consistency_check: bool, verbose: bool = False) -> None:
        """Move to the stage in force at ``consumed_samples``; O(log stages).

        With ``consistency_check``: the first such call validates every stage from the current one
        on (:meth:`StepSchedule.validate`), so later ones return at once, unless stages were only
        warned about (``strict_future=False``): then each new stage in force is checked alone, and
        raises if it breaks a rule. Without it, num_microbatches is floored as upstream does.
        """
        index = self.step_schedule.stage_index_at(consumed_samples)
        batch = self.step_schedule.entries[index].global_batch_size
        if consistency_check:
            self._check(consumed_samples, index)
        if verbose and self.rank == 0 and batch != self.current_global_batch_size:
            logger.info(
                "global batch size %s -> %d at %d consumed samples (%d micro-batches)",
                self.current_global_batch_size,
                batch,
                consumed_samples,
                batch // self.micro_batch_times_data_parallel_size,
            )
        self.current_global_batch_size = batch
        self.current_running_global_batch_size = batch
        self.num_micro_batches = batch // self.micro_batch_times_data_parallel_size

    def extend(self, threshold_samples: int, global_batch_size: int) -> None:
        """A stage added during the run (``--ga-batch-size-warmup auto``): ``global_batch_size``
        from ``threshold_samples`` on, after every stage (StepSchedule checks the order); every
        stage from the one in force on is validated again at the next checked update."""
        self.step_schedule = StepSchedule.from_stages(
            [*self.step_schedule.stages, (threshold_samples, global_batch_size)]
        )
        self.schedule = self.step_schedule.stages
        self.global_batch_size = self.step_schedule.final_global_batch_size
        self._checked_from = None

    def plan(self, train_samples: int) -> tuple[int, int]:
        """(iterations, samples) a run of ``--train-samples`` takes from 0: one more step while
        consumed < train_samples, each step consuming MBS x DP x num_microbatches
        (StepSchedule.run_totals: the stages the run uses, each in closed form, so a long ramp works
        too)."""
        return self.step_schedule.run_totals(
            self.micro_batch_size, self.data_parallel_size, train_samples
        )

    def _check(self, consumed_samples: int, index: int) -> None:
        """Validate every remaining stage once; afterwards O(1): when some stage was only warned
        about, each new stage in force is checked alone against today's layout; a stage before the
        validated one is validated again from there."""
        if self._checked_from is not None and index >= self._checked_from:
            if self._demoted and index != self._last_checked:
                error = self.step_schedule.stage_error(
                    index,
                    self.micro_batch_size,
                    self.data_parallel_size,
                    self.pipeline_model_parallel_size,
                    self.virtual_pipeline_size,
                    self.microbatch_group_size_per_vp_stage,
                )
                if error is not None:
                    raise error
                self._last_checked = index
            return
        demoted = self.step_schedule.validate(
            self.micro_batch_size,
            self.data_parallel_size,
            self.pipeline_model_parallel_size,
            self.virtual_pipeline_size,
            consumed_samples,
            self.planned_data_parallel_sizes,
            microbatch_group_size_per_vp_stage=self.microbatch_group_size_per_vp_stage,
            strict_future=self.strict_future,
        )
        self._checked_from = self._last_checked = index
        self._demoted = bool(demoted)
        if self.validated_from is None:
            self.validated_from = consumed_samples


def live_step_calculator() -> StepScheduleCalculator | None:
    """The live calculator if it is the extension's step-schedule calculator (under the guard), else
    None."""
    live = live_calculator()
    live = getattr(live, "inner", live)
    return live if isinstance(live, StepScheduleCalculator) else None


def _present(value: int | None, name: str) -> int:
    if value is None:
        raise ScheduleError(f"{name} is not set: call update() first.")
    return value


def _need_gbs(global_batch_size: int | None) -> int:
    if global_batch_size is None:
        raise SizeError(
            "--global-batch-size is required without --step-batch-size-schedule; give the target "
            "GBS."
        )
    return global_batch_size
