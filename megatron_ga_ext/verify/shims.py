"""CPU shims that let real megatron-core run on gloo without a GPU. Used by ``verify`` and tests only.

megatron-core allocates some tensors on "cuda" and calls CUDA runtime functions even when every
module lives on the CPU. Every replacement below stands in for one of those (UPSTREAM.md §4):

1. ``torch.cuda.current_device`` answers ``0`` and the device mode maps it to the CPU
   (grad buffers, ``param_and_grad_buffer.py``; p2p receive buffers).
2. :class:`_CpuDeviceMode`, a ``TorchFunctionMode``: any ``device=`` that names CUDA (``"cuda"``,
   ``"cuda:0"``, ``torch.device("cuda")`` or an int) becomes ``"cpu"``; ``Tensor.cuda()`` is a no-op;
   ``Tensor.to("cuda")`` stays on the CPU (token counter in the schedules, tied embeddings under PP,
   the default causal mask).
3. RNG: ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` route to the CPU generator,
   ``torch.cuda.manual_seed_all`` does nothing (there is no CUDA generator to seed), and the RNG
   tracker's own ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` (``tensor_parallel/random.py``) use
   the CPU state, so ``model_parallel_cuda_manual_seed`` and the tracker's ``fork`` work (dropout is 0).
4. ``torch.cuda.synchronize`` does nothing (``p2p_communication.py`` after batched p2p,
   ``parallel_state.py``, DDP's buffer free/allocate), nor does ``torch.cuda.set_device`` (megatron's
   async checkpoint and inference code).
5. Streams: ``torch.cuda.current_stream`` / ``default_stream`` answer a :class:`_Stream`, and
   ``torch.cuda.Stream`` / ``Event`` construct one, whose ``wait_event`` / ``wait_stream`` / ``record`` /
   ``synchronize`` do nothing, ``record_event`` answers another stand-in and ``query`` answers True;
   ``torch.cuda.stream(...)`` is an empty context (grad sync: ``param_and_grad_buffer.py``, 0.16 with
   ``default_stream``, 0.19 with ``current_stream``; the communication stream under
   ``overlap_grad_reduce``).
6. ``torch.cuda.is_available`` answers ``False`` and ``device_count`` ``0``, also on a machine with a
   GPU, so megatron takes its CPU paths where it asks.

Measured: a default ``megatron-ga verify`` calls only ``current_device``, ``get_rng_state``,
``manual_seed``, the tracker's two RNG functions and (0.19.2) ``current_stream``; the others cover paths
the same code reaches under other settings (batched PP p2p, overlapped grad reduce, a visible GPU) and
cost nothing when unused, so they stay.

Nothing here is imported by ``install()``: the shims exist to prove the extension on the CPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cpu_shims"]


def _is_cuda(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CpuDeviceMode(TorchFunctionMode):
    """Maps every CUDA device argument to the CPU (shim 2)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _Stream:
    """A CUDA stream or event stand-in whose synchronisation calls do nothing (shim 5)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> "_Stream":
        return _Stream()

    def record(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def _null_context(*args: Any, **kwargs: Any) -> Iterator[None]:
    yield


def _replacements() -> dict[str, Any]:
    return {
        "current_device": lambda: 0,
        "set_device": lambda *a, **k: None,
        "is_available": lambda: False,
        "device_count": lambda: 0,
        "synchronize": lambda *a, **k: None,
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: None,
        "current_stream": lambda *a, **k: _Stream(),
        "default_stream": lambda *a, **k: _Stream(),
        "Stream": _Stream,
        "Event": _Stream,
        "stream": _null_context,
    }


def _rng_replacements() -> dict[str, Any]:
    return {
        "_get_cuda_rng_state": lambda *a, **k: torch.get_rng_state(),
        "_set_cuda_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
    }


@contextlib.contextmanager
def _patched(target: Any, replacements: dict[str, Any]) -> Iterator[None]:
    saved = {name: getattr(target, name) for name in replacements if hasattr(target, name)}
    for name, value in replacements.items():
        setattr(target, name, value)
    try:
        yield
    finally:
        for name in replacements:
            if name in saved:
                setattr(target, name, saved[name])
            else:
                delattr(target, name)


@contextlib.contextmanager
def cpu_shims() -> Iterator[None]:
    """Install every shim above for the duration of the block, then restore torch and megatron."""
    from megatron.core.tensor_parallel import random as tp_random

    with _patched(torch.cuda, _replacements()), _patched(tp_random, _rng_replacements()):
        with _CpuDeviceMode():
            yield
