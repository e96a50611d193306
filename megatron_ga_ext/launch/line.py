"""Read the batch arithmetic out of a real launch line (torchrun ... pretrain_gpt.py ...). Pure Python.

Only the flags config/flags.py and core/megatron_flags.py declare are read (Megatron's that decide the batch
arithmetic, the launcher's, the ``--ga-*`` flags, typed as declared); every other flag is passed over with its
values. ``--flag=value`` and ``--flag value`` both work, and ``_`` in a flag counts as ``-`` (torchrun accepts
both spellings); messages name a flag as the line spelled it. Megatron's parser takes no positional arguments,
so words left after a Megatron flag's values (a schedule split by an unquoted shell array) are kept to be
reported: Megatron stops with "unrecognized arguments" there. ``problems.py`` turns a :class:`Launch` into its
problems.
"""

from __future__ import annotations

import copy
import itertools
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_ga_ext.config.flags import BY_DEST, GA_OPTIONS, OPTIONS, GAFlag
from megatron_ga_ext.core.layout import FLAGS
from megatron_ga_ext.core.megatron_flags import LAUNCHER_OPTIONS, NOT_MEGATRON, Option
from megatron_ga_ext.core.numbers import read_int
from megatron_ga_ext.errors import GAError, UsageError
from megatron_ga_ext.launch.layer_split import LayerSplit, VirtualPipeline, virtual_pipeline
from megatron_ga_ext.launch.report import Edit, Note, Problem
from megatron_ga_ext.launch.script import is_script, read_script
from megatron_ga_ext.launch.slurm import Slurm, read_slurm, slurm_world, torchrun_under_slurm

__all__ = [
    "Launch",
    "LaunchLayout",
    "UsageError",
    "ga_values",
    "layout_kwargs",
    "parse_int",
    "parse_launch",
    "read_layout",
]

_LAUNCHER = {option.flag for option in LAUNCHER_OPTIONS}
#: The module of the drop-in entry (megatron_ga_ext/__main__.py).
ENTRY = "megatron_ga_ext"


@dataclass
class Launch:
    """The declared flags of a launch line: the last value of each, and what else the line shows."""

    values: dict[str, list[str]] = field(default_factory=dict)
    """Each flag with values (by its declared spelling): the values of its last occurrence."""
    switches: dict[str, bool] = field(default_factory=dict)
    """Each switch given: on, or off for ``--no-<name>``."""
    repeated: dict[str, list[list[str]]] = field(default_factory=dict)
    spelled: dict[str, str] = field(default_factory=dict)
    """How the line spelled each flag it gave (``--nproc_per_node`` for ``--nproc-per-node``)."""
    stray: dict[str, list[str]] = field(default_factory=dict)
    """Words left after a Megatron flag's values, which Megatron's parser refuses."""
    not_megatron: dict[str, list[str]] = field(default_factory=dict)
    """Flags no Megatron parser defines (NOT_MEGATRON), with their values."""
    entry: bool = False
    """The line runs the drop-in entry: ``python -m megatron_ga_ext SCRIPT`` or ``torchrun ... -m megatron_ga_ext``."""
    slurm: Slurm = field(default_factory=Slurm)
    """srun's (sbatch's, salloc's) options and the allocation's, where Slurm starts the line."""
    read_as: str = "a launch line"
    """How the words were read: a launch line, a pasted script (its arrays expanded)."""
    read_notes: list[Note] = field(default_factory=list)
    """What reading the line found besides its flags: variables taken from the environment."""
    read_problems: list[Problem] = field(default_factory=list)
    """What the shell would do apart from the launch: a continuation line it runs as a command of its own."""

    @property
    def extension(self) -> bool:
        """The extension is on: the drop-in entry, or any ``--ga-*`` flag (a script with install() in it)."""
        return self.entry or any(flag.startswith("--ga-") for flag in (*self.values, *self.switches))

    def get(self, flag: str) -> str | None:
        return self.values[flag][0] if flag in self.values else None

    def on(self, flag: str) -> bool:
        """A switch is on (given, and not as ``--no-<name>``)."""
        return bool(self.switches.get(flag, OPTIONS[flag].default))

    def name(self, flag: str) -> str:
        """``flag`` as the line spelled it."""
        return self.spelled.get(flag, flag)

    def edited(self, edit: Edit) -> Launch:
        """A copy of this line with ``edit`` applied (a flag given replaces its value; repeats and strays go)."""
        line = copy.deepcopy(self)
        line.entry = line.entry or edit.entry
        for spelling, values in edit.give:
            option = OPTIONS[spelling]
            line._forget(option.flag)
            if option.nargs == 0:
                line.switches[option.flag] = not spelling.startswith("--no-")
            else:
                line.values[option.flag] = list(values)
        for spelling in edit.drop:
            if spelling in OPTIONS:
                line._forget(OPTIONS[spelling].flag)
            line.not_megatron.pop(spelling, None)
        return line

    def _forget(self, flag: str) -> None:
        for held in (self.values, self.switches, self.repeated, self.spelled, self.stray):
            held.pop(flag, None)


