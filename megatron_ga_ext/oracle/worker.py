"""The oracle's worker: Megatron-LM's own argument parsing and validation on launch lines, in the
process
:mod:`megatron_ga_ext.oracle.runner` starts (``python -m megatron_ga_ext.oracle.worker``). Imports torch and
the Megatron-LM source tree it is given; nothing of the package imports this module.

Reads ``{"root": TREE, "lines": [{"argv": [...], "world_size": N}, ...]}`` on stdin and writes one
line on stdout,
:data:`MARKER` and JSON: a verdict per line. For each line, as ``pretrain_gpt.py`` runs them on rank 0 (no GPU, no
real process group: ``WORLD_SIZE`` and ``RANK`` in the environment are what ``parse_args`` reads of
the world):

1. ``parse_args()`` with the line's argv (``megatron/training/arguments.py``);
2. ``validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})`` (pretrain_gpt.py's defaults);
3. ``init_num_microbatches_calculator`` as ``set_global_variables`` calls it (``global_vars.py``),
   and for a step schedule ``update_num_microbatches(threshold, consistency_check=True)`` at each
   stage's threshold, as the training loop calls it, with the loop's own check that GA never
   decreases (``training.py``);
4. ``parallel_state.initialize_model_parallel`` as ``initialize.py`` calls it, over torch's fake
   process group of the line's world size (its checks of the expert grid and the other group sizes);
5. ``core_transformer_config_from_args(args)``: ``TransformerConfig.__post_init__`` checks heads and
   query groups against TP, and parses and validates ``--pipeline-model-parallel-layout``.

The first step that raises gives the verdict "refused" with the exception's type and message
(argparse's ``error:`` line for a SystemExit); the numbers are those known up to there.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import os
import sys
import time
from typing import Any

from megatron_ga_ext.oracle.standins import install_standins
from megatron_ga_ext.oracle.stubs import install_stubs

#: pretrain_gpt.py's args_defaults (core_v0.19.0 and main).
ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def _modules(root: str) -> tuple[Any, Any]:
    """(megatron.training.arguments, megatron.core.num_microbatches_calculator) of ``root``."""
    install_stubs()
    # A snapshot imports itself as top-level `megatron`: its root first on sys.path makes that
    # import resolve to the snapshot, not to an installed megatron-core.
    sys.path.insert(0, root)
    import megatron.core.num_microbatches_calculator as calculator
    import megatron.training.arguments as arguments

    if not str(arguments.__file__).startswith(root):
        raise ImportError(
            f"megatron.training.arguments came from {arguments.__file__}, not from {root}"
        )
    install_standins()
    _build_parser_once(arguments)
    return arguments, calculator


def _build_parser_once(arguments: Any) -> None:
    """``parse_args`` builds the same parser at every call (0.3 s: it reads the config dataclasses'
    docstrings with inspect): built once here, and the one parser handed back at each call. Parsing
    does not change it."""
    build = arguments.add_megatron_arguments
    built = build(argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False))
    arguments.add_megatron_arguments = lambda parser: built


def _error_line(text: str) -> str:
    """argparse's ``prog: error: ...`` line of what it printed before exiting."""
    errors = [line for line in text.splitlines() if ": error: " in line]
    return errors[-1].split(": error: ", 1)[1] if errors else text.strip()[-500:]


def _stages(calculator: Any) -> list[list[int]] | None:
    """[threshold in samples, GBS, GA] at each stage of a step schedule (None for a constant
    batch)."""
    current = calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR
    schedule = getattr(current, "schedule", None)
    if schedule is None:
        return None
    stages: list[list[int]] = []
    for threshold, _ in schedule:
        calculator.update_num_microbatches(threshold, consistency_check=True)
        # The training loop's own check at each change of GA (training.py:3767 at core_v0.19.0).
        if stages and calculator.get_num_microbatches() < stages[-1][2]:
            raise AssertionError(
                f"Number of microbatches should not decrease; going from {stages[-1][2]} to "
                f"{calculator.get_num_microbatches()}"
            )
        running = calculator.get_current_running_global_batch_size()
        stages.append([threshold, running, calculator.get_num_microbatches()])
    return stages


