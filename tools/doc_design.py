"""docs/design.md's two tables, rendered by ``make docs``: the hook table (every row, in phase
order) and the step (each feature of installation.FEATURES in the order it runs, the ``--ga-*``
flags that act in it and its part in each phase; then the flags that act outside the features,
CORE_FLAGS). Kept out of the installed package; tools/docs.py writes them."""

from __future__ import annotations

from megatron_ga_ext.integration import installation
from megatron_ga_ext.integration.features import Feature
from megatron_ga_ext.integration.hooks import PHASES, all_rows

__all__ = ["CORE_FLAGS", "FEATURE_PHASES", "hook_table", "step_table"]

_INTEGRATION = "megatron_ga_ext.integration"

#: The --ga-* flags that act outside the features: where each does (docs/design.md's table of the
#: step).
CORE_FLAGS = {
    "--ga-accept-source": "install() (acceptance.py): the hooked functions whose unknown source is "
    "patched anyway (the probes still run)",
    "--ga-strict": "install() (lifecycle.py): an untested source of a hooked function is refused "
    "(compat.py)",
    "--ga-convert-rampup": "configure_calculator: the rampup as a step schedule (calculator.py)",
    "--ga-checks": "finalize (finalize.py) reads the step's verdict at once, or after the "
    "optimizer step (async)",
    "--ga-zero-token-policy": "finalize (finalize.py): a step of 0 loss tokens stops, or its "
    "optimizer step is skipped",
    "--ga-on-violation": "finalize's checks and the guards' (features/guards.py): a broken step "
    "stops the run, or "
    "is logged once, counted and trained on (violations.py)",
}

#: The phases a feature takes part in, in the order of a training step (hooks.PHASES: the hook
#: table's).
FEATURE_PHASES = (
    "begin_step",
    "micro_batch",
    "end_step",
    "finalize",
    "before_optimizer_step",
    "after_optimizer_step",
    "after_log",
)


def step_table() -> str:
    """The step as markdown (docs/design.md): each feature in the order it runs, the ``--ga-*``
    flags that act in it, and its part in each phase (the first paragraph of its method's docstring;
    "yes" without one); then the flags that act outside the features."""
    header = ["feature", "flags", *FEATURE_PHASES, "checkpoint state"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for feature in (entry.load() for entry in installation.FEATURES):
        parts = []
        for phase in FEATURE_PHASES:
            method = getattr(feature, phase)
            own = method is not getattr(Feature, phase)
            parts.append(_summary(method.__doc__) if own else "")
        state = f"`{feature.name}` (layout {feature.version})" if feature.name else ""
        flags = ", ".join(f"`{flag}`" for flag in feature.flags)
        module = (
            feature.__module__.removeprefix(f"{_INTEGRATION}.")
            .removeprefix("megatron_ga_ext.")
            .replace(".", "/")
        )
        lines.append(
            f"| {feature.__name__} ({module}.py) | {flags} | {' | '.join(parts)} | {state} |"
        )
    lines += ["", "| flag | where it acts |", "|---|---|"]
    lines += [f"| `{flag}` | {where} |" for flag, where in CORE_FLAGS.items()]
    return "\n".join(lines)


def _summary(doc: str | None) -> str:
    """A docstring's first paragraph on one line (a summary may wrap); "yes" without one."""
    return " ".join((doc or "yes").strip().split("\n\n")[0].split())


def hook_table() -> str:
    """The table as markdown, in phase order (docs/design.md)."""
    lines = [
        "| phase | target | wrapped as | wired | fingerprinted | what it does |",
        "|---|---|---|---|---|---|",
    ]
    wired = {
        "import": "at install()",
        "loaded": "once loaded",
        "parser": "at install(), with Megatron-LM",
    }
    for hook in sorted(all_rows(), key=lambda hook: PHASES.index(hook.phase)):
        how = "class attribute" if "." in hook.name else "module global"
        lines.append(
            f"| {hook.phase} | `{hook.qualified}` | {how} | {hook.host}, {wired[hook.load]} | "
            f"{'yes' if hook.fingerprinted else 'no'} | {hook.does} |"
        )
    return "\n".join(lines)
