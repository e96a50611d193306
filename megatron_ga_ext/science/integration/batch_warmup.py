"""``--ga-batch-size-warmup auto``: the doubling rule (science/core/suggest.py) applied in the run.

After each measured step (``--ga-noise-scale K``), with B_simple in samples the lesser of the EMA's
and the ratio of medians over the last ROBUST_WINDOW measurements (science/core/noise_window.py: one
outlying step moves each median by one order statistic, so a spike alone never doubles the batch;
the window is not checkpointed and refills after a resume) and C the samples consumed once the step
is done:

    if trust x B_simple >= 2 x GBS, 2 x GBS <= --ga-batch-size-warmup-max, and C is outside the LR
    warmup and a WSD
    final decay:  the step schedule gets the stage C:2 x GBS (GBS doubles from the next step)

The run starts as the constant schedule ``0:--global-batch-size`` on the extension's step-schedule
calculator; a stage added is validated as any schedule's (MBS x DP divides it, the interleaved
rule), the loop's run length (``args.train_iters``, Megatron-Bridge's ``train.train_iters``) becomes
the steps the schedule now plans for ``--train-samples``, and the schedule so far is logged as the
``--step-batch-size-schedule`` string that replays it. The stages are kept in the checkpoint's
sidecar (sidecar.py, through batch_schedule.py) and restored on resume, so the resumed run trains
the decisions taken before the checkpoint and takes the later ones from the same measurements. The
LR windows are science/core/lr_windows.py's, as for ``--suggest``.
"""

from __future__ import annotations

import argparse
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_ga_ext.config.flags import BATCH_SIZE_WARMUP_MAX
from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.config.megatron_args import MegatronArgs
from megatron_ga_ext.core.schedule.step_schedule import StepSchedule
from megatron_ga_ext.errors import OptionError, ScheduleError
from megatron_ga_ext.integration.host import current_host
from megatron_ga_ext.logs import get_logger
from megatron_ga_ext.science.core.lr_windows import Frozen, lr_windows, warmup_samples
from megatron_ga_ext.science.core.noise_trace import TraceRow
from megatron_ga_ext.science.core.noise_window import median_b_simple, step_parts
from megatron_ga_ext.science.core.suggest import DoublingRule, suggest_schedule

__all__ = ["BatchSizeWarmup", "frozen_ranges"]

logger = get_logger(__name__)

#: The measurements the doubling statistic's medians span (module docstring).
ROBUST_WINDOW = 8


