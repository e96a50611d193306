"""The rules of validate_args on the batch and the run's length, declared for ``megatron-ga check``.
Pure Python.

Each mirrors an assertion of megatron/training/arguments.py (its line at each tested source in
``source``), or is ours (``ours`` says why). launch/registry.py evaluates them over the launch's
view (launch/view.py).
"""

from __future__ import annotations

from megatron_ga_ext.core.megatron_flags import BY_DEST
from megatron_ga_ext.core.rules import nearest_multiples
from megatron_ga_ext.core.schedule.stages import FLAG as SCHEDULE_FLAG
from megatron_ga_ext.launch.report import Edit
from megatron_ga_ext.launch.rule import ARGS, Rule, cite
from megatron_ga_ext.launch.view import View

__all__ = ["BATCH_RULES"]


def flag(dest: str) -> str:
    """The flag of ``dest`` as Megatron's parser spells it (edits give and drop flags so)."""
    return BY_DEST[dest].flag


def give(dest: str, value: object = None) -> Edit:
    return Edit(give=((flag(dest), () if value is None else (str(value),)),))


def drop(*dests: str) -> Edit:
    return Edit(drop=tuple(flag(d) for d in dests))


def _given(view: View, *dests: str) -> bool:
    return all(d in view.given for d in dests)


# -- the batch
# -------------------------------------------------------------------------------------------


def _batch_size_edit(view: View) -> Edit:
    """--batch-size out; its value as --micro-batch-size where the line has none."""
    edit = drop("batch_size")
    if "micro_batch_size" not in view.given and view["batch_size"] is not None:
        edit += give("micro_batch_size", view["batch_size"])
    return edit


def _eval_broken(view: View) -> bool:
    """The eval batch divides by eval MBS x DP; unless given, it is the global batch, whose own rule
    reports it (core/layout.py), except where --decrease-batch-size-if-needed rounds the global
    batch and not the eval one."""
    gbs, mbs, dp = (
        view["eval_global_batch_size"],
        view["eval_micro_batch_size"],
        view["data_parallel_size"],
    )
    eval_given = _given(view, "eval_global_batch_size") or _given(view, "eval_micro_batch_size")
    if None in (gbs, mbs, dp) or not (eval_given or view["decrease_batch_size_if_needed"]):
        return False
    return bool(gbs % (mbs * dp) != 0)


def _eval_nearest(view: View) -> list[int]:
    step = view["eval_micro_batch_size"] * view["data_parallel_size"]
    return nearest_multiples(view["eval_global_batch_size"], step)


def _eval_default(view: View) -> bool:
    return "eval_global_batch_size" not in view.given