def _normalize(flag: str) -> str:
    return "--" + flag[2:].replace("_", "-")


def parse_launch(tokens: list[str], environment: Mapping[str, str] | None = None) -> Launch:
    """Collect the declared flags of ``tokens``; a single token holding a whole line is split like a shell, and a
    pasted script is read as the shell reads it (launch/script.py; ``environment`` stands in for os.environ)."""
    launch = Launch()
    sbatch: list[str] = []
    if len(tokens) == 1 and is_script(tokens[0]):
        script = read_script(tokens[0], environment)
        tokens, sbatch = script.words, script.sbatch
        launch.read_as = "a pasted script, its arrays and variables expanded as bash expands them"
        launch.read_notes += [
            Note(severity="info", text=f"${name} is {value}, from the environment check runs in.")
            for name, value in script.from_environment.items()
        ]
        launch.read_problems += [_orphan(words) for words in script.orphans]
    elif len(tokens) == 1 and " " in tokens[0].strip():
        try:  # as the shell reads a line: line continuations joined, comments dropped
            tokens = shlex.split(tokens[0].replace("\\\n", " "), comments=True)
        except ValueError as error:
            raise UsageError(f"the launch line cannot be split like a shell line: {error}.") from None
    launch.slurm = read_slurm(tokens, sbatch, environment)
    i = launch.slurm.program_index or 0
    launch.entry = any(a in ("-m", "--module") and b == ENTRY for a, b in itertools.pairwise(tokens))
    while i < len(tokens):
        token, i = tokens[i], i + 1
        if not token.startswith("--"):
            continue
        name, eq, inline = token.partition("=")
        flag = _normalize(name)
        if flag in NOT_MEGATRON:
            launch.not_megatron[flag], i = _values(tokens, i, name, 1, inline if eq else None)
        elif flag in OPTIONS:
            i = _read(launch, OPTIONS[flag], flag, name, tokens, i, inline if eq else None)
    return launch


def _orphan(words: str) -> Problem:
    first = words.split()[0]
    return Problem(
        message=f"the script runs '{words[:80]}' as a command of its own: the line before it does not end with '\\', "
        f"so the launch never gets {first} and what follows it. End the line before with '\\'.",
        rule="script-continuation",
        flag=first,
        fix="End the line before with '\\'.",
    )


def _read(launch: Launch, option: Option, flag: str, name: str, tokens: list[str], i: int, inline: str | None) -> int:
    """Record ``option`` (given as ``name``) and its values from ``tokens[i:]``; the index after them."""
    launch.spelled[option.flag] = name
    if option.nargs == 0:
        launch.switches[option.flag] = not flag.startswith("--no-")
        return i
    values, i = _values(tokens, i, name, option.nargs, inline)
    if option.flag in launch.values:
        launch.repeated.setdefault(option.flag, [launch.values[option.flag]]).append(values)
    launch.values[option.flag] = values
    if option.flag not in _LAUNCHER:  # the launcher's flags are followed by the script and its words
        stray = []
        while i < len(tokens) and not tokens[i].startswith("-"):
            stray.append(tokens[i])
            i += 1
        if stray:
            launch.stray[option.flag] = stray
    return i


