"""The package's layers, read from its source: imports run one way and nothing cycles.

    errors, logs  <-  core  <-  config  <-  {launch, integration}  <-  the package root (the public API)
        <-  testing  <-  {verify, oracle}  <-  cli  <-  __main__ (python -m megatron_ga_ext SCRIPT)

Every import counts, at module level or inside a function (an import moved into a function to dodge
a cycle is still a cycle). core, config and launch never import torch or megatron; cli imports them
only inside the function that runs ``verify``; oracle only in the worker process it starts. testing
(the CPU shims and the gloo launcher verify needs) is reached only from verify, from testing itself,
and from the tests; the test-only support (tests/support/) from nothing installed.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_ga_ext"
RANKS = {
    "errors": 0,
    "logs": 0,
    "core": 1,
    "science": 1.5,
    "config": 2,
    "launch": 3,
    "integration": 3,
    "": 4,
    "testing": 5,
    "verify": 6,
    "oracle": 6,
    "cli": 7,
    "__main__": 8,
}
PURE = ("core", "science", "config", "launch")
HEAVY = ("torch", "megatron")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every import in ``path``; ``from x import y`` gives
    x.y where x.y is a module of ours, else x."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.append((name if name in MODULES else node.module, id(node) in top_level))
    return found


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _layer(module: str) -> str:
    """The package's first name under the root; the batch-size science (science/) is a layer of its
    own above core, except its commands and its features, in cli's and integration's layers (each
    loads them on demand)."""
    parts = module.split(".")
    if parts[1:2] == ["science"]:
        return parts[2] if parts[2:3] in (["cli"], ["integration"]) else "science"
    return parts[1] if len(parts) > 1 else ""


def _ours(module: str) -> str | None:
    """The module of ours that an import of ``module`` loads (a name imported from a module: that
    module)."""
    while module and module not in MODULES:
        module = module.rpartition(".")[0]
    return module or None


def _graph() -> dict[str, set[str]]:
    return {
        name: {
            target
            for imported, _ in _imports(path)
            if (target := _ours(imported)) and target != name
        }
        for name, path in MODULES.items()
    }


def test_every_module_is_in_a_layer():
    assert {_layer(name) for name in MODULES} <= set(RANKS)


def test_imports_point_down_or_within_a_layer():
    upward = [
        f"{name} -> {target}"
        for name, targets in _graph().items()
        for target in targets
        if RANKS[_layer(target)] > RANKS[_layer(name)]
        or (
            RANKS[_layer(target)] == RANKS[_layer(name)]
            and _layer(target) != _layer(name)
            and RANKS[_layer(name)] > 0
        )
    ]
    assert upward == []


def test_no_import_cycle():
    graph, cycles, state = _graph(), [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target) :] + [node, target]))
            elif target not in state:
                visit(target, stack + [node])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert cycles == []


@pytest.mark.parametrize("layer", PURE)
def test_pure_layers_never_import_torch_or_megatron(layer):
    heavy = [
        f"{name}: {imported}"
        for name, path in MODULES.items()
        if _layer(name) == layer
        for imported, _ in _imports(path)
        if imported.split(".")[0] in HEAVY
    ]
    assert heavy == []


#: What a user runs without a GPU stack, and what it must not load: each in a fresh interpreter.
PURE_PYTHON_RUNS = {
    "the public API": ("import megatron_ga_ext", ("torch", "megatron")),
    "the pure layers": (
        "import megatron_ga_ext.core.layout, megatron_ga_ext.config.launch_rules, "
        "megatron_ga_ext.launch.line",
        ("torch", "megatron"),
    ),
    "megatron-ga ledger": (
        "main(['ledger', '--world-size', '8', '--micro-batch-size', '1'])",
        ("torch", "megatron"),
    ),
    "megatron-ga check": (
        "main(['check', '--', 'torchrun --nproc-per-node 8 x.py --micro-batch-size 1 "
        "--calculate-per-token-loss'])",
        ("torch", "megatron"),
    ),
    "megatron-ga schedule": (
        "main(['schedule', '0:8 100:16', '--micro-batch-size', '1', '--data-parallel-size', '8'])",
        ("torch", "megatron", "matplotlib"),
    ),
}


@pytest.mark.parametrize("run", PURE_PYTHON_RUNS, ids=str)
def test_pure_python_runs_load_neither_torch_nor_megatron(run):
    """The run-time side of the rules above: what the pure-Python commands load, lazy imports
    included."""
    statement, heavy = PURE_PYTHON_RUNS[run]
    code = (
        f"import sys\nfrom megatron_ga_ext.cli.main import main\n{statement}\nprint('loaded:', "
        f"*(m for m in {heavy!r} if m in sys.modules))"
    )
    if not statement.startswith("main("):
        code = code.replace("from megatron_ga_ext.cli.main import main\n", "")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=PACKAGE.parent
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "loaded:", f"{run}: {result.stdout.splitlines()[-1]}"


def test_cli_imports_torch_and_megatron_only_inside_functions():
    heavy = [
        f"{name}: {imported}"
        for name, path in MODULES.items()
        if _layer(name) == "cli"
        for imported, top in _imports(path)
        if top and imported.split(".")[0] in HEAVY
    ]
    assert heavy == []


def test_testing_is_reached_only_from_verify_and_tests():
    reached = [
        f"{name} -> {target}"
        for name, targets in _graph().items()
        for target in targets
        if _layer(target) == "testing" and _layer(name) not in ("testing", "verify")
    ]
    assert reached == []


def test_the_package_never_imports_the_test_support():
    """Fault injection, the e2e fork server and its recorder are tests/support/, not in the wheel:
    nothing installed may import them (verify's CPU shims and gloo launcher are testing/, in the
    package)."""
    reaching = [
        f"{name}: {imported}"
        for name, path in MODULES.items()
        for imported, _ in _imports(path)
        if imported.split(".")[0] == "tests"
    ]
    assert reaching == []


#: The most lines a module of the package may have: a module per job (STYLE.md); split one that
#: grows past it.
MAX_LINES = 450


def test_no_module_is_over_the_line_cap():
    long = [
        f"{path.relative_to(PACKAGE.parent)}: {length} lines"
        for path in sorted(MODULES.values())
        if (length := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert long == [], f"modules over {MAX_LINES} lines (split each by job): {', '.join(long)}"


def test_the_line_cap_names_a_long_module_and_its_length(tmp_path, monkeypatch):
    path = tmp_path / "megatron_ga_ext" / "core" / "long.py"
    path.parent.mkdir(parents=True)
    path.write_text("x = 1\n" * (MAX_LINES + 1))
    monkeypatch.setattr(sys.modules[__name__], "MODULES", {"megatron_ga_ext.core.long": path})
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "megatron_ga_ext")
    with pytest.raises(
        AssertionError, match=rf"megatron_ga_ext/core/long\.py: {MAX_LINES + 1} lines"
    ):
        test_no_module_is_over_the_line_cap()


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The rules above can fail: a planted cycle and a planted upward import are found."""
    fake = {
        "megatron_ga_ext.core.a": "from megatron_ga_ext.core.b import x\n",
        "megatron_ga_ext.core.b": "def f():\n    from megatron_ga_ext.core.a import y\n",
        "megatron_ga_ext.core.c": "from megatron_ga_ext.integration.d import z\n",
        "megatron_ga_ext.integration.d": "import torch\n",
    }
    paths = {}
    for name, text in fake.items():
        path = tmp_path.joinpath(*name.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        paths[name] = path
    monkeypatch.setattr(sys.modules[__name__], "MODULES", paths)
    with pytest.raises(
        AssertionError, match=r"core\.a -> megatron_ga_ext\.core\.b -> megatron_ga_ext\.core\.a"
    ):
        test_no_import_cycle()
    with pytest.raises(AssertionError, match=r"core\.c -> megatron_ga_ext\.integration\.d"):
        test_imports_point_down_or_within_a_layer()


def test_test_support_lives_in_tests_support():
    """Every module under tests/ is a test file, a conftest or a package marker, except under
    tests/support/."""
    tests = Path(__file__).resolve().parent
    strays = [
        str(path.relative_to(tests))
        for path in tests.rglob("*.py")
        if path.relative_to(tests).parts[0] != "support"
        and not path.name.startswith("test_")
        and path.name not in ("conftest.py", "__init__.py")
    ]
    assert strays == [], f"support modules outside tests/support/: {strays}"


#: The host port (integration/host.py) and its adapters: the only modules that read a host loop's
#: run state.
HOST_ADAPTERS = {
    f"megatron_ga_ext.integration.{name}"
    for name in ("host", "megatron_lm", "bridge_loop", "core_loop")
}
#: How a module reaches a host's state: Megatron-LM's global args and writers, Bridge's GlobalState.
HOST_STATE = {
    "_GLOBAL_ARGS",
    "get_args",
    "get_tensorboard_writer",
    "get_wandb_writer",
    "global_vars",
}
HOST_STATE |= {"train_state", "tensorboard_logger", "wandb_logger", "GlobalState"}


def _host_state_reads(path: Path) -> list[str]:
    """The names of HOST_STATE that ``path`` reads: as an attribute, a name, an imported name or
    module, or a module path in a string (``sys.modules.get("megatron.training.global_vars")``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute):
            words = (
                [node.attr] if node.attr != "get_args" else []
            )  # typing.get_args; megatron's is imported by name
        elif isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.alias):
            words = node.name.split(".")
        elif isinstance(node, ast.ImportFrom) and node.module:
            words = node.module.split(".")
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and " " not in node.value
        ):
            words = node.value.split(".")
        else:
            continue
        found += [word for word in words if word in HOST_STATE]
    return found


def test_only_the_host_adapters_read_a_hosts_state():
    """Features ask the host port (current_host()); a host's own state is read in its adapter only.
    testing/ drives the hosts in tests and is exempt."""
    readers = {
        name: reads
        for name, path in sorted(MODULES.items())
        if name not in HOST_ADAPTERS
        and _layer(name) != "testing"
        and (reads := _host_state_reads(path))
    }
    assert readers == {}


def test_the_host_check_sees_a_read_of_megatrons_args(tmp_path, monkeypatch):
    path = tmp_path / "feature.py"
    path.write_text(
        'import sys\nargs = sys.modules["megatron.training.global_vars"]._GLOBAL_ARGS\n'
    )
    assert sorted(_host_state_reads(path)) == ["_GLOBAL_ARGS", "global_vars"]
    monkeypatch.setattr(
        sys.modules[__name__], "MODULES", {"megatron_ga_ext.integration.feature": path}
    )
    with pytest.raises(AssertionError, match="_GLOBAL_ARGS"):
        test_only_the_host_adapters_read_a_hosts_state()


def test_no_module_checks_with_assert():
    """Validation never uses assert (python -O strips it): every check in the package raises a typed
    error."""
    asserting = [
        f"{name}:{node.lineno}"
        for name, path in sorted(MODULES.items())
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Assert)
    ]
    assert asserting == []
