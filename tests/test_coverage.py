"""The coverage table (config/coverage/): every refused row stops install() at start-up and is a
problem of ``megatron-ga check``, both naming the flag; every row's test exists; every row's flags
are declared; the limits that apply are notes of ``check``; docs/coverage.md is the table's
rendering."""

from __future__ import annotations

import argparse
import ast
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megatron_ga_ext.cli.main import main
from megatron_ga_ext.config.coverage import ROWS, Setting, verdict
from megatron_ga_ext.config.flags import GA_FLAGS, OPTIONS
from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.core.megatron_flags import COVERED_OPTIONS, MEGATRON_OPTIONS, Option
from megatron_ga_ext.errors import CoverageError
from tools.doc_tables import coverage_doc

ROOT = Path(__file__).resolve().parent.parent
BY_ID = {row.id: row for row in ROWS}
TOKEN = ["--calculate-per-token-loss"]
#: What Megatron's validate_args needs of every FSDP2 and Megatron-FSDP line (launch/rules_fsdp.py).
FSDP2_OK = ["--no-gradient-accumulation-fusion", "--untie-embeddings-and-output-weights"]
MFSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
EP_MOE = [
    "--num-experts",
    "4",
    "--expert-model-parallel-size",
    "2",
    "--moe-token-dispatcher-type",
    "alltoall",
    "--bf16",
]


@dataclass(frozen=True)
class Refusal:
    """A launch a refused row stops: Megatron's flags and the extension's settings."""

    row: str
    flags: list[str]
    ga: dict = field(default_factory=dict)
    spelling: str = ""
    """Another spelling of the same row (a test id of its own)."""

    @property
    def id(self) -> str:
        return self.row + (f"-{self.spelling}" if self.spelling else "")

    def ga_flags(self) -> list[str]:
        """The ``--ga-*`` flags of :attr:`ga` (a switch by its spelling: ``--no-ga-guards`` for
        guards False)."""
        words: list[str] = []
        for name, value in self.ga.items():
            spellings = GA_FLAGS[name].spellings
            words += (
                [spellings[0] if value else spellings[-1]]
                if isinstance(value, bool)
                else [spellings[0], value]
            )
        return words


MICROBATCH = {"loss_reduction": "microbatch"}
SCHEDULE = ["--step-batch-size-schedule", "0:16 4096:32", "--train-samples", "8192"]
REFUSALS = [
    Refusal(
        "full-iteration-graph-token",
        [*TOKEN, "--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad"],
    ),
    Refusal(
        "full-iteration-graph-token",
        [*TOKEN, "--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"],
        spelling="0.16-scope",
    ),
    Refusal(
        "full-iteration-graph-token",
        [*TOKEN, "--enable-cuda-graph", "--cuda-graph-scope", "full_iteration"],
        spelling="enable-cuda-graph",
    ),
    Refusal(
        "full-iteration-graph-token",
        [*TOKEN, "--cuda-graph-modules", "full_iteration"],
        spelling="modules",
    ),
    Refusal(
        "full-iteration-graph-schedule",
        [
            "--cuda-graph-impl",
            "full_iteration",
            "--step-batch-size-schedule",
            "0:16 4096:32",
            "--train-samples",
            "160",
        ],
        MICROBATCH,
    ),
    Refusal(
        "optimizer-graph-skip", [*TOKEN, "--optimizer-cuda-graph"], {"zero_token_policy": "skip"}
    ),
    Refusal("average-in-collective-token", [*TOKEN, "--ddp-average-in-collective"]),
    Refusal("yaml-cfg", [*TOKEN, "--yaml-cfg", "config.yaml"]),
    Refusal("rerun-report-stats", [*TOKEN, "--rerun-mode", "report_stats"]),
    Refusal("gtp", [*TOKEN, "--tensor-parallel-num-weight-shards", "2"]),
    Refusal(
        "gtp",
        [*TOKEN, "--expert-tensor-parallel-num-weight-shards", "2", *EP_MOE],
        spelling="experts",
    ),
    Refusal(
        "rl-context-parallel-token", [*TOKEN, "--perform-rl-step", "--context-parallel-size", "2"]
    ),
    Refusal(
        "override-iteration-schedule", ["--override-ckpt-iteration", "10", *SCHEDULE], MICROBATCH
    ),
    Refusal(
        "override-iteration-schedule",
        ["--freeze-all-layers", *SCHEDULE],
        MICROBATCH,
        spelling="freeze",
    ),
    Refusal(
        "phase-transitions-schedule", ["--phase-transition-iterations", "10", *SCHEDULE], MICROBATCH
    ),
    Refusal(
        "hybrid-context-parallel-schedule",
        [*TOKEN, "--hybrid-context-parallel", *SCHEDULE],
        {"guards": False},
    ),
]


