"""Hostile numbers: every command answers any input in under a second and in bounded memory.

Each case runs the command in-process (``megatron-ga``'s own main) and asserts the answer (exit
status and the typed error or the result) and a wall-time bound of 1 s and a peak of 50 MB of Python
allocations.
"""

import json
import time
import tracemalloc

import pytest

BIG = "1" + "0" * 30  # 10**30, the largest size read
HUGE = "9" * 5000  # past Python's own 4300-digit limit for int()
LINE = [
    "torchrun",
    "--nproc_per_node",
    "8",
    "pretrain_gpt.py",
    "--calculate-per-token-loss",
    "--micro-batch-size",
    "1",
    "--seq-length",
    "2048",
]


def answer(cli, *argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``megatron-ga ARGV``, held to 1 s and 50 MB."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        result = cli(*argv)
    finally:
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert seconds < 1.0, f"megatron-ga {' '.join(argv)[:80]} took {seconds:.2f} s"
    assert peak < 50 * 2**20, f"megatron-ga {' '.join(argv)[:80]} allocated {peak / 2**20:.0f} MB"
    return result.status, result.out, result.err


def messages(out: str) -> list[str]:
    """The messages of ``check --json``'s problems."""
    return [problem["message"] for problem in json.loads(out)["problems"]]


def test_gbs_of_1e30_that_does_not_divide(cli):
    status, _, err = answer(
        cli, "ledger", "--world-size", "16", "--micro-batch-size", "3", "--global-batch-size", BIG
    )
    assert status == 2
    assert (
        f"--global-batch-size {BIG} is not a multiple of --micro-batch-size 3 x data-parallel "
        "size 16 = 48" in err
    )
    assert (
        "Nearest valid --global-batch-size: 999999999999999999999999999984, "
        "1000000000000000000000000000032" in err
    )
    assert "or --micro-batch-size in {1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 40, 50, ...}" in err
    status, out, _ = answer(
        cli, "check", "--json", "--", *LINE, "--global-batch-size", str(10**30 - 1)
    )
    assert status == 1
    assert (
        "is not a multiple of --micro-batch-size 1 x data-parallel size 8 = 8" in messages(out)[0]
    )
    status, out, _ = answer(
        cli, "check", "--json", "--", *LINE, "--global-batch-size", str(10**30 + 1)
    )
    assert status == 2 and "is larger than 1e30" in json.loads(out)["error"]


def test_world_of_1e30_that_does_not_divide(cli):
    status, _, err = answer(
        cli,
        "ledger",
        "--world-size",
        BIG,
        "--micro-batch-size",
        "1",
        "--tensor-model-parallel-size",
        "7",
    )
    assert status == 2
    assert (
        "Nearest valid world sizes: 999999999999999999999999999999, 1000000000000000000000000000006"
        in err
    )


def test_rampup_to_a_gbs_of_1e12_is_described(cli):
    status, out, _ = answer(
        cli,
        "schedule",
        "--from-rampup",
        "16",
        "8",
        "300000",
        "--global-batch-size",
        "1T",
        "--micro-batch-size",
        "8",
        "--data-parallel-size",
        "1",
    )
    assert status == 0
    assert (
        "--rampup-batch-size 16 8 300000 --global-batch-size 1T is this step schedule: "
        "124,999,999,999 stages: 0:16 1:24 ... 300K:1000000000000" in out
    )
    status, out, _ = answer(
        cli,
        "schedule",
        "--from-rampup",
        "1",
        "1",
        "1000T",
        "--global-batch-size",
        "1T",
        "--micro-batch-size",
        "1",
        "--data-parallel-size",
        "1",
        "--json",
    )
    assert status == 0 and json.loads(out)["stages_count"] == 10**12
    status, out, _ = answer(
        cli,
        "check",
        "--json",
        "--",
        *LINE,
        "--global-batch-size",
        "1000000000000",
        "--rampup-batch-size",
        "16",
        "8",
        "300000",
    )
    report = json.loads(out)
    assert status == 1 and report["problems"][0]["rule"] == "rampup-ignored"
    assert (
        report["stages"]["summary"].startswith("124,999,999,999 stages")
        and report["stages"]["stages"] is None
    )


def test_a_bad_ramp_of_a_trillion_stages_is_checked_in_closed_form(cli):
    status, _, err = answer(
        cli,
        "schedule",
        "--from-rampup",
        "16",
        "8",
        "300000",
        "--global-batch-size",
        "1T",
        "--micro-batch-size",
        "4",
        "--data-parallel-size",
        "6",
    )
    assert status == 2 and "more problems in later stages" in err


def test_huge_num_experts(cli):
    status, _, err = answer(
        cli,
        "ledger",
        "--world-size",
        "7",
        "--micro-batch-size",
        "1",
        "--num-experts",
        BIG,
        "--expert-model-parallel-size",
        "7",
    )
    assert status == 2
    assert f"--num-experts {BIG} is not divisible by --expert-model-parallel-size 7" in err
    # EP divides the experts and world / (ETP x PP) = 7: only 1 (arguments.py, core_v0.19.0)
    assert "Valid --expert-model-parallel-size: 1." in err


def test_interleaved_ga_near_1e21(cli):
    gbs = str(2 * 10**21 + 2)
    status, _, err = answer(
        cli,
        "ledger",
        "--world-size",
        "8",
        "--micro-batch-size",
        "1",
        "--pipeline-model-parallel-size",
        "4",
        "--num-virtual-stages-per-pipeline-rank",
        "2",
        "--global-batch-size",
        gbs,
    )
    assert status == 2
    assert (
        "Nearest valid --global-batch-size: 2000000000000000000000, 2000000000000000000008" in err
    )


def test_gbs_1e8_with_interleaving(cli):
    status, out, _ = answer(
        cli,
        "ledger",
        "--world-size",
        "8",
        "--micro-batch-size",
        "1",
        "--json",
        "--pipeline-model-parallel-size",
        "4",
        "--num-virtual-stages-per-pipeline-rank",
        "2",
        "--global-batch-size",
        "100000000",
    )
    assert status == 0 and json.loads(out)["num_microbatches"] == 5 * 10**7
    status, _, err = answer(
        cli,
        "ledger",
        "--world-size",
        "8",
        "--micro-batch-size",
        "1",
        "--pipeline-model-parallel-size",
        "4",
        "--num-virtual-stages-per-pipeline-rank",
        "2",
        "--global-batch-size",
        "100000002",
    )
    assert status == 2 and "Nearest valid --global-batch-size: 100000000, 100000008" in err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["ledger", "--world-size", "8", "--micro-batch-size", HUGE], "--micro-batch-size"),
        (["check", "--", *LINE, "--global-batch-size", HUGE], "--global-batch-size"),
        (["check", "--world-size", HUGE, "--", *LINE], "--world-size"),
        (
            [
                "check",
                "--",
                *LINE,
                "--rampup-batch-size",
                "16",
                "8",
                HUGE,
                "--global-batch-size",
                "64",
            ],
            "--rampup-batch-size ramp-up samples",
        ),
        (
            ["schedule", "0:8", "--micro-batch-size", HUGE, "--data-parallel-size", "1"],
            "--micro-batch-size",
        ),
    ],
)
def test_a_5000_digit_number_is_a_typed_error_naming_the_flag(cli, argv, flag):
    status, out, err = answer(cli, *argv)
    text = err + out
    assert status in (1, 2) and "Exceeds the limit" not in text and "Traceback" not in text
    assert (
        f"{flag} value '999999999999...9999' has 5000 characters" in text
        or f"{flag} is 5000 characters long" in text
    )


