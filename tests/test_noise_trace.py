"""science/core/noise_trace.py: the trace row the run writes is the row ``schedule --suggest``
reads, through each of its three forms (the JSON Lines file, the log line, the TensorBoard tags)."""

import json

import pytest

from megatron_ga_ext.science.core.noise_trace import (
    SCALARS,
    TraceRow,
    json_line,
    log_line,
    read_log,
    read_trace,
    scalar_tag,
    trace_row,
)


def row(iteration: int, consumed: int | None, samples: float | None = 12.5) -> dict:
    return trace_row(
        iteration=iteration,
        consumed_samples=consumed,
        b_simple_tokens=None if samples is None else samples * 64,
        b_simple_samples=samples,
        tokens_per_sample=64.0,
        grad_sq=0.25,
        trace_sigma=3.5,
        grad_sq_ema=0.5,
        trace_sigma_ema=4.0,
        step_b_simple_tokens=896.0,
        tokens=1024,
        replicas=2,
    )


def test_the_row_has_every_key_in_the_written_order():
    assert list(row(10, 160)) == [
        "iteration",
        "consumed_samples",
        "b_simple_tokens",
        "b_simple_samples",
        "tokens_per_sample",
        "grad_sq",
        "trace_sigma",
        "grad_sq_ema",
        "trace_sigma_ema",
        "step_b_simple_tokens",
        "tokens",
        "replicas",
    ]
    assert set(SCALARS) <= set(row(10, 160))


def test_the_json_lines_file_reads_back():
    rows = [row(10, 160), row(20, 320, None), row(30, 480, 40.0)]
    text = "".join(json_line(r) for r in rows)
    assert text.count("\n") == 3 and json.loads(text.splitlines()[1]) == rows[1]
    assert read_trace(text) == [
        TraceRow(position=1, consumed_samples=160, b_simple_samples=12.5, iteration=10),
        TraceRow(position=2, consumed_samples=320, b_simple_samples=None, iteration=20),
        TraceRow(position=3, consumed_samples=480, b_simple_samples=40.0, iteration=30),
    ]


def test_the_log_line_reads_back():
    lines = [log_line(row(10, 160)), "unrelated line", log_line(row(20, 320, None))]
    assert lines[0].startswith(
        " megatron-ga-ext noise scale | iteration 10 | B_simple (EMA): 8.0000E+02 tokens, "
        "1.2500E+01 samples |"
    )
    assert lines[0].endswith("| consumed samples: 160 |")
    assert read_log(lines) == [
        TraceRow(position=1, consumed_samples=160, b_simple_samples=12.5, iteration=10),
        TraceRow(position=2, consumed_samples=320, b_simple_samples=None, iteration=20),
    ]


def test_a_log_line_without_consumed_samples_takes_megatrons():
    line = log_line(row(10, None))
    assert "consumed samples: n/a |" in line
    megatron = " iteration       10/     100 | consumed samples:          160 | lm loss: 6.3E+00 |"
    assert read_log([megatron, line])[0].consumed_samples == 160


@pytest.mark.parametrize(
    ("name", "tag"),
    [
        ("b_simple_samples", "noise-scale/b-simple-samples"),
        ("consumed_samples", "noise-scale/consumed-samples"),
        ("grad_sq_ema", "noise-scale/grad-sq-ema"),
    ],
)
def test_the_tensorboard_tags(name, tag):
    assert scalar_tag(name) == tag
