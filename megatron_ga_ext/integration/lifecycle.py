"""``install()`` / ``uninstall()``: the extension on and off in this process, and the one live
installation.

install() checks each hooked function's source fingerprint against the tested sources (compat.py),
then wires the hook table (hooks.py: every target, how it is wrapped, the phase it serves); the
phases run in installation.py.

A name bound elsewhere by ``from x import y`` before install() (megatron.training.training binds
``finalize_model_grads``) is rebound too: every loaded module whose global holds the original is
patched. A model config that already holds upstream's ``finalize_model_grads`` (a loop that set it
before install()) gets the extension's at the next forward/backward call, and a training step that
never reached the extension's finalize in token mode is an error. uninstall() puts back every
original: in the modules patched, in modules imported since that bound a replacement, and in model
configs.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.config.install_check import check_args
from megatron_ga_ext.integration.acceptance import check_targets
from megatron_ga_ext.integration.calculator_adoption import unguard_live_calculator
from megatron_ga_ext.integration.compat import TARGETS, matching_sources, megatron_core_version
from megatron_ga_ext.integration.hooks import wire, wired_line
from megatron_ga_ext.integration.host import Host, current_host, use_core_loop
from megatron_ga_ext.integration.installation import Installation
from megatron_ga_ext.integration.wiring import correction_of
from megatron_ga_ext.logs import get_logger

__all__ = ["install", "installed", "uninstall", "wire_vendored"]

logger = get_logger(__name__)

#: The live installation. install(), uninstall() and installed() take no handle (a training script
#: calls install() once at its top, and a vendored tree's patched modules call wire_vendored() with
#: their name only), so the one installation of the process is kept here, set by install() and
#: wire_vendored(), cleared by uninstall().
_live: Installation | None = None


def installed() -> Installation | None:
    """The live installation, if any."""
    return _live


def install(
    config: GAConfig | argparse.Namespace | None = None, *, host: Host | None = None
) -> Installation:
    """Turn the extension on. ``config``: a :class:`GAConfig`, Megatron's parsed args, or None:
    Megatron's parsed args once they exist (read at the first hook that runs), else the defaults
    (token mode, strict). Twice is harmless; a different config replaces the installation. Before or
    after Megatron builds its num-microbatches calculator, at argument parsing or in
    initialize_runtime_services (Megatron-LM #7418): one built after is built through the hook, one
    built before is adopted here (calculator_adoption.py). ``host``: a megatron-core loop of the
    caller's own (core_loop.CoreLoop), where neither Megatron-LM's nor Bridge's runs."""
    global _live
    use_core_loop(host if host is not None else Host())
    resolved, waiting = _resolve_config(config)
    current = _live
    if current is not None:
        if config is None or current.config == resolved:
            return current
        if current.vendored:  # the tree is wired already (patches/): only the config changes
            current.waiting_for_args = False
            current.configure(resolved)
            return current
        uninstall()
    import megatron.core.distributed.finalize_model_grads
    import megatron.core.num_microbatches_calculator
    import megatron.core.pipeline_parallel.schedules  # noqa: F401

    version = megatron_core_version()
    # Waiting for Megatron's args, strictness is theirs to decide (--no-ga-strict): refused at the
    # first hook.
    problems = check_targets(
        version,
        resolved.strict and not waiting,
        TARGETS,
        accept=resolved.accept_source,
        correction=correction_of,
    )
    args = config if config is not None and not isinstance(config, GAConfig) else None
    if config is None and not waiting:
        args = current_host().parsed_args()
    if args is not None:
        check_args(resolved, args)
    sources = ", ".join(matching_sources()) or "no single tested source"
    state = Installation(config=resolved, version=version, waiting_for_args=waiting)
    state.wiring.compat_problems = problems
    state.configure(resolved)
    try:
        wire(state)
        state.adopt_live_calculator()  # one Megatron built before install(): calculator_adoption.py
    except BaseException:
        state.restore()
        raise
    if current is not None:
        current.successor = (
            state  # wrappers that outlive the old installation (an optimizer's step) follow it
        )
    _live = state
    if waiting:
        logger.info(
            "megatron-ga-ext installed on megatron-core %s (hooked functions as in %s); its "
            "configuration is read from Megatron's args once they are parsed",
            version,
            sources,
        )
    else:
        logger.info(
            "megatron-ga-ext installed on megatron-core %s (hooked functions as in %s): %s",
            version,
            sources,
            resolved,
        )
    logger.info(
        "megatron-ga-ext: %s; a host loop's rows follow once it is loaded", wired_line(state)
    )
    return state


def wire_vendored(module_name: str) -> None:
    """Called at the end of each patched upstream module of a vendored tree (patches/): wire that
    module into the one installation, which reads Megatron's args at its first hook like
    install()."""
    global _live
    if _live is None:
        _live = Installation(
            config=GAConfig(), version=megatron_core_version(), vendored=True, waiting_for_args=True
        )
        _live.configure(_live.config)
    wire(_live, module_name)


def uninstall() -> None:
    """Restore every original install() replaced; harmless when nothing is installed."""
    global _live
    state, _live = _live, None
    use_core_loop(Host())
    if state is None:
        return
    state.restore()
    unguard_live_calculator()
    if state.finalize is not None:
        state.finalize.poll(
            wait=True
        )  # --ga-checks async: the last step's checks, everything restored first


def _resolve_config(config: GAConfig | argparse.Namespace | None) -> tuple[GAConfig, bool]:
    """(config, waiting): waiting when Megatron's training code exists but has not parsed its args
    yet."""
    if isinstance(config, GAConfig):
        return config, False
    if config is not None:
        return GAConfig.from_args(config), False
    args = current_host().parsed_args()
    if args is not None:
        return GAConfig.from_args(args), False
    return GAConfig(), _has_megatron_training()


def _has_megatron_training() -> bool:
    """Megatron-LM's training package is there (it is not in the megatron-core wheel)."""
    if "megatron.training" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False
