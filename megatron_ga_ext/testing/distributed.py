"""Run one function on N gloo ranks: free port, timeout, results and errors back to the caller.

    results = run_on_ranks(fn, world_size=4, args=(cfg,), timeout_s=120)   # results[rank] = fn(*args)

Workers are forked where the platform allows it, so a parent that has already imported megatron-core
(5-12 s) hands that import to every rank for free. A worker pickles its reply itself and sends
bytes, so a result or exception that cannot be pickled comes back as a :class:`WorkerError` naming
it, at once. A worker's exception is re-raised in the parent as itself (its type and message survive
pickling), with the worker's traceback attached as a note. A rank that exits without a reply, with
any exit code, fails the launch at once; a worker whose parent dies exits within a second (no leaked
ranks).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_module
import socket
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["LaunchConfig", "WorkerError", "free_port", "run_on_ranks"]


class WorkerError(RuntimeError):
    """A rank failed without a picklable exception, died, or ran past the timeout."""


@dataclass(kw_only=True, frozen=True)
class LaunchConfig:
    """How the ranks are started."""

    backend: str = "gloo"
    """torch.distributed backend: gloo on the CPU, nccl with ``--device cuda``."""
    start_method: str | None = None
    """multiprocessing start method; None means fork where available, else spawn."""
    timeout_s: float = 300.0
    """Wall-clock limit for the whole launch."""
    threads_per_rank: int = 1
    """torch intra-op threads per rank (the machine's cores are shared by all ranks)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    cfg: LaunchConfig,
    fn: Callable,
    args: Sequence,
    queue: Any,
    parent_pid: int,
) -> None:
    _exit_with_parent(parent_pid)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cfg.threads_per_rank)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    try:
        dist.init_process_group(
            cfg.backend, rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}"
        )
        reply = _reply(rank, "ok", fn(*args), "")
    except BaseException as exc:
        reply = _reply(rank, "error", exc, traceback.format_exc())
    try:
        queue.put(reply)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_with_parent(parent_pid: int) -> None:
    """Exit this worker (status 1) within a second of its parent's death, so no rank outlives a
    launch."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _reply(rank: int, status: str, payload: Any, tb: str) -> tuple[int, str, str, bytes]:
    """(rank, status, traceback text, pickled payload), pickled here: ``Queue.put`` pickles in a
    background thread and never raises, so an unpicklable payload would vanish silently."""
    try:
        return rank, status, tb, pickle.dumps(payload)
    except Exception as exc:
        what = "result" if status == "ok" else f"exception ({type(payload).__name__}: {payload})"
        message = (
            f"rank {rank} {'returned' if status == 'ok' else 'raised'} a {what} that cannot be "
            f"pickled ({type(exc).__name__}: {exc}); rank functions must return plain "
            "data"
        )
        return rank, "error", tb, pickle.dumps(WorkerError(f"{message}\n{tb}" if tb else message))


def _start_method(cfg: LaunchConfig) -> str:
    if cfg.start_method:
        return cfg.start_method
    return "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def run_on_ranks(
    fn: Callable, world_size: int, args: Sequence = (), config: LaunchConfig | None = None
) -> list[Any]:
    """Run ``fn(*args)`` on ranks 0..world_size-1 of a fresh process group; return each rank's
    result.

    Raises the exception of the first rank whose failure reaches the parent (the other ranks may
    wait forever in a collective, so the launch does not wait for theirs), or :class:`WorkerError`
    when a reply cannot be pickled or unpickled, a rank exits without a reply, or the launch runs
    past ``config.timeout_s``.
    """
    cfg = config or LaunchConfig()
    ctx = mp.get_context(_start_method(cfg))
    queue = ctx.Queue()
    port = free_port()
    # typeshed's BaseContext lacks the concrete contexts' Process
    procs = [
        ctx.Process(  # type: ignore[attr-defined]
            target=_worker,
            args=(r, world_size, port, cfg, fn, args, queue, os.getpid()),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        replies = _collect(queue, procs, cfg.timeout_s)
    finally:
        _stop(procs)
    return _unpack(replies, world_size)


def _collect(queue: Any, procs: list, timeout_s: float) -> dict[int, tuple[str, str, bytes]]:
    """Replies by rank until every rank replied or one reported an error."""
    deadline = time.monotonic() + timeout_s
    replies: dict[int, tuple[str, str, bytes]] = {}
    while len(replies) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WorkerError(
                f"ranks {_missing(replies, procs)} did not finish within the launch timeout of "
                f"{timeout_s:.0f} s"
            )
        try:
            rank, status, tb, blob = queue.get(timeout=min(remaining, 1.0))
        except queue_module.Empty:
            if any(p.exitcode is not None for r, p in enumerate(procs) if r not in replies):
                _drain(
                    queue, replies
                )  # a reply may still be in the pipe of a rank that just exited
                if any(status == "error" for status, _, _ in replies.values()):
                    break
                _raise_if_dead(replies, procs)
            continue
        replies[rank] = (status, tb, blob)
        if status == "error":
            break  # the other ranks may now wait forever in a collective
    return replies


def _drain(queue: Any, replies: dict[int, tuple[str, str, bytes]]) -> None:
    while True:
        try:
            rank, status, tb, blob = queue.get(timeout=0.5)
        except queue_module.Empty:
            return
        replies[rank] = (status, tb, blob)


def _raise_if_dead(replies: dict[int, tuple[str, str, bytes]], procs: list) -> None:
    for rank, proc in enumerate(procs):
        if rank not in replies and proc.exitcode is not None:
            code = proc.exitcode
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            raise WorkerError(
                f"rank {rank} of {len(procs)} {how} without sending a reply (killed, out of "
                "memory, or os._exit/sys.exit in the rank function)"
            )


def _missing(replies: dict, procs: list) -> list[int]:
    return sorted(set(range(len(procs))) - set(replies))


def _stop(procs: list) -> None:
    for proc in procs:
        proc.join(timeout=2.0)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()


def _unpack(replies: dict[int, tuple[str, str, bytes]], world_size: int) -> list[Any]:
    """Each rank's result; re-raise a rank's error in the parent."""
    values = {}
    for rank in sorted(replies):
        status, tb, blob = replies[rank]
        try:
            payload = pickle.loads(blob)
        except Exception as exc:
            raise WorkerError(
                f"rank {rank} of {world_size} sent a reply ({status}) that cannot be unpickled "
                f"in the parent ({type(exc).__name__}: {exc})"
                + (f"; its traceback:\n{tb}" if tb else "")
            ) from exc
        if status == "error":
            if isinstance(payload, BaseException):
                payload.add_note(f"(raised on rank {rank} of {world_size})\n{tb}")
                raise payload
            raise WorkerError(f"rank {rank} of {world_size} failed:\n{tb}")
        values[rank] = payload
    return [values[r] for r in range(world_size)]
