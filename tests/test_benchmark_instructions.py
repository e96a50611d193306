"""benchmarks/instructions.py's reading of callgrind's dumps and its arithmetic, on dumps whose
answer is known (the counting itself runs under valgrind in the benchmark, not here)."""

import ctypes
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "instructions.py"
_SPEC = importlib.util.spec_from_file_location("instructions", _PATH)
instructions = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(instructions)


def _dump(directory: Path, name: str, trigger: str, total: int, thread: int = 1) -> None:
    """A dump file as callgrind 3.19 writes it with --separate-threads=yes (header, then costs; the
    total on its ``summary:`` line)."""
    (directory / name).write_text(
        "# callgrind format\nversion: 1\ncreator: callgrind-3.19.0\npid: 42\ncmd:  python\npart: "
        "1\n"
        f"thread: {thread}\n\ndesc: I1 cache: \ndesc: Timerange: Basic block 0 - 1000\ndesc: "
        f"Trigger: {trigger}\n\npositions: line\nevents: Ir\nsummary: "
        f"{total}\n\n\ntotals: {total}\n"
    )


def test_dumps_are_read_by_label_main_thread_only_and_the_unlabelled_ones_left_out(tmp_path):
    _dump(tmp_path, "callgrind.42.1-01", "Client Request: 0 upstream 0", 1000)
    _dump(
        tmp_path, "callgrind.42.1-02", "Client Request: 0 upstream 0", 900, thread=2
    )  # a gloo thread's share
    _dump(tmp_path, "callgrind.42.2-01", "Client Request: 0 extension 0", 1100)
    _dump(tmp_path, "callgrind.42-01", "Program termination", 5)
    (tmp_path / "callgrind.43").write_text("")  # a process that never dumped
    (tmp_path / "callgrind_requests.c").write_text(
        "desc: Trigger: Client Request: not a dump\nsummary: 7\n"
    )
    assert instructions.read_dumps(tmp_path) == {"0 upstream 0": 1000, "0 extension 0": 1100}


def test_summary_pairs_each_round_with_its_upstream_and_converts_at_upstreams_rate():
    """Two rounds of 4 steps at GA 4; ranks averaged. Upstream: 10,000 instructions a step in round
    0, 10,100 in round 1 (spread 1.01); the extension adds 400 a step (100 per micro-batch), async
    200. Upstream's CPU time per step is 5 us, so its rate is 10,050 / 5 = 2,010 instructions per us
    and 100 instructions are 0.05 us."""
    steps, ga = 4, 4
    upstream = [10_000, 10_100]
    counts = {}
    for index, base in enumerate(upstream):
        for rank, skew in enumerate((-10, 10)):  # the ranks differ; their mean is what counts
            for variant, extra in (("upstream", 0), ("extension", 400), ("extension_async", 200)):
                counts[f"{rank} {variant} {index}"] = (base + extra + skew) * steps
        counts["0 skip"] = 123  # start-up steps, never counted
    native = {
        "times": {"upstream": [4e-6, 5e-6, 6e-6], "extension": [1.0], "extension_async": [1.0]}
    }
    row = instructions.summarize(ga, "positionwise", counts, native, steps)
    assert row["rounds"] == 2 and row["steps"] == 8
    assert row["instructions_per_step"] == {
        "upstream": 10_050,
        "extension": 10_450,
        "extension_async": 10_250,
    }
    assert row["spread"] == pytest.approx(1.01)
    assert row["ratio_median"]["extension"] == pytest.approx(
        round((10_400 / 10_000 + 10_500 / 10_100) / 2, 5)
    )
    assert row["ratio_min"]["extension"] == pytest.approx(10_500 / 10_100, abs=1e-5)
    assert row["added_instructions_per_microbatch"] == {"extension": 100, "extension_async": 50}
    assert row["upstream_instructions_per_us"] == pytest.approx(2010.0)
    assert row["added_us_per_microbatch"] == {
        "extension": pytest.approx(0.05),
        "extension_async": pytest.approx(0.02),
    }


def test_table_has_a_row_per_model_and_ga():
    row = {
        "model": "positionwise",
        "num_microbatches": 4,
        "instructions_per_step": {"upstream": 10_050},
        "upstream_instructions_per_us": 2010.0,
        "ratio_median": {"extension": 1.04, "extension_async": 1.02},
        "ratio_min": {"extension": 1.03, "extension_async": 1.01},
        "ratio_max": {"extension": 1.05, "extension_async": 1.03},
        "added_instructions_per_microbatch": {"extension": 100, "extension_async": 50},
        "added_us_per_microbatch": {"extension": 21.37, "extension_async": 10.0},
        "spread": 1.01,
    }
    lines = instructions.table([row]).splitlines()
    assert len(lines) == 3
    assert lines[2] == (
        "| position-wise (host-bound) | 4 | 10,050 (2,010) | 1.0400 [1.0300, 1.0500] | 100 | "
        "21.4 | 1.0200 [1.0100, 1.0300] | 50 | 10.0 | 1.0100 |"
    )


@pytest.mark.skipif(
    not (shutil.which("gcc") and Path("/usr/include/valgrind/callgrind.h").exists()),
    reason="needs gcc and valgrind's callgrind.h",
)
def test_the_client_request_helper_builds_and_is_a_no_op_outside_valgrind(tmp_path):
    helper = ctypes.CDLL(str(instructions.build_helper(tmp_path)))
    helper.megatron_ga_start()
    helper.megatron_ga_dump(b"0 upstream 0")
    assert instructions.read_dumps(tmp_path) == {}  # nothing is written outside valgrind


def test_write_records_the_json_and_replaces_only_its_own_table(tmp_path, monkeypatch):
    monkeypatch.setattr(instructions.overhead, "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "performance.md"
    doc.write_text(
        "# P\n<!-- table:overhead -->\nkept\n<!-- /table:overhead -->\n<!-- table:instructions "
        "-->\nold\n<!-- /table:instructions -->\ntail\n"
    )
    env = {
        "date": "2026-12-01T20:00:00+00:00",
        "versions": {"python": "3.12.1", "torch": "2.14.1", "megatron-core": "0.19.2"},
        "layout": "DP 2",
    }
    row = {
        "model": "gpt",
        "num_microbatches": 4,
        "instructions_per_step": {"upstream": 100},
        "upstream_instructions_per_us": 2.0,
        "ratio_median": {"extension": 1.0, "extension_async": 1.0},
        "ratio_min": {"extension": 1.0, "extension_async": 1.0},
        "ratio_max": {"extension": 1.0, "extension_async": 1.0},
        "added_instructions_per_microbatch": {"extension": 0, "extension_async": 0},
        "added_us_per_microbatch": {"extension": 0.0, "extension_async": 0.0},
        "spread": 1.0,
    }
    instructions.write([row], env)
    text = doc.read_text()
    assert (
        "kept" in text
        and "old" not in text
        and text.endswith("<!-- /table:instructions -->\ntail\n")
    )
    assert (
        "Run on 2026-12-01: Python 3.12.1, torch 2.14.1, megatron-core 0.19.2; DP 2, one "
        "intra-op thread." in text
    )
    assert "| tiny GPT | 4 | 100 (2) |" in text
    recorded = json.loads(
        (tmp_path / "benchmarks" / "results" / "instructions-2026-12-01.json").read_text()
    )
    assert recorded["rows"] == [row] and recorded["layout"] == "DP 2"
