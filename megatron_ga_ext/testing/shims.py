"""CPU shims that let real megatron-core run on gloo without a GPU. Used by ``verify`` and tests
only.

megatron-core allocates some tensors on "cuda" and calls CUDA runtime functions even when every
module lives on the CPU. Every replacement below stands in for one of those:

1. ``torch.cuda.current_device`` answers ``0``, which shim 2 maps to the CPU (grad buffers,
   ``param_and_grad_buffer.py``; p2p receive buffers).
2. CUDA devices become the CPU where megatron names them: the factories in :data:`FACTORIES` and the
   ``Tensor.new_*`` methods map a ``device=`` that names CUDA (``"cuda"``, ``"cuda:0"``,
   ``torch.device("cuda")`` or an int) to ``"cpu"``; ``Tensor.to`` does so for its device,
   positional or ``device=``; ``Tensor.cuda()`` answers the tensor itself (DDP buffers, p2p buffers
   and the token counter in the schedules, tied embeddings under PP, the default causal mask, the
   router's and rotary embedding's ``.to``). Only these calls pay for a wrapper: a torch-function
   mode over every call would add ~2 us to each torch op and tensor attribute read, upstream's and
   the extension's alike, which a GPU run has not.
3. RNG: ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` route to the CPU
   generator, ``torch.cuda.manual_seed_all`` does nothing (there is no CUDA generator to seed), and
   the RNG tracker's own ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``
   (``tensor_parallel/random.py``) use the CPU state, so ``model_parallel_cuda_manual_seed`` and the
   tracker's ``fork`` work (dropout is 0).
4. ``torch.cuda.synchronize`` does nothing (``p2p_communication.py`` after batched p2p,
   ``parallel_state.py``, DDP's buffer free/allocate), nor does ``torch.cuda.set_device``
   (megatron's async checkpoint and inference code).
5. Streams: ``torch.cuda.current_stream`` / ``default_stream`` answer a :class:`_Stream`, and
   ``torch.cuda.Stream`` / ``Event`` construct one, whose ``wait_event`` / ``wait_stream`` /
   ``record`` / ``synchronize`` / ``wait`` do nothing, ``record_event`` answers another stand-in and
   ``query`` answers True; ``torch.cuda.stream(...)`` is an empty context and
   ``Tensor.record_stream`` given a stand-in does nothing (grad sync: ``param_and_grad_buffer.py``,
   0.16 with ``default_stream``, 0.19 with ``current_stream``; the communication stream under
   ``overlap_grad_reduce``; Megatron-FSDP waits on its reduce-scatter's event; combined 1F1B's
   compute and communication streams, ``pipeline_parallel/utils.py``, whose 0.16 nodes also
   mark NVTX ranges: ``torch.cuda.nvtx.range_push`` / ``range_pop`` do nothing, as a CPU build of
   torch has no NVTX).
6. ``torch.cuda.is_available`` answers ``False`` and ``device_count`` ``0``, also on a machine with
   a GPU, so megatron takes its CPU paths where it asks.
7. MoE alltoall: the token dispatcher's ``maybe_move_tensor_to_cpu`` turns only CUDA tensors into
   host numbers, so on the CPU the split sizes reach ``all_to_all_single`` as tensors, which gloo
   rejects; the stand-in hands CPU tensors over as numpy arrays where it is asked to (``as_numpy``);
   and 0.16's router reads ``moe_utils.te_general_gemm``, which it defines only with Transformer
   Engine installed (a NameError without it): it is set to None there, so the torch path runs.
   Likewise main's MTP layer asks ``is_inference_column_parallel_linear``, an isinstance() against
   Transformer Engine classes that are MagicMock stand-ins without it (a TypeError): there it
   answers False, as it would for a local linear.

Megatron-LM's own training loop (``pretrain()``, :func:`training_shims`) needs these on top:

8. ``device_count`` answers ``1``: ``initialize.py`` builds the model-parallel groups and seeds the
   RNG tracker only when it is > 0.
9. ``initialize_megatron`` is called with ``allow_no_cuda=True``: it asserts CUDA otherwise (faking
   ``is_available`` instead makes the DataLoader pin CUDA memory).
10. The dataset helpers are not compiled: ``compile_helpers`` (rank 0 runs ``make`` with
    pybind11) does nothing, and a source tree without the compiled ``helpers_cpp`` gets the
    installed wheel's (the same ``helpers.cpp`` from 0.16.1 to main). A rank on a CUDA device needs
    this one alone (:func:`dataset_shims`).
11. 0.16/0.17 build the legacy fused kernels with nvcc at start-up: ``fused_kernels.load`` does
    nothing (the local transformer implementation never calls them).
12. ``torch.cuda`` memory statistics (``memory_allocated``, ``max_memory_allocated``,
   ``memory_reserved``, ``max_memory_reserved``) answer 0 and ``memory_stats`` an empty dict, for
   the first iteration's memory report.
18. A bf16 or fp16 run: ``Tensor.type()`` without arguments names a CPU tensor's CUDA type
    (``torch.cuda.BFloat16Tensor``): Megatron's bf16 and fp16 optimizers sort their parameters by
    it and refuse any other name.

Megatron's FSDP paths (``--use-torch-fsdp2``, ``--use-megatron-fsdp``) need one more, part of
:func:`cpu_shims` (13 and 14 are Megatron-Bridge's, bridge_shims.py; 15 is here, for both loops):

15. ``clip_grad_by_total_norm_fp32`` (``optimizer/clip_grads.py``, bound by name in
    ``optimizer.py``) asserts each gradient is a ``torch.cuda.FloatTensor`` (in
    :func:`training_shims`, and Bridge's): the stand-in scales by the same coefficient, min(1,
    max_norm / (total_norm + 1e-6)), as megatron-core's local ``multi_tensor_scale`` does, without
    the assert. Megatron computes the norm it clips by itself; with ``--clip-grad 0`` it clips
    nothing.
16. FSDP meshes: megatron's torch FSDP2 wrapper (``DeviceMesh.from_group(group, "cuda")``) and
    Megatron-FSDP (``mcore_fsdp_adapter.py``, ``device_type="cuda"``) build their device meshes on
    CUDA; ``DeviceMesh.from_group`` builds them on the CPU instead (``fully_shard`` and
    Megatron-FSDP run on CPU tensors over gloo).
17. ``torch.cuda.get_device_properties`` answers a stand-in of compute capability 0.0 (in
    :func:`training_shims`): Megatron-LM's ``validate_args`` asks the device's architecture under
    ``--use-megatron-fsdp`` (``arguments.py``, ``get_device_arch_version``).

Every factory that takes ``device=`` is wrapped, not only those megatron-core is known to call, so a
path that starts to call another one keeps running; a call none of them covers fails loudly (no
CUDA). A shim costs nothing where its path is not taken.

Nothing here is imported by ``install()``: the shims exist to prove the extension on the CPU.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "allow_no_cuda",
    "cpu_shims",
    "dataset_shims",
    "memory_replacements",
    "patched",
    "training_shims",
]


def _is_cuda(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return bool(device.type == "cuda")
    return isinstance(device, str) and device.startswith("cuda")


#: The torch factories that take ``device=``, wrapped by shim 2.
FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "as_tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "randperm",
    "linspace",
    "eye",
    "empty_strided",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "rand_like",
    "randn_like",
    "randint_like",
)
#: The tensor methods that take ``device=``, wrapped by shim 2 (besides ``to`` and ``cuda``).
NEW_METHODS = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


def _on_cpu(factory: Any) -> Any:
    """``factory`` with a CUDA ``device=`` replaced by the CPU (shim 2)."""

    def on_cpu(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return on_cpu


def _to_on_cpu(to: Any) -> Any:
    """``Tensor.to`` with a CUDA device, positional or ``device=``, replaced by the CPU (shim 2)."""

    def on_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args and _is_cuda(args[0]):
            args = ("cpu", *args[1:])
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        return to(self, *args, **kwargs)

    return on_cpu


def _device_replacements() -> tuple[dict[str, Any], dict[str, Any]]:
    """Shim 2: (replacements in ``torch``, replacements in ``torch.Tensor``)."""
    factories = {name: _on_cpu(getattr(torch, name)) for name in FACTORIES}
    methods = {name: _on_cpu(getattr(torch.Tensor, name)) for name in NEW_METHODS}
    methods.update(
        to=_to_on_cpu(torch.Tensor.to),
        cuda=lambda self, *args, **kwargs: self,
        record_stream=_record_stream(torch.Tensor.record_stream),
    )
    return factories, methods


def _record_stream(record_stream: Any) -> Any:
    """``Tensor.record_stream`` that does nothing for a stand-in stream (shim 5)."""

    def record(self: torch.Tensor, stream: Any) -> None:
        if not isinstance(stream, _Stream):
            record_stream(self, stream)

    return record


def _nothing(*args: Any, **kwargs: Any) -> None:
    pass


class _Stream:
    """A CUDA stream or event stand-in whose synchronisation calls do nothing (shim 5)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    wait_event = wait_stream = record = synchronize = wait = _nothing

    def record_event(self, *args: Any) -> _Stream:
        return _Stream()

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def _null_context(*args: Any, **kwargs: Any) -> Iterator[None]:
    yield


