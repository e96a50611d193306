"""Real text through Megatron's own data path: pretrain_gpt.py (through the drop-in entry, DP 2,
token mode) reads benchmarks/corpus.py's indexed dataset with ``--data-path`` and ``--split``
instead of ``--mock-data``, with ``--eod-mask-loss``, trains and validates on it.

Checked on the newest release and main commit: the run trains its iterations at its GBS, Megatron
evaluates the validation split at every ``--eval-interval``, and the first loss is that of an
untrained model over the corpus's 257 ids (ln 257 = 5.55, within 0.5), the vocabulary the tokenizer
flags set.
"""

from __future__ import annotations

import math
import re

import pytest

from benchmarks import corpus
from tests.e2e.test_pretrain_gpt import TOKEN

pytestmark = pytest.mark.e2e

ITERATIONS = 6
EVAL_INTERVAL = 3


def test_pretrain_gpt_trains_and_validates_on_the_corpus(launches, newest_source):
    cache = launches.workdir / newest_source.name / "dp2" / "corpus-index-cache"
    run = launches.get(
        newest_source,
        "dp2",
        "real-text",
        [
            *TOKEN,
            "--global-batch-size",
            "16",
            "--train-iters",
            str(ITERATIONS),
            "--eval-interval",
            str(EVAL_INTERVAL),
            "--eval-iters",
            "2",
            "--data-cache-path",
            str(cache),
            *corpus.data_flags(newest_source),
        ],
    )
    assert run.rc == 0 and run.error is None, run.describe()
    rows = run.iterations
    assert [r["iteration"] for r in rows] == list(range(1, ITERATIONS + 1)), rows
    assert {r["global_batch_size"] for r in rows} == {16}, rows
    validated = sorted(
        {int(i) for i in re.findall(r"validation loss at iteration\s+(\d+)", run.output)}
    )
    assert validated == list(range(EVAL_INTERVAL, ITERATIONS + 1, EVAL_INTERVAL)), run.describe()
    assert abs(rows[0]["loss"]["lm loss"] - math.log(corpus.EOD + 1)) < 0.5, rows[0]