def _values(tokens: list[str], i: int, name: str, nargs: int | str, inline: str | None) -> tuple[list[str], int]:
    """The values of a flag given as ``name`` at ``tokens[i:]`` (``nargs="+"``: every word up to the next flag)."""
    need = nargs if isinstance(nargs, int) else 1
    if inline is not None:
        values = [inline]
    else:
        count = need if isinstance(nargs, int) else max(_words_before_flag(tokens, i), 1)
        values = tokens[i : i + count]
    if len(values) < need or any(v.startswith("--") for v in values):
        raise UsageError(f"{name} needs {need} value(s), got {' '.join(values) or 'none'}.")
    return values, i if inline is not None else i + len(values)


def _words_before_flag(tokens: list[str], i: int) -> int:
    end = i
    while end < len(tokens) and not tokens[end].startswith("-"):
        end += 1
    return end - i


def parse_int(flag: str, text: str) -> int:
    """An integer flag value (at most 10**30); a shell variable left unexpanded or a float is unusable input."""
    return read_int(flag, text)


def ga_values(launch: Launch) -> dict[str, Any]:
    """The ``--ga-*`` flags the line gives, by GAConfig field, typed as config/flags.py declares them: an integer
    that is not one raises UsageError naming the flag as spelled; a float that is no number stays text (its rule
    names it). Flags the line leaves out are absent (the rule pass reads their defaults)."""
    values: dict[str, Any] = {}
    for option in GA_OPTIONS:
        if option.type is bool and option.flag in launch.switches:
            values[option.field] = launch.on(option.flag)
        elif option.type is not bool and option.flag in launch.values:
            values[option.field] = _typed(launch, option, launch.values[option.flag][0])
    return values


def _typed(launch: Launch, option: GAFlag, text: str) -> object:
    if option.type is int:
        return read_int(launch.name(option.flag), text)
    if option.type is float:
        try:
            return float(text)
        except ValueError:
            return text
    return text


# -- the layout of a launch ----------------------------------------------------------------------


@dataclass
class LaunchLayout:
    """BatchLayout arguments of a launch line, and the rules its layer split breaks."""

    kwargs: dict[str, object]
    virtual_pipeline: VirtualPipeline
    seq_problems: list[str] = field(default_factory=list)
    read_problems: list[Problem] = field(default_factory=list)
    """What the line leaves out or contradicts: no --micro-batch-size, a check --world-size the line disagrees
    with, a Slurm start that splits the world (``missing_ok`` reads only)."""
    read_notes: list[Note] = field(default_factory=list)

    @property
    def problems(self) -> list[GAError]:
        return list(self.virtual_pipeline.problems)


def read_ints(launch: Launch) -> dict[str, int]:
    """Every integer flag given, by its argparse destination (UsageError naming the flag as spelled)."""
    return {
        OPTIONS[flag].dest: read_int(launch.name(flag), values[0])
        for flag, values in launch.values.items()
        if OPTIONS[flag].type is int and OPTIONS[flag].nargs == 1
    }


MISSING_MICRO_BATCH = "--micro-batch-size is missing; Megatron needs it to split the global batch."


