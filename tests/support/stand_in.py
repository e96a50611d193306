"""A stand-in for the installation a feature runs under (integration/features/__init__.py's Handle),
for the features' unit tests (tests/features/): what a feature may ask, set by the test, nothing
else."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.integration.loss_contract import LossContract


@dataclass
class StandIn:
    """features.Handle, as a test sets it: token mode has its loss contract, as install() gives
    it."""

    config: GAConfig = field(default_factory=GAConfig)
    steps_bounded: bool = False
    model_configs: dict[Any, Any] = field(default_factory=dict)
    """The TransformerConfig (a stand-in) of each model chunk a test names."""
    contract: LossContract | None = None

    def __post_init__(self) -> None:
        if self.contract is None and self.config.loss_reduction == "token":
            self.contract = LossContract()

    def model_config(self, model: Any) -> Any:
        chunk = model[0] if isinstance(model, (list, tuple)) else model
        return self.model_configs.get(chunk)


class Liveness:
    """An optimizer's liveness (liveness.StepLiveness) that records each check it is asked for."""

    def __init__(self) -> None:
        self.checks: list[tuple[bool, bool]] = []

    def check(self, *, after_step: bool, exempt: bool = False) -> None:
        self.checks.append((after_step, exempt))