def _replacements(device_count: int) -> dict[str, Any]:
    return {
        "current_device": lambda: 0,
        "set_device": lambda *a, **k: None,
        "is_available": lambda: False,
        "device_count": lambda: device_count,
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
def patched(target: Any, replacements: dict[str, Any]) -> Iterator[None]:
    saved = {
        name: vars(target)[name] for name in replacements if name in vars(target)
    }  # a class's own only
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


def _host_splits(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """Shim 7: what ``maybe_move_tensor_to_cpu`` gives a CUDA tensor, for a CPU one."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


@contextlib.contextmanager
def cpu_shims(*, device_count: int = 0) -> Iterator[None]:
    """Install shims 1-7 and 16 for the duration of the block, then restore torch and megatron."""
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe = {"maybe_move_tensor_to_cpu": _host_splits}
    gemm = {} if hasattr(moe_utils, "te_general_gemm") else {"te_general_gemm": None}
    mtp, inference_linear = _mtp_without_te()
    factories, methods = _device_replacements()
    with (
        patched(torch.cuda, _replacements(device_count)),
        patched(torch.cuda.nvtx, {"range_push": _nothing, "range_pop": _nothing}),
        patched(tp_random, _rng_replacements()),
        patched(token_dispatcher, moe),
        patched(moe_utils, gemm),
        patched(mtp, inference_linear),
        patched(torch, factories),
        patched(torch.Tensor, methods),
        patched(DeviceMesh, {"from_group": staticmethod(_mesh_on_cpu(DeviceMesh.from_group))}),
    ):
        yield


def _mesh_on_cpu(from_group: Any) -> Any:
    """``DeviceMesh.from_group`` with a CUDA ``device_type`` built on the CPU (shim 16)."""

    def on_cpu(group: Any, device_type: str, *args: Any, **kwargs: Any) -> Any:
        return from_group(group, "cpu" if _is_cuda(device_type) else device_type, *args, **kwargs)

    return on_cpu


def _mtp_without_te() -> tuple[Any, dict[str, Any]]:
    """Shim 7, last part: (module, replacements) for main's MTP layer without Transformer Engine."""
    from megatron.core.transformer import multi_token_prediction

    layers = sys.modules.get("megatron.core.tensor_parallel.inference_layers")
    stand_in = layers is not None and not isinstance(
        getattr(layers, "InferenceColumnParallelLinear", type), type
    )
    if stand_in and hasattr(multi_token_prediction, "is_inference_column_parallel_linear"):
        return multi_token_prediction, {"is_inference_column_parallel_linear": lambda module: False}
    return multi_token_prediction, {}


def memory_replacements() -> dict[str, Any]:
    zero = lambda *a, **k: 0  # noqa: E731
    return {
        "memory_allocated": zero,
        "max_memory_allocated": zero,
        "memory_reserved": zero,
        "max_memory_reserved": zero,
        "memory_stats": lambda *a, **k: {},
    }


def _no_device_properties(*args: Any, **kwargs: Any) -> types.SimpleNamespace:
    """Shim 17: a device of compute capability 0.0, no memory, one multiprocessor."""
    return types.SimpleNamespace(
        major=0, minor=0, name="cpu", total_memory=0, multi_processor_count=1
    )


def clip_without_cuda_assert(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """Shim 15: megatron-core's clip_grad_by_total_norm_fp32 without its CUDA type assert."""
    from megatron.core.optimizer.clip_grads import to_local_if_dtensor

    params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    grads = [getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad for p in params]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            if grad is not None:
                to_local_if_dtensor(grad).detach().mul_(clip_coeff)


def clip_shims() -> list[contextlib.AbstractContextManager]:
    """Shim 15 where megatron-core binds the function: its module and the optimizers' (import
    megatron first)."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer

    clip = {"clip_grad_by_total_norm_fp32": clip_without_cuda_assert}
    return [patched(clip_grads, clip), patched(optimizer, clip)]


def allow_no_cuda(initialize_megatron: Any) -> Any:
    def initialize(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    return initialize


def _load_wheel_helpers() -> None:
    """Import the installed wheel's compiled ``helpers_cpp`` under the name a source tree expects
    (shim 10)."""
    import importlib.metadata
    import importlib.util
    import sys

    name = "megatron.core.datasets.helpers_cpp"
    if name in sys.modules or importlib.util.find_spec(name) is not None:
        return
    files = importlib.metadata.distribution("megatron-core").files or []
    built = [f for f in files if f.name.startswith("helpers_cpp.") and f.name.endswith(".so")]
    if not built:
        raise RuntimeError(
            "the installed megatron-core wheel ships no compiled helpers_cpp to run the datasets "
            "with"
        )
    path = str(built[0].locate())
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise RuntimeError(f"cannot load megatron-core's compiled helpers from {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[name] = module


@contextlib.contextmanager
def dataset_shims() -> Iterator[None]:
    """Shim 10 alone: Megatron-LM's datasets without compiling their helpers, on any device (import
    megatron first)."""
    from megatron.core.datasets import utils as dataset_utils

    _load_wheel_helpers()
    with patched(dataset_utils, {"compile_helpers": lambda *a, **k: None}):
        yield


def _cuda_type_names(type_: Any) -> Any:
    """Shim 18 (``optimizer.py``, ``distrib_optimizer.py``); with a dtype, ``type`` converts."""

    def named(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = type_(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or ".cuda." in name:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    return named


@contextlib.contextmanager
def training_shims() -> Iterator[None]:
    """Shims 1-12, 15, 17 and 18, for Megatron-LM's ``pretrain()`` on the CPU over gloo (import megatron
    first)."""
    import sys

    import megatron.training.initialize as initialize

    holders = [
        m
        for m in list(sys.modules.values())
        if getattr(m, "initialize_megatron", None) is initialize.initialize_megatron
    ]
    patches: list[contextlib.AbstractContextManager[Any]] = [dataset_shims()]
    patches += [
        patched(m, {"initialize_megatron": allow_no_cuda(initialize.initialize_megatron)})
        for m in holders
    ]
    patches.append(
        patched(
            torch.cuda, {**memory_replacements(), "get_device_properties": _no_device_properties}
        )
    )
    patches += clip_shims()
    patches.append(patched(torch.Tensor, {"type": _cuda_type_names(torch.Tensor.type)}))
    fused_kernels = sys.modules.get("megatron.legacy.fused_kernels")
    if fused_kernels is not None:
        patches.append(patched(fused_kernels, {"load": lambda *a, **k: None}))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        stack.enter_context(cpu_shims(device_count=1))
        yield