def read_layout(launch: Launch, world_size: int | None = None, *, missing_ok: bool = False) -> LaunchLayout:
    """The layout of ``launch``; ``world_size`` stands in for the launcher's where the line leaves it open.
    UsageError where it cannot be read. With ``missing_ok`` (check), a missing --micro-batch-size and a
    ``world_size`` the line contradicts are problems (the line's world is kept), not errors."""
    ints = read_ints(launch)
    kwargs: dict[str, object] = {name: ints.get(BY_DEST[name].dest) for name in FLAGS if name in BY_DEST}
    given: dict[str, str] = {}
    found = _Found() if missing_ok else None
    kwargs["world_size"] = _checked_world(launch, ints, given, world_size, found)
    read_problems = found.problems if found is not None else []
    if kwargs["micro_batch_size"] is None:
        if not missing_ok:
            raise UsageError(MISSING_MICRO_BATCH)
        read_problems.append(
            Problem(
                message=MISSING_MICRO_BATCH,
                rule="micro-batch-size-missing",
                flag="--micro-batch-size",
                fix="Give --micro-batch-size N.",
            )
        )
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
    ):
        if kwargs[name] is None:
            kwargs[name] = 1
    seq_problems = _seq_length(launch, ints, kwargs, given)
    vpp = virtual_pipeline(_layer_split(launch, ints, kwargs["pipeline_model_parallel_size"]))  # type: ignore[arg-type]
    kwargs["virtual_pipeline_model_parallel_size"] = vpp.size
    if vpp.given:
        given["virtual_pipeline_model_parallel_size"] = vpp.given
    for name in FLAGS:
        flag = BY_DEST[name].flag if name in BY_DEST else None
        if flag in launch.spelled and launch.spelled[flag] != flag and name not in given:
            given[name] = launch.spelled[flag]
    kwargs["given"] = given
    return LaunchLayout(
        kwargs=kwargs,
        virtual_pipeline=vpp,
        seq_problems=seq_problems,
        read_problems=read_problems,
        read_notes=found.notes if found is not None else [],
    )


def _checked_world(
    launch: Launch, ints: dict[str, int], given: dict[str, str], world_size: int | None, found: _Found | None
) -> int:
    """The world size: the line's, else ``world_size`` (check's --world-size). With ``problems`` (check), a
    ``world_size`` the line contradicts (its own --world-size or --nnodes x --nproc-per-node, or one that is not a
    multiple of --nproc-per-node where --nnodes is left open) is a problem, and the line's world is kept; without
    ``problems``, ``world_size`` wins."""
    if world_size is None:
        return _world_size(launch, ints, given, found)
    if found is None:
        return world_size
    check = f"megatron-ga check --world-size {world_size}"
    try:
        line_world = _world_size(launch, ints, given, found)
    except UsageError:
        line_world = None
    nproc = launch.get("--nproc-per-node")
    open_nodes = "world_size" not in ints and launch.get("--nnodes") is None and line_world is not None
    if line_world is None or (open_nodes and world_size % line_world == 0):
        per_node = f"{launch.name('--nproc-per-node')} {nproc}"
        nodes = "" if line_world is None else f" = {world_size // line_world} nodes x {per_node}"
        given["world_size"] = check + nodes
        return world_size
    if open_nodes:
        reason = (
            f"is not a multiple of the line's {launch.name('--nproc-per-node')} {nproc} (ranks per node), so no "
            f"number of nodes gives it"
        )
    else:
        line_given = given.get("world_size", f"--world-size {line_world}")
        reason = f"contradicts the line, whose {line_given} start {line_world:,} ranks"
    found.problems.append(
        Problem(
            message=f"{check} {reason}: the ledger shows the line's {line_world:,}. Drop check's --world-size, or "
            f"change the line's launcher flags.",
            rule="world-size-contradiction",
            flag="--world-size",
            value=str(world_size),
            fix="Drop check's --world-size, or change the line's launcher flags.",
        )
    )
    return line_world


def layout_kwargs(launch: Launch, world_size: int | None = None) -> dict[str, object]:
    """BatchLayout arguments from a launch line, raising its first layer-split problem (the ledger's way)."""
    layout = read_layout(launch, world_size)
    if layout.problems:
        raise layout.problems[0]
    return layout.kwargs


def _layer_split(launch: Launch, ints: dict[str, int], pipeline_model_parallel_size: int) -> LayerSplit:
    pattern = launch.get("--hybrid-layer-pattern") or launch.get("--hybrid-override-pattern")
    return LayerSplit(
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        num_layers=ints.get("num_layers"),
        decoder_num_layers=ints.get("decoder_num_layers"),
        num_layers_per_virtual_pipeline_stage=ints.get("num_layers_per_virtual_pipeline_stage"),
        num_virtual_stages_per_pipeline_rank=ints.get("num_virtual_stages_per_pipeline_rank"),
        pipeline_model_parallel_layout=launch.get("--pipeline-model-parallel-layout"),
        hybrid_layer_pattern=pattern,
        decoder_first_pipeline_num_layers=ints.get("decoder_first_pipeline_num_layers"),
        decoder_last_pipeline_num_layers=ints.get("decoder_last_pipeline_num_layers"),
        account_for_embedding_in_pipeline_split=launch.on("--account-for-embedding-in-pipeline-split"),
        account_for_loss_in_pipeline_split=launch.on("--account-for-loss-in-pipeline-split"),
    )