def test_a_5000_digit_schedule_entry(cli):
    status, _, err = answer(
        cli, "schedule", f"0:8 {HUGE}:16", "--micro-batch-size", "1", "--data-parallel-size", "8"
    )
    assert status == 2
    assert (
        "--step-batch-size-schedule entry 2" in err and "threshold is 5000 characters long" in err
    )


def test_a_pipeline_layout_that_unrolls_without_end(cli):
    status, out, _ = answer(
        cli,
        "check",
        "--json",
        "--",
        *LINE,
        "--pipeline-model-parallel-size",
        "2",
        "--pipeline-model-parallel-layout",
        "E(t|)*1000000000000L",
    )
    assert status == 1
    assert any("unrolls to more than 1,000,000 layers" in p for p in messages(out))


#: Where a count below 1 meets the rules that divide by it (CI's fuzzer found four such crashes).
COUNT_CONTEXTS = (
    [],
    ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--group-query-attention"],
    ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
     "--max-position-embeddings", "2048", "--step-batch-size-schedule", "0:8 100:16",
     "--train-samples", "1000", "--gpu-memory", "80GiB"],
)  # fmt: skip


def test_every_integer_flag_below_1_is_answered_not_a_crash(cli):
    """Each integer flag of Megatron's that check reads, at 0 and -1, in each context: check
    answers (0; 1 with the problems; 2 with a typed usage error, as for a flag of three values given
    one) and raises nothing."""
    from megatron_ga_ext.core.megatron_flags import COVERED_OPTIONS, MEGATRON_OPTIONS, RULE_OPTIONS

    flags = {o.flag for o in (*MEGATRON_OPTIONS, *RULE_OPTIONS, *COVERED_OPTIONS) if o.type is int}
    assert len(flags) > 40
    for flag in sorted(flags):
        for value in ("0", "-1"):
            for context in COUNT_CONTEXTS:
                memory = context[-2:] if context[-2:] == ["--gpu-memory", "80GiB"] else []
                line = [*LINE, *context[: len(context) - len(memory)], flag, value]
                result = cli("check", "--json", *memory, "--", *line)
                assert result.status in (0, 1, 2), (flag, value, context, result.err[-300:])
