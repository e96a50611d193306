"""The registry of ``megatron-ga check``'s rules: every declaration (launch/rules_*.py) in one
tuple, evaluated in one pass over one resolved view of the launch (launch/view.py); tools/doc_rules.py renders it as
docs/check-rules.md. Pure Python.

:data:`RULES` mirror upstream's validation (each with its file:line per tested source) or are ours (each with the
reason). :data:`ADDITIONS` are what check adds beyond Megatron and decides elsewhere (the schedule's
replay, the coverage table): the oracle tier reads both to know which disagreements are deliberate.
:data:`NOT_APPLIED` lists upstream's batch and parallelism rules that check does not apply, with
why.
"""

from __future__ import annotations

from megatron_ga_ext.launch.report import Problem
from megatron_ga_ext.launch.rule import Rule
from megatron_ga_ext.launch.rules_batch import BATCH_RULES
from megatron_ga_ext.launch.rules_fsdp import FSDP_RULES
from megatron_ga_ext.launch.rules_model import MODEL_RULES
from megatron_ga_ext.launch.rules_parallel import PARALLEL_RULES
from megatron_ga_ext.launch.view import View

__all__ = ["ADDITIONS", "NOT_APPLIED", "RULES", "registry_problems"]

RULES: tuple[Rule, ...] = (*BATCH_RULES, *PARALLEL_RULES, *MODEL_RULES, *FSDP_RULES)

#: What check adds beyond Megatron, decided outside the registry: (rule id, why, where).
ADDITIONS: tuple[tuple[str, str, str], ...] = (
    (
        "train-length",
        "--train-iters with a step schedule: Megatron sizes LR decay and the dataset with MBS x "
        "DP while each step advances by the stage's GBS",
        "config/launch_rules.py",
    ),
    (
        "rampup-ignored",
        "megatron-core >= 0.18 drops --rampup-batch-size on the training path and logs nothing; "
        "0.16 and 0.17 refuse it with --train-iters",
        "launch/schedule_problems.py",
    ),
    (
        "stage-never-reached",
        "a schedule stage after the run's end: Megatron trains without it, silently",
        "launch/stage_table.py",
    ),
    (
        "schedule-stage",
        "a stage whose batch decreases passes validate_args and the calculator, and stops the run "
        'when reached (training.py:3767 at core_v0.19.0: micro-batches "should not decrease")',
        "core/schedule/step_schedule.py",
    ),
    (
        "global-batch-size",
        "with --decrease-batch-size-if-needed the ledger shows the GBS the run trains at (96 for "
        "100 at MBS x DP 32); Megatron's args keep the given 100",
        "launch/check.py",
    ),
    (
        "schedule",
        "a step schedule and a rampup both given: megatron-core >= 0.18 runs the schedule and "
        "drops the rampup silently; check refuses the pair, since the line asks for two "
        "ramps",
        "config/resolve.py",
    ),
    (
        "upstream:<row>",
        "an upstream defect a coverage row records (FSDP2's per-token factor among them)",
        "config/coverage/",
    ),
    (
        "coverage:<row>",
        "the extension's own refusals, only with megatron-ga-ext on the line",
        "config/coverage/",
    ),
)

#: Upstream's batch and parallelism rules check does not apply, and why: (upstream's words,
#: file:line, why).
NOT_APPLIED: tuple[tuple[str, str, str], ...] = (
    (
        "FSDP2 requires PyTorch >= 2.4.0",
        "arguments.py:998 at core_v0.19.0",
        "the torch of the training image: check runs without torch",
    ),
    (
        "FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset",
        "arguments.py:1014 at core_v0.19.0",
        "the environment of the training job, not the line",
    ),
    (
        "num_experts % expert_model_parallel_size == 0",
        "arguments.py:1602 at core_v0.19.0",
        "applied by core/layout.py (the `layout` rule), with the valid EP sizes",
    ),
    (
        "world size divisible by TP x PP x CP; GBS a multiple of MBS x DP; the interleaved "
        "schedule's groups",
        "arguments.py, num_microbatches_calculator.py",
        "applied by core/layout.py (`layout`, `global-batch-size`, `interleave`) and the "
        "schedule's stages (`schedule-stage`)",
    ),
    (
        "the layer split over the pipeline stages",
        "arguments.py, transformer_config.py",
        "applied by launch/layer_split.py (`layer-split`)",
    ),
    (
        "eval_global_batch_size divides by eval_micro_batch_size x DP x gtp_weight_remat_size",
        "arguments.py:715 at d98e8a64",
        "main's GTP factor: check reads no --gtp-* size (1 unless given)",
    ),
)


def registry_problems(view: View) -> list[Problem]:
    """Every rule the launch breaks, in declaration order (a rule of the extension only where it is
    on the line)."""
    return [
        rule.problem(view)
        for rule in RULES
        if (view.extension or not rule.extension_only) and rule.broken(view)
    ]
