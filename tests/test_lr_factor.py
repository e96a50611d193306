"""core/lr_factor.py: (GBS / base GBS) ** exponent, the one factor of ``--ga-lr-scaling`` and the
table's hints."""

import math

import pytest

from megatron_ga_ext.core.lr_factor import EXPONENTS, lr_factor
from megatron_ga_ext.core.schedule.step_schedule import StepSchedule


@pytest.mark.parametrize(("scaling", "expected"), [("none", 1.0), ("sqrt", 2.0), ("linear", 4.0)])
def test_the_factor(scaling, expected):
    assert lr_factor(1024, 256, scaling) == expected
    assert lr_factor(256, 256, scaling) == 1.0


@pytest.mark.parametrize("scaling", sorted(EXPONENTS))
def test_the_factor_is_the_ratio_to_the_exponent(scaling):
    for batch in (96, 512, 3072, 10**6):
        assert lr_factor(batch, 96, scaling) == pytest.approx(
            (batch / 96) ** EXPONENTS[scaling], rel=1e-15
        )


def test_sqrt_is_correctly_rounded():
    assert lr_factor(2, 1, "sqrt") == math.sqrt(2.0)


def test_the_tables_hints_are_lr_times_the_factor():
    rows = StepSchedule.parse("0:96 1000:384 5000:1536").table(4, 8, lr=3e-4, lr_base_batch_size=96)
    for row in rows:
        assert row.lr_linear == 3e-4 * lr_factor(row.global_batch_size, 96, "linear")
        assert row.lr_sqrt == 3e-4 * lr_factor(row.global_batch_size, 96, "sqrt")
    plain = StepSchedule.parse("0:96").table(4, 8)
    assert (plain[0].lr_linear, plain[0].lr_sqrt) == (None, None)
