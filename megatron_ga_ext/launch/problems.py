"""Every problem of a launch line, each from the rule it breaks (``megatron-ga check``). Pure
Python.

The rules are the ones a run is held to: Megatron's parser (flags it does not define, stray words,
repeats), the registry's rules of validate_args (launch/registry.py), the one schedule of the launch
(launch/schedule_problems.py: every entry that does not parse, every stage against the layout), the
layer split and the batch arithmetic (``core/layout.py``), install()'s own rule pass
(config/launch_rules.py), the coverage table's refusals with the extension on the line and, without
it, the upstream defects its rows record (``config/coverage/``). launch/check.py gathers them into
one report and checks each fix that is an edit of the line against all of them.
"""

from __future__ import annotations

from megatron_ga_ext.config.coverage import Setting, verdict
from megatron_ga_ext.config.coverage.upstream import upstream_traps
from megatron_ga_ext.config.flags import GA_FLAGS, LOSS_REDUCTION, closest_choice
from megatron_ga_ext.config.launch_rules import named_launch_errors
from megatron_ga_ext.config.megatron_args import MegatronArgs
from megatron_ga_ext.core.layout import BatchLayout
from megatron_ga_ext.core.megatron_flags import COVERED_OPTIONS, MEGATRON_OPTIONS, NOT_MEGATRON
from megatron_ga_ext.core.schedule.stages import FLAG as SCHEDULE_FLAG
from megatron_ga_ext.errors import GAError
from megatron_ga_ext.launch.line import Launch, ga_values
from megatron_ga_ext.launch.line_layout import read_ints
from megatron_ga_ext.launch.report import Edit, Note, Problem, problem_of

__all__ = [
    "coverage_problems",
    "launch_args",
    "launch_notes",
    "launch_setting",
    "line_problems",
    "loss_reduction_note",
    "rule_problems",
    "upstream_findings",
]


# -- Megatron's parser
# ----------------------------------------------------------------------------------


def line_problems(launch: Launch) -> list[Problem]:
    """What Megatron's parser itself refuses: flags it does not define, words it cannot place; and
    repeats."""
    problems = [
        Problem(
            message=f"{launch.name(flag)} is given {len(vals)} times "
            f"({', '.join(' '.join(v) for v in vals)}); "
            f"Megatron keeps the last ({' '.join(vals[-1])}). Give it once.",
            rule="repeated-flag",
            flag=launch.name(flag),
            value=" ".join(vals[-1]),
            fix="Give it once.",
        )
        for flag, vals in launch.repeated.items()
    ]
    for flag, values in launch.not_megatron.items():
        problems.append(
            Problem(
                message=f"{flag} {' '.join(values)} is not a flag of Megatron's parser (no "
                "tested release, "
                f'core_v0.16.1 to main, defines it): Megatron stops with "unrecognized arguments". '
                f"{NOT_MEGATRON[flag]}.",
                rule="unknown-flag",
                flag=flag,
                value=" ".join(values),
                fix=f"{NOT_MEGATRON[flag]}.",
                edit=Edit(drop=(flag,)),
            )
        )
    for flag, words in launch.stray.items():
        problems.append(_stray_problem(launch, flag, words))
    return problems


def _stray_problem(launch: Launch, flag: str, words: list[str]) -> Problem:
    given = f"{launch.name(flag)} {' '.join(launch.values[flag])}"
    if flag == SCHEDULE_FLAG and all(":" in w for w in words):
        whole = " ".join([*launch.values[flag], *words])
        fix = f'Quote the whole schedule: {flag} "{whole}"'
        return Problem(
            message=f"{given} is followed by {' '.join(words)}: the schedule was split into "
            "words (an unquoted shell "
            f"variable or array?), so Megatron reads only {launch.values[flag][0]!r} and stops "
            'with "unrecognized '
            f'arguments: {" ".join(words)}". {fix} (its stages are checked as if quoted).',
            rule="split-schedule",
            flag=launch.name(flag),
            value=launch.values[flag][0],
            fix=fix + ".",
        )
    return Problem(
        message=f"{given} is followed by {' '.join(words)}, which no flag takes: Megatron's "
        "parser has no positional "
        f'arguments and stops with "unrecognized arguments: {" ".join(words)}". Drop them, or '
        "quote the value.",
        rule="stray-words",
        flag=launch.name(flag),
        value=" ".join(launch.values[flag]),
        fix="Drop them, or quote the value.",
    )


# -- the extension's rule pass
# ---------------------------------------------------------------------------


#: install()'s rules that hold of a plain Megatron line too: --train-iters with a step schedule
#: (ours: Megatron sizes the LR schedule and the dataset with MBS x DP while each step advances by
#: the stage's GBS).
_PLAIN_RULES = frozenset({"train-length"})


def rule_problems(launch: Launch, layout: BatchLayout | None) -> list[Problem]:
    """The rule pass install() runs (config/launch_rules.py), over the line's --ga-* flags and
    Megatron's: each problem named by its rule, with the edit that fixes it where there is one.
    Without the extension on the line only :data:`_PLAIN_RULES` hold: the rest are its own, and
    their fixes name its flags (Megatron's parser rejects --ga-*)."""
    values = ga_values(launch)
    problems = []
    for rule, error in named_launch_errors(values, launch_args(launch, layout)):
        if not launch.extension and rule not in _PLAIN_RULES:
            continue
        problems.append(problem_of(error, rule, edit=_rule_edit(launch, rule, values)))
    return problems


