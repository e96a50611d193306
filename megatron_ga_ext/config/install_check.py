"""What Megatron's parsed args must agree with when install() reads them (before any model is
built). Pure Python.

The rule pass of config/launch_rules.py over the ``--ga-*`` settings and Megatron's args, then what
only the training machine can check (the trace file's directory: every rank fails here at once, not
the last one alone at iteration K), then the coverage table (config/coverage/; the first
forward/backward call checks it again, for a loop without Megatron's args). ``megatron-ga check``
runs the same pass on a launch line (launch/problems.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from megatron_ga_ext.config.coverage import Setting, verdict
from megatron_ga_ext.config.ga_config import GAConfig
from megatron_ga_ext.config.launch_rules import check_launch, check_trace_path
from megatron_ga_ext.config.megatron_args import MegatronArgs

__all__ = ["check_args"]


def check_args(
    config: GAConfig, args: argparse.Namespace | Mapping[str, Any] | MegatronArgs
) -> None:
    """Raise the first rule the pair breaks (launch_rules.launch_errors), then the trace path's
    (launch_rules.check_trace_path), else the coverage table's refusal."""
    settings = MegatronArgs.of(args)
    check_launch(config.flag_values(), settings)
    check_trace_path(config.noise_scale, config.noise_scale_trace)
    refused = verdict(Setting.of(argparse.Namespace(**settings.values), config)).error()
    if refused is not None:
        raise refused
