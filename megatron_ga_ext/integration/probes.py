"""Start-up probes: upstream's arithmetic that a correction rests on, measured once on a tiny input.

A hooked function whose normalised source (compat.py) matches no tested one is judged by what it
does, where the extension's correction depends on what it computes. Each probe runs upstream's own
code object, once per code object, before install() wires anything, with its collectives and
model-parallel state stood in for (its module's globals swapped for the call: no process group, no
GPU), and compares the result with the arithmetic of the tested sources:

* ``finalize_model_grads``: a one-parameter stand-in model chunk with gradient 1, in a stand-in DP
  group of two ranks holding the same count (the all-reduce doubles it). ``num_tokens = 4`` must
  scale the gradient by 1 / N = 1/8 (N after the all-reduce, upstream's ``1.0 / clamp(N, min=1)``);
  ``num_tokens = None`` must leave it at 1 (token mode calls upstream without a count and divides by
  its own checked N, finalize.py).
* ``forward_step_calc_loss``: a loss function returning ``(loss = 6, num_tokens = 3, {})`` with
  ``num_microbatches = 2`` on the last stage: with per-token loss on, the loss and the count must
  come back as they are (6, 3: finalize divides by N); off, the loss divided by its count and by
  num_microbatches (6 / 3 / 2 = 1).
* the calculator (``_configure_global_num_microbatches_calculator``, ``get_num_microbatches``,
  ``update_num_microbatches``): GBS 8, micro-batch 1, DP 2 must give 4 micro-batches, still 4 after
  an update.

Outcome: the tested arithmetic, ``same`` (the correction patches as on a tested source); anything
else, ``changed`` (install() refuses, naming the function and the measured difference). None of
these three has a known upstream fix the extension would step aside for; the corrections of the
router's count, the z-loss and MTP measure at their first call (upstream_factors.py) and step aside
where upstream is fixed.
"""

from __future__ import annotations

import inspect
import math
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_ga_ext.integration.compat import CALCULATOR, FINALIZE, SCHEDULES

__all__ = ["CHANGED", "FIRST_CALL", "PROBES", "SAME", "Measured", "probe"]

SAME = "same"
"""The tested sources' arithmetic: the correction patches."""
CHANGED = "changed"
"""Other arithmetic: install() refuses (the measured difference named)."""


@dataclass(frozen=True)
class Measured:
    """What a probe found: its outcome and, in words, what it measured against what the tested
    sources give."""

    outcome: str
    detail: str

    @property
    def same(self) -> bool:
        return self.outcome == SAME


class _Group:
    """A stand-in process group: one rank (a collective on it goes through the stand-in
    torch.distributed)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


_GROUP = _Group()


class _ParallelState:
    """``megatron.core.parallel_state`` as the probed call sees it: every size 1, every rank 0,
    every stage the first and the last, every group a stand-in."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.endswith(("world_size", "_size")):
            return lambda *args, **kwargs: 1
        if name.endswith("rank"):
            return lambda *args, **kwargs: 0
        if name.startswith("is_"):
            return lambda *args, **kwargs: True
        return lambda *args, **kwargs: _GROUP


class _Distributed:
    """``torch.distributed`` for the probed call: a broadcast from the last stage changes nothing
    (one stage), an all-reduce sums over two data-parallel ranks holding the same values (doubles
    them)."""

    def __init__(self) -> None:
        self.all_reduces = 0

    def broadcast(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        return None

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.all_reduces += 1
        tensor.mul_(2)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)


class _Torch:
    """``torch`` with the stand-in ``torch.distributed``."""

    def __init__(self, distributed: _Distributed) -> None:
        self.distributed = distributed

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _Config:
    """A model config for the probe: the attributes given, every other one ``missing``."""

    def __init__(self, missing: Any, **given: Any) -> None:
        self.__dict__.update(given)
        self._missing = missing

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.__dict__["_missing"]


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _isolated(function: Callable, replace: dict[str, Any], *, helpers: bool = False) -> Callable:
    """``function``'s own code over a copy of its module's globals with ``replace`` applied (and,
    where ``helpers``, every other megatron function it could call made a no-op: their collectives
    are not measured)."""
    original = inspect.unwrap(function)
    scope = dict(original.__globals__)
    if helpers:
        for name, value in scope.items():
            if isinstance(value, types.FunctionType) and value.__module__.startswith("megatron"):
                scope[name] = _noop
    scope.update(replace)
    copy = types.FunctionType(
        original.__code__, scope, original.__name__, original.__defaults__, original.__closure__
    )
    copy.__kwdefaults__ = original.__kwdefaults__
    return copy


def _call(function: Callable, given: dict[str, Any]) -> Any:
    """``function`` with the arguments of ``given`` it takes, by name."""
    parameters = inspect.signature(function).parameters
    return function(**{name: value for name, value in given.items() if name in parameters})


class _Chunk(torch.nn.Module):
    """A one-parameter model chunk: gradient 1; its grad sync does nothing (one replica); it scales
    as DDP does."""

    def __init__(self, config: _Config) -> None:
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        self.weight.grad = torch.ones(1, dtype=torch.float64)

    def finish_grad_sync(self, *args: Any, **kwargs: Any) -> None:
        return None

    def scale_gradients(self, scaling: Any) -> None:
        self.weight.grad = self.weight.grad * scaling if self.weight.grad is not None else None


