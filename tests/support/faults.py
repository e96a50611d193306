"""Faults injected into a rank of the e2e run (``MEGATRON_GA_FAULT``), for the tests that the
extension stops them.

``MEGATRON_GA_FAULT`` injects faults, comma-separated, each ``NAME[:K][@R]`` (at iteration K, on
rank R only; every rank without ``@R``):

* ``pp-multiplied-microbatches``: the training loop calls its forward/backward function with
  num_microbatches x PP, the mistake the PP guard exists for;
* ``zero-tokens-at:K``: every micro-batch of iteration K has an all-zero loss mask (a global batch
  without a single loss token), for the zero-token policies;
* ``empty-microbatch-at:K@R``: the first micro-batch of iteration K has an all-zero loss mask (the
  iteration row records the tokens removed as ``zeroed_tokens``);
* ``nan-loss-at:K@R``: the loss function's loss of the first micro-batch of iteration K is NaN;
* ``bypass-hooks``: the training loop's forward/backward function is upstream's schedule, not the
  one install() wrapped (``get_forward_backward_func`` returns it unwrapped), so the extension's
  schedule hook never runs;
* ``late-install``: Megatron builds its calculator without the extension, and install() runs again
  after ``initialize_megatron`` (a script that installs late);
* ``runtime-services-order``: the start-up order of Megatron-LM #7418 on a source without it: the
  num-microbatches calculator is built after parsing, not in ``set_global_variables``
  (calculator_adoption.py);
* ``reinstall-at:K``: after iteration K is logged, install() with another config (``--ga-checks``
  flipped);
* ``two-tuple-loss``: the loss function returns ``(loss, report)``, without the token count;
* ``ddp-before-per-token-flag``: Megatron's DDP wrappers are built while
  ``calculate_per_token_loss`` is off, and the flag is set again after (a model wrapped before the
  flag).

:func:`fsdp2_sum_reverted` takes install()'s torch FSDP2 fix out, as an audit would (tests/test_fsdp.py and
``make verify-fuzz``'s reverted row).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

__all__ = [
    "FAULTS",
    "apply_faults",
    "current_iteration",
    "faulty_loss",
    "fsdp2_sum_reverted",
    "without_row",
    "patch_everywhere",
    "rank_faults",
    "reinstall",
    "runtime_services_order",
]


def faulty_loss(loss_func: Callable, *, nan: bool) -> Callable:
    """``loss_func`` whose loss is NaN (``nan``), else returning ``(loss, report)`` (a 2-tuple)."""

    @functools.wraps(loss_func)
    def faulty(*args: Any, **kwargs: Any) -> Any:
        outputs = loss_func(*args, **kwargs)
        if kwargs.get("non_loss_data"):
            return outputs
        if nan:
            return (outputs[0] * float("nan"), *outputs[1:])
        return outputs[0], outputs[-1]

    return faulty


@contextlib.contextmanager
def fsdp2_sum_reverted() -> Any:
    """install()'s torch FSDP2 fix taken out where install() and finalize call it: the units keep
    FSDP2's average over DP x CP and no one divides by N (upstream's own per-token step,
    integration/features/torch_fsdp2.py)."""
    from megatron_ga_ext.integration import finalize
    from megatron_ga_ext.integration.features import torch_fsdp2 as fsdp
    from megatron_ga_ext.testing.shims import patched

    noop = lambda *args, **kwargs: None  # noqa: E731
    upstream_scale = {"scale_gradients": lambda chunk, scaling: chunk.scale_gradients(scaling)}
    with (
        patched(fsdp, {"prepare_units": noop, "check_units": noop}),
        patched(finalize, upstream_scale),
    ):
        yield


def without_row(name: str) -> None:
    """install() without the hook row ``name`` for the rest of the process, as an audit reverts a
    correction: out of the phases' table and out of the feature that declares it. A name no row has
    is refused, so a revert cannot silently keep the correction."""
    from megatron_ga_ext.integration import hooks
    from megatron_ga_ext.integration.installation import FEATURES

    found = any(h.name == name for h in hooks.HOOKS)
    hooks.HOOKS = tuple(h for h in hooks.HOOKS if h.name != name)
    for feature in (entry.load() for entry in FEATURES):
        found |= any(h.name == name for h in feature.hooks)
        feature.hooks = tuple(h for h in feature.hooks if h.name != name)
    if not found:
        raise ValueError(f"no hook row is named {name!r}")


def rank_faults(text: str, rank: int) -> dict[str, int | None]:
    """``MEGATRON_GA_FAULT`` for ``rank``: {fault: iteration K, or None}, leaving out faults for
    other ranks."""
    faults: dict[str, int | None] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        item, _, on_rank = item.partition("@")
        name, _, at = item.partition(":")
        if not on_rank or int(on_rank) == rank:
            faults[name] = int(at) if at else None
    return faults


def ddp_before_per_token_flag() -> None:
    """The fault ``ddp-before-per-token-flag``: DDP sees calculate_per_token_loss off while it is
    built."""
    from megatron.core.distributed import DistributedDataParallel

    original = DistributedDataParallel.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        config = signature.bind(self, *args, **kwargs).arguments["config"]
        flag, config.calculate_per_token_loss = config.calculate_per_token_loss, False
        try:
            original(self, *args, **kwargs)
        finally:
            config.calculate_per_token_loss = flag

    DistributedDataParallel.__init__ = init


def late_install() -> None:
    """The fault ``late-install``: Megatron builds its calculator without the extension (its
    installation is inactive around ``init_num_microbatches_calculator``), and ``install()`` runs
    again once ``initialize_megatron`` has returned: a script that calls install() after
    initialize_megatron, with the args the drop-in's parser read."""
    import megatron.training.global_vars as global_vars

    import megatron_ga_ext
    from megatron_ga_ext.integration.lifecycle import installed

    init = global_vars.init_num_microbatches_calculator

    @functools.wraps(init)
    def init_without_the_extension(*args: Any, **kwargs: Any) -> Any:
        state = installed()
        # the drop-in's args are read as they would be, then set aside
        state.configure_from_megatron_args()
        state.active = False
        try:
            return init(*args, **kwargs)
        finally:
            state.active = True

    global_vars.init_num_microbatches_calculator = init_without_the_extension

    def late(initialize_megatron: Callable) -> Callable:
        @functools.wraps(initialize_megatron)
        def initialize(*args: Any, **kwargs: Any) -> Any:
            result = initialize_megatron(*args, **kwargs)
            megatron_ga_ext.uninstall()
            megatron_ga_ext.install()
            return result

        return initialize

    patch_everywhere("megatron.training.initialize", "initialize_megatron", late)