class BatchSizeWarmup:
    """The decisions of the adaptive warmup; see the module docstring. Made by install() where it is
    on.

    Attributes:
        decisions: the stages it added, as (iteration, consumed samples, GBS).
    """

    def __init__(self, config: GAConfig) -> None:
        self.trust = config.batch_size_warmup_trust
        cap = config.batch_size_warmup_max
        if cap is None:  # the rule pass refuses it first, naming the launch
            raise OptionError(
                f"--ga-batch-size-warmup auto needs {BATCH_SIZE_WARMUP_MAX.flag}: give the "
                "largest global batch size the warmup may reach."
            )
        self.cap: int = cap
        self.decisions: list[tuple[int | None, int, int]] = []
        self._held: str | None = None
        self._recent: deque[Mapping[str, Any]] = deque(maxlen=ROBUST_WINDOW)

    def decide(self, row: Mapping[str, Any], calculator: Any) -> bool:
        """After a measured step (``row``: its trace row, science/core/noise_trace.py): add the
        stage the rule calls for to ``calculator`` (the live StepScheduleCalculator); True where it
        did."""
        if calculator is None:
            raise ScheduleError(
                "--ga-batch-size-warmup auto needs the extension's step-schedule calculator, "
                "which install() puts in force when Megatron builds its num-microbatches "
                "calculator (or adopts from the one Megatron built): none is live. A "
                "megatron-core loop builds one with init_num_microbatches_calculator()."
            )
        consumed, estimate = row.get("consumed_samples"), self._estimate(row)
        if consumed is None or estimate is None:
            return False
        settings = current_host().settings()
        batch = calculator.step_schedule.final_global_batch_size
        rule = DoublingRule(
            micro_batch_size=calculator.micro_batch_size,
            data_parallel_size=calculator.data_parallel_size,
            max_global_batch_size=self.cap,
            initial_global_batch_size=batch,
            trust=self.trust,
            frozen=frozen_ranges(settings),
        )
        trace = [
            TraceRow(
                position=1,
                consumed_samples=consumed,
                b_simple_samples=estimate,
                iteration=row.get("iteration"),
            )
        ]
        suggestion = suggest_schedule(trace, rule)
        for held in suggestion.held:
            reason = (
                f"the cap {BATCH_SIZE_WARMUP_MAX.flag} {self.cap}"
                if held.reason.startswith("the cap")
                else held.reason
            )
            if reason != self._held:  # once per reason, not at every measured step
                logger.info(
                    "megatron-ga-ext batch-size warmup: iteration %s: %.4g x B_simple %.4g "
                    "samples >= 2 x GBS %d, held by %s",
                    row.get("iteration"),
                    self.trust,
                    estimate,
                    batch,
                    reason,
                )
            self._held = reason
        if not suggestion.decisions:
            return False
        calculator.extend(consumed, 2 * batch)
        self.decisions.append((row.get("iteration"), consumed, 2 * batch))
        _replan(calculator, settings)
        logger.warning(
            "megatron-ga-ext batch-size warmup: iteration %s: %.4g x B_simple %.4g samples >= 2 "
            "x GBS %d: GBS %d from "
            '%d consumed samples; the run\'s schedule so far: --step-batch-size-schedule "%s"',
            row.get("iteration"),
            self.trust,
            estimate,
            batch,
            2 * batch,
            consumed,
            _schedule_string(calculator.step_schedule, settings),
        )
        return True

    def _estimate(self, row: Mapping[str, Any]) -> float | None:
        """B_simple (samples) the rule doubles on: the EMA's, at most the median ratio of the recent
        steps (module docstring); the EMA's alone for a row without its step's parts."""
        ema = row.get("b_simple_samples")
        if step_parts(row) is None:
            return ema
        self._recent.append(row)
        robust = median_b_simple(list(self._recent))
        return None if ema is None or robust is None else min(ema, robust)

    @staticmethod
    def stages(calculator: Any) -> list[list[int]]:
        """The schedule so far, for the checkpoint: ``[[threshold_samples, GBS], ...]``."""
        return [[threshold, batch] for threshold, batch in calculator.step_schedule.stages]

    def restore(self, stages: Sequence[Sequence[int]], calculator: Any) -> None:
        """On resume: the stages saved with the checkpoint, from the same first stage (the same
        ``--global-batch-size``) and within this run's cap, replace the calculator's; the run length
        follows."""
        schedule = StepSchedule.from_stages([(int(t), int(b)) for t, b in stages])
        self._check_cap(schedule)
        first = calculator.step_schedule.stages[0]
        if tuple(schedule.stages[0]) != tuple(first):
            raise ScheduleError(
                f"the checkpoint's batch-size warmup starts at {schedule.stages[0][1]} from "
                "sample 0, this run's "
                f"--global-batch-size gives {first[1]}: resume with the --global-batch-size the "
                "run started with."
            )
        for threshold, batch in schedule.stages[1:]:
            calculator.extend(threshold, batch)
        settings = current_host().settings()
        _replan(calculator, settings)
        logger.info(
            'megatron-ga-ext batch-size warmup: resumed with --step-batch-size-schedule "%s"',
            _schedule_string(calculator.step_schedule, settings),
        )

    def _check_cap(self, schedule: StepSchedule) -> None:
        """The restored stages must fit under --ga-batch-size-warmup-max: a run cannot shrink a
        batch it has trained (the dataset, and Megatron's own checks, are sized for the cap). Raises
        OptionError."""
        batch = max(b for _, b in schedule.stages)
        if batch <= self.cap:
            return
        threshold = next(t for t, b in schedule.stages if b == batch)
        raise OptionError(
            f"{BATCH_SIZE_WARMUP_MAX.flag} {self.cap} is below the global batch size {batch} the "
            "checkpoint's "
            f"batch-size warmup reached (from sample {threshold}); the warmup never shrinks the "
            "batch, and this run's dataset and micro-batch checks are sized for the cap. Resume "
            "with "
            f"{BATCH_SIZE_WARMUP_MAX.flag} {batch} or more."
        )


def frozen_ranges(args: argparse.Namespace | MegatronArgs | None) -> tuple[Frozen, ...]:
    """Consumed samples where the batch must not change (science/core/lr_windows.py): the LR warmup
    (``--lr-warmup-samples``, or ``--lr-warmup-fraction`` of the decay), and a WSD schedule's final
    decay (``--lr-wsd-decay-samples`` before the end of ``--lr-decay-samples``, else of
    ``--train-samples``)."""
    if args is None:
        return ()
    view = MegatronArgs.of(args)
    decay_end = view.lr_decay_samples or view.train_samples
    warmup = warmup_samples(view.lr_warmup_samples, view.lr_warmup_fraction, decay_end)
    wsd = view.lr_decay_style == "WSD"
    return lr_windows(
        warmup=warmup, decay_end=decay_end, final_decay=view.lr_wsd_decay_samples if wsd else None
    )


def _replan(calculator: Any, settings: MegatronArgs) -> None:
    """The loop's run length (``args.train_iters``, Bridge's ``train.train_iters``; read at every
    iteration): the steps the schedule now plans for ``--train-samples``."""
    if settings.train_samples:
        current_host().set_train_iters(calculator.plan(settings.train_samples)[0])


def _schedule_string(schedule: StepSchedule, settings: MegatronArgs) -> str:
    """As pretrain_gpt.py reads it: thresholds in tokens where ``--seq-length`` is set."""
    return schedule.to_string(settings.seq_length)
