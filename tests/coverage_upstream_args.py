"""Read launches with Megatron-LM's own parser at each source snapshot, and print what the coverage table makes of
them, as JSON: {snapshot: {"flags": [option strings], "refused": {case: [row ids] or null}}} (null: that parser
refuses the line, e.g. a flag it does not define yet).

Run by tests/test_coverage_upstream.py in a subprocess, the cases as JSON on stdin ([[case, flags, GAConfig
kwargs], ...]), the snapshot roots as arguments. Each snapshot's ``megatron/training/arguments.py`` builds its
parser (``add_megatron_arguments``); optional packages the parser never uses are stubbed when not installed.
"""
import argparse
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import sys
import types
import warnings

from megatron_ga_ext.config.coverage import Setting, verdict
from megatron_ga_ext.config.ga_config import GAConfig

warnings.filterwarnings("ignore")


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            return type(name, (), {"__init_subclass__": classmethod(lambda cls, **kw: None),
                                   "__init__": lambda self, *a, **k: None})
        return _Stub(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return self


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Optional packages the training code imports but the parser does not need (tests/megatron_parser_flags.py
    says why triton is special)."""
    names = {"modelopt", "six", "yaml", "regex", "pydantic"}
    needs_triton = "megatron.core.transformer.custom_layers.batch_invariant_kernels"

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.names or name in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install_stubs() -> None:
    for name in list(_StubFinder.names):
        try:
            importlib.import_module(name)
            _StubFinder.names.discard(name)
        except ImportError:
            pass
    if importlib.util.find_spec("triton") is None:
        _StubFinder.names.add(_StubFinder.needs_triton)
    sys.meta_path.insert(0, _StubFinder())


def parser_of(root: str) -> argparse.ArgumentParser:
    for key in [k for k in sys.modules if k == "megatron" or k.startswith("megatron.")]:
        del sys.modules[key]
    sys.path.insert(0, root)
    try:
        arguments = importlib.import_module("megatron.training.arguments")
        assert arguments.__file__.startswith(root), arguments.__file__
        return arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    finally:
        sys.path.remove(root)


def refused(parser: argparse.ArgumentParser, flags: list[str], ga: dict) -> list[str] | None:
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = parser.parse_args(flags)
    except SystemExit:
        return None
    return [row.id for row in verdict(Setting.of(args, GAConfig(**ga))).refused]


def main() -> None:
    cases = json.load(sys.stdin)
    install_stubs()
    out = {}
    for root in sys.argv[1:]:
        parser = parser_of(root)
        out[root] = {"flags": sorted(s for action in parser._actions for s in action.option_strings),
                     "refused": {case: refused(parser, flags, ga) for case, flags, ga in cases}}
    print(json.dumps(out))


main()