def _rule_edit(launch: Launch, rule: str, values: dict) -> Edit | None:
    """The edit of the line that fixes a broken rule, where one edit does."""
    if rule.startswith("flag:"):
        option = GA_FLAGS[rule[len("flag:") :]]
        near = closest_choice(option, values.get(option.field)) if option.choices else None
        return Edit(give=((option.flag, (near,)),)) if near else None
    if rule == "loss-mode":
        if values.get(LOSS_REDUCTION.field, LOSS_REDUCTION.default) == "token":
            return Edit(give=(("--calculate-per-token-loss", ()),))
        return Edit(drop=("--calculate-per-token-loss",))
    if rule == "guards":
        return Edit(give=(("--no-ga-guards", ()),))
    if rule == "lr-scaling":
        return Edit(drop=(GA_FLAGS["lr_scaling"].flag,))
    return None


def launch_args(launch: Launch, layout: BatchLayout | None) -> MegatronArgs:
    """Megatron's args as the launch line gives them: its flags by destination (the integers as
    numbers), DP from the layout (None where it is broken), and --calculate-per-token-loss as
    install() leaves it (on in token mode, with the extension on the line; without it the loss mode
    is not ours to check)."""
    values = dict(launch_setting(launch).values)
    values.update(_ints(launch))
    values.pop("world_size", None)
    values["data_parallel_size"] = None if layout is None else layout.data_parallel_size
    mode = ga_values(launch).get(LOSS_REDUCTION.field, LOSS_REDUCTION.default)
    values["calculate_per_token_loss"] = launch.on("--calculate-per-token-loss") or mode == "token"
    return MegatronArgs(values)


def _ints(launch: Launch) -> dict[str, int]:
    try:
        return read_ints(launch)
    except GAError:
        return {}


def launch_setting(launch: Launch) -> Setting:
    """The coverage table's view of a launch line: Megatron's flags it gives, by argparse
    destination (the rest read as Megatron's defaults), and the ``--ga-*`` settings."""
    values: dict[str, object] = {}
    for option in (*MEGATRON_OPTIONS, *COVERED_OPTIONS):
        if option.nargs == 0 and option.flag in launch.switches:
            values[option.dest] = launch.on(option.flag)
        elif option.nargs != 0 and option.flag in launch.values:
            given = launch.values[option.flag]
            values[option.dest] = given[0] if option.nargs == 1 else given
    ga = ga_values(launch)
    return Setting(
        values,
        **{
            name: ga[name]
            for name in ("loss_reduction", "zero_token_policy", "checks", "convert_rampup")
            if name in ga
        },
    )


# -- the coverage table
# -------------------------------------------------------------------------------------


def coverage_problems(launch: Launch) -> list[Problem]:
    """With the extension on the line, each row that refuses the launch (its message names why and
    what instead)."""
    if not launch.extension:
        return []
    return [
        problem_of(row.message(), f"coverage:{row.id}", flag=row.flags[0], fix=row.instead or None)
        for row in verdict(launch_setting(launch)).refused
    ]


def upstream_findings(launch: Launch) -> tuple[list[Problem], list[Note]]:
    """Without the extension on the line, each upstream defect a coverage row records that the
    launch meets: a problem where it changes the gradients, a note where it may."""
    if launch.extension:
        return [], []
    problems, notes = [], []
    for row, trap in upstream_traps(launch_setting(launch)):
        link = f"docs/coverage.md#{row.id}"
        if trap.severity == "wrong":
            edit = Edit(drop=trap.drop, entry=trap.entry) if trap.drop or trap.entry else None
            problems.append(
                Problem(
                    message=f"without megatron-ga-ext, {trap.given}: {trap.effect}. {trap.fix} "
                    f"({link})",
                    rule=f"upstream:{row.id}",
                    flag=row.flags[0],
                    fix=trap.fix,
                    edit=edit,
                )
            )
        else:
            notes.append(
                Note(
                    severity="careful",
                    text=trap.brief or f"{trap.given}: {trap.effect}. {trap.fix}",
                    link=link,
                )
            )
    return problems, notes


def launch_notes(launch: Launch) -> list[Note]:
    """What ``check`` says of a launch line beside its problems: its loss reduction, and the limits
    of the coverage table that apply to it (only where the extension is on the line)."""
    notes = [loss_reduction_note(launch)]
    if launch.extension:
        for row in verdict(launch_setting(launch)).limited:
            notes.append(
                Note(severity=row.severity, text=row.brief, link=f"docs/coverage.md#{row.id}")
            )
    return notes


def loss_reduction_note(launch: Launch) -> Note:
    """The launch's loss reduction: what Megatron runs without the extension, or what the extension
    holds it to; nothing about a mode the line does not set to one of its choices (that is a problem
    of its own)."""
    per_token = launch.on("--calculate-per-token-loss")
    mode = launch.get(LOSS_REDUCTION.flag) or LOSS_REDUCTION.default
    if not launch.extension:
        if per_token:
            return Note(
                severity="info",
                text="per-token loss (--calculate-per-token-loss), as Megatron runs it, "
                "unchecked: megatron-ga-ext is not on this line.",
            )
        return Note(
            severity="info",
            text="upstream's mean of means: each micro-batch's loss over its own tokens, "
            "averaged. megatron-ga-ext is not on this line.",
        )
    if mode not in LOSS_REDUCTION.choices:
        return Note(
            severity="info",
            text=f"loss reduction unknown: {LOSS_REDUCTION.flag} {mode!r} is not a choice (see "
            "the problems).",
        )
    if mode == "token":
        turned = "" if per_token else "; install() turns on --calculate-per-token-loss"
        return Note(
            severity="info",
            text=f"token-level loss ({LOSS_REDUCTION.flag} token), checked every step{turned}.",
        )
    return Note(
        severity="info", text=f"upstream's mean of means ({LOSS_REDUCTION.flag} microbatch)."
    )