def megatron_parser() -> argparse.ArgumentParser:
    """Megatron's flags as our declarations give them (the slow test below holds them to Megatron's
    parsers)."""
    parser = argparse.ArgumentParser()
    for option in (*MEGATRON_OPTIONS, *COVERED_OPTIONS):
        for spelling in option.spellings:
            parser.add_argument(spelling, dest=option.dest, **_argparse_kwargs(option, spelling))
    return parser


def _argparse_kwargs(option: Option, spelling: str) -> dict:
    if option.type is bool:
        store_false = spelling.startswith("--no-")
        return {"action": "store_false" if store_false else "store_true", "default": option.default}
    return {
        "nargs": None if option.nargs == 1 else option.nargs,
        "type": option.type,
        "default": option.default,
    }


def check(capsys, flags: list[str]) -> tuple[int, dict]:
    """``megatron-ga check --json`` of a launch line with ``flags``: (exit status, report)."""
    line = [
        "torchrun",
        "--nproc-per-node",
        "8",
        "-m",
        "megatron_ga_ext",
        "pretrain_gpt.py",
        "--micro-batch-size",
        "1",
        *flags,
    ]
    if "--step-batch-size-schedule" not in flags:
        line += ["--global-batch-size", "16"]
    status = main(["check", "--json", "--", *line])
    report = json.loads(capsys.readouterr().out)
    report["problems"] = [problem["message"] for problem in report["problems"]]
    report["note_rows"] = [
        note["link"].partition("#")[2] for note in report["notes"] if note["link"]
    ]
    return status, report


# -- every refused row: install() at start-up and check -------------------------------------------


def test_every_refused_row_has_a_refusal_launch():
    refused = {row.id for row in ROWS if row.support == "refused"}
    assert {refusal.row for refusal in REFUSALS} == refused
    assert all(BY_ID[r.row].support == "refused" for r in REFUSALS)
    # the doc names each refusal's test by the row id: the first launch of each row has no other
    # spelling
    assert {r.row for r in REFUSALS if not r.spelling} == refused


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: r.id)
def test_refused_rows_stop_install_and_check(refusal, monkeypatch, capsys):
    row = BY_ID[refusal.row]
    named = f"megatron-ga-ext refuses {re.escape(row.case)}"
    assert row.flags[0] in row.given
    status, report = check(capsys, [*refusal.flags, *refusal.ga_flags()])
    assert status == 1 and [p for p in report["problems"] if re.match(named, p)], report["problems"]
    _install_refuses(refusal, named, monkeypatch)