def _eval_edit(view: View) -> Edit:
    """The nearest valid eval batch; where it is the global batch (rounded by
    --decrease-batch-size-if-needed), the global batch the run trains at, which every release
    accepts."""
    given, step = (
        view["eval_global_batch_size"],
        view["eval_micro_batch_size"] * view["data_parallel_size"],
    )
    if _eval_default(view):
        return give("global_batch_size", given // step * step or step)
    return give(
        "eval_global_batch_size", min(_eval_nearest(view), key=lambda v: (abs(v - given), v))
    )


def _eval_given(view: View) -> str:
    default = " (--global-batch-size, its default)" if _eval_default(view) else ""
    return (
        f"--eval-global-batch-size {view['eval_global_batch_size']}{default} with "
        "--eval-micro-batch-size "
        f"{view['eval_micro_batch_size']} x data-parallel size {view['data_parallel_size']}"
    )


def _eval_fix(view: View) -> str:
    nearest = f"Nearest valid --eval-global-batch-size: {', '.join(map(str, _eval_nearest(view)))}"
    return nearest + (
        "; or give the --global-batch-size the run trains at." if _eval_default(view) else "."
    )


BATCH_SIZE_REMOVED = Rule(
    id="batch-size-removed",
    about="batch_size",
    reads=("batch_size",),
    broken=lambda v: _given(v, "batch_size"),
    given=lambda v: f"{v.named('batch_size')} is given",
    says="--batch-size argument is no longer valid, use --micro-batch-size instead",
    fix="Drop --batch-size; give the micro-batch as --micro-batch-size.",
    edit=_batch_size_edit,
    source=cite(ARGS, 414, 482, 589, 573, 591),
)

EVAL_BATCH = Rule(
    id="eval-global-batch-size",
    about="eval_global_batch_size",
    reads=(
        "eval_global_batch_size",
        "eval_micro_batch_size",
        "data_parallel_size",
        "decrease_batch_size_if_needed",
    ),
    broken=_eval_broken,
    given=_eval_given,
    says=lambda v: (
        f"eval_global_batch_size ({v['eval_global_batch_size']}) must be divisible by "
        f"eval_micro_batch_size ({v['eval_micro_batch_size']}) * data_parallel_size "
        f"({v['data_parallel_size']})"
    ),
    fix=_eval_fix,
    edit=_eval_edit,
    source=cite(ARGS, None, None, 710, 694, 715),
)

RL_PACKING = Rule(
    id="rl-sequence-packing",
    about="micro_batch_size",
    reads=("perform_rl_step", "rl_use_sequence_packing", "micro_batch_size"),
    broken=lambda v: (
        bool(v["perform_rl_step"] and v["rl_use_sequence_packing"])
        and v["micro_batch_size"] not in (1, None)
    ),
    given=lambda v: f"--rl-use-sequence-packing with {v.named('micro_batch_size')}",
    says="micro_batch_size must be 1 when using sequence packing. To increase compute per micro "
    "batch increase "
    "the sequence length.",
    fix="Use --micro-batch-size 1 (a longer sequence packs more).",
    edit=lambda v: give("micro_batch_size", 1),
    source=cite(ARGS, 387, 455, 562, 546, 564),
)


def _grpo_samples(view: View) -> int:
    """Samples one inference iteration generates: prompts per step x group size x GRPO
    iterations."""
    return int(view["grpo_prompts_per_step"] * view["grpo_group_size"] * view["grpo_iterations"])


RL_SAMPLES = Rule(
    id="rl-global-batch-size",
    about="global_batch_size",
    reads=(
        "perform_rl_step",
        "grpo_prompts_per_step",
        "grpo_group_size",
        "grpo_iterations",
        "global_batch_size",
    ),
    broken=lambda v: (
        bool(v["perform_rl_step"])
        and isinstance(v["global_batch_size"], int)
        and None not in (v["grpo_prompts_per_step"], v["grpo_group_size"], v["grpo_iterations"])
        and _grpo_samples(v) % v["global_batch_size"] != 0
    ),
    given=lambda v: (
        f"--perform-rl-step generating {_grpo_samples(v)} samples per inference iteration "
        "(--grpo-prompts-per-step x --grpo-group-size x --grpo-iterations) with GBS "
        f"{v['global_batch_size']}"
    ),
    says="grpo_group_size * grpo_prompts_per_step * grpo_iterations should be divisible by "
    "global_batch_size",
    fix="Give a --global-batch-size that divides the samples generated per inference iteration.",
    source=cite(ARGS, 373, 576, 719, 703, 727),
)

SCHEDULE_AND_GBS = Rule(
    id="schedule-and-global-batch-size",
    about="global_batch_size",
    reads=("step_batch_size_schedule", "global_batch_size"),
    broken=lambda v: _given(v, "step_batch_size_schedule", "global_batch_size"),
    given=lambda v: f"{v.flag('global_batch_size')} is given together with {SCHEDULE_FLAG}",
    says="Cannot specify both --step-batch-size-schedule and --global-batch-size",
    fix="Drop --global-batch-size (the schedule sets the batch size).",
    edit=lambda v: drop("global_batch_size"),
    source=cite(ARGS, None, None, 696, 680, 698),
)

# -- the run's length: iterations or samples, never both
# -------------------------------------------------


def _iters_run(view: View) -> bool:
    return _given(view, "train_iters") and not _given(view, "train_samples")


def _samples_run(view: View) -> bool:
    return _given(view, "train_samples") and not _given(view, "train_iters")


def _unit(
    twin: str, dest: str, says: str, run: str, lines: tuple[int, ...], zero_ok: bool = False
) -> Rule:
    """``dest`` given in the other unit than the run's (``run``: train_iters or train_samples)."""
    in_run = _iters_run if run == "train_iters" else _samples_run
    counted = "iterations" if run == "train_iters" else "samples"
    return Rule(
        id="train-length-units",
        about=dest,
        reads=(run, dest),
        broken=lambda v: in_run(v) and _given(v, dest) and not (zero_ok and v[dest] == 0),
        given=lambda v: f"{v.named(dest)} with {v.named(run)} (a run counted in {counted})",
        says=says,
        fix=f"Give {flag(twin)} instead.",
        edit=lambda v: drop(dest),
        source=cite(ARGS, *lines),
    )


TRAIN_LENGTH_BOTH = Rule(
    id="train-length-units",
    about="train_iters",
    reads=("train_iters", "train_samples"),
    broken=lambda v: _given(v, "train_iters", "train_samples"),
    given=lambda v: f"{v.named('train_iters')} and {v.named('train_samples')} are both given",
    says="expected iteration-based training",
    fix="Keep one of them.",
    source=cite(ARGS, 759, 1050, 1230, 1239, 1279),
)

TRAIN_LENGTH_UNITS = (
    _unit("lr_decay_iters", "lr_decay_samples", "expected iteration-based learning rate decay", "train_iters",
          (761, 1052, 1232, 1241, 1281)),
    _unit("lr_warmup_iters", "lr_warmup_samples", "expected iteration-based learning rate warmup", "train_iters",
          (763, 1054, 1234, 1243, 1283), zero_ok=True),
    _unit("lr_decay_samples", "lr_decay_iters", "expected sample-based learning rate decay", "train_samples",
          (777, 1068, 1246, 1255, 1295)),
    _unit("lr_warmup_samples", "lr_warmup_iters", "expected sample-based learnig rate warmup", "train_samples",
          (779, 1070, 1248, 1257, 1297), zero_ok=True),
)  # fmt: skip


def _wsd(dest: str, twin: str, run: str) -> Rule:
    """Megatron reads the WSD decay in the run's unit only (training.py
    get_optimizer_param_scheduler)."""
    return Rule(
        id="train-length-units",
        about=dest,
        reads=(run, dest),
        broken=lambda v: (
            (_iters_run(v) if run == "train_iters" else _samples_run(v)) and _given(v, dest)
        ),
        given=lambda v: f"{v.named(dest)} with {v.named(run)}",
        says=f"Megatron reads the WSD decay of a run counted by {flag(run)} from {flag(twin)} "
        "only, so this value is ignored (no assertion: the decay silently falls back to its "
        "default)",
        fix=f"Give {flag(twin)} instead.",
        edit=lambda v: drop(dest),
        ours="upstream has no assertion: megatron/training/training.py reads only the run's "
        "unit, silently",
    )


WSD_UNITS = (
    _wsd("lr_wsd_decay_samples", "lr_wsd_decay_iters", "train_iters"),
    _wsd("lr_wsd_decay_iters", "lr_wsd_decay_samples", "train_samples"),
)


def _fraction(twin: str, run: str, lines: tuple[int, ...]) -> Rule:
    """--lr-warmup-fraction with a warmup length in the run's unit."""
    in_run = _iters_run if run == "train_iters" else _samples_run
    return Rule(
        id="lr-warmup-fraction",
        about=twin,
        reads=("lr_warmup_fraction", twin, run),
        broken=lambda v: (
            in_run(v) and v["lr_warmup_fraction"] is not None and v[twin] not in (0, None)
        ),
        given=lambda v: f"{v.named('lr_warmup_fraction')} with {v.named(twin)}",
        says=f"can only specify one of lr-warmup-fraction and {flag(twin)[2:]}",
        fix=f"Keep one of --lr-warmup-fraction and {flag(twin)}.",
        edit=lambda v: drop(twin),
        source=cite(ARGS, *lines),
    )


LR_WARMUP_FRACTION = (
    _fraction("lr_warmup_iters", "train_iters", (768, 1059, 1237, 1246, 1286)),
    _fraction("lr_warmup_samples", "train_samples", (782, 1073, 1251, 1260, 1300)),
)

BATCH_RULES: tuple[Rule, ...] = (
    BATCH_SIZE_REMOVED,
    EVAL_BATCH,
    RL_PACKING,
    RL_SAMPLES,
    SCHEDULE_AND_GBS,
    TRAIN_LENGTH_BOTH,
    *TRAIN_LENGTH_UNITS,
    *WSD_UNITS,
    *LR_WARMUP_FRACTION,
)