def probe_finalize(function: Callable) -> Measured:
    """``finalize_model_grads``'s scaling (module docstring)."""
    scaled = []
    for num_tokens in (torch.tensor(4, dtype=torch.int64), None):
        config = _Config(0, timers=None, calculate_per_token_loss=num_tokens is not None)
        chunk = _Chunk(config)
        distributed = _Distributed()
        replace = {
            "torch": _Torch(distributed),
            "parallel_state": _ParallelState(),
            "get_model_config": lambda model: model.config,
            "get_pp_last_rank": lambda group: 0,
        }
        _call(
            _isolated(function, replace, helpers=True), {"model": [chunk], "num_tokens": num_tokens}
        )
        grad = chunk.weight.grad
        scaled.append(float(grad) if grad is not None else math.nan)
    with_count, without = scaled
    if math.isclose(with_count, 1 / 8) and without == 1.0:
        return Measured(
            SAME, "scales by 1/N with N all-reduced over DP (1/8), not at all without a count"
        )
    return Measured(
        CHANGED,
        "on a one-parameter chunk with num_tokens 4 in a DP group of two, it scaled the gradient "
        "by "
        f"{with_count:g} (tested sources: 1/N = 0.125, N = 8 after the all-reduce) and by "
        f"{without:g} without a count (tested: 1)",
    )


def probe_loss_division(function: Callable) -> Measured:
    """``forward_step_calc_loss``'s division of a 3-tuple loss (module docstring)."""
    found = []
    for per_token in (True, False):
        config = _Config(None, timers=None, calculate_per_token_loss=per_token)
        isolated = _isolated(function, {"parallel_state": _ParallelState()})
        loss, count = _call(
            isolated,
            {
                "model": object(),
                "output_tensor": torch.zeros(1),
                "loss_func": lambda output: (torch.tensor(6.0), torch.tensor(3), {}),
                "config": config,
                "vp_stage": None,
                "collect_non_loss_data": False,
                "num_microbatches": 2,
                "forward_data_store": [],
                "cp_group_size": 1,
                "is_last_stage": True,
            },
        )
        found.append((float(loss), int(count)))
    if found == [(6.0, 3), (1.0, 3)]:
        return Measured(
            SAME, "per-token loss on: the loss (6) and count (3) as given; off: 6 / 3 / 2 = 1"
        )
    (on_loss, on_count), (off_loss, off_count) = found
    return Measured(
        CHANGED,
        f"a loss function returning (6, 3, {{}}) with 2 micro-batches came back as ({on_loss:g}, "
        f"{on_count}) with per-token loss on (tested sources: (6, 3), undivided) and "
        f"({off_loss:g}, {off_count}) "
        "off (tested: "
        f"(1, 3), divided by the count and by num_microbatches)",
    )


_LIVE = "_GLOBAL_NUM_MICROBATCHES_CALCULATOR"


def probe_calculator(function: Callable) -> Measured:
    """The calculator's count: GBS 8, micro-batch 1, DP 2 -> 4 micro-batches (module docstring)."""
    module = sys.modules[CALCULATOR]
    kept = getattr(module, _LIVE)
    setattr(module, _LIVE, None)  # upstream's configure(init=True) builds only where none is built
    try:
        given = {
            "rank": 1,
            "rampup_batch_size": None,
            "global_batch_size": 8,
            "micro_batch_size": 1,
        }
        given |= {"data_parallel_size": 2, "decrease_batch_size_if_needed": False, "init": True}
        _call(inspect.unwrap(function), given)
        first = inspect.unwrap(module.get_num_microbatches)()
        inspect.unwrap(module.update_num_microbatches)(8, consistency_check=True)
        then = inspect.unwrap(module.get_num_microbatches)()
    finally:
        setattr(module, _LIVE, kept)
    if (first, then) == (4, 4):
        return Measured(SAME, "GBS 8 / (micro-batch 1 x DP 2) = 4 micro-batches, 4 after an update")
    return Measured(
        CHANGED,
        f"GBS 8, micro-batch 1, DP 2 gave {first} micro-batches, {then} after an update (tested "
        "sources: 4, 4)",
    )


#: Qualified function -> its start-up probe (the calculator's three functions share one
#: measurement).
PROBES: dict[str, Callable[[Callable], Measured]] = {
    f"{FINALIZE}.finalize_model_grads": probe_finalize,
    f"{SCHEDULES}.forward_step_calc_loss": probe_loss_division,
    f"{CALCULATOR}._configure_global_num_microbatches_calculator": probe_calculator,
    f"{CALCULATOR}.get_num_microbatches": probe_calculator,
    f"{CALCULATOR}.update_num_microbatches": probe_calculator,
}

#: A correction that measures upstream's arithmetic at its first call (upstream_factors.py) -> that
#: check.
FIRST_CALL = {
    "exact_token_counts": "RouterCountCheck (the router's token count)",
    "tp_cp_scaled_z_loss": "ZLossFactorCheck (the z-loss's TP x CP factor)",
    "global_count_mtp_loss": "MTPRatioCheck (MTP's attachment)",
}

#: (probe, code object of the calculator's configure, or of the function) -> the measurement: once
#: per process.
_MEASURED: dict[tuple[Any, Any], Measured] = {}


def probe(qualified: str, function: Callable) -> Measured | None:
    """The start-up probe of ``qualified`` on the live ``function`` (None: it has none); measured
    once per code object. A probe that raises measured a change: upstream's code no longer runs on
    the tested inputs."""
    measure = PROBES.get(qualified)
    if measure is None:
        return None
    if measure is probe_calculator:
        function = sys.modules[CALCULATOR]._configure_global_num_microbatches_calculator
    code = getattr(inspect.unwrap(function), "__code__", function)
    key = (measure, code)
    if key not in _MEASURED:
        try:
            _MEASURED[key] = measure(function)
        except Exception as error:  # a changed upstream may fail in any way on the probe
            _MEASURED[key] = Measured(
                CHANGED, f"the probe's call failed: {type(error).__name__}: {error}"
            )
    return _MEASURED[key]
