"""Proof on a fork: copies of the installed megatron-core (0.19.2) with edited hooked functions,
first on the path of a subprocess, as a team's own fork of Megatron-LM would be.

* A fork whose hooked functions gained comments, another docstring, reformatting, and (in the
  functions a start-up probe measures: finalize_model_grads, forward_step_calc_loss) an unrelated
  statement: install() accepts it under the defaults (strict), and verify's token row on DP 2 x 4
  micro-batches trains it exactly (each rank's gradient against the unpartitioned reference, through
  install(), in its own launch of gloo ranks).
* A fork whose finalize scales by 2/N and whose schedule divides the loss twice: install() refuses
  at start-up, naming each function and what its probe measured.

Two launches in all (one per tree); the verify row launches its two ranks from the first.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_ga_ext.integration.compat import megatron_core_version

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        megatron_core_version() != "0.19.2", reason="the fork is a copy of megatron-core 0.19.2"
    ),
]

ROOT = Path(__file__).resolve().parents[1]
FINALIZE = "megatron/core/distributed/finalize_model_grads.py"
SCHEDULES = "megatron/core/pipeline_parallel/schedules.py"
GPT_MODEL = "megatron/core/models/gpt/gpt_model.py"


def copy_megatron(tmp_path: Path, name: str) -> Path:
    """The installed ``megatron`` package copied to ``tmp_path/name`` (a tree to put first on the
    path)."""
    import megatron.core

    root = tmp_path / name
    shutil.copytree(
        Path(megatron.core.__file__).parents[1],
        root / "megatron",
        ignore=shutil.ignore_patterns("*.pyc"),
    )
    return root


def edit_function(path: Path, name: str, edit) -> None:
    """Replace the lines of function (or ``Class.method``) ``name`` in ``path`` by ``edit(lines,
    docstring_end)``: the function's lines and the index, within them, of its docstring's last
    line."""
    text = path.read_text()
    body = ast.parse(text).body
    *classes, function = name.split(".")
    for class_name in classes:
        body = next(n.body for n in body if isinstance(n, ast.ClassDef) and n.name == class_name)
    node = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == function)
    lines = text.splitlines(keepends=True)
    start, end = node.lineno - 1, node.end_lineno
    docstring_end = node.body[0].end_lineno - 1 - start
    lines[start:end] = edit(lines[start:end], docstring_end)
    path.write_text("".join(lines))


def with_lines(*added: str, replace: tuple[str, str] | None = None):
    """An edit: ``added`` lines after the docstring (indented as the body), and one text
    replaced."""

    def edit(lines: list[str], docstring_end: int) -> list[str]:
        indent = lines[docstring_end][
            : len(lines[docstring_end]) - len(lines[docstring_end].lstrip())
        ]
        new = [
            *lines[: docstring_end + 1],
            *(f"{indent}{line}\n" for line in added),
            *lines[docstring_end + 1 :],
        ]
        text = "".join(new)
        if replace is not None:
            if replace[0] not in text:
                raise ValueError(f"{replace[0]!r} is not in the function")
            text = text.replace(replace[0], replace[1], 1)
        return text.splitlines(keepends=True)

    return edit


def run_python(code: str, tree: Path) -> dict:
    """``code`` in a subprocess with ``tree`` first on the path; its last stdout line, as JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise AssertionError(
            f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_fork_with_comments_reformatting_and_unrelated_statements_trains_exactly(tmp_path: Path):
    tree = copy_megatron(tmp_path, "cosmetic")
    edit_function(
        tree / FINALIZE,
        "finalize_model_grads",
        with_lines(
            "# our site's note: grads are synced before the embedding all-reduce",
            "_site_tag = 'fork'  # an unrelated statement",
            replace=(
                "safe_num_tokens = torch.clamp(num_tokens, min=1)",
                "safe_num_tokens = torch.clamp(\n            num_tokens,  # reformatted\n        "
                "    min=1,\n        )",
            ),
        ),
    )
    edit_function(
        tree / SCHEDULES,
        "forward_step_calc_loss",
        with_lines(
            "_site_counter = 0  # an unrelated statement",
            replace=("dtype=torch.int)", "dtype=torch.int )"),
        ),
    )
    edit_function(
        tree / SCHEDULES, "forward_backward_no_pipelining", with_lines("# our fork's comment", "")
    )
    edit_function(tree / GPT_MODEL, "GPTModel.forward", with_lines("# our fork's comment"))
    found = run_python(
        """
        import json
        import megatron.core
        import megatron.core.distributed.finalize_model_grads, megatron.core.pipeline_parallel.schedules
        import megatron.core.models.gpt.gpt_model, megatron.core.num_microbatches_calculator
        from megatron_ga_ext.integration import acceptance, compat
        from megatron_ga_ext.verify.launches import launch_all
        from megatron_ga_ext.verify.layouts import Layout

        verdicts = {t.name: acceptance.decide(t, t.resolve()).verdict for t in compat.live_targets(compat.TARGETS)}
        results, _ = launch_all([Layout(data_parallel_size=2, num_microbatches=4)], device="cpu", timeout_s=300,
                                aux_layouts=())
        rows = [[r.mode, r.rel_err_token, r.rel_err_mean_of_means] for rank in results[2] for r in rank]
        print(json.dumps({"core": megatron.core.__file__, "verdicts": verdicts, "rows": rows}))
        """,
        tree,
    )
    assert found["core"].startswith(str(tree))
    verdicts = found["verdicts"]
    assert (
        verdicts["finalize_model_grads"] == "same behaviour"
    )  # an unrelated statement: its probe decides
    assert verdicts["forward_step_calc_loss"] == "same behaviour"
    assert (
        verdicts["forward_backward_no_pipelining"] == "tested"
    )  # comments and formatting: the tested source
    assert verdicts["GPTModel.forward"] == "tested"
    token = [row for row in found["rows"] if row[0] == "token"]
    assert len(token) == 2 and all(
        rel_err <= 1e-5 for _, rel_err, _ in token
    )  # each rank, through install()
    mean = [row for row in found["rows"] if row[0] == "microbatch"]
    assert len(mean) == 2 and all(rel_err <= 1e-5 for _, _, rel_err in mean)


def test_a_fork_that_scales_by_2_over_n_and_divides_twice_is_refused_at_start_up(tmp_path: Path):
    tree = copy_megatron(tmp_path, "changed")
    edit_function(
        tree / FINALIZE,
        "finalize_model_grads",
        with_lines(replace=("scaling = 1.0 / safe_num_tokens", "scaling = 2.0 / safe_num_tokens")),
    )
    division = "                    output_tensor /= num_microbatches\n"
    edit_function(
        tree / SCHEDULES,
        "forward_step_calc_loss",
        with_lines(
            replace=(division, division + "                output_tensor /= num_microbatches\n")
        ),
    )
    found = run_python(
        """
        import json
        import megatron.core
        import megatron_ga_ext
        from megatron_ga_ext.errors import CompatError
        from megatron_ga_ext.integration.lifecycle import installed

        try:
            megatron_ga_ext.install(megatron_ga_ext.GAConfig())  # the defaults, strict
            refusal = None
        except CompatError as error:
            refusal = str(error)
        print(json.dumps({"core": megatron.core.__file__, "refusal": refusal,
                          "installed": installed() is not None}))
        """,
        tree,
    )
    assert found["core"].startswith(str(tree)) and not found["installed"]
    refusal = found["refusal"]
    assert (
        "megatron.core.distributed.finalize_model_grads.finalize_model_grads has fingerprint"
        in refusal
    )
    assert "scaled the gradient by 0.25 (tested sources: 1/N = 0.125" in refusal
    assert (
        "megatron.core.pipeline_parallel.schedules.forward_step_calc_loss has fingerprint"
        in refusal
    )
    assert (
        "came back as (3, 3) with per-token loss on (tested sources: (6, 3), undivided)" in refusal
    )
