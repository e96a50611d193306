"""A coverage row and the launch it is applied to: :class:`Setting` (Megatron's values and the
extension's settings), :class:`Row` (a flag, where it matters, and one behaviour: supported, limited
or refused) and
:class:`Proof` (the test that runs it). Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_ga_ext.config.flags import (
    BY_DEST,
    CHECKS,
    CONVERT_RAMPUP,
    LOSS_REDUCTION,
    ZERO_TOKEN_POLICY,
)
from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.config.megatron_args import MegatronArgs
from megatron_ga_ext.core.megatron_flags import COVERED_OPTIONS, MEGATRON_OPTIONS

__all__ = ["READ", "SCOPE_DEPRECATED", "Proof", "Row", "Setting", "Support", "Upstream"]

Support = Literal["supported", "limited", "refused"]
#: How a note of ``megatron-ga check`` starts: ``wrong`` changes what the run trains, ``careful``
#: may, ``info`` not.
Severity = Literal["wrong", "careful", "info"]

#: Where 0.18 and later parse --cuda-graph-scope (validate_args moves it into cuda_graph_modules,
#: and a full_iteration scope into --cuda-graph-impl full_iteration).
SCOPE_DEPRECATED = "cuda_graph_scope_deprecated"
#: Megatron's args the rows read: argparse destinations.
READ = (*dict.fromkeys(o.dest for o in (*MEGATRON_OPTIONS, *COVERED_OPTIONS)), SCOPE_DEPRECATED)


@dataclass(frozen=True)
class Setting:
    """One launch as the rows see it: Megatron's values by argparse destination (absent: Megatron's
    default) and the extension's settings."""

    values: Mapping[str, Any] = field(default_factory=dict)
    loss_reduction: str = LOSS_REDUCTION.default
    zero_token_policy: str = ZERO_TOKEN_POLICY.default
    checks: str = CHECKS.default
    convert_rampup: bool = CONVERT_RAMPUP.default

    @classmethod
    def of(cls, args: Any, config: GAConfig) -> Setting:
        """From Megatron's parsed ``args`` (None: a megatron-core loop without them) and the
        installed ``config``."""
        view = MegatronArgs.of(args)
        values = {dest: view.get(dest) for dest in READ if view.has(dest)}
        return cls(
            values,
            config.loss_reduction,
            config.zero_token_policy,
            config.checks,
            config.convert_rampup,
        )

    def value(self, dest: str) -> Any:
        if dest in self.values:
            return self.values[dest]
        return BY_DEST[dest].default if dest in BY_DEST else None

    def names(self, dest: str) -> list[str]:
        """A value as a list of names: an enum by its name (0.16's CudaGraphScope), one string as a
        list of one."""
        value = self.value(dest)
        if value is None:
            return []
        items = value if isinstance(value, (list, tuple)) else [value]
        return [str(getattr(item, "name", item)) for item in items]

    def on(self, dest: str) -> bool:
        return bool(self.value(dest))

    def number(self, dest: str) -> int:
        """An integer value (a launch line gives text); 0 where absent or not a number."""
        try:
            return int(self.value(dest) or 0)
        except (TypeError, ValueError):
            return 0

    @property
    def token(self) -> bool:
        return self.loss_reduction == "token"


@dataclass(frozen=True, kw_only=True)
class Proof:
    """A test that runs the row: a pytest node id, and the row of that test's table where it checks
    many."""

    test: str
    case: str = ""

    def __str__(self) -> str:
        return f"`{self.test}`" + (f" ({self.case})" if self.case else "")


@dataclass(frozen=True, kw_only=True)
class Upstream:
    """A defect of upstream Megatron itself that a row records: what a launch *without* the
    extension gets. ``megatron-ga check`` reports it (a problem where it changes the gradients,
    ``wrong``; a note where it may, ``careful``) and docs/coverage.md lists it, both from this
    declaration."""

    given: str
    """The launch that meets it, e.g. ``--use-torch-fsdp2 with --calculate-per-token-loss``."""
    effect: str
    """What upstream does: the factor or the silent change, one clause."""
    severity: Literal["wrong", "careful"]
    fix: str
    """What to do, one sentence."""
    applies: Callable[[Setting], bool]
    """True for a launch without the extension that meets it."""
    drop: tuple[str, ...] = ()
    """Flags whose removal fixes it (check verifies the edit)."""
    entry: bool = False
    """Running the script through ``-m megatron_ga_ext`` fixes it (check verifies the edit)."""
    brief: str = ""
    """``careful`` ones: the note, one plain line (about 25 words) with the fix."""


@dataclass(frozen=True, kw_only=True)
class Row:
    """One row of the table; see the module docstring."""

    id: str
    """A short name: the parametrize id of the row's tests."""
    flags: tuple[str, ...]
    """The flags of Megatron's parser the row is about (a test checks each against the parsers)."""
    given: str
    """The flags and values as the table and the messages name them."""
    when: str = ""
    """The condition beyond the flags: the loss mode, another ``--ga-*`` flag ("" for any)."""
    support: Support
    text: str
    """supported: what holds; limited: the limit; refused: why the guarantee cannot hold."""
    instead: str = ""
    """refused: what to do instead."""
    proofs: tuple[Proof, ...] = ()
    replays: bool = False
    """The launch's iterations replay a captured graph without the extension's Python hooks, by
    design: the per-iteration liveness check (integration/liveness.py) does not count them."""
    applies: Callable[[Setting], bool]
    brief: str = ""
    """limited and refused rows: the row in one plain line (about 25 words), ``megatron-ga check``'s
    note."""
    severity: Severity = "careful"
    """limited rows: how the note starts (``careful`` where the gradients may differ from the
    target, ``info`` where only the proof is missing)."""
    upstream: tuple[Upstream, ...] = ()
    """The defects of upstream itself the row records, for a launch without the extension."""

    @property
    def case(self) -> str:
        return self.given + (f" {self.when}" if self.when else "")

    def message(self) -> str:
        if self.support == "refused":
            return f"megatron-ga-ext refuses {self.case}: {self.text} {self.instead}"
        return f"{self.case}: {self.text}"
