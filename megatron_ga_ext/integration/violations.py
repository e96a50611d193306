"""``--ga-on-violation``: what a run-time check does when a step breaks its rule.

``stop`` (the default): the check's error stops training, before the optimizer step (``--ga-checks
sync``) or right after it (``async``), as it always has. ``log``: an observe mode for a pilot, in
which the error is logged once per kind (its rule, the iteration it was first seen at), counted
(``ga-violations/<kind>`` to the loop's TensorBoard and W&B writers at every violating step, through
the host port), and training goes on: finalize still divides by the step's N, the guards' counts
move on. Start-up refusals (a refused setting, a refused hooked function, ranks that disagree) stop
in either mode: a configuration that cannot be right is not piloted.

A check site wraps its check in :func:`observed`: nothing else changes at the site, and nothing runs
per step beyond the check itself where nothing is violated.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from megatron_ga_ext.errors import GAError
from megatron_ga_ext.integration.host import current_host
from megatron_ga_ext.logs import get_logger

__all__ = ["ON_VIOLATION", "VIOLATIONS", "Violations", "observed"]

logger = get_logger(__name__)

#: ``--ga-on-violation``'s choices.
ON_VIOLATION = ("stop", "log")


class Violations:
    """The violations a ``log`` run has seen: counted per kind; each kind logged once (its
    first)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def record(self, kind: str, error: GAError) -> None:
        """One violation of ``kind``: logged where it is the kind's first, counted, sent to the
        writers."""
        host = current_host()
        iteration = host.iteration()
        self.counts[kind] += 1
        if self.counts[kind] == 1:
            at = f"iteration {iteration}" if iteration is not None else "a step"
            logger.warning(
                "megatron-ga-ext --ga-on-violation log: %s broke the rule '%s' (%s: %s); "
                "training goes on, and further violations of this rule are counted "
                "(ga-violations/%s), not logged",
                at,
                kind,
                type(error).__name__,
                error,
                kind,
            )
        if iteration is not None:
            host.record_metrics({f"ga-violations/{kind}": float(self.counts[kind])}, iteration)


#: This process's violations (a run has one training loop).
VIOLATIONS = Violations()


class observed:
    """Run a run-time check: its error stops training under ``--ga-on-violation stop``, is recorded
    under ``log``. A class, not a generator: entered at a few sites per step, where nothing else
    runs beside the check."""

    __slots__ = ("config", "kind")

    def __init__(self, config: Any, kind: str) -> None:
        self.config, self.kind = config, kind

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: Any
    ) -> bool:
        if not isinstance(error, GAError) or getattr(self.config, "on_violation", "stop") != "log":
            return False
        VIOLATIONS.record(self.kind, error)
        return True
