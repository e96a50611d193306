"""The oracle tier (make oracle): megatron-ga check's verdict and numbers on every line of
corpus.jsonl held to Megatron-LM's own parse_args + validate_args + num-microbatches calculator +
TransformerConfig, run from the snapshots of core_v0.19.0 and main d98e8a64
(megatron_ga_ext/oracle/), except check's deliberate additions (its rule registry: rules marked
``ours`` and ADDITIONS). Lines where check is still wrong are listed in known.toml (strict xfails).
Every disagreement is also written to $MEGATRON_GA_ORACLE_REPORT (default
/tmp/oracle/disagreements.txt), one block per line.
"""

from __future__ import annotations

import json
import os
import shlex
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_ga_ext.oracle.agreement import (
    check_verdict,
    deliberate_rules,
    disagreements,
    report_block,
)
from megatron_ga_ext.oracle.runner import megatron_argv, run_upstream
from tools import regress

pytestmark = pytest.mark.oracle

HERE = Path(__file__).parent
CORPUS = [json.loads(line) for line in (HERE / "corpus.jsonl").read_text().splitlines()]
KNOWN = tomllib.loads((HERE / "known.toml").read_text())
#: The sources the tier runs: a release and main (MANIFEST.tsv of the snapshots).
SOURCES = {"core_v0.19.0": "core_v0.19.0", "d98e8a64": "d98e8a64ddf3"}
REPORT = Path(os.environ.get("MEGATRON_GA_ORACLE_REPORT", "/tmp/oracle/disagreements.txt"))


def _tree(ref: str) -> Path:
    tarball = regress.snapshot_dir() / f"megatron-lm-{ref}.tar.gz"
    if not tarball.exists():
        pytest.fail(
            f"no snapshot {tarball}: make oracle needs MEGATRON_LM_SNAPSHOTS (default "
            "../shared/upstream)"
        )
    return regress.tree(tarball)


@pytest.fixture(scope="module")
def verdicts():
    """{id: (check's verdict, {source: upstream's verdict}, what differs)}; the report file
    written."""
    lines = [(megatron_argv(shlex.split(row["line"])), row["world"]) for row in CORPUS]
    trees = {name: _tree(ref) for name, ref in SOURCES.items()}
    with ThreadPoolExecutor(len(trees)) as pool:
        upstream = dict(
            zip(trees, pool.map(lambda tree: run_upstream(tree, lines), trees.values()))
        )
    deliberate = deliberate_rules()
    found, blocks, agree = {}, [], dict.fromkeys(upstream, 0)
    for i, row in enumerate(CORPUS):
        check = check_verdict(shlex.split(row["line"]))
        theirs = {name: answers[i] for name, answers in upstream.items()}
        differs = []
        for name, verdict in theirs.items():
            said = disagreements(check, verdict, row["world"], deliberate)
            agree[name] += not said
            differs += [f"{name}: {d}" for d in said]
        found[row["id"]] = (check, theirs, differs)
        if differs:
            block = report_block(row["line"], check, theirs, differs)
            blocks.append(f"== {row['id']} ({row['kind']}: {row['why']})\n{block}")
    counts = ", ".join(f"{name} {n} of {len(CORPUS)}" for name, n in agree.items())
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(f"check agrees with upstream on: {counts}\n\n" + "\n\n".join(blocks) + "\n")
    print(f"\noracle: check agrees with upstream on {counts}; disagreements in {REPORT}")
    return found


def _param(row: dict):
    reason = KNOWN.get(row["id"])
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(row["id"], id=row["id"], marks=marks)


def test_the_corpus_is_large_and_covers_each_kind():
    kinds = {row["kind"] for row in CORPUS}
    assert len(CORPUS) >= 200 and kinds == {"example", "violation", "edge"}
    assert len({row["id"] for row in CORPUS}) == len(CORPUS)
    assert set(KNOWN) <= {row["id"] for row in CORPUS}


@pytest.mark.parametrize("line_id", [_param(row) for row in CORPUS])
def test_check_agrees_with_megatron(verdicts, line_id):
    _check, _upstream, differs = verdicts[line_id]
    assert differs == [], "\n".join(differs)


def test_upstream_refuses_what_the_rules_say(verdicts):
    """The oracle itself: a few lines whose upstream verdict is known from the source, each refused
    by the rule it was written to break (or accepted), on both sources."""
    expected = {
        "fsdp2-valid": None,
        "fsdp2-pp2": "--use-torch-fsdp2 is not supported with pipeline parallelism",
        "heads-12-tp8": "num_attention_heads (12) must be a multiple of "
        "tensor_model_parallel_size (8)",
        "seq-cp8-1000": "seq-length should be a multiple of 2 * context-parallel-size",
        "batch-size": "--batch-size argument is no longer valid",
        "eval-gbs-not-divisible": "eval_global_batch_size (20) must be divisible by "
        "eval_micro_batch_size (2)",
    }
    for line_id, message in expected.items():
        for source, verdict in verdicts[line_id][1].items():
            assert verdict.accepted is (message is None), (line_id, source, verdict)
            assert message is None or message in verdict.message, (line_id, source, verdict.message)
    dp_ga = {
        s: (v.data_parallel_size, v.global_batch_size, v.num_microbatches)
        for s, v in verdicts["fsdp2-valid"][1].items()
    }
    assert set(dp_ga.values()) == {(8, 64, 8)}
