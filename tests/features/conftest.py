"""The features' unit tests run without megatron-core: every ``megatron`` module is hidden while one
runs, so an import of it in a phase the test calls fails the test (a module loaded earlier in the
session included)."""

import sys

import pytest


@pytest.fixture(autouse=True)
def without_megatron(monkeypatch):
    for name in [name for name in sys.modules if name.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)  # put back after the test
    monkeypatch.setitem(sys.modules, "megatron", None)  # any import of megatron or below it raises
