"""A theme of the off-path list: flags off the loss, gradient, step and batch path for one reason.
Pure Python.

config/off_path.py and config/off_path_outside.py list the themes; this module is the type both
use, so that neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Theme"]


@dataclass(frozen=True, kw_only=True)
class Theme:
    """Flags off the path for one reason."""

    name: str
    reason: str
    """Why each flag of the theme is off the path: one sentence."""
    flags: tuple[str, ...]
    """Each flag as Megatron's parser spells it, every spelling listed (``--no-<name>`` too)."""
