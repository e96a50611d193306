"""Replacing Megatron's functions and putting them back: a module global in every module that bound
it, a class attribute on its class.

A module global is rebound in the module that defines it and in every loaded module that bound it by
``from x import y``; a class attribute is replaced on the class, so objects built before install()
see it too.
:meth:`Patches.restore` puts an original back only where the replacement is still bound: a wrapper other code put
on top of ours stays where it is.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Patches"]


@dataclass
class _GlobalPatch:
    """A module global install() replaced, in one module's namespace."""

    namespace: dict[str, Any]
    name: str
    original: Callable
    replacement: Callable


@dataclass
class _AttributePatch:
    """A class attribute install() replaced (a method: every instance looks it up on the class)."""

    owner: type
    name: str
    original: Callable
    replacement: Callable


@dataclass
class Patches:
    """What install() replaced, in the order it replaced it, so that :meth:`restore` can put it
    back."""

    globals: list[_GlobalPatch] = field(default_factory=list)
    attributes: list[_AttributePatch] = field(default_factory=list)

    def patch(self, module_name: str, name: str, make: Callable[[Callable], Callable]) -> Callable:
        """Replace ``module.name`` by ``make(original)`` there and in every module that bound it."""
        module = sys.modules[module_name]
        original = module.__dict__[name]
        replacement = make(original)
        for namespace in _namespaces_holding(original, name):
            self.globals.append(_GlobalPatch(namespace, name, original, replacement))
            namespace[name] = replacement
        return replacement

    def patch_attribute(self, owner: type, name: str, make: Callable[[Callable], Callable]) -> None:
        """Replace the class attribute ``owner.name`` by ``make(original)``."""
        original = owner.__dict__[name]
        replacement = make(original)
        self.attributes.append(_AttributePatch(owner, name, original, replacement))
        setattr(owner, name, replacement)

    def wrapped(self) -> list[str]:
        """The upstream functions replaced, once each, in the order they were: ``module.name`` or
        ``module.Class.name``."""
        names = [f"{p.original.__module__}.{p.name}" for p in self.globals]
        names += [f"{a.owner.__module__}.{a.owner.__qualname__}.{a.name}" for a in self.attributes]
        return list(dict.fromkeys(names))

    def restore(self) -> None:
        """Every original back where its replacement is still what is bound: on classes, in the
        modules patched, and in modules imported since that bound it (``from x import y`` after
        install())."""
        for a in reversed(self.attributes):
            if a.owner.__dict__.get(a.name) is a.replacement:
                setattr(a.owner, a.name, a.original)
        self.attributes.clear()
        for p in reversed(self.globals):
            for namespace in [p.namespace, *_namespaces_holding(p.replacement, p.name)]:
                if namespace.get(p.name) is p.replacement:
                    namespace[p.name] = p.original
        self.globals.clear()


def _namespaces_holding(original: Callable, name: str) -> list[dict[str, Any]]:
    """Globals of every loaded module that hold ``original`` under ``name`` (``from x import
    name``)."""
    found = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get(name) is original:
            found.append(namespace)
    return found
