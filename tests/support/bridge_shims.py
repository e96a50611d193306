"""CPU shims for Megatron-Bridge's ``pretrain()``, on top of megatron-core's (shims.py). Tests only.

Megatron-Bridge's ``pretrain()`` (:func:`bridge_import_shim`, then :func:`bridge_shims`: shims 1-10
and 12 with ``device_count`` 1, docs/bridge.md) needs these on top:

13. ``import megatron.bridge`` reaches ``peft/lora_layers.py:20``, an unguarded ``import
    transformer_engine.pytorch``.
   While that one module's body runs (and only then), ``transformer_engine``, ``.pytorch`` and
   ``.pytorch.ops`` are inert stand-ins whose classes raise when built; the modules it imports after
   TE are imported first, so every other ``try: import transformer_engine`` (megatron-core's
   ``HAVE_TE``, Bridge's models) still finds none. With a real Transformer Engine installed it does
   nothing.
14. Bridge's ``initialize_megatron`` (its own, ``bridge/training/initialize.py:91`` asserts CUDA) is
    called with
   ``allow_no_cuda=True``, which ``setup.py:253`` never passes; and its ``compile_helpers`` (bound
   by name from megatron-core) does nothing, as shim 10 (the 0.19.2 wheel ships no Makefile:
   ``make`` fails on a GPU too).
15. ``clip_grad_by_total_norm_fp32`` asserts each gradient is a ``torch.cuda.FloatTensor``:
    shims.py's stand-in
   (Megatron-LM's loop takes it too).

Nothing here is imported by ``install()``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

from megatron_ga_ext.testing.shims import (
    allow_no_cuda,
    clip_shims,
    cpu_shims,
    dataset_shims,
    memory_replacements,
    patched,
)

__all__ = ["bridge_import_shim", "bridge_shims"]


#: Shim 13: the module with the unguarded TE import, and what it imports after it (imported before
#: the stand-in).
_LORA_LAYERS = "megatron.bridge.peft.lora_layers"
_LORA_IMPORTS = (
    "megatron.core.transformer.moe.moe_utils",
    "megatron.bridge.peft.adapter_wrapper",
    "megatron.bridge.peft.lora_merge",
)


class _NoTransformerEngine(types.ModuleType):
    """An inert ``transformer_engine`` module: any attribute is a class that raises when built."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def refuse(instance: Any, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(
                f"transformer_engine.{name} is a stand-in (tests/support/bridge_shims.py, shim 13)"
            )

        stand_in = type(name, (), {"__init__": refuse})
        setattr(self, name, stand_in)
        return stand_in


class _LoraLayersLoader(importlib.abc.Loader):
    """Runs lora_layers' body with the TE stand-ins in sys.modules, and removes them after."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        for name in _LORA_IMPORTS:
            importlib.import_module(name)
        te, pytorch, ops = (
            _NoTransformerEngine(n)
            for n in (
                "transformer_engine",
                "transformer_engine.pytorch",
                "transformer_engine.pytorch.ops",
            )
        )
        te.__path__, pytorch.__path__ = [], []
        te.pytorch, pytorch.ops = pytorch, ops
        stand_ins = {m.__name__: m for m in (te, pytorch, ops)}
        sys.modules.update(stand_ins)
        try:
            self.inner.exec_module(module)
        finally:
            for name in stand_ins:
                sys.modules.pop(name, None)


class _LoraLayersFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, name: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != _LORA_LAYERS:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _LoraLayersLoader(spec.loader)
                return spec
        return None


@contextlib.contextmanager
def bridge_import_shim() -> Iterator[None]:
    """Shim 13, for the block: import megatron.bridge inside it."""
    if importlib.util.find_spec("transformer_engine") is not None:
        yield
        return
    finder = _LoraLayersFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


@contextlib.contextmanager
def bridge_shims() -> Iterator[None]:
    """Shims 1-10, 12, 14 and 15, for Megatron-Bridge's ``pretrain()`` on the CPU over gloo (import
    megatron.bridge.training.pretrain first, under :func:`bridge_import_shim`)."""
    import megatron.bridge.training.initialize as initialize
    import megatron.bridge.training.setup as setup

    with contextlib.ExitStack() as stack:
        stack.enter_context(dataset_shims())
        stack.enter_context(patched(initialize, {"compile_helpers": lambda *a, **k: None}))
        stack.enter_context(
            patched(setup, {"initialize_megatron": allow_no_cuda(setup.initialize_megatron)})
        )
        for clip in clip_shims():
            stack.enter_context(clip)
        stack.enter_context(patched(torch.cuda, memory_replacements()))
        stack.enter_context(cpu_shims(device_count=1))
        yield