def _install_refuses(refusal: Refusal, named: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """install() given Megatron's parsed args refuses at once, before anything is patched or built;
    install() without them, at the first forward/backward call, before the schedule runs."""
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    from megatron_ga_ext.config.args import add_args
    from megatron_ga_ext.integration import lifecycle as installing
    from megatron_ga_ext.integration import megatron_lm

    parsed = add_args(megatron_parser()).parse_args([*refusal.flags, *refusal.ga_flags()])
    original = schedules.forward_step_calc_loss
    with pytest.raises(CoverageError, match=named):
        installing.install(parsed)
    assert installing.installed() is None and schedules.forward_step_calc_loss is original

    args = megatron_parser().parse_args(refusal.flags)
    installing.install(GAConfig(**refusal.ga))
    monkeypatch.setattr(
        megatron_lm.MEGATRON_LM, "parsed_args", lambda: args
    )  # where the first step reads get_args()
    try:
        with pytest.raises(CoverageError, match=named):
            schedules.forward_backward_no_pipelining(
                forward_step_func=None,
                data_iterator=None,
                model=[],
                num_microbatches=1,
                seq_length=1,
                micro_batch_size=1,
                forward_only=False,
            )
    finally:
        installing.uninstall()


def test_a_launch_with_several_refusals_names_each():
    flags = [*TOKEN, "--cuda-graph-impl", "full_iteration", "--ddp-average-in-collective"]
    error = verdict(Setting.of(megatron_parser().parse_args(flags), GAConfig())).error()
    assert isinstance(error, CoverageError) and str(error).startswith(
        "2 settings of this launch are refused: (1) "
    )
    assert "--cuda-graph-impl" in str(
        error
    ) and "(2) megatron-ga-ext refuses --ddp-average-in-collective" in str(error)


@pytest.mark.parametrize(
    "flags, ga",
    [
        (
            ["--cuda-graph-impl", "full_iteration"],
            MICROBATCH,
        ),  # limited: constant GBS, microbatch mode
        (
            [
                *TOKEN,
                "--cuda-graph-impl",
                "transformer_engine",
                "--cuda-graph-scope",
                "attn",
                "mlp",
            ],
            {},
        ),
        ([*TOKEN, "--optimizer-cuda-graph"], {"checks": "async"}),
        ([*EP_MOE, "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"], MICROBATCH),
        ([*TOKEN, *EP_MOE, "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"], {}),
        (
            ["--num-experts", "4", "--moe-router-load-balancing-type", "quantile_balancing"],
            MICROBATCH,
        ),
        (
            [
                *TOKEN,
                "--num-experts",
                "4",
                "--moe-router-load-balancing-type",
                "quantile_balancing",
            ],
            {},
        ),
        (
            [
                *TOKEN,
                "--num-experts",
                "4",
                "--moe-router-load-balancing-type",
                "aux_loss",
                "quantile_balancing",
                "--moe-z-loss-coeff",
                "1e-3",
            ],
            {},
        ),
        (["--use-torch-fsdp2", *FSDP2_OK], MICROBATCH),
        # supported: install() makes its units sum (features/torch_fsdp2.py)
        ([*TOKEN, "--use-torch-fsdp2", *FSDP2_OK], {}),
        (
            [*TOKEN, "--hybrid-context-parallel"],
            {"guards": False},
        ),  # a constant global batch: the sampler's
    ],
)
def test_the_same_flags_elsewhere_are_not_refused(flags, ga, capsys):
    """Where the guarantee holds (another mode, another value), the flag is not refused; its limit
    is a note."""
    status, report = check(capsys, [*flags, *Refusal("", [], ga).ga_flags()])
    assert status == 0 and report["problems"] == [], report["problems"]
    assert report["notes"]


# -- the noise scale's refusals: one rule (config/launch_rules.py), named by the rows
# ----------------

#: (the row that says --ga-noise-scale refuses its flag, the launch's flags, the refusal's setting
#: as named).
NOISE_SCALE_REFUSED = [
    ("context-parallel", ["--context-parallel-size", "2"], "--context-parallel-size 2"),
    (
        "hybrid-context-parallel",
        ["--hybrid-context-parallel", "--no-ga-guards"],
        "--hybrid-context-parallel",
    ),
    (
        "gtp",
        ["--tensor-model-parallel-size", "2", "--tensor-parallel-num-weight-shards", "4"],
        "--tensor-parallel-num-weight-shards 4 (above --tensor-model-parallel-size 2)",
    ),
    (
        "distributed-optimizer-instances",
        ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
        "--num-distributed-optimizer-instances 2",
    ),
    *(
        (
            f"megatron-fsdp-{strategy.replace('_', '-')}",
            ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy],
            "--use-megatron-fsdp",
        )
        for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params")
    ),
    ("torch-fsdp2-token", ["--use-torch-fsdp2"], "--use-torch-fsdp2"),
    (
        "fp32-local-accumulation",
        ["--bf16", "--ddp-param-name-patterns-for-fp32-local-accumulation", "all"],
        "--ddp-param-name-patterns-for-fp32-local-accumulation all",
    ),
    ("optimizer-graph", ["--optimizer-cuda-graph"], "--optimizer-cuda-graph"),
    (
        "optimizer-graph",
        [
            "--optimizer-cuda-graph",
            "--ga-batch-size-warmup",
            "auto",
            "--ga-batch-size-warmup-max",
            "64",
            "--train-samples",
            "1024",
        ],
        "--optimizer-cuda-graph",
    ),
]