def runtime_services_order() -> None:
    """The fault ``runtime-services-order``: ``set_global_variables`` registers the args without
    building the num-microbatches calculator, which is built, with the same arguments, where
    ``initialize_megatron`` starts (0.18 and later parse before it, so this is where #7418's
    ``initialize_runtime_services`` runs, before ``pretrain()``'s setup) or, where it parses the
    args itself (0.16, 0.17), once it returns."""
    import megatron.training.global_vars as global_vars

    init = global_vars.init_num_microbatches_calculator
    deferred: list[tuple[tuple, dict]] = []

    def build_deferred() -> None:
        while deferred:
            args, kwargs = deferred.pop(0)
            init(*args, **kwargs)
            print(
                "runtime-services-order: the num-microbatches calculator built after parsing",
                flush=True,
            )

    def later(*args: Any, **kwargs: Any) -> None:
        deferred.append((args, kwargs))

    global_vars.init_num_microbatches_calculator = later

    def services_apart(initialize_megatron: Callable) -> Callable:
        @functools.wraps(initialize_megatron)
        def initialize(*args: Any, **kwargs: Any) -> Any:
            build_deferred()
            result = initialize_megatron(*args, **kwargs)
            build_deferred()
            return result

        return initialize

    patch_everywhere("megatron.training.initialize", "initialize_megatron", services_apart)


def reinstall() -> None:
    """The fault ``reinstall-at:K``: after iteration K, install() with another config (--ga-checks
    flipped), while the model config still holds the first installation's finalize and the optimizer
    its step wrapper."""
    import dataclasses

    import megatron_ga_ext
    from megatron_ga_ext.integration.lifecycle import installed

    config = installed().config
    megatron_ga_ext.install(
        dataclasses.replace(config, checks="async" if config.checks == "sync" else "sync")
    )


def current_iteration() -> int:
    """The iteration the training loop is running (1-based, as Megatron logs it)."""
    from megatron.training.global_vars import get_args

    return get_args().curr_iteration + 1


def _pp_multiplied(get_forward_backward_func: Callable) -> Callable:
    """The fault ``pp-multiplied-microbatches``: num_microbatches x PP reaches the schedule."""

    @functools.wraps(get_forward_backward_func)
    def get(*args: Any, **kwargs: Any) -> Callable:
        from megatron.core import parallel_state

        forward_backward = get_forward_backward_func(*args, **kwargs)
        pp = parallel_state.get_pipeline_model_parallel_world_size()

        def multiplied(*f_args: Any, **f_kwargs: Any) -> Any:
            if not f_kwargs.get("forward_only"):
                f_kwargs["num_microbatches"] *= pp
            return forward_backward(*f_args, **f_kwargs)

        return multiplied

    return get


def _unwrapped(get_forward_backward_func: Callable) -> Callable:
    """The fault ``bypass-hooks``: the training loop gets the schedule install() wrapped, unwrapped
    (the original upstream function, as a loop that bound it before install() would hold)."""

    @functools.wraps(get_forward_backward_func)
    def get(*args: Any, **kwargs: Any) -> Callable:
        forward_backward = get_forward_backward_func(*args, **kwargs)
        return getattr(forward_backward, "__wrapped__", forward_backward)

    return get


#: The faults that replace a Megatron function: (module, name, make the replacement from the
#: original).
FAULTS = {
    "pp-multiplied-microbatches": (
        "megatron.core.pipeline_parallel",
        "get_forward_backward_func",
        _pp_multiplied,
    ),
    "bypass-hooks": ("megatron.core.pipeline_parallel", "get_forward_backward_func", _unwrapped),
}


def patch_everywhere(module_name: str, name: str, make: Callable[[Callable], Callable]) -> None:
    """``module_name.name`` replaced by ``make(it)`` in every loaded module that bound it by
    name."""
    original = getattr(sys.modules[module_name], name)
    replacement = make(original)
    for module in list(sys.modules.values()):
        if getattr(module, name, None) is original:
            setattr(module, name, replacement)


def apply_faults(faults: dict[str, int | None]) -> None:
    """Before the script runs: the faults that patch Megatron (:data:`FAULTS`,
    ``ddp-before-per-token-flag``, ``late-install``, ``runtime-services-order``); the others act
    through the
    :class:`~tests.support.recorder.Recorder`."""
    for fault in faults:
        if fault in FAULTS:
            patch_everywhere(*FAULTS[fault])
    if "ddp-before-per-token-flag" in faults:
        ddp_before_per_token_flag()
    if "late-install" in faults:
        late_install()
    if "runtime-services-order" in faults:
        runtime_services_order()
