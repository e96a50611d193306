"""Run one function on N gloo ranks: free port, timeout, results and errors back to the caller.

    results = run_on_ranks(fn, world_size=4, args=(cfg,), timeout_s=120)   # results[rank] = fn(*args)

Workers are forked where the platform allows it, so a parent that has already imported megatron-core
(5-12 s) hands that import to every rank for free. A worker's exception is re-raised in the parent as
itself (its type and message survive pickling), with the worker's traceback attached as a note.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

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
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, cfg: LaunchConfig, fn: Callable, args: Sequence,
            queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cfg.threads_per_rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group(cfg.backend, rank=rank, world_size=world_size,
                                init_method=f"tcp://127.0.0.1:{port}")
        result = fn(*args)
        queue.put((rank, "ok", result, ""))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        tb = traceback.format_exc()
        try:
            queue.put((rank, "error", exc, tb))
        except Exception:  # noqa: BLE001 - an unpicklable exception travels as text
            queue.put((rank, "error", None, tb))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _start_method(cfg: LaunchConfig) -> str:
    if cfg.start_method:
        return cfg.start_method
    return "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def run_on_ranks(fn: Callable, world_size: int, args: Sequence = (),
                 config: LaunchConfig | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ranks 0..world_size-1 of a fresh process group; return each rank's result.

    Raises the first failing rank's exception (lowest rank first), or :class:`WorkerError` when a
    rank dies silently or the launch runs past ``config.timeout_s``.
    """
    cfg = config or LaunchConfig()
    ctx = mp.get_context(_start_method(cfg))
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, cfg, fn, args, queue), daemon=True)
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        replies = _collect(queue, procs, cfg.timeout_s)
    finally:
        _stop(procs)
    return _unpack(replies, world_size)


def _collect(queue: Any, procs: list, timeout_s: float) -> dict[int, tuple]:
    deadline = time.monotonic() + timeout_s
    replies: dict[int, tuple] = {}
    while len(replies) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WorkerError(f"ranks {sorted(set(range(len(procs))) - set(replies))} did not finish "
                              f"within the launch timeout of {timeout_s:.0f} s")
        try:
            rank, status, payload, tb = queue.get(timeout=min(remaining, 1.0))
            replies[rank] = (status, payload, tb)
            if status == "error":
                break  # the other ranks may now wait forever in a collective
        except Exception:  # noqa: BLE001 - queue.Empty: check for dead ranks
            dead = [r for r, p in enumerate(procs) if r not in replies and p.exitcode not in (None, 0)]
            if dead:
                raise WorkerError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
    return replies


def _stop(procs: list) -> None:
    for proc in procs:
        proc.join(timeout=2.0)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()


def _unpack(replies: dict[int, tuple], world_size: int) -> list[Any]:
    for rank in sorted(replies):
        status, payload, tb = replies[rank]
        if status != "error":
            continue
        if isinstance(payload, BaseException):
            payload.add_note(f"(raised on rank {rank} of {world_size})\n{tb}")
            raise payload
        raise WorkerError(f"rank {rank} of {world_size} failed:\n{tb}")
    return [replies[r][1] for r in range(world_size)]
