"""Run a Megatron-LM training script on the CPU over gloo, and record every iteration (``make e2e``).

    cd <Megatron-LM root>
    MEGATRON_GA_RECORD=out/run python -m megatron_ga_ext.testing.pretrain_server --nproc-per-node 4 \\
        -m megatron_ga_ext pretrain_gpt.py <pretrain_gpt.py's flags> --distributed-backend gloo ...

With ``--nproc-per-node N`` it is its own launcher: it imports Megatron once, then forks N ranks with the
environment torchrun would give them (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the 7-12 s
import is paid once per launch instead of once per rank; the first rank to fail stops the others, and the
exit status is the first failure's. With ``--serve`` it imports Megatron once for many launches
(``tests/e2e/pretrain_runs.py``), each forked from that import; see :func:`serve`. Without either, it runs one
rank under torchrun
(``torchrun ... -m megatron_ga_ext.testing.pretrain_server SCRIPT ...``). SCRIPT may be ``-m MODULE``. Either way the script runs as ``python
SCRIPT`` would run it from the Megatron-LM root (whose ``megatron`` package comes first on the path), under
:func:`~megatron_ga_ext.testing.shims.training_shims`; with ``MEGATRON_GA_DEVICE=cuda`` (a rank on a CUDA device:
tests/gpu) under :func:`~megatron_ga_ext.testing.shims.dataset_shims` only. With
``MEGATRON_GA_RECORD`` set, rank R appends JSON lines to ``<record>.rank<R>.jsonl``:

* ``{"event": "start", "megatron": <path of the megatron package>, "version": ...}``;
* per logged iteration (``training_log``): iteration, consumed samples, the calculator's GBS and
  num_microbatches, learning rate, losses, grad norm, skipped, whether this rank is a last pipeline stage,
  ``mask_tokens`` (the sum of the loss masks this rank's loss functions saw since the last iteration, read
  from pretrain_gpt's ``loss_func`` partial; not read while a CUDA graph is being captured, where a host read
  would end the capture, nor run where a captured graph replays), and from megatron-ga-ext when installed:
  ``num_tokens`` (the
  global N of the step) and ``forward_steps`` (the guard's count of forward steps per model chunk);
* ``{"event": "end", "train_iters": ..., "error": <type: message> or null}``.

``MEGATRON_GA_FAULT`` injects faults, comma-separated, each ``NAME[:K][@R]`` (at iteration K, on rank R only;
every rank without ``@R``):

* ``pp-multiplied-microbatches``: the training loop calls its forward/backward function with
  num_microbatches x PP, the mistake the PP guard exists for;
* ``zero-tokens-at:K``: every micro-batch of iteration K has an all-zero loss mask (a global batch without a
  single loss token), for the zero-token policies;
* ``empty-microbatch-at:K@R``: the first micro-batch of iteration K has an all-zero loss mask (the iteration row
  records the tokens removed as ``zeroed_tokens``);
* ``nan-loss-at:K@R``: the loss function's loss of the first micro-batch of iteration K is NaN;
* ``bypass-hooks``: the training loop's forward/backward function is upstream's schedule, not the one install()
  wrapped (``get_forward_backward_func`` returns it unwrapped), so the extension's schedule hook never runs;
* ``late-install``: Megatron builds its calculator without the extension, and install() runs again after
  ``initialize_megatron`` (a script that installs late);
* ``reinstall-at:K``: after iteration K is logged, install() with another config (``--ga-checks`` flipped);
* ``two-tuple-loss``: the loss function returns ``(loss, report)``, without the token count;
* ``ddp-before-per-token-flag``: Megatron's DDP wrappers are built while ``calculate_per_token_loss`` is off, and
  the flag is set again after (a model wrapped before the flag).

``MEGATRON_GA_EXTRA_ARGS_RANK<R>`` (shell words) is appended to rank R's command line, after everything else:
ranks launched with different flags (argparse keeps the last value).

``MEGATRON_GA_MOCK_DOCUMENT_LENGTH=L`` draws ``--mock-data`` documents of 1 to L-1 tokens (upstream: up to
4095), so that with ``--eod-mask-loss`` every micro-batch masks a different, sizeable share of its tokens
and the token and micro-batch means differ clearly.

Nothing here is imported by ``install()``: it exists to test the extension in the real loop.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import runpy
import shlex
import sys
import time
from collections import Counter
from typing import Any, Callable

#: What a rank runs as ``__main__``: a script's path or a module, through runpy.
Program = Callable[[], object]

__all__ = ["main"]


class Recorder:
    """Appends one JSON object per event to this rank's file."""

    def __init__(self, prefix: str, faults: dict[str, int | None] | None = None) -> None:
        rank = os.environ.get("RANK", "0")
        self.path = f"{prefix}.rank{rank}.jsonl"
        self.mask_tokens = 0
        self.zeroed_tokens = 0
        self.faults = faults or {}
        """This rank's faults (:func:`rank_faults`) that act on the forward step or the loss function."""
        self.microbatches: Counter = Counter()
        """Forward steps per iteration, so a fault can pick the first micro-batch of one."""

    def write(self, row: dict) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(row) + "\n")

    def training_log(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def training_log(loss_dict: dict, total_loss_dict: dict, learning_rate: Any, iteration: int,
                         loss_scale: Any, report_memory_flag: Any, skipped_iter: Any, grad_norm: Any,
                         *args: Any, **kwargs: Any) -> Any:
            self.write(self._iteration_row(loss_dict, learning_rate, iteration, skipped_iter, grad_norm))
            if self._at("reinstall-at", int(iteration)):
                _reinstall()
            return original(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                            report_memory_flag, skipped_iter, grad_norm, *args, **kwargs)

        return training_log

    def _iteration_row(self, loss_dict: dict, learning_rate: Any, iteration: int, skipped_iter: Any,
                       grad_norm: Any) -> dict:
        from megatron.core import num_microbatches_calculator as calculators
        from megatron.core import parallel_state
        from megatron.training.global_vars import get_args

        from megatron_ga_ext.integration.install import installed

        state = installed()
        finalize = getattr(state, "finalize", None)
        counter = getattr(state, "counter", None)
        row = {
            "event": "iteration",
            "iteration": int(iteration),
            "consumed_samples": int(get_args().consumed_train_samples),
            "global_batch_size": int(calculators.get_current_global_batch_size()),
            "num_microbatches": int(calculators.get_num_microbatches()),
            "learning_rate": None if learning_rate is None else float(learning_rate),
            "loss": {key: float(value) for key, value in loss_dict.items()},
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "skipped": int(skipped_iter),
            "last_stage": parallel_state.is_pipeline_last_stage(ignore_virtual=True),
            "mask_tokens": self.mask_tokens,
            "zeroed_tokens": self.zeroed_tokens,
            "num_tokens": getattr(finalize, "last_num_tokens", None),
            "forward_steps": None if counter is None else sorted(counter.counts.values()),
            "time": time.perf_counter(),  # when Megatron logged the iteration (its log interval is 1 here)
        }
        self.mask_tokens = self.zeroed_tokens = 0
        return row

    def pretrain(self, original: Callable) -> Callable:
        """``pretrain`` whose forward step reports each micro-batch's loss-mask sum."""

        signature = inspect.signature(original)  # 0.18 puts a config container first

        @functools.wraps(original)
        def pretrain(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.arguments["forward_step_func"] = self._counting(bound.arguments["forward_step_func"])
            return original(*bound.args, **bound.kwargs)

        return pretrain

    def _counting(self, forward_step_func: Callable) -> Callable:
        from megatron_ga_ext.integration.hooks import stream_capturing

        @functools.wraps(forward_step_func)
        def forward_step(*args: Any, **kwargs: Any) -> Any:
            result = forward_step_func(*args, **kwargs)
            loss_func = result[1] if isinstance(result, tuple) and len(result) == 2 else None
            mask = loss_func.args[0] if isinstance(loss_func, functools.partial) and loss_func.args else None
            iteration = _iteration()
            first = self.microbatches[iteration] == 0
            self.microbatches[iteration] += 1
            if hasattr(mask, "sum") and not stream_capturing():
                if self._at("zero-tokens-at", iteration) or first and self._at("empty-microbatch-at", iteration):
                    self.zeroed_tokens += int(mask.sum())
                    mask.zero_()
                self.mask_tokens += int(mask.sum())
            if loss_func is not None:
                nan = first and self._at("nan-loss-at", iteration)
                if nan or "two-tuple-loss" in self.faults:
                    result = (result[0], _faulty_loss(loss_func, nan=nan))
            return result

        return forward_step

    def _at(self, fault: str, iteration: int) -> bool:
        return fault in self.faults and self.faults[fault] == iteration


def _faulty_loss(loss_func: Callable, *, nan: bool) -> Callable:
    """``loss_func`` whose loss is NaN (``nan``), else returning ``(loss, report)`` (a 2-tuple)."""

    @functools.wraps(loss_func)
    def faulty(*args: Any, **kwargs: Any) -> Any:
        outputs = loss_func(*args, **kwargs)
        if kwargs.get("non_loss_data"):
            return outputs
        if nan:
            return (outputs[0] * float("nan"), *outputs[1:])
        return outputs[0], outputs[-1]

    return faulty


def rank_faults(text: str, rank: int) -> dict[str, int | None]:
    """``MEGATRON_GA_FAULT`` for ``rank``: {fault: iteration K, or None}, leaving out faults for other ranks."""
    faults: dict[str, int | None] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        item, _, on_rank = item.partition("@")
        name, _, at = item.partition(":")
        if not on_rank or int(on_rank) == rank:
            faults[name] = int(at) if at else None
    return faults


def _ddp_before_per_token_flag() -> None:
    """The fault ``ddp-before-per-token-flag``: DDP sees calculate_per_token_loss off while it is built."""
    from megatron.core.distributed import DistributedDataParallel

    original = DistributedDataParallel.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        config = signature.bind(self, *args, **kwargs).arguments["config"]
        flag, config.calculate_per_token_loss = config.calculate_per_token_loss, False
        try:
            original(self, *args, **kwargs)
        finally:
            config.calculate_per_token_loss = flag

    DistributedDataParallel.__init__ = init


def _late_install() -> None:
    """The fault ``late-install``: Megatron builds its calculator without the extension (its installation is inactive
    around ``init_num_microbatches_calculator``), and ``install()`` runs again once ``initialize_megatron`` has
    returned: a script that calls install() after initialize_megatron, with the args the drop-in's parser read."""
    import megatron.training.global_vars as global_vars

    import megatron_ga_ext
    from megatron_ga_ext.integration.install import installed

    init = global_vars.init_num_microbatches_calculator

    @functools.wraps(init)
    def init_without_the_extension(*args: Any, **kwargs: Any) -> Any:
        state = installed()
        state.configure_from_megatron_args()  # the drop-in's args are read as they would be, then set aside
        state.active = False
        try:
            return init(*args, **kwargs)
        finally:
            state.active = True

    global_vars.init_num_microbatches_calculator = init_without_the_extension

    def late(initialize_megatron: Callable) -> Callable:
        @functools.wraps(initialize_megatron)
        def initialize(*args: Any, **kwargs: Any) -> Any:
            result = initialize_megatron(*args, **kwargs)
            megatron_ga_ext.uninstall()
            megatron_ga_ext.install()
            return result

        return initialize

    _patch_everywhere("megatron.training.initialize", "initialize_megatron", late)


def _reinstall() -> None:
    """The fault ``reinstall-at:K``: after iteration K, install() with another config (--ga-checks flipped), while the
    model config still holds the first installation's finalize and the optimizer its step wrapper."""
    import dataclasses

    import megatron_ga_ext
    from megatron_ga_ext.integration.install import installed

    config = installed().config
    megatron_ga_ext.install(dataclasses.replace(config, checks="async" if config.checks == "sync" else "sync"))


def _iteration() -> int:
    """The iteration the training loop is running (1-based, as Megatron logs it)."""
    from megatron.training.global_vars import get_args

    return get_args().curr_iteration + 1


def _pp_multiplied(get_forward_backward_func: Callable) -> Callable:
    """The fault ``pp-multiplied-microbatches``: num_microbatches x PP reaches the schedule."""

    @functools.wraps(get_forward_backward_func)
    def get(*args: Any, **kwargs: Any) -> Callable:
        from megatron.core import parallel_state

        forward_backward = get_forward_backward_func(*args, **kwargs)
        pp = parallel_state.get_pipeline_model_parallel_world_size()

        def multiplied(*f_args: Any, **f_kwargs: Any) -> Any:
            if not f_kwargs.get("forward_only"):
                f_kwargs["num_microbatches"] *= pp
            return forward_backward(*f_args, **f_kwargs)

        return multiplied

    return get


def _unwrapped(get_forward_backward_func: Callable) -> Callable:
    """The fault ``bypass-hooks``: the training loop gets the schedule install() wrapped, unwrapped (the original
    upstream function, as a loop that bound it before install() would hold)."""

    @functools.wraps(get_forward_backward_func)
    def get(*args: Any, **kwargs: Any) -> Callable:
        forward_backward = get_forward_backward_func(*args, **kwargs)
        return getattr(forward_backward, "__wrapped__", forward_backward)

    return get


FAULTS = {"pp-multiplied-microbatches": ("megatron.core.pipeline_parallel", "get_forward_backward_func", _pp_multiplied),
          "bypass-hooks": ("megatron.core.pipeline_parallel", "get_forward_backward_func", _unwrapped)}


def _patch_everywhere(module_name: str, name: str, make: Callable[[Callable], Callable]) -> None:
    original = getattr(sys.modules[module_name], name)
    replacement = make(original)
    for module in list(sys.modules.values()):
        if getattr(module, name, None) is original:
            setattr(module, name, replacement)


def main() -> None:
    if sys.argv[1:] == ["--serve"]:
        sys.exit(serve())
    launch = _as_script(sys.argv[1:])
    _import_megatron()
    sys.exit(_run(*launch))


def _as_script(argv: list[str]) -> tuple[Program, int | None]:
    """``[--nproc-per-node N] SCRIPT ARGS...`` or ``[--nproc-per-node N] -m MODULE ARGS...``: (what to run, N), with
    ``sys.path`` and ``sys.argv`` as ``python SCRIPT ARGS...`` (or ``python -m MODULE ARGS...``) run from the
    Megatron-LM root (the working directory) has them."""
    nproc = None
    if argv[:1] == ["--nproc-per-node"]:
        nproc, argv = int(argv[1]), argv[2:]
    if argv[:1] == ["-m"]:
        module, *module_args = argv[1:]
        sys.path[0] = os.getcwd()  # as `python -m` sets it
        sys.argv = [module, *module_args]
        return functools.partial(runpy.run_module, module, run_name="__main__", alter_sys=True), nproc
    script, *script_args = argv
    script = os.path.abspath(script)
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` sets it
    sys.path.insert(1, os.getcwd())  # the Megatron-LM root, as pretrain_gpt.py run from it sees it
    sys.argv = [script, *script_args]
    return functools.partial(runpy.run_path, script, run_name="__main__"), nproc


def _import_megatron() -> None:
    import megatron.core  # noqa: F401
    import megatron.training.training  # noqa: F401  (megatron before the shims: import-time code reads torch.cuda)


def _run(program: Program, nproc: int | None) -> int:
    return run_rank(program) if nproc is None else fork_ranks(program, nproc)


def serve() -> int:
    """``--serve``: import Megatron once, then run one launch per JSON line on stdin, each forked from that import
    into a session of its own: ``{"argv": [launcher args], "env": {...}, "log": path}``; answers ``{"pid": P}``
    at the fork and ``{"rc": R}`` when it ends, one JSON line each on stdout. A launch sees the process as a
    fresh ``python -m megatron_ga_ext.testing.pretrain_server ARGV`` from the same directory would, less the import.
    Everything else the server prints goes to stderr."""
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
    """torchrun's job on one node: N ranks, forked after the import; the first failure stops the rest."""
    import signal

    from megatron_ga_ext.testing.distributed import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()),
                      WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0")
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
    """The shims a rank runs under: on the CPU all of them; on a CUDA device only the dataset helpers' (shim 10),
    which a source tree needs wherever its helpers are not compiled."""
    from megatron_ga_ext.testing.shims import dataset_shims, training_shims

    if device == "cpu":
        return training_shims()
    if device == "cuda":
        return dataset_shims()
    raise ValueError(f"{DEVICE}={device!r} is not one of 'cpu', 'cuda'")


def run_rank(program: Program) -> int:
    """One rank: the shims, the recorder and any fault, then the program as __main__; its exit status."""
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
        recorder.write({"event": "start", "megatron": os.path.dirname(os.path.dirname(megatron.core.__file__)),
                        "version": megatron_core_version()})
        _patch_everywhere("megatron.training.training", "training_log", recorder.training_log)
        _patch_everywhere("megatron.training.training", "pretrain", recorder.pretrain)
    for fault in faults:
        if fault in FAULTS:
            _patch_everywhere(*FAULTS[fault])
    if "ddp-before-per-token-flag" in faults:
        _ddp_before_per_token_flag()
    if "late-install" in faults:
        _late_install()
    error, code = None, 0
    try:
        with rank_shims(os.environ.get(DEVICE, "cpu")):
            program()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        error = None if code == 0 else f"SystemExit: {exc.code}"
    except BaseException as exc:  # noqa: BLE001 - the rank's failure is its exit status, as under torchrun
        traceback.print_exc()
        error, code = f"{type(exc).__name__}: {exc}", 1
    finally:
        if recorder is not None:
            args = sys.modules["megatron.training.global_vars"]._GLOBAL_ARGS
            recorder.write({"event": "end", "train_iters": getattr(args, "train_iters", None), "error": error})
    return code


if __name__ == "__main__":
    main()