def test_every_row_that_says_the_noise_scale_refuses_it_has_a_launch():
    said = {row.id for row in ROWS if "--ga-noise-scale refuses" in row.text}
    assert said == {row for row, _, _ in NOISE_SCALE_REFUSED}


@pytest.mark.parametrize(
    "row, flags, setting",
    NOISE_SCALE_REFUSED,
    ids=[f"{c[0]}-{len(c[1])}" for c in NOISE_SCALE_REFUSED],
)
def test_the_noise_scale_refuses_what_its_rows_say_in_install_and_check(
    row, flags, setting, capsys
):
    """``megatron-ga check`` on the launch line and install() on Megatron's parsed args: one
    OptionError, naming the flag and its value; without --ga-noise-scale (the warmup needs it)
    neither refuses it."""
    pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    from megatron_ga_ext.config.args import add_args
    from megatron_ga_ext.errors import OptionError
    from megatron_ga_ext.integration import lifecycle as installing

    named = f"--ga-noise-scale with {setting}: "
    status, report = check(capsys, [*TOKEN, *flags, "--ga-noise-scale", "10"])
    found = [p for p in report["problems"] if p.startswith(named)]
    assert status == 1 and len(found) == 1 and found[0].endswith("."), report["problems"]
    assert found[0].split(": ", 1)[1].count(". Drop --ga-noise-scale, or ") == 1
    if "--ga-batch-size-warmup" not in flags:
        _, report = check(capsys, [*TOKEN, *flags])
        assert not [p for p in report["problems"] if p.startswith("--ga-noise-scale")], report[
            "problems"
        ]
    parsed = add_args(megatron_parser()).parse_args([*TOKEN, *flags, "--ga-noise-scale", "10"])
    parsed.world_size, parsed.global_batch_size = (
        8,
        16,
    )  # as check's line, and Megatron's validate_args leaves them
    parsed.data_parallel_size = 8 // (
        parsed.tensor_model_parallel_size * parsed.context_parallel_size
    )
    with pytest.raises(OptionError) as refused:
        installing.install(parsed)
    assert str(refused.value) == found[0] and installing.installed() is None


# -- limits: the start-up log and check's notes ----------------------------------------------------


def test_limits_are_notes_of_check_and_logged_at_start_up(caplog, capsys):
    from megatron_ga_ext.config.coverage import enforce

    flags = [*TOKEN, "--ddp-bucket-size", "1000", "--iterations-to-skip", "3", "7"]
    status, report = check(capsys, flags)
    rows = report["note_rows"]
    assert status == 0 and {"grad-reduce-buckets", "iterations-to-skip"} <= set(rows), report[
        "notes"
    ]
    with caplog.at_level("INFO", logger="megatron_ga_ext.config.coverage"):
        result = enforce(megatron_parser().parse_args(flags), GAConfig())
    assert {row.id for row in result.limited} <= set(rows) and all(
        note in caplog.text for note in result.notes()
    )


def test_a_launch_without_covered_flags_gets_megatrons_defaults():
    setting = Setting.of(argparse.Namespace(), GAConfig())
    assert [row.id for row in verdict(setting).limited] == []
    assert "rerun-machine-token" in [row.id for row in ROWS if row.applies(setting)]
    assert verdict(Setting.of(None, GAConfig(loss_reduction="microbatch"))).limited == ()


def test_check_reads_multi_value_flags_up_to_the_next_flag(capsys):
    status, report = check(
        capsys, [*TOKEN, "--cuda-graph-scope", "attn", "full_iteration", "--bf16"]
    )
    assert status == 1 and any("--cuda-graph-scope full_iteration" in p for p in report["problems"])
    assert not any("unrecognized arguments" in p for p in report["problems"])


# -- every row: declared flags, and its tests exist ------------------------------------------------


def test_rows_are_unique_and_complete():
    assert len(BY_ID) == len(ROWS)
    for row in ROWS:
        assert row.flags and row.text.endswith("."), row.id
        assert all(flag in OPTIONS for flag in row.flags), (
            row.id,
            row.flags,
        )  # declared, so check reads them
        if row.support == "supported":
            assert row.proofs, f"{row.id}: a supported row names the test that proves it"
        if row.support == "refused":
            assert row.instead and not row.proofs, row.id


