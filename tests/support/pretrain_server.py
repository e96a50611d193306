"""Run a Megatron-LM training script on the CPU over gloo, and record every iteration (``make
e2e``).

    cd <Megatron-LM root>
    MEGATRON_GA_RECORD=out/run python $REPO/tests/support/pretrain_server.py --nproc-per-node 4 \\
        -m megatron_ga_ext pretrain_gpt.py <pretrain_gpt.py's flags> --distributed-backend gloo ...

With ``--nproc-per-node N`` it is its own launcher: it imports Megatron once, then forks N ranks
with the environment torchrun would give them (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), so the 7-12 s import is paid once per launch instead of once per rank; the first rank
to fail stops the others, and the exit status is the first failure's. With ``--serve`` it imports
Megatron once for many launches (``tests/support/pretrain_runs.py``), each forked from that import;
see :func:`serve`. Without either, it runs one rank under torchrun (``torchrun ...
tests/support/pretrain_server.py SCRIPT ...``). SCRIPT may be ``-m MODULE``. Either way the script
runs as ``python SCRIPT`` would run it from the Megatron-LM root (whose ``megatron`` package comes
first on the path), under
:func:`~megatron_ga_ext.testing.shims.training_shims`; with ``MEGATRON_GA_DEVICE=cuda`` (a rank on a CUDA device:
tests/gpu) under :func:`~megatron_ga_ext.testing.shims.dataset_shims` only. With
``MEGATRON_GA_RECORD`` set, each rank records its iterations (tests/support/recorder.py);
``MEGATRON_GA_FAULT`` injects faults (tests/support/faults.py).

``MEGATRON_GA_EXTRA_ARGS_RANK<R>`` (shell words) is appended to rank R's command line, after
everything else: ranks launched with different flags (argparse keeps the last value).

``MEGATRON_GA_MOCK_DOCUMENT_LENGTH=L`` draws ``--mock-data`` documents of 1 to L-1 tokens (upstream:
up to 4095), so that with ``--eod-mask-loss`` every micro-batch masks a different, sizeable share of
its tokens and the token and micro-batch means differ clearly.

Nothing here is imported by ``install()``: it exists to test the extension in the real loop.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import runpy
import shlex
import sys
from collections.abc import Callable

from tests.support.faults import apply_faults, patch_everywhere, rank_faults
from tests.support.recorder import Recorder

#: What a rank runs as ``__main__``: a script's path or a module, through runpy.
Program = Callable[[], object]

__all__ = ["main"]


def main() -> None:
    if sys.argv[1:] == ["--serve"]:
        sys.exit(serve())
    launch = _as_script(sys.argv[1:])
    _import_megatron()
    sys.exit(_run(*launch))


def _as_script(argv: list[str]) -> tuple[Program, int | None]:
    """``[--nproc-per-node N] SCRIPT ARGS...`` or ``[--nproc-per-node N] -m MODULE ARGS...``: (what
    to run, N), with ``sys.path`` and ``sys.argv`` as ``python SCRIPT ARGS...`` (or ``python -m
    MODULE ARGS...``) run from the Megatron-LM root (the working directory) has them."""
    nproc = None
    if argv[:1] == ["--nproc-per-node"]:
        nproc, argv = int(argv[1]), argv[2:]
    if argv[:1] == ["-m"]:
        module, *module_args = argv[1:]
        sys.path[0] = os.getcwd()  # as `python -m` sets it
        sys.argv = [module, *module_args]
        return functools.partial(
            runpy.run_module, module, run_name="__main__", alter_sys=True
        ), nproc
    script, *script_args = argv
    script = os.path.abspath(script)
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` sets it
    sys.path.insert(1, os.getcwd())  # the Megatron-LM root, as pretrain_gpt.py run from it sees it
    sys.argv = [script, *script_args]
    return functools.partial(runpy.run_path, script, run_name="__main__"), nproc


def _import_megatron() -> None:
    import megatron.core
    import megatron.training.training  # noqa: F401  (megatron before the shims: import-time code reads torch.cuda)


def _run(program: Program, nproc: int | None) -> int:
    return run_rank(program) if nproc is None else fork_ranks(program, nproc)


def serve() -> int:
    """``--serve``: import Megatron once, then run one launch per JSON line on stdin, each forked
    from that import into a session of its own: ``{"argv": [launcher args], "env": {...}, "log":
    path}``; answers ``{"pid": P}`` at the fork and ``{"rc": R}`` when it ends, one JSON line each
    on stdout. A launch sees the process as a fresh ``python tests/support/pretrain_server.py ARGV``
    from the same directory would, less the import. Everything else the server prints goes to
    stderr."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.path[0] = os.getcwd()  # the Megatron-LM root's megatron, as every launch imports it
    _import_megatron()
    base_path = list(sys.path)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setsid()
                log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.environ.clear()
                os.environ.update(request["env"])
                sys.path[:] = base_path
                code = _run(*_as_script(request["argv"]))
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        answers.write(json.dumps({"pid": pid}) + "\n")
        _, wait_status = os.waitpid(pid, 0)
        answers.write(json.dumps({"rc": os.waitstatus_to_exitcode(wait_status)}) + "\n")
    return 0


