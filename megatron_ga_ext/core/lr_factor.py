"""The learning-rate factor of a batch size: what ``--ga-lr-scaling`` multiplies Megatron's rate by,
and what the ``schedule`` table's hints show. Pure Python.

    factor = (GBS / base GBS) ** exponent        none: 0 (always 1.0), sqrt: 1/2 (Adam's rule), linear: 1

The base is the first stage's GBS for ``--ga-lr-scaling``, ``--lr-base-batch-size`` for the table's
hints.
"""

from __future__ import annotations

import math

__all__ = ["EXPONENTS", "lr_factor"]

#: The exponent of each scaling rule, by its ``--ga-lr-scaling`` name.
EXPONENTS = {"none": 0, "sqrt": 0.5, "linear": 1}


def lr_factor(global_batch_size: int, base_global_batch_size: int, lr_scaling: str) -> float:
    """(GBS / base GBS) ** exponent: sqrt 1/2, linear 1, none 0 (always 1.0)."""
    if lr_scaling == "none":
        return 1.0
    ratio = global_batch_size / base_global_batch_size
    return (
        math.sqrt(ratio) if lr_scaling == "sqrt" else ratio
    )  # math.sqrt is correctly rounded, ** 0.5 need not be