def _steps(arguments: Any, calculator: Any, argv: list[str], verdict: dict[str, Any]) -> None:
    """Run the four steps, filling ``verdict`` as each passes (the module docstring)."""
    sys.argv = ["pretrain_gpt.py", *argv]
    verdict["step"] = "parse_args"
    args = arguments.parse_args()
    verdict["step"] = "validate_args"
    arguments.validate_args(args, dict(ARGS_DEFAULTS))
    verdict["data_parallel_size"] = args.data_parallel_size
    verdict["step"] = "num_microbatches_calculator"
    calculator.unset_num_microbatches_calculator()
    calculator.init_num_microbatches_calculator(
        rank=0,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        data_parallel_size=args.data_parallel_size * getattr(args, "gtp_weight_remat_size", 1),
        decrease_batch_size_if_needed=args.decrease_batch_size_if_needed,
        step_batch_size_schedule=getattr(args, "step_batch_size_schedule", None),
        seq_length=args.seq_length,
    )
    # The samples a step trains on: --decrease-batch-size-if-needed rounds the running GBS down, not
    # the GBS.
    verdict["global_batch_size"] = calculator.get_current_running_global_batch_size()
    verdict["num_microbatches"] = calculator.get_num_microbatches()
    verdict["stages"] = _stages(calculator)
    verdict["step"] = "initialize_model_parallel"
    _model_parallel(args)
    verdict["step"] = "TransformerConfig"
    arguments.core_transformer_config_from_args(args)
    verdict["step"] = None


#: initialize.py's call of initialize_model_parallel: (keyword, the args attribute it passes).
_MODEL_PARALLEL_KWARGS = {
    "virtual_pipeline_model_parallel_size": "virtual_pipeline_model_parallel_size",
    "pipeline_model_parallel_comm_backend": "pipeline_model_parallel_comm_backend",
    "gtp_remat_size": "gtp_weight_remat_size",
    "expert_gtp_remat_size": "expert_gtp_weight_remat_size",
    "context_parallel_size": "context_parallel_size",
    "hierarchical_context_parallel_sizes": "hierarchical_context_parallel_sizes",
    "hybrid_context_parallel": "hybrid_context_parallel",
    "expert_model_parallel_size": "expert_model_parallel_size",
    "num_distributed_optimizer_instances": "num_distributed_optimizer_instances",
    "expert_tensor_parallel_size": "expert_tensor_parallel_size",
}


def _model_parallel(args: Any) -> None:
    """parallel_state.initialize_model_parallel as initialize.py calls it (its size checks: the
    expert grid, the optimizer instances), over torch's fake process group of the line's world size:
    no communication."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    accepted = inspect.signature(parallel_state.initialize_model_parallel).parameters
    kwargs = {
        k: getattr(args, a)
        for k, a in _MODEL_PARALLEL_KWARGS.items()
        if k in accepted and hasattr(args, a)
    }
    order = "tp-cp-ep-pp-dp" if getattr(args, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-dp-pp"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    try:
        parallel_state.initialize_model_parallel(
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
            order=order,
            create_gloo_process_groups=False,
            **kwargs,
        )
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def verdict_of(arguments: Any, calculator: Any, argv: list[str], world_size: int) -> dict[str, Any]:
    """Upstream's verdict on one line (the module docstring)."""
    verdict: dict[str, Any] = {"accepted": False, "error_type": None, "message": None}
    os.environ.update(WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0")
    # The environment the example scripts set: CUDA_DEVICE_MAX_CONNECTIONS=1, which validate_args
    # needs for TP or CP (arguments.py:1435) and refuses for FSDP2 (:1012); the FSDP examples leave
    # it unset.
    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    if not {"--use-torch-fsdp2", "--use-megatron-fsdp"} & set(argv):
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            _steps(arguments, calculator, argv, verdict)
        verdict["accepted"] = True
    except SystemExit:
        verdict.update(error_type="SystemExit", message=_error_line(printed.getvalue()))
    except Exception as error:  # upstream's own refusal, whatever its type: it is the verdict
        verdict.update(error_type=type(error).__name__, message=str(error)[:2000])
    return verdict


#: The line of stdout that carries the answer (upstream logs to stdout too).
MARKER = "megatron-ga-oracle: "


def main() -> None:
    started = time.perf_counter()
    request = json.load(sys.stdin)
    try:
        arguments, calculator = _modules(request["root"])
    except ImportError as error:
        print(MARKER + json.dumps({"import_error": f"{type(error).__name__}: {error}"}), flush=True)
        return
    imported = time.perf_counter()
    verdicts = [
        verdict_of(arguments, calculator, line["argv"], line["world_size"])
        for line in request["lines"]
    ]
    seconds = {"import": imported - started, "lines": time.perf_counter() - imported}
    print(MARKER + json.dumps({"verdicts": verdicts, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
