"""``BatchSizeWarmup.restore`` (science/integration/batch_warmup.py): a resume whose
--ga-batch-size-warmup-max is below the batch the checkpoint's warmup reached is refused at load,
naming the flag, the restored batch and the fix (not in the optimizer step, naming the CLI's
--max-global-batch-size)."""

import pytest

from megatron_ga_ext import GAConfig
from megatron_ga_ext.core.schedule.step_schedule import StepSchedule
from megatron_ga_ext.errors import OptionError
from megatron_ga_ext.integration.calculator import StepScheduleCalculator
from megatron_ga_ext.science.integration.batch_warmup import BatchSizeWarmup

STAGES = [[0, 8], [16, 16], [48, 32]]


def warmup(cap: int) -> BatchSizeWarmup:
    return BatchSizeWarmup(
        GAConfig(noise_scale=1, batch_size_warmup="auto", batch_size_warmup_max=cap)
    )


def calculator() -> StepScheduleCalculator:
    return StepScheduleCalculator(StepSchedule.constant(8), 1, 2)  # MBS 1 x DP 2


def test_a_cap_below_the_restored_batch_is_refused_at_load():
    live = calculator()
    with pytest.raises(
        OptionError,
        match=r"^--ga-batch-size-warmup-max 16 is below the global batch size 32 the "
        r"checkpoint's batch-size warmup reached \(from sample 48\); .* Resume "
        r"with --ga-batch-size-warmup-max 32 or more\.$",
    ):
        warmup(16).restore(STAGES, live)
    assert list(live.step_schedule.stages) == [(0, 8)]  # nothing restored


@pytest.mark.parametrize("cap", [32, 64])
def test_a_cap_at_or_above_the_restored_batch_restores(cap):
    live = calculator()
    warmup(cap).restore(STAGES, live)
    assert list(live.step_schedule.stages) == [tuple(stage) for stage in STAGES]
