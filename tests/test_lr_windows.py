"""science/core/lr_windows.py: the LR warmup and WSD final decay where the batch must not change,
one computation for ``schedule --suggest`` (explicit flags) and ``--ga-batch-size-warmup auto``
(Megatron's args)."""

import argparse

import pytest

from megatron_ga_ext.science.cli import suggest
from megatron_ga_ext.science.core.lr_windows import Frozen, lr_windows, warmup_samples


def windows(frozen):
    return [(f.start, f.end) for f in frozen]


@pytest.mark.parametrize(
    ("warmup", "decay_end", "final", "expected"),
    [
        (0, None, None, []),
        (100, None, None, [(0, 100)]),
        (0, 1000, 200, [(800, None)]),
        (100, 1000, 200, [(0, 100), (800, None)]),
        (100, 1000, None, [(0, 100)]),  # not WSD: a cosine or linear decay keeps no final window
        (0, 100, 300, [(0, None)]),  # a final decay longer than the decay starts at 0
        (0, None, 300, []),  # no decay end: nothing to count back from
    ],
)
def test_the_windows(warmup, decay_end, final, expected):
    assert windows(lr_windows(warmup=warmup, decay_end=decay_end, final_decay=final)) == expected


def test_the_labels_name_where_a_window_starts_or_ends():
    frozen = lr_windows(warmup=5000, decay_end=200_000, final_decay=60_000)
    assert [f.label for f in frozen] == [
        "the LR warmup (to 5,000 samples)",
        "the WSD final decay (from 140,000 samples)",
    ]
    custom = lr_windows(warmup=5000, warmup_label="warmup to {samples}")
    assert custom[0].label == "warmup to 5000"


def test_a_window_holds_from_its_start_to_before_its_end():
    warmup, final = Frozen(label="w", start=0, end=100), Frozen(label="d", start=800, end=None)
    assert [warmup.holds(c) for c in (0, 99, 100)] == [True, True, False]
    assert [final.holds(c) for c in (799, 800, 10**12)] == [False, True, True]


@pytest.mark.parametrize(
    ("samples", "fraction", "decay_end", "expected"),
    [
        (100, 0.5, 1000, 100),  # --lr-warmup-samples wins
        (0, 0.25, 1000, 250),
        (None, 0.1, 999, 99),  # int(), as the run's args give it
        (None, 0.1, None, 0),
        (None, None, 1000, 0),
    ],
)
def test_the_warmup_length(samples, fraction, decay_end, expected):
    assert warmup_samples(samples, fraction, decay_end) == expected


def suggest_args(**flags):
    values = {"lr_warmup_samples": None, "lr_decay_samples": None, "lr_wsd_decay_samples": None}
    values.update(flags)
    return argparse.Namespace(**values)


def test_suggest_and_the_in_run_warmup_find_the_same_windows():
    """The same lengths through the command's flags and through Megatron's args: the same
    windows."""
    batch_warmup = pytest.importorskip(
        "megatron_ga_ext.science.integration.batch_warmup"
    )  # imports torch
    command = suggest._frozen(
        suggest_args(lr_warmup_samples="5K", lr_decay_samples="200K", lr_wsd_decay_samples="60K")
    )
    run = batch_warmup.frozen_ranges(
        argparse.Namespace(
            lr_warmup_samples=5000,
            lr_decay_samples=200_000,
            lr_wsd_decay_samples=60_000,
            lr_decay_style="WSD",
        )
    )
    assert windows(command) == windows(run) == [(0, 5000), (140_000, None)]
    assert [f.label for f in command] == [
        "the LR warmup (--lr-warmup-samples 5,000)",
        "the final decay (from 140,000 samples)",
    ]
