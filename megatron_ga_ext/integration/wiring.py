"""Which correction each hooked function serves on this source, read from the hook table (the rows
the features declare too), for the verdicts of acceptance.py, which sits below the table and cannot
read it itself."""

from __future__ import annotations

import sys

from megatron_ga_ext.integration import hooks
from megatron_ga_ext.integration.compat import Target

__all__ = ["correction_of"]


def correction_of(target: Target) -> str | None:
    """The name of the correction ``target`` serves where its hook row is wired on this source (the
    wrapper's, or the one that assumes its arithmetic); None where no row for it would be wired here
    (the defect is absent)."""
    every = getattr(hooks, "all_rows", None)  # the features' own rows too
    table = every() if every is not None else hooks.HOOKS
    rows = [
        h for h in table if h.qualified == target.qualified or h.wrap.__name__ == target.assumed_by
    ]
    if not rows:
        return target.assumed_by or ""
    for hook in rows:
        module = sys.modules.get(hook.module)
        if module is None or hook.found_in(module):
            return str(hook.wrap.__name__)
    return None