def _proofs() -> list:
    return sorted({proof for row in ROWS for proof in row.proofs}, key=str)


@pytest.mark.parametrize("proof", _proofs(), ids=str)
def test_each_rows_test_exists(proof):
    path, _, name = proof.test.partition("::")
    function, _, param = name.partition("[")
    tree = ast.parse((ROOT / path).read_text())
    defs = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert function in defs, f"{proof.test}: no test function {function} in {path}"
    if param:
        assert param[:-1] in _parametrize_ids(defs[function], tree), proof.test
    if proof.case:
        from megatron_ga_ext.verify.layouts import DEFAULT_LAYOUTS

        assert proof.case in {layout.name for layout in DEFAULT_LAYOUTS}, (
            f"{proof}: not a verify layout"
        )


def _parametrize_ids(function: ast.FunctionDef, tree: ast.Module) -> set[str]:
    """The string values of the test's ``pytest.mark.parametrize`` lists (names of the module
    resolved)."""
    assigned = {
        target.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    values: set[str] = set()
    for decorator in function.decorator_list:
        if isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", "") == "parametrize":
            argvalues = decorator.args[1]
            argvalues = assigned.get(getattr(argvalues, "id", ""), argvalues)
            values |= {
                n.value
                for n in ast.walk(argvalues)
                if isinstance(n, ast.Constant) and isinstance(n.value, str)
            }
    return values


# -- docs/coverage.md
# --------------------------------------------------------------------------------


def test_the_committed_doc_is_the_tables_rendering():
    doc = ROOT / "docs" / "coverage.md"
    assert doc.read_text() == coverage_doc(), (
        "docs/coverage.md is not the rendering of config/coverage/: regenerate it with make docs"
    )
    for row in ROWS:
        assert f'| <a id="{row.id}"></a>`{row.id}` |' in doc.read_text()  # check's notes link to it


def test_megatrons_nan_check_off_is_read_from_its_negative_flag(capsys):
    """Megatron's parser has only --no-check-for-nan-in-loss-and-grad (store_false, on by
    default)."""

    def applied(flags: list[str]) -> set[str]:
        setting = Setting.of(megatron_parser().parse_args(flags), GAConfig())
        return {row.id for row in ROWS if row.applies(setting)}

    assert "rerun-machine-token" in applied(TOKEN) and "no-megatron-nan-check-token" not in applied(
        TOKEN
    )
    off = applied([*TOKEN, "--no-check-for-nan-in-loss-and-grad"])
    assert "no-megatron-nan-check-token" in off and "rerun-machine-token" not in off


def test_check_prints_refusals_as_problems_and_limits_as_notes(capsys):
    line = [
        "torchrun",
        "--nproc-per-node",
        "2",
        "-m",
        "megatron_ga_ext",
        "pretrain_gpt.py",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "4",
        *TOKEN,
        "--ddp-average-in-collective",
        "--fp16",
    ]
    assert main(["check", "--", *line]) == 1
    out = capsys.readouterr().out
    notes, problems = out.index(" note(s)"), out.index("1 problem(s):")
    assert notes < problems and "  info: --fp16: " in out[notes:problems]
    assert (
        "  1. megatron-ga-ext refuses --ddp-average-in-collective in token mode: " in out[problems:]
    )


def test_unclassified_lists_the_flags_neither_a_row_nor_the_off_path_list_names():
    """Whether or not a tested parser has it: a flag is classified by a row (any spelling of it) or
    by a reason."""
    from megatron_ga_ext.config.coverage import unclassified

    parser = {
        "--lr",
        "--micro-batch-size",
        "--cuda-graph-impl",
        "--no-rl-use-sequence-packing",
        "--qk-layernorm",
    }
    assert unclassified(parser) == []
    assert unclassified([*parser, "--zz-new-step-path-flag", "--aa-new-flag"]) == [
        "--aa-new-flag",
        "--zz-new-step-path-flag",
    ]


@pytest.mark.parametrize(
    "flags, row",
    [
        (
            [
                *TOKEN,
                "--tensor-parallel-num-weight-shards",
                "2",
                "--tensor-model-parallel-size",
                "2",
            ],
            None,
        ),  # no GTP
        ([*TOKEN, "--qk-layernorm", "--tensor-model-parallel-size", "2"], "qk-layernorm"),
        (
            [*TOKEN, "--qk-layernorm"],
            None,
        ),  # TP 1: each rank holds the whole q/k layernorm gradient
        ([*TOKEN, "--grad-reduce-in-bf16", "--bf16"], "grad-reduce-bf16"),
        (
            [
                *TOKEN,
                "--bf16",
                "--grad-reduce-in-bf16",
                "--ddp-param-name-patterns-for-fp32-local-accumulation",
                "*norm*",
            ],
            "fp32-local-accumulation",
        ),
        (
            [
                *TOKEN,
                "--non-persistent-save-interval",
                "5",
                "--save",
                "ckpt",
                "--save-interval",
                "100",
            ],
            "non-persistent-checkpoints",
        ),
        (
            [*TOKEN, "--sequence-parallel", "--tensor-model-parallel-size", "2"],
            "tensor-parallel",
        ),  # SP: supported
        (
            [*TOKEN, "--num-experts", "4", "--moe-router-enable-expert-bias"],
            None,
        ),  # supported: no note
        ([*TOKEN, "--perform-rl-step"], "rl-step"),
        (
            [*TOKEN, "--override-ckpt-iteration", "10"],
            None,
        ),  # a constant global batch: iteration x GBS is right
        ([*SCHEDULE, "--lr-warmup-samples", "32"], "lr-schedule"),
        ([*TOKEN, "--ddp-num-buckets", "4"], "grad-reduce-buckets"),
        ([*TOKEN, *MFSDP, "--save", "ckpt", "--save-interval", "100"], "megatron-fsdp-checkpoint"),
        (
            [*TOKEN, *MFSDP, "--data-parallel-sharding-strategy", "optim", "--save", "ckpt"],
            "megatron-fsdp-checkpoint",
        ),
        ([*TOKEN, "--optimizer-cuda-graph"], "optimizer-graph-liveness"),
        (
            ["--optimizer-cuda-graph", "--ga-loss-reduction", "microbatch"],
            "optimizer-graph-liveness",
        ),
    ],
)
def test_the_new_rows_limit_or_leave_a_launch_as_their_text_says(flags, row, capsys):
    """The on-path flags a row names: refused nowhere here, a note where the row's limit applies."""
    status, report = check(capsys, flags)
    assert status == 0 and report["problems"] == [], report["problems"]
    if row is not None:
        assert row in report["note_rows"], report["notes"]
    else:
        assert not [
            n for n in report["note_rows"] if n in ("gtp", "qk-layernorm") or "override" in n
        ]


def test_a_refusal_stops_at_the_first_hook_after_megatron_parses_its_args(monkeypatch):
    """install() at the top of pretrain_gpt.py, before Megatron parses its args: the refusal comes
    at the first hook that reads them (Megatron's calculator init in initialize_megatron), before
    any model is built."""
    import sys
    import types

    calculators = pytest.importorskip("megatron.core.num_microbatches_calculator")
    from megatron_ga_ext.config.args import add_args
    from megatron_ga_ext.integration import lifecycle as installing

    training, global_vars = (
        types.ModuleType("megatron.training"),
        types.ModuleType("megatron.training.global_vars"),
    )
    global_vars._GLOBAL_ARGS = None
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    state = installing.install()
    try:
        assert state.waiting_for_args
        global_vars._GLOBAL_ARGS = add_args(megatron_parser()).parse_args(
            [*TOKEN, "--ddp-average-in-collective"]
        )
        with pytest.raises(
            CoverageError,
            match=r"megatron-ga-ext refuses --ddp-average-in-collective in token mode",
        ):
            calculators.init_num_microbatches_calculator(0, None, 16, 2, 4)
    finally:
        installing.uninstall()
        calculators.unset_num_microbatches_calculator()


@pytest.mark.parametrize(
    "flags",
    [
        [*MFSDP, "--data-parallel-sharding-strategy", "no_shard", "--save", "ckpt"],  # saves
        MFSDP,  # no checkpoint saved
        ["--save", "ckpt"],  # Megatron's DDP
    ],
)
def test_the_megatron_fsdp_checkpoint_note_only_where_the_optimizer_state_is_sharded(flags, capsys):
    status, report = check(capsys, [*TOKEN, *flags])
    assert status == 0 and "megatron-fsdp-checkpoint" not in report["note_rows"], report["notes"]