def fork_ranks(program: Program, nproc: int) -> int:
    """torchrun's job on one node: N ranks, forked after the import; the first failure stops the
    rest."""
    import signal

    from megatron_ga_ext.testing.distributed import free_port

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
    )
    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
            code = 1
            try:
                code = run_rank(program)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        ranks[pid] = rank
    status = 0
    while ranks:
        pid, wait_status = os.wait()
        ranks.pop(pid)
        code = os.waitstatus_to_exitcode(wait_status)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
            for other in ranks:
                os.kill(other, signal.SIGTERM)
    return status


#: The device the ranks train on: ``cpu`` (the default: every CPU shim) or ``cuda``.
DEVICE = "MEGATRON_GA_DEVICE"


def rank_shims(device: str) -> contextlib.AbstractContextManager:
    """The shims a rank runs under: on the CPU all of them; on a CUDA device only the dataset
    helpers' (shim 10), which a source tree needs wherever its helpers are not compiled."""
    from megatron_ga_ext.testing.shims import dataset_shims, training_shims

    if device == "cpu":
        return training_shims()
    if device == "cuda":
        return dataset_shims()
    raise ValueError(f"{DEVICE}={device!r} is not one of 'cpu', 'cuda'")


def run_rank(program: Program) -> int:
    """One rank: the shims, the recorder and any fault, then the program as __main__; its exit
    status."""
    import traceback

    import megatron.core

    from megatron_ga_ext.integration.compat import megatron_core_version

    document_length = os.environ.get("MEGATRON_GA_MOCK_DOCUMENT_LENGTH")
    if document_length:
        from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

        MockGPTLowLevelDataset.max_sequence_length = int(document_length)
    prefix = os.environ.get("MEGATRON_GA_RECORD")
    rank = int(os.environ.get("RANK", "0"))
    faults = rank_faults(os.environ.get("MEGATRON_GA_FAULT", ""), rank)
    sys.argv += shlex.split(os.environ.get(f"MEGATRON_GA_EXTRA_ARGS_RANK{rank}", ""))
    recorder = Recorder(prefix, faults) if prefix else None
    if recorder is not None:
        recorder.write(
            {
                "event": "start",
                "megatron": os.path.dirname(os.path.dirname(megatron.core.__file__)),
                "version": megatron_core_version(),
            }
        )
        patch_everywhere("megatron.training.training", "training_log", recorder.training_log)
        patch_everywhere("megatron.training.training", "pretrain", recorder.pretrain)
        recorder.watch_optimizer_steps()
    apply_faults(faults)
    error, code = None, 0
    try:
        with rank_shims(os.environ.get(DEVICE, "cpu")):
            program()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        error = None if code == 0 else f"SystemExit: {exc.code}"
    except BaseException as exc:  # the rank's failure is its exit status, as under torchrun
        traceback.print_exc()
        error, code = f"{type(exc).__name__}: {exc}", 1
    finally:
        if recorder is not None:
            args = sys.modules["megatron.training.global_vars"]._GLOBAL_ARGS
            recorder.write(
                {"event": "end", "train_iters": getattr(args, "train_iters", None), "error": error}
            )
    return code


if __name__ == "__main__":
    main()
