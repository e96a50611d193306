"""Stand-ins for optional packages that Megatron-LM's training code imports but its argument parser
and validation never use (modelopt, six, ...), installed only where the package is missing. Runs
inside the oracle's worker."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any, ClassVar


class _Stub(types.ModuleType):
    """A module whose every attribute is another stub (a class where the name is capitalised)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            init: dict[str, Any] = {"__init_subclass__": classmethod(lambda cls, **kw: None)}
            init["__init__"] = lambda self, *a, **k: None
            return type(name, (), init)
        return _Stub(f"{self.__name__}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Without triton the one Megatron module that imports it is stubbed instead: a stub triton
    would make torch believe triton is installed."""

    names: ClassVar[set[str]] = {"modelopt", "six", "yaml", "regex", "pydantic"}
    needs_triton = "megatron.core.transformer.custom_layers.batch_invariant_kernels"

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".")[0] in self.names or name in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install_stubs() -> None:
    """Stub each optional package that does not import."""
    for name in list(_StubFinder.names):
        try:
            importlib.import_module(name)
            _StubFinder.names.discard(name)
        except ImportError:
            pass
    if importlib.util.find_spec("triton") is None:
        _StubFinder.names.add(_StubFinder.needs_triton)
    sys.meta_path.insert(0, _StubFinder())