def _seq_length(launch: Launch, ints: dict[str, int], kwargs: dict[str, object], given: dict[str, str]) -> list[str]:
    """Megatron's seq_length: --seq-length, else --encoder-seq-length (arguments.py maps it so); the problems."""
    seq, encoder, decoder = (ints.get(k) for k in ("seq_length", "encoder_seq_length", "decoder_seq_length"))
    if seq is not None and encoder is not None:
        return [
            f"--seq-length {seq} and --encoder-seq-length {encoder} are both given; Megatron asserts "
            f"encoder_seq_length is None when --seq-length is set (it copies one into the other). Keep one."
        ]
    if seq is None and encoder is not None:
        kwargs["seq_length"] = encoder
        given["seq_length"] = launch.name("--encoder-seq-length")
    if seq is None and encoder is None and decoder is not None:
        return [
            f"--decoder-seq-length {decoder} is given without --seq-length or --encoder-seq-length; Megatron "
            f"asserts encoder_seq_length is not None: the decoder length does not set the sequence length "
            f"that schedules and tokens per step use. Add --seq-length."
        ]
    return []


def _world_size(launch: Launch, ints: dict[str, int], given: dict[str, str], found: _Found | None = None) -> int:
    """--world-size, else torchrun's --nnodes x --nproc-per-node, else Slurm's tasks; ``given`` records the flags
    used, ``found`` (check) what Slurm's start changes."""
    if "world_size" in ints:
        return ints["world_size"]
    nproc_flag = launch.name("--nproc-per-node")
    nnodes, nproc = launch.get("--nnodes"), launch.get("--nproc-per-node")
    if nproc is None and launch.slurm.launcher == "srun" and launch.slurm.values:
        world, given["world_size"], notes = slurm_world(launch.slurm, careful=found is not None)
        if found is not None:
            found.notes += notes
        return world
    if nproc is None:
        raise UsageError(
            "the world size is unknown: give torchrun's --nproc-per-node (and --nnodes), srun's --nodes and "
            "--ntasks-per-node, or megatron-ga check --world-size N -- <launch line>."
        )
    if nproc.strip() in ("gpu", "cpu", "auto", "xpu"):  # torchrun's own choices
        raise UsageError(
            f"{nproc_flag} {nproc} leaves the world size to the machine; pass it with "
            f"megatron-ga check --world-size N -- <launch line>."
        )
    per_node = read_int(nproc_flag, nproc)
    nodes = _nnodes(launch, nnodes)
    given["world_size"] = (
        f"{launch.name('--nnodes')} {nodes} x {nproc_flag} {per_node}"
        if nnodes is not None
        else f"{nproc_flag} {per_node}"
    )
    if found is not None:
        found.problems += torchrun_under_slurm(
            launch.slurm, launch.name("--nnodes"), nodes if nnodes is not None else None
        )
    return nodes * per_node


@dataclass
class _Found:
    """What reading the world size finds besides the number (check only)."""

    problems: list[Problem] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)


def _nnodes(launch: Launch, text: str | None) -> int:
    """torchrun's --nnodes: N, MIN:MAX with MIN == MAX (a fixed world), or an elastic range."""
    if text is None:
        return 1
    flag = launch.name("--nnodes")
    if ":" in text:
        low, _, high = text.partition(":")
        if low.strip() != high.strip():
            raise UsageError(
                f"{flag} {text} is an elastic range, so the world size is not fixed; pass the size to check "
                f"with megatron-ga check --world-size N -- <launch line>."
            )
        text = low
    return read_int(flag, text)
